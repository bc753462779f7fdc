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
    assert "LAYOUT_13B = LAYOUT_70B = LAYOUT_16K = None" in text  # defined even when the answer cell raises
    with pytest.raises(CheckFailed, match=r"LAYOUT_13B \(13b-one-node\): no layout yet: write a dict"):
        check_layout(scenario("13b-one-node"), None, name="LAYOUT_13B (13b-one-node)")


def test_exercise_12_does_not_ask_for_the_jobs_lab_13_solves():
    """Lab 13 prints the planner's best layouts for its jobs: the exercise's jobs must be others."""
    from course_lib.planner.exercise import EXERCISE_JOBS, SCENARIOS

    text = _exercise_text("12_parallelism_selection")
    assert not set(EXERCISE_JOBS) & set(SCENARIOS)
    assert not any(kw in SCENARIOS.values() for kw in EXERCISE_JOBS.values())
    assert all(f'"{name}"' in text for name in EXERCISE_JOBS) and not any(f'"{name}"' in text for name in SCENARIOS)


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


# Issue 34: for every exercise, fragments of its solution (code, formulas, the one design decision)
# that the learner-facing notebook must not hand over: not in a hint, a check message, the prose,
# or an import. Taken from the solutions in solutions/*.py.
FORBIDDEN = {
    "00_ring_allreduce": ["tensor_split", "% world", "2 * (world_size - 1)", "numel / world_size",
                          "world_size - 1 steps each", "N/p elements", "lab 01"],
    "01_memory_budget": ["34 + 5", "5*a*s", "5 a s / h", "5as/h", "34 s b h", "34*s*b*h", "2 s b h",
                         "2*s*b*h", "max(budget, key", "n_layers x activation_bytes", "4 + 4 + 4"],
    "02_zero_stages": ["(dp - 1)/dp x N", "(dp-1)/dp x N", "(n - 1)/n x S", "2(n - 1)/n", "passes",
                       "3 if stage == 3", "[:stage]", "divide by dp when"],
    "04_custom_attention": ["(j <= i) &", "unsqueeze(1)", "i % checkpoint_every", "p.grad.clone()",
                            "opt.zero_grad(set_to_none=True)"],
    "05_gradient_policy": ["statistics", "median", "max_norm / (total_norm", "g.mul_(coef)",
                           "pow(2).sum()", "sqrt(sum"],
    "07_atomic_checkpoint": ["os.replace", "os.fsync", "O_RDONLY", "fileno()", "f.flush()",
                             "[:-keep_last]", "path.unlink()"],
    "08_bucketed_ddp": ["zeros_like", "torch.cat(", "view_as(p)", "reversed(", "self.ready[",
                        "(self._on_grad_ready)", "async_op=True); remember"],
    "09_zero1_optimizer": ["owner[p] == self.rank", 'k != "params"', "min(range(self.world_size)",
                           "dist.broadcast(p.data", "self.owned_elements[owner]"],
    "10_tp_linear": ["view_as(x)", "F.linear(f(x)", "g(F.linear(", "chunk(N, dim)", "chunk(layer.tp",
                     "identity in forward, all-reduce", "all-reduce (sum) in forward",
                     "f = identity / all-reduce", "every row `0 1 1 0`"],
    "11_one_f_one_b": ["stage_actions", "pp - stage - 1", "pp - s - 1", "warmup + k"],
    "12_parallelism_selection": ["tp=4, pp=2, dp=16", "cp=4, zero_stage=3", "tp=2, pp=1, dp=4"],
    "13_online_softmax": ["torch.maximum(lse_a, lse_b)", "lse_a - safe", "safe + torch.log", "w_a + w_b",
                          "logaddexp", "torch.sigmoid", "exp(lse_a) + exp(lse_b)", "exp(lse_a - lse)",
                          "lse_a - lse", "online_softmax_update", "subtract the max"],
    "14_expert_dispatch": ["stable=True", "bincount", "minlength", "for j in range(e_local) for s in range(n_src)",
                           "view(n, e_local).sum(1)", "got_counts.sum(0)", "arrived[perm] = y", "out[order] = back",
                           "send_splits, recv_splits, group=group", "recv_splits, send_splits, group=group",
                           "inverse permutation", "argsort"],
    "15_fp8_blockwise": ["amax / E4M3_MAX", "/ 448", "amax(dim", "repeat_interleave", "functional.pad",
                         "reshape(rows, tiles", "-(-cols", "unsqueeze(-1)", "torch.where(amax"],
}
EXERCISES = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.py"))


