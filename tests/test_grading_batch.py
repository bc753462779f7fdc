"""The grader end to end: each batch mixes honest and hostile submissions of one exercise.

Every solution graded here scores full marks (01's; 05's and 07's run as the reference: see
TORCH_BATCHES), every untouched exercise zero, honest partial answers exactly
the tests they pass, and no hostile submission earns a point (see tests/grading_corpus/).

Each batch first builds the grader's reference: every cell of ``solutions/NN.py``, hidden tests
included, run in a fresh kernel at smoke size, and a ``ReferenceError`` if any cell fails. That is
the smoke run of these exercises' solution notebooks (built from those sources), so
tests/test_notebooks_execute.py does not execute them again (:data:`REFERENCE_BUILT`).
"""
import csv
import json

import pytest

from course_lib.grading import grade, probes, sandbox
from tests.grading_corpus import (ROOT, answer_source, exercise_notebook, hostile, patched,
                                  solution_notebook, write_submission)

SANDBOX = sandbox.sandbox_available()


def _grade(tmp_path, number, subs, **kw):
    out = tmp_path / "out"
    graded = grade.grade(subs, number, out, root=ROOT, cache_dir=tmp_path / "cache", progress=False, **kw)
    return {g.student: g for g in graded}, out


def _statuses(g):
    return {r.test.id: r.status for r in g.results}


