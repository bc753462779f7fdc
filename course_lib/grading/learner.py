"""``course check NN``: run the learner's own exercise notebook and score its visible checks.

Nothing here is adversarial: the learner checks their own work before submitting. Their notebook
runs as it is, in a fresh kernel at smoke size; a test cell (tagged ``points:N``) scores its points
when it runs without error and the grader-side probes it names (``probe:NAME``) find nothing wrong. Hidden tests are not in the exercise, so their points are shown as
"graded on submission".
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from course_lib.kit import notebooks
from course_lib.grading import assemble, probes, sandbox


@dataclass
class CheckLine:
    """One test cell of the learner's notebook: id, points earned and possible, status, message."""

    id: str
    points: int
    max_points: int
    status: str  # passed, failed, timeout, crashed, not-run, hidden
    message: str


def find_exercise_notebook(root: Path, number: str) -> Path:
    """``exercises/NN_*.ipynb`` for ``number`` (two digits)."""
    found = sorted(Path(root, "exercises").glob(f"{number}_*.ipynb"))
    if len(str(number)) != 2 or not str(number).isdigit() or len(found) != 1:
        have = ", ".join(p.stem[:2] for p in sorted(Path(root, "exercises").glob("[0-9][0-9]_*.ipynb")))
        raise ValueError(f"exercise {number!r}: no exercises/{number}_*.ipynb (exercises: {have})")
    return found[0]


def check_notebook(path: Path, *, cell_timeout: float = 300.0, notebook_timeout: float = 900.0,
                   memory_gb: float = 6.0) -> list[CheckLine]:
    """Run ``path`` (a learner's exercise notebook) and score each test cell (seconds, GiB)."""
    import json

    if cell_timeout <= 0 or notebook_timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {cell_timeout}")
    cells, problem = assemble.read_submission(Path(path))
    if problem:
        raise ValueError(f"{path}: {problem}")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    tags = {str(c.get("id", "")): c.get("metadata", {}).get("tags", []) for c in data.get("cells", [])}
    code, tests = [], []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        code.append((cell["id"], cell["source"]))
        if "parameters" in tags.get(cell["id"], []):
            code.append(assemble.SMOKE_CELL)
        points = [int(m.group(1)) for t in tags.get(cell["id"], []) if (m := assemble.POINTS_TAG.match(str(t)))]
        if points:
            hidden = notebooks.HIDDEN_PLACEHOLDER in cell["source"] and not cell["source"].replace(
                notebooks.HIDDEN_PLACEHOLDER, "").strip()
            wanted = tuple(m.group(1) for t in tags.get(cell["id"], []) if (m := assemble.PROBE_TAG.match(str(t)))
                           and m.group(1) in probes.PROBES)
            tests.append((cell["id"], points[0], hidden, wanted))
    memory_bytes = int(memory_gb * 2**30)
    with tempfile.TemporaryDirectory(prefix="course-check-") as tmp:
        run = sandbox.run_cells(code, Path(tmp) / "work", cell_timeout=cell_timeout,
                                notebook_timeout=notebook_timeout, memory_bytes=memory_bytes, sandbox=False)
        # the grader's own tests of the module the notebook wrote, as on submission (visible cells only)
        names = {n for _, _, hidden, wanted in tests if not hidden for n in wanted}
        verdicts = probes.run_probes(names, Path(tmp) / "work", Path(tmp) / "probes",
                                     probes.ProbeLimits(memory_bytes, (), False))
    lines = []
    for cid, points, hidden, wanted in tests:
        if hidden:
            lines.append(CheckLine(cid, 0, points, "hidden", "hidden tests: graded on submission"))
            continue
        out = run.cells.get(cid, sandbox.CellOutcome("not-run"))
        status = {"ok": "passed", "error": "failed"}.get(out.status, out.status)
        message = f"{out.error_name}: {out.error}".strip(": ")[:400]
        bad = next((f"the grader's own test '{n}': {v}" for n in wanted for v in verdicts[n] if v != "ok"), "")
        if status == "passed" and bad:
            status, message = "failed", bad[:400]
        lines.append(CheckLine(cid, points if status == "passed" else 0, points, status, message))
    return lines


def format_lines(name: str, lines: list[CheckLine]) -> str:
    """A plain-text table for the terminal, with the visible score and the hidden points."""
    out = [f"{name}: visible checks", f"{'cell':<9} {'points':>7}  status   message"]
    for ln in lines:
        pts = f"-/{ln.max_points}" if ln.status == "hidden" else f"{ln.points}/{ln.max_points}"
        out.append(f"{ln.id:<9} {pts:>7}  {ln.status:<8} {ln.message}")
    visible = [ln for ln in lines if ln.status != "hidden"]
    out.append(f"score on visible checks: {sum(ln.points for ln in visible)} / "
               f"{sum(ln.max_points for ln in visible)}; hidden tests worth "
               f"{sum(ln.max_points for ln in lines if ln.status == 'hidden')} more are run when you submit")
    return "\n".join(out)
