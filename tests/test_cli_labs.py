"""`course labs run`: executes labs with papermill and prints a summary table."""
from pathlib import Path

import pytest

from course_lib import cli
from course_lib.kit import notebooks

GOOD = '# %% tags=["parameters"]\nSMOKE = False\n\n# %%\nprint("smoke" if SMOKE else "full")\n'
BAD = '# %% tags=["parameters"]\nSMOKE = False\n\n# %%\nraise RuntimeError("planted")\n'


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[project]\nname='x'\n")
    for d in ("labs", "solutions", "exercises"):
        (tmp_path / d).mkdir()
    (tmp_path / "labs" / "90_good.py").write_text(GOOD)
    (tmp_path / "labs" / "91_bad.py").write_text(BAD)
    notebooks.write_all(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_labs_run_prints_a_summary_and_fails_on_a_broken_lab(project, capsys):
    code = cli.main(["labs", "run", "--smoke", "--out", str(project / "out")])
    out = capsys.readouterr().out
    assert code == 1
    assert "notebook  status   seconds  error" in out
    assert "90_good   ok" in out and "91_bad    failed" in out and "RuntimeError: planted" in out
    assert "1/2 ok" in out
    assert (project / "out" / "90_good.ipynb").exists()
    assert "smoke" in (project / "out" / "90_good.ipynb").read_text()


def test_labs_run_in_place_records_full_size_outputs(project, capsys):
    assert cli.main(["labs", "run", "90", "--in-place", "--out", str(project / "out")]) == 0
    assert notebooks.check_all(project) == [
        "labs/91_bad.ipynb: outputs are from older code or missing (run `course labs run 91_bad --in-place`)"]
    assert '"full\\n"' in (project / "labs" / "90_good.ipynb").read_text()


def test_labs_run_rejects_unknown_names_and_bad_flags(project):
    with pytest.raises(SystemExit, match="no lab matches 'zz'; labs are: 90_good, 91_bad"):
        cli.main(["labs", "run", "zz"])
    with pytest.raises(SystemExit, match="drop --smoke"):
        cli.main(["labs", "run", "--smoke", "--in-place"])
