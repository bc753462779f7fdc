"""Build the notebook that grades one submission: the student's answers, the instructor's tests.

From the instructor's source ``solutions/NN_topic.py``:

* **answer cells** hold a ``### BEGIN SOLUTION`` block: their code comes from the submission;
* **test cells** carry a jupytext cell tag ``points:N`` (``# %% tags=["points:2"]``; N a whole
  number of points, 1-100): their code, visible and hidden, always comes from the instructor;
* every other code cell (set-up, demos) also comes from the instructor;
* a test cell may also name **probes** (``# %% tags=["points:3", "probe:checkpoint-kills"]``):
  tests the grader runs itself on the module the submission wrote (:mod:`course_lib.grading.probes`).

Pairing rule (cell ids are positional, ``cell-000``..., identical in solution and exercise):
an answer cell takes the submission's *code* cell with the same id (the first one, if a tool
duplicated ids); a missing or non-code cell counts as an empty answer. A submission without any
``cell-NNN`` id but with exactly the instructor's number of cells is paired by position. Code cells
the student added (ids the instructor does not have) are kept and run right after the instructor
cell that precedes them in the submission (or after the set-up when nothing precedes them), so a
helper cell keeps working; submission cells whose id is a test or set-up cell are ignored.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from course_lib.kit import notebooks
from course_lib.grading.probes import PROBES

POINTS_TAG = re.compile(r"^points:(\d+)$")
# A test cell may name itself: "# test: <title>" (first such line). Hidden tests need it most, because
# the heading above them describes the visible part before them, not what they test.
TEST_TITLE = re.compile(r"^\s*# test: (.+?)\s*$", re.M)
PROBE_TAG = re.compile(r"^probe:([a-z0-9-]+)$")  # a test the grader runs itself (course_lib.grading.probes)
MAX_SUBMISSION_BYTES = 20 * 2**20  # a bigger .ipynb is not read (bytes)
SMOKE_CELL = ("injected-smoke", "SMOKE = True  # injected by the grader: smoke-test sizes")


class GradingSourceError(ValueError):
    """The instructor's source cannot be graded; the message names the file and cell."""


@dataclass(frozen=True)
class TestCell:
    """A graded cell: id, points, whether it is hidden in the exercise, and a readable title."""

    id: str
    points: int
    hidden: bool
    title: str
    probes: tuple = ()  # names of grader-side probes whose verdicts this cell also needs

    @property
    def label(self) -> str:
        return f"{self.id} ({self.title}, {'hidden' if self.hidden else 'visible'})"


@dataclass(frozen=True)
class Exercise:
    """One exercise as the grader sees it (all cells in order, from the instructor's source)."""

    number: str
    name: str  # NN_topic
    cells: list  # nbformat cells of the solution notebook
    answer_ids: frozenset
    tests: list[TestCell]
    parameters_id: str

    @property
    def max_points(self) -> int:
        return sum(t.points for t in self.tests)

    @property
    def probes(self) -> set[str]:
        """Every grader-side probe some test cell asks for."""
        return {name for t in self.tests for name in t.probes}


