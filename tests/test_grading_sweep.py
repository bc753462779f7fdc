"""Every exercise through the grader (slow: about 6 minutes on 2 loaded cores).

For each ``solutions/NN_*.py``: the solution notebook scores full marks (which also proves its
recorded values reproduce from one run to the next), the untouched exercise scores zero, for
05, 07, 13 and 14 an honest submission with one known mistake scores exactly the tests it passes, and for
the exercises whose code runs on ranks (00, 08-11) a forged submission - wrong answers, silenced
checks, course_lib's rank checker replaced in the kernel by one returning perfect rows - earns
only the points of the answers it left right (tests/grading_corpus/forged_*.py). Every exercise but 01
(tests/test_grading_batch.py) also grades a wrong-but-plausible answer (tests/grading_corpus/plausible.py,
and the honest partials): below full marks, through a visible test that ``course check`` fails too,
with a message naming the broken property. They join the batch of the same ``grade`` call, so the
reference is built once.
"""
from pathlib import Path

import pytest

from course_lib.grading import grade
from tests.grading_corpus import ROOT, exercise_notebook, forged_dp, forged_tp_pp, patched, solution_notebook, write_submission
from tests.grading_corpus.plausible import PARTIAL_WORDS, PLAUSIBLE, plausible_notebook, visible_failure
from tests.test_grading_batch import PARTIALS, write_partial

SOURCES = sorted(ROOT.glob("solutions/[0-9][0-9]_*.py"))
FORGED = {**forged_dp.FORGED, **forged_tp_pp.FORGED}
FORGED_KEEPS = {**getattr(forged_dp, "FORGED_KEEPS", {}), **getattr(forged_tp_pp, "FORGED_KEEPS", {})}


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_exercise_solution_full_exercise_zero(tmp_path, source: Path):
    number, name = source.stem[:2], source.stem
    subs = tmp_path / "subs"
    write_submission(subs, "solution", name, solution_notebook(name))
    write_submission(subs, "untouched", name, exercise_notebook(name))
    partial = write_partial(subs, name, number) if number in PARTIALS else None
    if number in PLAUSIBLE:
        write_submission(subs, "plausible", name, plausible_notebook(solution_notebook(name), number))
    if number in FORGED:
        write_submission(subs, "forged", name, patched(solution_notebook(name), FORGED[number]))
    graded = {g.student: g for g in grade.grade(subs, number, tmp_path / "out", root=ROOT,
                                                 cache_dir=tmp_path / "cache", progress=False, jobs=2)}
    full = sum(t.points for t in (r.test for r in graded["solution"].results))
    failing = [(r.test.id, r.status, r.message) for r in graded["solution"].results if r.status != "passed"]
    assert graded["solution"].points == full, failing
    assert graded["untouched"].points == 0
    if partial is not None:
        assert graded["partial"].points == partial
        assert visible_failure(graded["partial"], PARTIAL_WORDS[number]) is None, visible_failure(
            graded["partial"], PARTIAL_WORDS[number])
    if number in PLAUSIBLE:
        plausible = graded["plausible"]
        assert plausible.points < full, [(r.test.id, r.status, r.message) for r in plausible.results]
        assert visible_failure(plausible, PLAUSIBLE[number][2]) is None, visible_failure(plausible, PLAUSIBLE[number][2])
    if number in FORGED:
        forged = graded["forged"]
        assert forged.points == FORGED_KEEPS.get(number, 0), [(r.test.id, r.status, r.message) for r in forged.results]