def test_exercise_01_honest_and_hostile_batch(tmp_path):
    name = "01_memory_budget"
    sol, exe = solution_notebook(name), exercise_notebook(name)
    subs = tmp_path / "subs"
    out = tmp_path / "out"
    expected = {}

    def add(student, nb, points, flat=False):
        write_submission(subs, student, name, nb, flat)
        expected[student] = points

    add("solution", sol, 14)
    add("untouched", exe, 0, flat=True)
    # honest: Part 3's dominant_component returns the smallest part: Parts 1 and 2 score
    add("partial", patched(sol, {2: answer_source(sol, 2).replace("max(budget", "min(budget")}), 8)
    # honest: answer cells moved to the end, a helper cell of their own at the top, test cells
    # deleted or edited: answers are paired by id, tests come from the instructor
    nb = patched(sol, {0: answer_source(sol, 0).replace("(4 + 4 + 4)", "FP32_STATE")})
    answers = [c for c in nb["cells"] if "### BEGIN SOLUTION" in "".join(c["source"])]
    others = [c for c in nb["cells"] if c not in answers and c["id"] not in ("cell-005", "cell-016")]
    for c in others:
        if c["id"] == "cell-010":
            c["source"] = "pass  # I deleted this test"
    helper = {"cell_type": "code", "id": "a1b2c3", "metadata": {}, "outputs": [], "execution_count": None,
              "source": "FP32_STATE = 4 + 4 + 4  # my helper"}
    nb["cells"] = [helper, *others, *answers]
    add("reordered", nb, 14)
    # honest: an old tool dropped every cell id (same cells): paired by position
    nb = json.loads(json.dumps(sol))
    nb["nbformat_minor"] = 4
    for c in nb["cells"]:
        c.pop("id")
    add("no-ids", nb, 14)
    # robustness: the tests before the crash / hang keep their points
    add("hang-part3", patched(sol, {2: hostile.HANG}), 8)
    add("exit-part3", patched(sol, {2: hostile.HARD_EXIT}), 8)
    add("sysexit-part2", patched(sol, {1: hostile.SYS_EXIT}), 4)
    add("bomb-part2", patched(sol, {1: hostile.MEMORY_BOMB}), 4)
    # hostile: nothing earns a point
    add("eq-true", patched(sol, {0: hostile.EQ_ALWAYS_TRUE, 1: "", 2: hostile.EQ_ALWAYS_TRUE_2}), 0)
    add("patch-compare", patched(sol, {0: hostile.PATCH_COMPARISONS, 1: "", 2: hostile.NO_CHECKS_WRONG_BUDGET}), 0)
    add("forge", patched(sol, {0: hostile.FORGE_RECORDS, 1: "", 2: hostile.NO_CHECKS_WRONG_BUDGET}), 0)
    add("write-out", patched(sol, {0: hostile.WRITE_OUTPUTS.replace("{OUT}", str(out)), 1: "",
                                   2: hostile.NO_CHECKS_WRONG_BUDGET}), 0)
    add("exfiltrate", patched(sol, {0: hostile.EXFILTRATE_HIDDEN, 1: "", 2: ""}), 0)
    if SANDBOX:  # without namespaces these two would succeed (read) or kill the test run (signal)
        add("read-solutions", patched(sol, {0: hostile.READ_SOLUTIONS.replace("{ROOT}", str(ROOT)), 1: "",
                                            2: ""}), 0)
        add("kill-parent", patched(sol, {0: hostile.KILL_PARENT, 1: "", 2: hostile.NO_CHECKS_WRONG_BUDGET}), 0)

    # cell_timeout: the hang above waits this long; a cell that imports torch (the hostile
    # preludes) takes ~3 s of one core, up to ~8 s with the suite's two workers on 2 cores.
    cell_limit = 20
    graded, out = _grade(tmp_path, "01", subs, cell_timeout=cell_limit, notebook_timeout=90, memory_gb=2, jobs=2)
    assert {s: g.points for s, g in graded.items()} == expected
    # the answer cell cell-013 hangs / exits: its tests are not run, the earlier ones keep their points
    hang = {r.test.id: r for r in graded["hang-part3"].results}
    assert hang["cell-014"].status == "not-run" and "stopped at cell-013" in hang["cell-014"].message
    assert f"limit {cell_limit} s per cell" in hang["cell-014"].message
    assert _statuses(graded["exit-part3"])["cell-016"] == "not-run"
    assert "exit code 3" in {r.test.id: r for r in graded["exit-part3"].results}["cell-014"].message
    assert _statuses(graded["bomb-part2"])["cell-010"] == "failed"  # MemoryError in the answer: NameError here
    # the in-kernel checks passed for these: only the comparison outside the kernel caught them
    assert _statuses(graded["eq-true"])["cell-007"] == "wrong"  # its hidden checks compare with ==
    assert "wrong" in _statuses(graded["patch-compare"]).values()

    # the output folder holds exactly the grader's files, whatever a kernel wrote there
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(["grades.csv", "summary.md", "summary.png"]
                           + [f"feedback/{s}.{ext}" for s in expected for ext in ("html", "md")])
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert len(rows) == len(expected) * 6
    assert sum(int(r["points"]) for r in rows if r["student"] == "write-out") == 0
    assert not any(r["student"] == "mallory" for r in rows)
    # feedback names the failed check, never a hidden test's code
    hidden_code = (ROOT / "solutions" / f"{name}.py").read_text().split("### BEGIN HIDDEN TESTS")[1]
    secret = "n = estimate.ModelShape.preset(name).num_params()"
    assert secret in hidden_code
    for ext in ("md", "html"):
        text = (out / "feedback" / f"exfiltrate.{ext}").read_text()
        assert secret not in text and "withheld" in text
    partial = (out / "feedback" / "partial.md").read_text()
    assert "8 / 14" in partial and "none: wrong dominant part" in partial  # a hidden check's message, not its code
    assert "make activations the largest component" in partial  # the visible check's own words


# honest partial answers of the torch exercises (slow sweep: tests/test_grading_sweep.py)
PARTIALS = {
    # 05: clip_stats returns zeros: Part 1c's two tests (3 points) fail
    "05": ({2: ('return {"clip_rate": sum', 'return {"clip_rate": 0.0 * sum')}, 17),
    # 07: prunes before verifying the new checkpoint: Part 3 (3 points) fails
    "07": ({0: ("    atomic_save(state, path)\n    try:",
                "    atomic_save(state, path)\n    for old in list_checkpoints(folder)[:-keep_last]:\n"
                "        old.unlink()\n    try:")}, 9),
    # 13: the merge forgets rows that see no key in either block (NaN there): the masked-rows test
    # (2 points) and the hidden test (3, a row with no key at all) fail; the ring never meets such a row
    "13": ({0: ("safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))", "safe = m")}, 7),
    # 14: combine sends the outputs back but forgets to undo dispatch's sort by expert (each rank's
    # outputs come back in expert order, not in the order of its x): Parts 1 and 2 (2 + 3 points)
    # pass, Part 3 (3) and the hidden test (3) fail
    "14": ({0: ("    out = torch.empty_like(back)\n    out[order] = back\n    return out", "    return back")}, 5),
}