def load_exercise(source: Path) -> Exercise:
    """Parse ``solutions/NN_topic.py``: answer cells, test cells and their points."""
    source = Path(source)
    text = source.read_text()
    notebooks.make_exercise_source(text, source.name)  # validates the markers
    nb = notebooks.to_notebook(text, source.name)
    answers, tests, title = set(), [], nb.cells[0].source.split("\n")[0].lstrip("# ") if nb.cells else ""
    parameters_id = next(c.id for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            heading = next((ln.lstrip("# ").strip() for ln in cell.source.split("\n") if ln.startswith("#")), "")
            title = heading or title
            continue
        points = [int(m.group(1)) for t in cell.metadata.get("tags", []) if (m := POINTS_TAG.match(t))]
        has_answer = "### BEGIN SOLUTION" in cell.source
        if has_answer:
            answers.add(cell.id)
        if points:
            if has_answer:
                raise GradingSourceError(f"{source.name}: {cell.id} holds a solution block and a points tag; "
                                         "tests and answers must be separate cells")
            if not 1 <= points[0] <= 100:
                raise GradingSourceError(f"{source.name}: {cell.id}: points must be 1-100, got {points[0]}")
            probe_names = tuple(m.group(1) for t in cell.metadata.get("tags", []) if (m := PROBE_TAG.match(t)))
            unknown = [n for n in probe_names if n not in PROBES]
            if unknown:
                raise GradingSourceError(f"{source.name}: {cell.id}: unknown probe(s) {unknown}; known: {sorted(PROBES)}")
            own = TEST_TITLE.search(cell.source)
            tests.append(TestCell(cell.id, points[0], "### BEGIN HIDDEN TESTS" in cell.source,
                                  own.group(1) if own else title, probe_names))
    if not tests:
        raise GradingSourceError(f"{source.name}: no cell is tagged points:N, so nothing is graded")
    return Exercise(source.stem[:2], source.stem, nb.cells, frozenset(answers), tests, parameters_id)


def read_submission(path: Path) -> tuple[list[dict], str]:
    """The submission's cells as plain dicts (``id``, ``cell_type``, ``source`` text), and a
    problem sentence ("" when readable). Unreadable files give no cells, never an exception."""
    try:
        if Path(path).stat().st_size > MAX_SUBMISSION_BYTES:
            return [], f"the notebook is larger than {MAX_SUBMISSION_BYTES // 2**20} MiB"
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        cells = []
        for cell in data.get("cells", []):
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else source
            if not isinstance(source, str):
                source = ""
            cells.append({"id": str(cell.get("id", "")), "cell_type": str(cell.get("cell_type", "")),
                          "source": source})
        return cells, ""
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        return [], f"the notebook could not be read ({type(exc).__name__})"


def grading_cells(exercise: Exercise, submission: list[dict] | None) -> list[tuple[str, str]]:
    """The (id, source) code cells to run: instructor cells in order, answers from ``submission``
    (None: the instructor's own answers, for the reference run), student-added cells after their
    anchor, and ``SMOKE = True`` right after the parameters cell."""
    known = [c.id for c in exercise.cells]
    answers: dict[str, str] = {}
    extras: dict[str, list[tuple[str, str]]] = {}
    if submission is not None:
        answers, extras = _pair(exercise, submission, known)
    out: list[tuple[str, str]] = []
    for cell in exercise.cells:
        if cell.cell_type != "code":
            continue
        if cell.id in exercise.answer_ids:
            out.append((cell.id, cell.source if submission is None else answers.get(cell.id, "")))
        else:
            out.append((cell.id, cell.source))
        if cell.id == exercise.parameters_id:
            out.append(SMOKE_CELL)
            out.extend(extras.get("", []))
        out.extend(extras.get(cell.id, []))
    return out


def _pair(exercise: Exercise, submission: list[dict], known: list[str]):
    """Answers by id (or by position, see the module doc) and extra cells by anchor."""
    known_set = set(known)
    answers: dict[str, str] = {}
    extras: dict[str, list[tuple[str, str]]] = {}
    has_ids = any(re.fullmatch(r"cell-\d{3}", c["id"]) for c in submission)
    if not has_ids and len(submission) == len(known):
        submission = [{**c, "id": cid} for c, cid in zip(submission, known)]
    anchor = ""
    for k, cell in enumerate(submission):
        cid = cell["id"]
        if cid in known_set:
            anchor = cid
            if cid in exercise.answer_ids and cid not in answers:
                answers[cid] = cell["source"] if cell["cell_type"] == "code" else ""
            continue
        if cell["cell_type"] == "code" and cell["source"].strip():
            extras.setdefault(anchor, []).append((f"student-{k:03d}", cell["source"]))
    return answers, extras
