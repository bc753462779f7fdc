"""`course doctor` on this machine, and its verdict when the install is broken."""
import json
from pathlib import Path

from course_lib import cli
from course_lib.kit import catalog
from course_lib.kit import doctor

ROOT = Path(__file__).resolve().parent.parent


def test_doctor_reports_this_machine(monkeypatch, capsys):
    # `course doctor --json` (what a program reads), in this process: the installed `course`
    # script itself is run from PATH, as written, by tests/test_readme.py's quick blocks
    monkeypatch.chdir(ROOT)
    code = cli.main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["problems"]
    assert report["versions"]["torch"].startswith(doctor.PINNED_TORCH)
    for pkg in ("deepspeed", "jupyterlab", "papermill", "nbval"):
        assert report["versions"][pkg], pkg
    assert report["backends"]["gloo"] is True
    assert report["device"]["cpu_cores"] >= 1
    assert report["deepspeed"]["importable"] and report["deepspeed"]["accelerator"] in ("cpu", "cuda")
    assert report["kernel"]["registered"] and report["kernel"]["python_exists"]
    labs = {row["lab"]: row["verdict"] for row in report["labs"]}
    assert "00_orientation" in labs
    if not report["device"]["cuda_available"]:
        assert labs["00_orientation"].startswith("runs with CPU stand-ins")
    assert report["problems"] == []


def test_doctor_command_exits_zero_and_prints_a_verdict(monkeypatch, capsys):
    """``course doctor`` as a learner types it (``--json``: the test above)."""
    monkeypatch.chdir(ROOT)
    code = cli.main(["doctor"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "install is healthy" in out and "gloo: yes" in out


def test_broken_install_exits_non_zero_with_the_fix(monkeypatch, capsys):
    real_version = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda p: None if p == "nbval" else real_version(p))
    monkeypatch.setattr(doctor, "_kernel_info", lambda: {"registered": False, "error": ""})
    monkeypatch.chdir(ROOT)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "packages not installed: nbval" in out and "./kit setup" in out
    assert "kernel 'course-kit' is not registered" in out and "ipykernel install" in out


def test_every_lab_has_a_catalog_entry():
    for path in sorted((ROOT / "labs").glob("[0-9][0-9]_*.py")):
        assert path.stem in catalog.LABS, f"add {path.stem} to course_lib/kit/catalog.py"
    info = catalog.LABS["00_orientation"]
    assert catalog.verdict(info, has_cuda=True) == "runs fully here"


def test_doctor_lists_the_full_size_time_an_in_place_run_recorded(tmp_path):
    """`course labs run NN --in-place` records the wall time; a rebuild keeps it; doctor prints it."""
    import nbformat

    from course_lib.kit import notebooks

    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "00_orientation.py").write_text("# %%\nprint(1)\n")
    (tmp_path / "labs" / "01_memory.py").write_text("# %%\nprint(2)\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    notebooks.record_execution(nb, tmp_path / "labs" / "00_orientation.ipynb", seconds=187.26)
    run = notebooks.recorded_run(tmp_path / "labs" / "00_orientation.ipynb")
    assert run["full_size_seconds"] == 187.3 and "CPU cores" in run["measured_on"]
    rebuilt = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    notebooks._keep_outputs(rebuilt, tmp_path / "labs" / "00_orientation.ipynb")
    assert rebuilt.metadata["course"]["full_size_seconds"] == 187.3
    report = doctor.gather(root=tmp_path)
    text = doctor.format_report(report)
    line = next(ln for ln in text.splitlines() if "00_orientation" in ln)
    assert "full size  3.1 min" in line, line
    assert "full size not timed yet" in next(ln for ln in text.splitlines() if "01_memory" in ln)


def test_record_time_keeps_outputs_and_refuses_stale_labs(tmp_path):
    import nbformat
    import pytest

    from course_lib.kit import notebooks

    lab = tmp_path / "00_x.ipynb"
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nb = nbformat.v4.new_notebook(cells=[cell])
    notebooks.record_execution(nb, lab)
    before = nbformat.read(lab, as_version=4).cells[0].outputs
    notebooks.record_time(lab, 42.04)
    after = nbformat.read(lab, as_version=4)
    assert after.cells[0].outputs == before and notebooks.recorded_run(lab)["full_size_seconds"] == 42.0
    after.cells[0].source = "print(2)"  # the code changed since the outputs were made
    lab.write_text(notebooks.dumps(after))
    with pytest.raises(ValueError, match="older code"):
        notebooks.record_time(lab, 1.0)


def test_each_lab_line_carries_its_own_load_and_the_shared_stamp_is_printed_once():
    stamps = {"00_a": "2 CPU cores, load 3.9, no GPU, torch 2.13.0+cpu, 2026-11-23",
              "01_b": "2 CPU cores, load 0.8, no GPU, torch 2.13.0+cpu, 2026-11-24",
              "02_c": ""}
    report = {"python": "3", "executable": "py", "versions": {}, "kernel": {"registered": False},
              "problems": [], "labs": [{"lab": lab, "verdict": "runs fully here", "full_size_seconds": 60.0 if s else None,
                                        "measured_on": s} for lab, s in stamps.items()]}
    lines = doctor.format_report(report).splitlines()
    by_lab = {lab: next(ln for ln in lines if lab in ln) for lab in stamps}
    assert "(load 3.9, 2026-11-23)" in by_lab["00_a"] and "(load 0.8, 2026-11-24)" in by_lab["01_b"]
    assert "load" not in by_lab["02_c"] and "not timed yet" in by_lab["02_c"]
    footer = next(ln for ln in lines if "measured on" in ln)
    assert "measured on 2 CPU cores, no GPU, torch 2.13.0+cpu;" in footer
    assert footer.count("CPU cores") == 1 and "3.9" not in footer  # once, not one stamp per lab