def write_partial(subs, name, number):
    """An honest submission of exercise ``number`` with one known mistake; returns its points."""
    sol = solution_notebook(name)
    changes, points = PARTIALS[number]
    changed = {k: answer_source(sol, k).replace(*change) for k, change in changes.items()}
    assert all(changed[k] != answer_source(sol, k) for k in changed)
    write_submission(subs, "partial", name, patched(sol, changed))
    return points


# (number, name, stubs). The solutions of these two are not graded as submissions here: each
# batch's reference build already runs the whole solution (and, for 07, every probe on it), a
# ReferenceError unless every cell is ok and every probe says "ok"; the hostile submissions are
# scored against that reference. A second run of the solution would add only the reproducibility
# of its records (and probe verdicts), which the slow sweep (tests/test_grading_sweep.py) checks
# for every exercise; that a solution submission scores full marks - its answers paired by id,
# by position, reordered - is the 01 batch above.
#
# 05 runs under -m slow only: its promise (a top cell that silences the checks and patches every
# comparison earns nothing; only the comparison outside the kernel catches the wrong answers) is held
# in the default suite by 07's forged submission (the same top cell, PATCH_PRELUDE) and 01's
# patch-compare and eq-true (wrong values under silenced checks: "wrong"); its solution's smoke run
# is then tests/test_notebooks_execute.py's, and the slow sweep grades 05's solution and partial.
TORCH_BATCHES = [
    pytest.param("05", "05_gradient_policy", hostile.STUBS_05, marks=pytest.mark.slow, id="05-slow"),
    pytest.param("07", "07_atomic_checkpoint", None, id="07"),  # forged below: a superset of the stub attack
]
# the exercises whose reference (the whole solution, run by the grader) the default run of this module builds
REFERENCE_BUILT = ("01", "07")
# kills per run of the "checkpoint-kills" probe in these batches: one at a random moment, one
# mid-write (the grader's default, probes.KILL_CYCLES = 4, is checked in tests/test_grading.py).
# Reference and submissions get the same count, so a correct module still matches the reference.
BATCH_KILL_CYCLES = 2


@pytest.mark.parametrize("number,name,stubs", TORCH_BATCHES)
def test_exercise_batch_with_torch(tmp_path, monkeypatch, number, name, stubs):
    monkeypatch.setattr(probes, "KILL_CYCLES", BATCH_KILL_CYCLES)
    sol, exe = solution_notebook(name), exercise_notebook(name)
    subs = tmp_path / "subs"
    write_submission(subs, "untouched", name, exe)
    expected = {"untouched": 0}
    if number == "05":
        # hostile: an added cell at the top makes every comparison say "equal" and silences the
        # checks; the answers are wrong stubs that those checks would now accept
        nb = patched(sol, stubs)
        nb["cells"].insert(0, {"cell_type": "code", "id": "evil", "metadata": {}, "outputs": [],
                               "execution_count": None, "source": hostile.PATCH_PRELUDE})
        write_submission(subs, "patched", name, nb)
        expected["patched"] = 0
    else:  # 07: the same prelude, the answers unsafe, and every recorded value forged right
        nb = patched(sol, {0: hostile.UNSAFE_07})
        nb["cells"].insert(0, {"cell_type": "code", "id": "evil", "metadata": {}, "outputs": [],
                               "execution_count": None, "source": hostile.FORGE_07})
        write_submission(subs, "forged", name, nb)
        expected["forged"] = 0
    graded, out = _grade(tmp_path, number, subs, cell_timeout=120, notebook_timeout=300, memory_gb=6, jobs=2)
    assert {s: g.points for s, g in graded.items()} == expected
    if number == "05":
        # the silenced checks let the stubs' cells finish: only the comparison outside the kernel failed them
        assert "wrong" in _statuses(graded["patched"]).values()
    else:
        # every cell finished and recorded the reference's values: only the grader's probes caught it
        forged = graded["forged"].results
        assert all(r.status == "wrong" and "grader's own test" in r.message for r in forged), \
            [(r.test.id, r.status, r.message) for r in forged]
        assert any("got its final name before it was complete" in r.message for r in forged)
