"""A lab's scratch run folders, emptied before each fresh run so a learner can re-run one cell.

Every lab writes its runs under a folder of its own in the system's temporary directory
(``RUNS = Path(tempfile.mkdtemp(prefix="labNN-"))``). The trainer refuses a fresh run into a folder
that already holds checkpoints (``course_lib.trainer.startup.check_fresh_folder``: a second run
there would let retention delete the first one's checkpoints). That is right for a real job and
wrong for a notebook cell run twice: the learner asked for the same experiment again, and the
first run's files are the lab's own scratch. :func:`fresh` removes the folder first, and only
ever inside the temporary directory, so it can never delete a run the learner cares about.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def fresh(path: str | Path) -> Path:
    """``path`` (a run folder, or an output file, inside a lab's scratch directory), removed with
    everything in it if it exists, so the next run there starts from nothing. Returns ``path`` as a Path, not created.

    Refuses (ValueError, nothing removed) a path outside the system's temporary directory
    (``tempfile.gettempdir()``) or the temporary directory itself: this is for a lab's scratch
    runs only, never for a folder that may hold a run worth keeping."""
    path = Path(path).resolve()
    tmp = Path(tempfile.gettempdir()).resolve()
    if path == tmp or tmp not in path.parents:
        raise ValueError(f"fresh({str(path)!r}): path must be a run folder inside the temporary directory "
                         f"{tmp} (a lab's scratch RUNS folder); refusing to delete anything elsewhere")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    return path
