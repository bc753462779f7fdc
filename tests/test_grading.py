"""Fast tests of the grader's parts: record encoding, the comparison, cell pairing, argument checks,
and the sandbox's limits (one tiny kernel per test, no torch)."""
import json
import math

import pytest
import torch

from course_lib.grading import assemble, grade, record, sandbox, values
from tests.grading_corpus import ROOT, answer_source, exercise_notebook, solution_notebook, write_submission

EX01 = ROOT / "solutions" / "01_memory_budget.py"


def _roundtrip(tmp_path, monkeypatch, value, **kw):
    monkeypatch.setenv("COURSE_GRADING_RECORDS", str(tmp_path / "rec"))
    record("v", value, **kw)
    return values.load_records(tmp_path / "rec")["v"]


def test_record_is_a_noop_outside_grading(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_GRADING_RECORDS", raising=False)
    monkeypatch.chdir(tmp_path)
    record("x", 1)
    assert list(tmp_path.iterdir()) == []


def test_record_round_trip_keeps_types_and_tensors(tmp_path, monkeypatch):
    value = {"a": [1, 2.5, float("nan"), "s", None, True], 3: (torch.arange(4), torch.ones(2, dtype=torch.bfloat16))}
    got = _roundtrip(tmp_path, monkeypatch, value, rtol=1e-3).value
    assert got["a"][:2] == [1, 2.5] and math.isnan(got["a"][2]) and got["a"][3:] == ["s", None, True]
    assert torch.equal(got[3][0], torch.arange(4)) and got[3][1].dtype == torch.bfloat16
    assert values.mismatch(got, got, 0, 0) is None


def test_objects_that_lie_about_equality_are_not_values(tmp_path, monkeypatch):
    class Yes:
        def __eq__(self, other):
            return True
    rec = _roundtrip(tmp_path, monkeypatch, [Yes()])
    assert values.mismatch(rec.value, [5], 1e-9, 0) is not None
    assert "could not be read" in values.mismatch(rec.value[0], 5, 1e-9, 0)


@pytest.mark.parametrize("got,want,rtol,atol,ok", [
    (1.0 + 1e-10, 1.0, 1e-9, 0, True), (1.001, 1.0, 1e-9, 0, False), (2, 2.0, 1e-9, 0, True),
    (True, 1, 1e-9, 0, False), ("skip", "skip", 0, 0, True), ("Skip", "skip", 0, 0, False),
    (float("nan"), float("nan"), 0, 0, True), (float("nan"), 1.0, 0, 0, False),
    ([1, 2], [1, 2, 3], 0, 0, False), ({"a": 1}, {"a": 1, "b": 2}, 0, 0, False),
    (torch.ones(3), torch.ones(3) + 1e-7, 1e-5, 0, True), (torch.ones(3), torch.ones(4), 1, 1, False),
    (torch.ones(3, dtype=torch.float64), torch.ones(3), 1, 1, False), ([1.0], torch.ones(1), 1, 1, False),
])
def test_mismatch(got, want, rtol, atol, ok):
    assert (values.mismatch(got, want, rtol, atol) is None) == ok


def test_garbage_records_are_ignored_and_first_write_wins(tmp_path):
    folder = tmp_path / "rec"
    folder.mkdir()
    (folder / "records.jsonl").write_text("\n".join([
        "not json", json.dumps({"name": "x", "value": 1}), json.dumps({"name": "x", "value": 2}),
        json.dumps({"name": "t", "value": {"$tensor": "t0"}, "tensors": "../../../etc/passwd"}),
        json.dumps({"name": "u", "value": {"$pickle": "gASV"}})]) + "\n")
    recs = values.load_records(folder)
    assert recs["x"].value == 1 and "t" not in recs and isinstance(recs["u"].value, values.Malformed)


def test_points_tags_and_answer_cells_of_exercise_01():
    ex = assemble.load_exercise(EX01)
    assert [(t.id, t.points, t.hidden) for t in ex.tests] == [
        ("cell-005", 2, False), ("cell-007", 2, True), ("cell-010", 2, False), ("cell-011", 2, True),
        ("cell-014", 3, False), ("cell-016", 3, True)]
    assert sorted(ex.answer_ids) == ["cell-004", "cell-009", "cell-013"] and ex.max_points == 14


def test_a_points_tag_on_an_answer_cell_is_refused(tmp_path):
    bad = tmp_path / "99_bad.py"
    bad.write_text('# %% tags=["parameters"]\nSMOKE = False\n\n# %% tags=["points:2"]\ndef f():\n'
                   '    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n')
    with pytest.raises(assemble.GradingSourceError, match="solution block and a points tag"):
        assemble.load_exercise(bad)


def test_pairing_takes_answers_by_id_and_tests_from_the_instructor():
    ex = assemble.load_exercise(EX01)
    sol = solution_notebook("01_memory_budget")
    cells = [{"id": c["id"], "cell_type": c["cell_type"], "source": "".join(c["source"])} for c in sol["cells"]]
    by_id = {c["id"]: c for c in cells}
    by_id["cell-005"]["source"] = "print('tests deleted')"       # an edited test cell: ignored
    by_id["cell-004"]["source"] = "def model_state_bytes(n): return 'mine'"
    extra = {"id": "xyz", "cell_type": "code", "source": "HELPER = 1"}
    reordered = [by_id["cell-009"], extra, *[c for c in cells if c["id"] != "cell-009"]]
    run = dict(assemble.grading_cells(ex, reordered))
    order = [cid for cid, _ in assemble.grading_cells(ex, reordered)]
    assert run["cell-004"] == "def model_state_bytes(n): return 'mine'"
    assert run["cell-005"] == next(c.source for c in ex.cells if c.id == "cell-005")  # instructor's test
    assert order.index("cell-009") > order.index("cell-005")  # answers run at the instructor's position
    extra_id = next(cid for cid, src in run.items() if src == "HELPER = 1")
    assert order.index(extra_id) == order.index("cell-009") + 1  # after the cell before it in the submission
    assert order[order.index(ex.parameters_id) + 1] == "injected-smoke"
    # a deleted answer cell is an empty answer; duplicated ids: the first one counts
    missing = [c for c in cells if c["id"] != "cell-013"] + [dict(by_id["cell-004"], source="second")]
    run = dict(assemble.grading_cells(ex, missing))
    assert run["cell-013"] == "" and run["cell-004"] == "def model_state_bytes(n): return 'mine'"


def test_pairing_by_position_when_a_tool_dropped_the_ids():
    ex = assemble.load_exercise(EX01)
    sol = solution_notebook("01_memory_budget")
    cells = [{"id": "", "cell_type": c["cell_type"], "source": "".join(c["source"])} for c in sol["cells"]]
    assert dict(assemble.grading_cells(ex, cells))["cell-009"] == answer_source(sol, 1)
    assert dict(assemble.grading_cells(ex, cells[:-1]))["cell-009"] == ""  # other length: no guessing


def test_unreadable_submission_is_an_empty_answer(tmp_path):
    path = tmp_path / "x.ipynb"
    path.write_text("{not json")
    cells, note = assemble.read_submission(path)
    assert cells == [] and "could not be read" in note


@pytest.mark.parametrize("kw,match", [
    (dict(number="1"), "two digits"), (dict(number="42"), "no solutions/42_"),
    (dict(jobs=0), "--jobs"), (dict(memory_gb=0.1), "--memory-gb"), (dict(cell_timeout=0), "--timeout"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, kw, match):
    subs = tmp_path / "subs"
    write_submission(subs, "ann", "01_memory_budget", exercise_notebook("01_memory_budget"))
    args = dict(number="01", jobs=1, memory_gb=2, cell_timeout=10)
    args.update(kw)
    number = args.pop("number")
    with pytest.raises(ValueError, match=match):
        grade.grade(subs, number, tmp_path / "out", root=ROOT, cache_dir=tmp_path / "cache", **args)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_output_folder_must_be_empty_and_names_must_be_clean(tmp_path):
    subs, out = tmp_path / "subs", tmp_path / "out"
    write_submission(subs, "ann", "01_memory_budget", exercise_notebook("01_memory_budget"))
    out.mkdir()
    (out / "old.csv").write_text("x")
    with pytest.raises(ValueError, match="absent or an empty folder"):
        grade.grade(subs, "01", out, root=ROOT, cache_dir=tmp_path / "cache")
    write_submission(subs, "ann", "01_memory_budget", exercise_notebook("01_memory_budget"), flat=True)
    with pytest.raises(ValueError, match="two submissions"):
        grade.find_submissions(subs, "01_memory_budget")
    write_submission(tmp_path / "s2", "a b", "01_memory_budget", {})
    with pytest.raises(ValueError, match="student name"):
        grade.find_submissions(tmp_path / "s2", "01_memory_budget")


def _run(tmp_path, cells, **kw):
    args = dict(cell_timeout=10, notebook_timeout=30, memory_bytes=2 * 2**30)
    args.update(kw)
    return sandbox.run_cells([(f"c{i}", s) for i, s in enumerate(cells)], tmp_path / "work", **args)


def test_memory_limit_turns_a_bomb_into_an_error(tmp_path):
    run = _run(tmp_path, ["x = 1", "b = bytearray(3 * 2**30)", "y = 2"])
    assert [o.status for o in run.cells.values()] == ["ok", "error", "ok"]
    assert run.cells["c1"].error_name == "MemoryError"


def test_notebook_time_limit_and_sys_exit(tmp_path):
    run = _run(tmp_path, ["import sys; sys.exit(0)", "import time; time.sleep(60)", "z = 1"],
               cell_timeout=30, notebook_timeout=10)  # 10 s: the kernel's start fits, also on a loaded machine
    assert [o.status for o in run.cells.values()] == ["error", "timeout", "not-run"]
    assert run.seconds < 25  # the notebook's limit stopped the 60 s sleep, not the cell's 30 s


@pytest.mark.skipif(not sandbox.sandbox_available(), reason="needs unprivileged user namespaces")
def test_sandbox_hides_paths_and_has_no_network(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "answer.txt").write_text("42")
    probe = (f"import os, socket\nseen = os.listdir({str(secret)!r})\n"
             "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3); net = 'open'\n"
             "except OSError as e:\n    net = 'closed'\n"
             "from course_lib.grading import record\nrecord('seen', seen); record('net', net)\n"
             "record('ppid', os.getppid())")
    run = _run(tmp_path, [probe], hide=[secret], sandbox=True)
    recs = values.load_records(run.records_dir)
    assert run.cells["c0"].status == "ok", run.cells["c0"].error
    assert recs["seen"].value == [] and recs["net"].value == "closed" and recs["ppid"].value == 0
    assert (secret / "answer.txt").read_text() == "42"


def test_course_check_scores_the_learners_visible_checks(tmp_path):
    from course_lib.grading import learner

    exe, sol = exercise_notebook("01_memory_budget"), solution_notebook("01_memory_budget")
    nb = json.loads(json.dumps(exe))
    for cell in nb["cells"]:
        if cell["id"] == "cell-004":  # Part 1 answered, the rest untouched
            cell["source"] = answer_source(sol, 0)
    path = write_submission(tmp_path, "me", "01_memory_budget", nb)
    lines = {ln.id: ln for ln in learner.check_notebook(path, cell_timeout=30)}
    assert (lines["cell-005"].status, lines["cell-005"].points) == ("passed", 2)
    assert lines["cell-007"].status == "hidden" and lines["cell-011"].status == "hidden"
    assert lines["cell-010"].status == "failed" and "NotImplementedError" in lines["cell-010"].message
    assert "2 / 7" in learner.format_lines("01", list(lines.values()))


def test_cli_registers_grade_and_check():
    from course_lib.cli import build_parser

    args = build_parser().parse_args(["grade", "subs", "--exercise", "01", "--out", "o", "--jobs", "3"])
    assert (args.exercise, args.jobs, args.timeout) == ("01", 3, 120.0)
    assert build_parser().parse_args(["check", "05"]).exercise == "05"


def test_a_judge_compares_verdicts_and_only_the_reference_names_it(tmp_path, monkeypatch):
    # describe() as a stand-in judge: two tensors of one shape get the same verdict
    monkeypatch.setenv("COURSE_GRADING_RECORDS", str(tmp_path / "ref"))
    record("v", torch.ones(3), judge="course_lib.grading.values:describe")
    monkeypatch.setenv("COURSE_GRADING_RECORDS", str(tmp_path / "student"))
    record("v", torch.zeros(3))
    want, got = values.load_records(tmp_path / "ref")["v"], values.load_records(tmp_path / "student")["v"]
    assert want.judge == "course_lib.grading.values:describe" and got.judge == ""
    assert values.mismatch(got.value, want.value, want.rtol, want.atol) is not None  # plain comparison fails
    assert values.mismatch(values.judged(want.judge, got.value), values.judged(want.judge, want.value), 0, 0) is None
    # a value the judge cannot take is malformed, never equal; judges live in course_lib only
    refused = values.judged("course_lib.grading.grade:find_exercise_source", 5)  # takes two arguments
    assert isinstance(refused, values.Malformed) and "judge refused it" in refused.why
    for bad in ("os:system", "course_lib.x", "course_lib.grading.values:describe; rm"):
        with pytest.raises(ValueError, match="judge"):
            record("w", 1, judge=bad)
        with pytest.raises(ValueError, match="course_lib"):
            values.judged(bad, 1)


def test_an_unknown_probe_tag_is_refused_and_known_ones_are_attached(tmp_path):
    bad = tmp_path / "99_bad.py"
    bad.write_text('# %% tags=["parameters"]\nSMOKE = False\n\n# %% tags=["points:2", "probe:no-such-probe"]\n'
                   'x = 1\n')
    with pytest.raises(assemble.GradingSourceError, match="unknown probe"):
        assemble.load_exercise(bad)
    ex = assemble.load_exercise(ROOT / "solutions" / "07_atomic_checkpoint.py")
    assert [t.probes for t in ex.tests] == [("checkpoint-atomic",), ("checkpoint-retention",),
                                            ("checkpoint-kills",), ("checkpoint-kills",)]


def test_checkpoints_verdict_reads_the_disk_like_a_restarted_run(tmp_path):
    from course_lib.labs.lab07_checkpoints import make_state
    from course_lib.grading.probes import checkpoints_verdict

    def folder(name, steps, torn=(), link=None):
        f = tmp_path / name
        f.mkdir()
        for s in steps:
            path = f / f"step_{s:08d}.pt"
            torch.save(make_state(s, 8), path)
            if s in torn:
                path.write_bytes(path.read_bytes()[:100])
        if link:
            (f / f"step_{link:08d}.pt").symlink_to(f / f"step_{steps[0]:08d}.pt")
        return f
    assert checkpoints_verdict(folder("good", [4, 5]), expect_steps=[4, 5]) == "ok"
    assert "got its final name before it was complete" in checkpoints_verdict(folder("torn", [4, 5], torn=(5,)))
    assert "not consecutive" in checkpoints_verdict(folder("gap", [4, 9]))
    assert "not a checkpoint file" in checkpoints_verdict(folder("link", [4], link=5))
    assert "at most one extra" in checkpoints_verdict(folder("many", [3, 4, 5, 6]), max_count=3)
    assert checkpoints_verdict(tmp_path / "missing") == "no checkpoint (step_*.pt) on disk"


# --------------------------------------------------------------------------------------------
# reports: unreadable submissions are named on the console and in the summary; one status word
# --------------------------------------------------------------------------------------------

def _graded_by_hand(tmp_path):
    """Two students graded without a kernel: bob's file is fine, the others' cannot be read."""
    from course_lib.grading.reference import TestResult

    ex = assemble.load_exercise(EX01)
    notes = {}
    for student, text in (("empty", ""), ("badjson", "{not json"), ("python", "import torch\nprint(1)\n")):
        path = tmp_path / f"{student}.ipynb"
        path.write_text(text)
        cells, notes[student] = assemble.read_submission(path)
        assert cells == [] and "could not be read" in notes[student], (student, notes[student])
    zero = [TestResult(t, 0, "failed", "NotImplementedError: fill in", 0.1) for t in ex.tests]
    bob = [TestResult(t, t.points if i else 0, "passed" if i else "failed", "" if i else "CheckFailed: no", 0.1)
           for i, t in enumerate(ex.tests)]
    graded = [grade.Graded("bob", bob, 1.0)] + [grade.Graded(s, zero, 0.2, n) for s, n in notes.items()]
    return ex, graded


def test_unreadable_submissions_are_named_on_the_console_and_in_the_summary(tmp_path):
    from course_lib.grading import report

    ex, graded = _graded_by_hand(tmp_path)
    lines = report.console_lines(graded)
    assert "UNREADABLE" not in lines[0] and lines[0].startswith("bob")
    for line, g in zip(lines[1:], graded[1:]):
        assert line.startswith(g.student) and f"0 / {ex.max_points}" in line
        assert "UNREADABLE" in line and "could not be read" in line and f"feedback/{g.student}.md" in line
    out = tmp_path / "out"
    out.mkdir()
    report.write_reports(out, ex, graded)
    summary = (out / "summary.md").read_text()
    assert "Unreadable submissions (3)" in summary
    for g in graded[1:]:
        assert f"- {g.student}: the notebook could not be read" in summary
    assert "| bob |" in summary and "unreadable" not in summary.split("| bob |")[1].split("\n")[0]
    assert "Unreadable submission: the notebook could not be read" in (out / "feedback" / "empty.md").read_text()


def test_feedback_and_grades_csv_use_the_same_status_word(tmp_path):
    import csv

    from course_lib.grading import report

    ex, graded = _graded_by_hand(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    report.write_reports(out, ex, graded)
    csv_words = {(r["student"], r["test"]): r["status"] for r in csv.DictReader((out / "grades.csv").open())}
    assert set(csv_words.values()) == {"passed", "failed"}
    md = (out / "feedback" / "bob.md").read_text()
    table = [ln.split(" | ") for ln in md.splitlines() if ln.startswith("| cell-")]
    assert table and all(row[2] == csv_words[("bob", row[0].lstrip("| "))] for row in table)
    assert "a check failed" not in md and "- **failed**:" in md and "- **passed**:" in md


def test_hidden_tests_are_labelled_for_what_they_test():
    ex = assemble.load_exercise(ROOT / "solutions" / "09_zero1_optimizer.py")
    hidden = [t.title for t in ex.tests if t.hidden]
    assert hidden == ["SGD (momentum, a parameter group added mid-run) and AdamW under an lr schedule, on 3 ranks"]
    # without its own "# test:" line a test keeps the heading above it
    assert [t.title for t in ex.tests if not t.hidden][0].startswith("Part 2")


def test_grade_help_names_the_cache_folder_the_code_uses(capsys):
    from course_lib.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["grade", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert str(grade.default_cache_dir()).endswith("course-kit/grading")
    assert "~/.cache/course-kit/grading" in text


# --------------------------------------------------------------------------------------------
# probes: the grader's default number of kills, and no kernel after a verdict that already failed
# --------------------------------------------------------------------------------------------

def test_real_grading_keeps_every_kill_of_the_probes(tmp_path, monkeypatch):
    """tests/test_grading_batch.py sets fewer kills to save kernels; the grader's defaults stay:
    4 kills of save_checkpoint (2 at a random moment, 2 mid-write) and 2 of atomic_save per run."""
    from course_lib.grading import probes
    from course_lib.labs.lab07_checkpoints import make_state

    assert probes.KILL_CYCLES == 4
    calls = []

    def fake_kills(work, scratch, limits, module, function, *, cycles, seed):
        calls.append((function, cycles))
        return ["ok"] * cycles
    monkeypatch.setattr(probes, "kill_cycles", fake_kills)
    # the atomic_save scenario's files as a correct module leaves them, without a kernel
    folder = tmp_path / "scenario"
    (folder / "a").mkdir(parents=True)
    (folder / "b").mkdir()
    torch.save(make_state(2, 16), folder / "a" / "model.pt")
    torch.save({"step": 4, "w": {"nested": [torch.full((5,), 4.0)]}}, folder / "b" / "x.pt")
    monkeypatch.setattr(probes, "_scenario", lambda *a, **k: (folder, []))
    limits = probes.ProbeLimits(2**30, (), False)
    verdicts = probes.run_probes({"checkpoint-kills", "checkpoint-atomic"}, tmp_path, tmp_path / "p", limits)
    assert sorted(calls) == [("atomic_save", 2), ("save_checkpoint", 4)]
    assert verdicts == {"checkpoint-atomic": ["ok"] * 4, "checkpoint-kills": ["ok"] * 4}


def test_a_kill_probe_stops_at_its_first_failed_verdict(tmp_path, monkeypatch):
    """Points need every verdict equal to the reference's ("ok") and feedback shows the first one
    that is not, so the kills after a failure start no kernel; the verdict list keeps its length."""
    from course_lib.grading import probes

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "ex07_checkpoint.py").write_text("# a module the probe never imports here\n")
    started = []
    monkeypatch.setattr(probes.sandbox, "start_kernel", lambda folder, **kw: started.append(folder) or
                        type("K", (), {"send": lambda self, cid, src: True})())
    monkeypatch.setattr(probes.sandbox, "stop_kernel", lambda kernel: None)
    monkeypatch.setattr(probes, "_kill_mid_save", lambda *a, **k: "")
    said = iter(["ok", "steps [3, 5] on disk", "ok", "ok"])
    monkeypatch.setattr(probes, "checkpoints_verdict", lambda *a, **k: next(said))
    limits = probes.ProbeLimits(2**30, (), False)
    got = probes.probe_kills(tmp_path / "work", tmp_path / "scratch", limits)
    assert got == ["ok", "steps [3, 5] on disk", probes.NOT_RUN, probes.NOT_RUN]
    assert len(started) == 2
