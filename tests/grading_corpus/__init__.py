"""Submissions for the grader's tests, generated from the instructor's solution notebooks.

Each case is a small patch: new sources for some answer cells (by their position among the
exercise's answer cells), optionally a reshaping of the notebook (reorder, strip ids...). Nothing
here is a committed notebook; :func:`write_submission` builds the .ipynb in a temporary folder.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def solution_notebook(name: str) -> dict:
    """The instructor's generated solution notebook ``solutions/<name>.ipynb`` as a JSON dict."""
    return json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())


def exercise_notebook(name: str) -> dict:
    """The untouched exercise notebook ``exercises/<name>.ipynb`` as a JSON dict."""
    return json.loads((ROOT / "exercises" / f"{name}.ipynb").read_text())


def answer_ids(nb: dict) -> list[str]:
    """Ids of the answer cells (the ones holding a solution block), in order."""
    return [c["id"] for c in nb["cells"] if "### BEGIN SOLUTION" in "".join(c["source"])]


def patched(nb: dict, answers: dict[int, str]) -> dict:
    """A copy of ``nb`` whose k-th answer cell has source ``answers[k]``."""
    nb = json.loads(json.dumps(nb))
    ids = answer_ids(nb)
    for cell in nb["cells"]:
        for k, src in answers.items():
            if cell["id"] == ids[k]:
                cell["source"] = src
    return nb


def answer_source(nb: dict, k: int) -> str:
    """The source of the k-th answer cell."""
    cid = answer_ids(nb)[k]
    return next("".join(c["source"]) for c in nb["cells"] if c["id"] == cid)


def write_submission(folder: Path, student: str, name: str, nb: dict, flat: bool = False) -> Path:
    """Write ``nb`` as student ``student``'s submission (``<student>/<name>.ipynb`` or flat)."""
    path = folder / f"{student}_{name}.ipynb" if flat else folder / student / f"{name}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))
    return path
