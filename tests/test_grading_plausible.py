"""The wrong-but-plausible answers of exercises 09, 11 and 13 (tests/grading_corpus/plausible.py)
against the checks their test cells call, in this process: no kernel, no rank, well under a
second each. The sweep (tests/test_grading_sweep.py, slow) grades every exercise's plausible
answer end to end; these hold the three that once earned full marks, and ``course grade`` run
from outside the kit."""
import pytest
import torch

from course_lib.kit.checks import CheckFailed
from tests.grading_corpus import ROOT, answer_ids, answer_source, solution_notebook
from tests.grading_corpus.plausible import PLAUSIBLE, plausible_notebook


def _answers(nb: dict) -> dict:
    """Run every answer cell of ``nb`` (a %%writefile line dropped) in one namespace."""
    space = {"torch": torch}
    for k in range(len(answer_ids(nb))):
        src = answer_source(nb, k)
        if src.startswith("%%writefile"):
            src = src.split("\n", 1)[1]
        exec(compile(src, f"answer {k}", "exec"), space)
    return space


def test_13_a_merge_that_writes_into_its_inputs_fails_the_first_visible_check():
    from course_lib.labs import exercise13_online_softmax as ex

    sol = solution_notebook("13_online_softmax")
    ex.check_two_blocks(_answers(sol)["merge"])  # the solution leaves its inputs alone
    wrong = _answers(plausible_notebook(sol, "13"))["merge"]
    with pytest.raises(CheckFailed, match="changed the out_a it was given.*inputs are not changed"):
        ex.check_two_blocks(wrong)
    # and wherever the hidden test calls it
    q = torch.randn(3, 2)
    a, b = (ex.block_attention(q, torch.randn(4, 2), torch.randn(4, 2)) for _ in range(2))
    with pytest.raises(CheckFailed, match="hidden: your merge changed the out_a"):
        ex.call_merge(wrong, a, b, "hidden")


def test_11_a_warm_up_read_off_four_stages_fails_beyond_them():
    from course_lib.labs import exercise11_one_f_one_b as ex

    sol = solution_notebook("11_one_f_one_b")
    right = _answers(sol)["one_f_one_b"]
    for pp in range(1, 7):  # the visible pipelines and the hidden sweep
        for m in (1, 3, 8):
            ex.check_schedule_fn(right, pp, m)
    capped = _answers(plausible_notebook(sol, "11"))["one_f_one_b"]
    ex.check_schedule_fn(capped, 4, 8)  # right up to 4 stages ...
    with pytest.raises(CheckFailed, match="warm-up"):
        ex.check_schedule_fn(capped, 6, 8)  # ... and the visible check's 6 stages find it
    # a warm-up table that wraps after 4 stages deadlocks at 5: simulate says who waits for what
    space = _answers(sol)
    src = answer_source(sol, [k for k in range(len(answer_ids(sol))) if "def one_f_one_b" in answer_source(sol, k)][0])
    exec(src.replace("warmup = min(pp - stage - 1, m)", "warmup = min((pp - stage - 1) % 4, m)"), space)
    ex.check_schedule_fn(space["one_f_one_b"], 4, 8)
    with pytest.raises(CheckFailed, match="deadlocks: stage 0 waits"):
        ex.check_schedule_fn(space["one_f_one_b"], 5, 2)


def test_09_the_contract_owners_are_the_solutions_and_round_robin_is_not(monkeypatch):
    import torch.distributed as dist

    from course_lib.labs import exercise09_zero1_optimizer as ex

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    held = {}
    for who, nb in (("solution", solution_notebook("09_zero1_optimizer")),
                    ("round-robin", plausible_notebook(solution_notebook("09_zero1_optimizer"), "09"))):
        cls = _answers(nb)["ShardedOptimizer"]
        ps = [torch.zeros(s, requires_grad=True) for s in ex.SHAPES + ex.LATE_SHAPES]
        n = len(ex.SHAPES)
        opt = cls([{"params": ps[:4]}, {"params": ps[4:n]}], torch.optim.SGD, lr=0.1)
        opt.add_param_group({"params": ps[n:]})
        held[who] = [sum(p.numel() for p in ps if opt.owner[p] == r) for r in range(2)]
    numel = [torch.Size(s).numel() for s in ex.SHAPES + ex.LATE_SHAPES]
    want = ex.contract_owners(numel, 2, late=True)
    assert held["solution"] == [sum(x for x, o in zip(numel, want) if o == r) for r in range(2)]
    assert held["round-robin"] != held["solution"]  # what the visible check now names


def test_course_grade_finds_the_kit_from_another_folder(tmp_path, monkeypatch, capsys):
    from course_lib.cli import build_parser
    from course_lib.grading.grade import find_exercise_source

    subs = tmp_path / "subs"
    subs.mkdir()
    monkeypatch.chdir(tmp_path)  # no pyproject.toml and labs/ above: the checkout course_lib came from
    args = build_parser().parse_args(["grade", "subs", "--exercise", "13", "--out", "out"])
    assert args.func(args) == 2
    # it found solutions/13_online_softmax.py and stopped at the empty folder, before any kernel
    assert "no submission of 13_online_softmax" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no solutions/ folder.*instructor's checkout"):
        find_exercise_source(tmp_path, "13")


def test_every_exercise_has_a_plausible_wrong_answer():
    from tests.test_grading_batch import PARTIALS

    numbers = {p.stem[:2] for p in ROOT.glob("solutions/[0-9][0-9]_*.py")}
    assert numbers - {"01"} <= set(PLAUSIBLE) | set(PARTIALS)  # 01's is in tests/test_grading_batch.py
