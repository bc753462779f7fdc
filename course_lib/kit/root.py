"""Where the kit lives: the repository root the front doors (``course ...``, the grader) read labs,
exercises and configs from. Its own module so that every command can ask without importing the
others (``course_lib.cli`` and ``course_lib.grading.cli`` both need it)."""
from __future__ import annotations

from pathlib import Path


def find_root(start: Path | None = None) -> Path:
    """The repository root: the nearest folder upward from ``start`` (default: the working
    directory) holding ``pyproject.toml`` and ``labs/``; else the checkout this package was
    imported from. SystemExit with what to do when neither is one."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").exists() and (folder / "labs").is_dir():
            return folder
    package_root = Path(__file__).resolve().parents[2]  # course_lib/kit/root.py -> the checkout
    if (package_root / "pyproject.toml").exists() and (package_root / "labs").is_dir():
        return package_root
    raise SystemExit("course: cannot find the kit's root (a folder with pyproject.toml and labs/); "
                     "run this inside the repository")
