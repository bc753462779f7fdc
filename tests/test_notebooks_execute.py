"""Every notebook executed headless: labs and solutions pass, exercises fail at a graded cell.

An exercise that passes untouched would mean its checks cannot fail; a solution that fails would
mean the checks are wrong. Both directions are asserted here.
"""
from pathlib import Path

import nbformat
import pytest

from course_lib import run_notebooks

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(ROOT.glob("labs/[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted(ROOT.glob("solutions/[0-9][0-9]_*.ipynb"))
EXERCISES = sorted(ROOT.glob("exercises/[0-9][0-9]_*.ipynb"))
GRADED_FAILURES = {"NotImplementedError", "CheckFailed", "AssertionError"}

pytestmark = pytest.mark.notebooks


def _run(nb: Path, tmp_path: Path) -> run_notebooks.RunResult:
    # cwd is a scratch folder: notebooks that write files (%%writefile) leave the repo untouched
    return run_notebooks.execute(nb, tmp_path / nb.name, smoke=True, timeout_s=600, cwd=tmp_path)


# Labs are not run here: nbval executes each of them (pyproject's testpaths include labs/, at smoke
# size through conftest's COURSE_SMOKE=1) and fails on any error, besides comparing the cells tagged
# nbval-check-output. Running them here too would execute every lab twice per test run.
@pytest.mark.parametrize("nb", SOLUTIONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
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
