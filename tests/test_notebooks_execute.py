"""Every notebook executed headless: labs and solutions pass, exercises fail at a graded cell.

An exercise that passes untouched would mean its checks cannot fail; a solution that fails would
mean the checks are wrong. Both directions are asserted here, except the solutions of the
exercises tests/test_grading_batch.py grades: its grader builds their reference by running every
cell of ``solutions/NN.py`` (what the notebook is built from, hidden tests included) at smoke size
and fails on any failing cell, so running the notebook here too would only repeat that run.
"""
from pathlib import Path

import nbformat
import pytest

from course_lib.kit import run_notebooks
from tests import test_grading_batch

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(ROOT.glob("labs/[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted(ROOT.glob("solutions/[0-9][0-9]_*.ipynb"))
# solutions whose every cell the grading batch already runs (its reference build); see the docstring
RUN_BY_GRADER = [p for p in SOLUTIONS if p.stem[:2] in test_grading_batch.REFERENCE_BUILT]
EXERCISES = sorted(ROOT.glob("exercises/[0-9][0-9]_*.ipynb"))
GRADED_FAILURES = {"NotImplementedError", "CheckFailed", "AssertionError"}

pytestmark = pytest.mark.notebooks


def _run(nb: Path, tmp_path: Path) -> run_notebooks.RunResult:
    # cwd is a scratch folder: notebooks that write files (%%writefile) leave the repo untouched
    return run_notebooks.execute(nb, tmp_path / nb.name, smoke=True, timeout_s=600, cwd=tmp_path)


# Labs are not run here: nbval executes each of them (pyproject's testpaths include labs/, at smoke
# size through conftest's COURSE_SMOKE=1) and fails on any error, besides comparing the cells tagged
# nbval-check-output. Running them here too would execute every lab twice per test run.
@pytest.mark.parametrize("nb", [p for p in SOLUTIONS if p not in RUN_BY_GRADER],
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_notebook_runs_clean_at_smoke_size(nb, tmp_path):
    result = _run(nb, tmp_path)
    assert result.status == "ok", f"{nb.name} failed in {result.failed_cell_id}: {result.error}"


@pytest.mark.parametrize("nb", EXERCISES, ids=lambda p: p.stem)
def test_untouched_exercise_fails_at_a_graded_cell(nb, tmp_path):
    result = _run(nb, tmp_path)
    assert result.status == "failed", f"{nb.name} passed untouched: its checks cannot fail"
    assert result.error_name in GRADED_FAILURES, (
        f"{nb.name} failed for the wrong reason ({result.error}); an untouched exercise must stop "
        "at a NotImplementedError or a failed check")
    executed = nbformat.read(result.output, as_version=4)
    cells = {c.id: c for c in executed.cells}
    failed = cells[result.failed_cell_id]
    # the failing cell is a graded one: it holds the learner's gap or calls a check on it
    assert ("raise NotImplementedError" in failed.source or "check" in failed.source), (
        f"{nb.name} failed in {failed.id}, which is neither a solution gap nor a check")


def test_every_solution_has_its_exercise():
    assert [p.name for p in SOLUTIONS] == [p.name for p in EXERCISES]
    assert LABS, "no labs found"


def test_the_solutions_not_run_here_are_run_whole_by_the_default_grading_batch():
    """The grading batch's reference build stands in for this module's run of these solutions:
    it must exist for each of them, run in the default (not slow) suite, and fail on any cell."""
    import inspect

    from course_lib.grading import reference

    assert len(RUN_BY_GRADER) == len(test_grading_batch.REFERENCE_BUILT) >= 1, RUN_BY_GRADER
    for test in (test_grading_batch.test_exercise_01_honest_and_hostile_batch,
                 test_grading_batch.test_exercise_batch_with_torch):
        assert "slow" not in [m.name for m in getattr(test, "pytestmark", [])], test.__name__
    default_batches = {p.values[0] for p in test_grading_batch.TORCH_BATCHES
                       if "slow" not in [m.name for m in p.marks]}
    assert set(test_grading_batch.REFERENCE_BUILT) <= {"01", *default_batches}, default_batches
    batch = inspect.getsource(test_grading_batch)
    assert "cache_dir=tmp_path" in batch  # a fresh cache: the reference is built, not read back
    build = inspect.getsource(reference.build_reference)
    assert 'o.status != "ok"' in build and "raise ReferenceError" in build  # any failing cell fails it


def test_nbval_executes_every_lab_once_per_run():
    """The labs' only execution in a test run is nbval's: it must collect labs/ at smoke size."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "labs" in ini["testpaths"] and "--nbval-lax" in ini["addopts"], ini
    assert "COURSE_SMOKE" in (ROOT / "conftest.py").read_text()
