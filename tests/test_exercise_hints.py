"""Exercise hints and checks point to the idea and say how far off, never the answer (issue 24).

Fast: no kernel and no rank is started (the rank launcher is replaced where a message needs it).
"""
import json
from pathlib import Path

import pytest

from course_lib.kit.checks import CheckFailed

ROOT = Path(__file__).resolve().parent.parent


def _exercise_text(name: str) -> str:
    nb = json.loads((ROOT / "exercises" / f"{name}.ipynb").read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"])


def test_exercise_11_does_not_spell_out_the_warm_up_formula():
    text = _exercise_text("11_one_f_one_b")
    assert "pp - stage - 1" not in text and "pp - s - 1" not in text
    assert "before the first gradient" in text  # the idea stays


def _one_f_then_one_b(pp, m, stage):
    """Deadlock-free and within 1F1B's memory, but no warm-up: every stage waits for each backward."""
    actions = []
    for i in range(m):
        actions += ([] if stage == 0 else [("recv_activation", i)]) + [("forward", i)] \
            + ([] if stage == pp - 1 else [("send_activation", i)])
        actions += ([] if stage == pp - 1 else [("recv_grad", i)]) + [("backward", i)] \
            + ([] if stage == 0 else [("send_grad", i)])
    return actions


def test_exercise_11_check_says_how_far_off_not_the_answer():
    from course_lib.labs import exercise11_one_f_one_b as ex

    with pytest.raises(CheckFailed) as caught:
        ex.check_schedule_fn(_one_f_then_one_b, 4, 6)
    text = str(caught.value)
    assert "time units" in text and "%" in text  # how far off
    assert "min(pp - stage - 1" not in text and "1F1B has" not in text  # not the answer
    assert ex.check_schedule_fn(ex_solution_order, 4, 6)["makespan"] == (6 + 4 - 1) * 3.0


def ex_solution_order(pp, m, stage):
    from course_lib.parallel.pipeline.schedules import stage_actions

    return stage_actions("1f1b", pp, m, stage)


def test_exercise_12_judge_never_names_the_planners_best_layout():
    from course_lib.planner.exercise import best, check_layout, review, scenario

    spec = scenario("70b-8-nodes")
    slow = dict(tp=1, pp=1, dp=64, zero_stage=3, recompute="full", micro_batch=1,
                why="shard everything over all GPUs")
    top = best(spec).layout.label()
    row = review(spec, slow)
    assert top not in row["verdict"] and top not in json.dumps(row, default=str)
    assert f"{row['vs_best']:+.1%}" in row["verdict"]  # how far off
    with pytest.raises(CheckFailed) as caught:
        check_layout(spec, slow, name="LAYOUT_70B (70b-8-nodes)")
    assert top not in str(caught.value) and "slower than the best" in str(caught.value)


def test_exercise_12_untouched_part_1_says_what_to_fill_in():
    from course_lib.planner.exercise import check_layout, scenario

    text = _exercise_text("12_parallelism_selection")
    assert "LAYOUT_7B = LAYOUT_70B = LAYOUT_8K = None" in text  # defined even when the answer cell raises
    with pytest.raises(CheckFailed, match=r"LAYOUT_7B \(7b-one-node\): no layout yet: write a dict"):
        check_layout(scenario("7b-one-node"), None, name="LAYOUT_7B (7b-one-node)")


@pytest.mark.parametrize("what", ["your f and g", "your tensor-parallel layers", "your BucketedDDP"])
def test_not_implemented_message_is_grammatical_for_any_subject(what, monkeypatch):
    from course_lib.labs import exercise_harness as exercise_runs
    from course_lib.parallel.ranks.launch import RankFailedError

    def fails(*_a, **_k):
        raise RankFailedError(1, "NotImplementedError: hint", exc_type="NotImplementedError")

    monkeypatch.setattr(exercise_runs, "run_ranks", fails)
    with pytest.raises(NotImplementedError) as caught:
        exercise_runs._launch(print, 2, what, 5.0)
    text = str(caught.value)
    assert text.startswith(f"{what}: a 'YOUR CODE HERE' still raises NotImplementedError (rank 1)")
    assert f"{what} still raises" not in text
