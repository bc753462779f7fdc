"""Deterministic builds, stale detection and the committed notebooks' sync with their sources."""
import json
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from course_lib import cli
from course_lib.kit import notebooks

ROOT = Path(__file__).resolve().parent.parent

LAB = '''# %% [markdown]
# # Lab 99

# %% tags=["parameters"]
SMOKE = False

# %%
print("hi")
'''
SOLUTION = '''# %% tags=["parameters"]
SMOKE = False

# %%
def f():
    ### BEGIN SOLUTION give back one
    return 1
    ### END SOLUTION

# %%
assert f() == 1
### BEGIN HIDDEN TESTS
assert f() + 1 == 2
### END HIDDEN TESTS
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    for d in ("labs", "solutions", "exercises"):
        (tmp_path / d).mkdir()
    (tmp_path / "pyproject.toml").write_text("[project]\nname='x'\n")
    (tmp_path / "labs" / "99_demo.py").write_text(LAB)
    (tmp_path / "solutions" / "99_demo.py").write_text(SOLUTION)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*.ipynb"))}


def test_build_writes_three_notebooks_with_positional_ids(project):
    changed = notebooks.write_all(project)
    assert sorted(p.relative_to(project).as_posix() for p in changed) == [
        "exercises/99_demo.ipynb", "labs/99_demo.ipynb", "solutions/99_demo.ipynb"]
    ex = nbformat.read(project / "exercises" / "99_demo.ipynb", as_version=4)
    sol = nbformat.read(project / "solutions" / "99_demo.ipynb", as_version=4)
    assert [c.id for c in ex.cells] == [c.id for c in sol.cells] == ["cell-000", "cell-001", "cell-002"]
    assert ex.cells[0].metadata["tags"] == ["parameters"]
    assert "NotImplementedError" in ex.cells[1].source and "return 1" not in ex.cells[1].source
    assert "f() + 1" not in ex.cells[2].source and "f() + 1" in sol.cells[2].source
    assert ex.metadata["kernelspec"]["name"] == "course-kit"


def test_building_twice_gives_identical_bytes(project):
    notebooks.write_all(project)
    first = _snapshot(project)
    assert notebooks.write_all(project) == []
    assert _snapshot(project) == first


def test_check_reports_stale_missing_and_orphans(project, capsys):
    notebooks.write_all(project)
    lab_problems = notebooks.check_all(project)
    # a freshly built lab has never been executed: its outputs are missing
    assert lab_problems == ["labs/99_demo.ipynb: outputs are from older code or missing "
                            "(run `course labs run 99_demo --in-place`)"]
    (project / "solutions" / "99_demo.py").write_text(SOLUTION.replace("return 1\n    ###", "return 2 - 1\n    ###"))
    (project / "exercises" / "00_orphan.ipynb").write_text("{}")
    (project / "labs" / "99_demo.ipynb").unlink()
    problems = notebooks.check_all(project)
    assert "solutions/99_demo.ipynb: differs from its source (run `course notebooks build`)" in problems
    assert "labs/99_demo.ipynb: missing (run `course notebooks build`)" in problems
    assert "exercises/00_orphan.ipynb: has no source .py (delete it or add one)" in problems
    assert cli.main(["notebooks", "check"]) == 1
    assert "solutions/99_demo.ipynb" in capsys.readouterr().err


def test_lab_outputs_survive_a_rebuild_until_their_code_changes(project):
    notebooks.write_all(project)
    lab = project / "labs" / "99_demo.ipynb"
    nb = nbformat.read(lab, as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    nb.cells[2].execution_count = 1
    notebooks.record_execution(nb, lab)
    assert notebooks.check_all(project) == []
    # a markdown edit keeps outputs and freshness
    (project / "labs" / "99_demo.py").write_text(LAB.replace("# # Lab 99", "# # Lab 99, revised"))
    notebooks.write_all(project)
    assert nbformat.read(lab, as_version=4).cells[2].outputs[0]["text"] == "hi\n"
    assert notebooks.check_all(project) == []
    # a code edit drops that cell's outputs and makes the lab stale
    (project / "labs" / "99_demo.py").write_text(LAB.replace('print("hi")', 'print("hello")'))
    notebooks.write_all(project)
    assert nbformat.read(lab, as_version=4).cells[2].outputs == []
    assert any("outputs are from older code" in p for p in notebooks.check_all(project))


def test_malformed_source_writes_nothing(project, capsys):
    (project / "solutions" / "98_bad.py").write_text('# %% tags=["parameters"]\nSMOKE = False\n'
                                                     "# %%\n### BEGIN SOLUTION\nx = 1\n")
    assert cli.main(["notebooks", "build"]) == 2
    assert "solutions/98_bad.py:4:" in capsys.readouterr().err
    assert _snapshot(project) == {}


def test_markers_in_labs_are_refused(project):
    (project / "labs" / "97_x.py").write_text(LAB + "### BEGIN SOLUTION\n### END SOLUTION\n")
    with pytest.raises(notebooks.NotebookSourceError, match="labs/97_x.py:9: .*belong in solutions"):
        notebooks.build_all(project)


def test_nbval_markers_are_cell_tags_not_comments_the_learner_reads(project):
    notebooks.write_all(project)
    (project / "labs" / "99_demo.py").write_text(LAB + "\n# %%\n# NBVAL_CHECK_OUTPUT\nprint(2)\n")
    notebooks.write_all(project)
    problems = notebooks.check_all(project)
    assert any("NBVAL_" in p and "tags" in p and "99_demo" in p for p in problems), problems
    (project / "labs" / "99_demo.py").write_text(LAB + '\n# %% tags=["nbval-check-output"]\nprint(2)\n')
    notebooks.write_all(project)
    assert not any("NBVAL_" in p for p in notebooks.check_all(project))


def test_committed_notebooks_match_their_sources():
    """The sync check CI relies on: every generated notebook in the repository is fresh."""
    problems = notebooks.check_all(ROOT)
    assert problems == [], "\n".join(problems)


def test_every_notebook_starts_with_a_smoke_parameter():
    for path in sorted(ROOT.glob("*/[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "parameters" in first["metadata"].get("tags", []), path
        assert "SMOKE = False" in "".join(first["source"]), path


def test_exercises_and_solutions_are_committed_without_outputs():
    for path in sorted(ROOT.glob("exercises/*.ipynb")) + sorted(ROOT.glob("solutions/*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path


def test_labs_are_committed_executed():
    labs = sorted(ROOT.glob("labs/[0-9][0-9]_*.ipynb"))
    assert labs, "no lab notebooks"
    for path in labs:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code), f"{path.name} has unexecuted cells"


def test_no_committed_output_shows_a_path_of_the_machine(project):
    """record_execution writes <repo>/<tmp>/~ instead of this machine's prefixes; check flags any left."""
    import tempfile

    import nbformat

    notebooks.write_all(project)
    lab = project / "labs" / "99_demo.ipynb"
    nb = nbformat.read(lab, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code" and "hi" in c.source)
    code.outputs = [nbformat.v4.new_output("stream", name="stdout",
                                           text=f"wrote {project}/runs/a.json and {tempfile.gettempdir()}/lab-x/b\n")]
    notebooks.record_execution(nb, lab)
    text = nbformat.read(lab, as_version=4)
    shown = next(c for c in text.cells if c.cell_type == "code" and "hi" in c.source).outputs[0]["text"]
    assert shown == "wrote <repo>/runs/a.json and <tmp>/lab-x/b\n", shown
    assert not any("path of the machine" in p for p in notebooks.check_all(project))
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="saved to /home/alice/kit/x.pt\n")]
    lab.write_text(notebooks.dumps(nb))  # as if committed by hand from another machine
    assert any("path of the machine" in p and "/home/alice/kit/x.pt" in p for p in notebooks.check_all(project))


def test_a_worked_answer_stays_collapsed_through_build_and_execution(project):
    """Lab 13 shows its worked answers collapsed (``jupyter.source_hidden``) until the learner has
    tried: the flag survives the build and the clean-up of an executed notebook, while papermill's
    own cell metadata does not."""
    (project / "labs" / "99_demo.py").write_text(LAB + '\n# %% jupyter={"source_hidden": true}\nprint("worked")\n')
    notebooks.write_all(project)
    nb = nbformat.read(project / "labs" / "99_demo.ipynb", as_version=4)
    assert nb.cells[3].metadata == {"jupyter": {"source_hidden": True}} and nb.cells[2].metadata == {}
    nb.cells[3].metadata["papermill"] = {"duration": 0.1}
    nb.cells[3].metadata["tags"] = ["x"]
    clean = notebooks.to_notebook_like(nb)
    assert clean.cells[3].metadata == {"tags": ["x"], "jupyter": {"source_hidden": True}}
    assert clean.cells[2].metadata == {}