def _hints(name: str) -> list[str]:
    import ast

    hints = []
    for node in ast.walk(ast.parse(_code(name))):
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                and getattr(node.exc.func, "id", None) == "NotImplementedError" and node.exc.args):
            hints.append(ast.literal_eval(node.exc.args[0]))
    return hints


def _code(name: str) -> str:
    """The exercise notebook's code cells, '%%writefile' and '%' magics turned into comments."""
    nb = json.loads((ROOT / "exercises" / f"{name}.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    return "\n".join("\n".join("#" + ln if ln.startswith("%") else ln for ln in c.splitlines())
                     for c in cells)


def test_every_exercise_has_a_forbidden_list():
    assert set(FORBIDDEN) == set(EXERCISES)


@pytest.mark.parametrize("name", EXERCISES)
def test_exercise_notebook_does_not_hand_over_the_solution(name):
    text = _exercise_text(name)
    for fragment in FORBIDDEN[name]:
        assert fragment not in text, f"exercises/{name}.ipynb gives away {fragment!r}"


@pytest.mark.parametrize("name", EXERCISES)
def test_every_hint_says_something(name):
    solution = (ROOT / "solutions" / f"{name}.py").read_text()
    hints = _hints(name)
    assert len(hints) == solution.count("### BEGIN SOLUTION")
    for hint in hints:
        assert hint != "write your solution here" and len(hint.split()) >= 6, f"{name}: hint {hint!r}"


@pytest.mark.parametrize("module, fragments", [
    ("exercise08_bucketed_ddp", ["view_as(", "reset the per-bucket", "Divide the summed bucket",
                                 "reverse parameter order"]),
    ("exercise09_zero1_optimizer", ["copy each group's options", "fewest elements",
                                    "must get only the parameters it owns"]),
    ("exercise10_tp_linear", ["view_as(", "must all-reduce (sum)", "must return the sum",
                              "is the identity", "Add it once, after g", "rows [r*out/N",
                              "columns [r*in/N", "f's in backward"]),
    ("exercise13_online_softmax", ["maximum(lse", "logaddexp", "exp(lse_a", "lse_a - ", "subtract the max",
                                   "the larger lse", "largest lse", "online_softmax_update"]),
    ("exercise14_expert_dispatch", ["bincount(expert,", "minlength=num_experts", "view(n, e_local)",
                                    "send_splits, recv_splits", "recv_splits, send_splits", "inverse permutation",
                                    "swap the splits", "index_copy"]),
])
def test_check_messages_say_what_is_wrong_not_the_code(module, fragments):
    """The checkers' sentences (CheckFailed and problem texts) name no code and no fix."""
    source = (ROOT / "course_lib" / "labs" / f"{module}.py").read_text()
    for fragment in fragments:
        assert fragment not in source, f"course_lib/labs/{module}.py: {fragment!r}"


def test_exercise_08_says_how_far_off():
    import torch

    from course_lib.labs.exercise08_bucketed_ddp import _compare

    want = {"w": torch.tensor([1.0, -2.0, 3.0])}
    (text,) = _compare("step 1 gradients", {"w": 2 * want["w"]}, want, "")
    assert "2 x the expected" in text
    (text,) = _compare("step 1 gradients", {"w": want["w"].reshape(1, 3)}, want, "")
    assert "1-D" in text and "view_as" not in text


def test_exercise_11_draws_gpipe_without_importing_the_schedules():
    from course_lib.labs import exercise11_one_f_one_b as ex
    from course_lib.parallel.pipeline.schedules import stage_actions

    assert ex.gpipe_lists(3, 4) == [stage_actions("gpipe", 3, 4, s) for s in range(3)]
    assert "gpipe_lists" in _exercise_text("11_one_f_one_b")


def _averaged(out_a, lse_a, out_b, lse_b):
    """Every block weighted the same: the lse is right, the out is not."""
    import torch

    m = torch.maximum(lse_a, lse_b)
    return (out_a + out_b) / 2, m + torch.log(torch.exp(lse_a - m) + torch.exp(lse_b - m))


def _exponentiated(out_a, lse_a, out_b, lse_b):
    """Right for small scores; exp overflows for large ones."""
    import torch

    w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)
    return (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / (w_a + w_b).unsqueeze(-1), torch.log(w_a + w_b)


def _unguarded(out_a, lse_a, out_b, lse_b):
    """Stable for large scores, NaN where neither block has a key."""
    import torch

    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / (w_a + w_b).unsqueeze(-1), m + torch.log(w_a + w_b)


def test_exercise_13_checks_say_what_went_wrong_not_the_formula():
    from course_lib.labs import exercise13_online_softmax as ex

    messages = []
    for merge, check_fn, said in ((_averaged, ex.check_two_blocks, ["off by up to", "how much of the row's total"]),
                                  (_exponentiated, ex.check_large_scores, ["NaN", "88", "Which number"]),
                                  (_unguarded, ex.check_masked_rows, ["NaN", "-inf", "count for nothing"])):
        with pytest.raises(CheckFailed) as caught:
            check_fn(merge)
        text = str(caught.value)
        messages.append(text)
        assert all(s in text for s in said), text
    for text in messages:
        assert "maximum" not in text and "logaddexp" not in text and "exp(lse" not in text, text
    # each of the three passes the checks the others fail: every mistake is caught by its own check
    ex.check_two_blocks(_exponentiated)
    ex.check_large_scores(_unguarded)
    ex.check_two_blocks(_unguarded)


def test_exercise_14_checks_say_what_went_wrong_not_the_code():
    """Plausible mistakes in exercise 14, each caught with words that say what came out (no ranks:
    the per-rank problem finders are called on hand-made results)."""
    import torch

    from course_lib.labs import exercise14_expert_dispatch as ex

    def no_zeros(expert, num_experts):  # forgets the experts no row chose
        return torch.argsort(expert, stable=True), torch.bincount(expert)

    def descending(expert, num_experts):
        return torch.argsort(-expert, stable=True), torch.bincount(expert, minlength=num_experts)

    def as_arrived(rows, counts):  # no regrouping
        return rows.clone(), torch.arange(rows.shape[0])

    for fn, said in ((no_zeros, "still needs its 0"), (descending, "ascending")):
        with pytest.raises(CheckFailed) as caught:
            ex.check_sort_by_expert(fn, [([1, 1, 0], 4)])
        assert said in str(caught.value), str(caught.value)
    with pytest.raises(CheckFailed) as caught:
        ex.check_group_by_local_expert(as_arrived, [[[1, 2], [3, 0]]])
    assert "order they arrived" in str(caught.value)

    sc = ex.scenario("uneven", 2, 4, [9, 11], "uneven", seed=3)
    rows, counts, arrival = ex.reference_received(sc, 0)
    assert ex._dispatch_problems((rows, counts, None), sc, 0, 4)[0] == []  # the reference itself passes
    problems, _ = ex._dispatch_problems((arrival, counts, None), sc, 0, 4)
    assert not torch.equal(rows, arrival) and "order they arrived" in problems[0][1]
    _, own = ex.rank_inputs(sc, 0)
    mine_only = torch.bincount(own, minlength=4)[:2]
    problems, _ = ex._dispatch_problems((rows, mine_only, None), sc, 0, 4)
    assert "only the rows this rank routed" in problems[0][1]
    weights = ex.expert_weights(4, 4)
    want = ex.reference_outputs(sc, 0, weights)
    assert ex._combine_problems(want, sc, 0, weights) == []
    in_expert_order = want[torch.argsort(own, stable=True)]
    (problem,) = ex._combine_problems(in_expert_order, sc, 0, weights)
    assert "sorted by expert" in problem[1]
