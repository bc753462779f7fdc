"""torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B) against one process and against
our from-scratch ``pipeline_step``, on 2 gloo ranks (and GPipe/1F1B on 4).

Tolerance: fp32 ``rtol=1e-5, atol=1e-6`` against one process (micro-batches add the same numbers
in another order than one pass over the global batch). Against the from-scratch runner the
comparison is exact (``torch.equal``): both divide each micro-batch loss by m before its backward
and accumulate in micro-batch order, so they do the same arithmetic.
"""
import pytest
import torch

import torch_pp_rank_fns as fns
from course_lib.parallel import run_ranks
from course_lib.parallel.pipeline.torch_pipelining import (TORCH_SCHEDULES, build_torch_stages,
                                                           torch_pipeline_step)

pytestmark = pytest.mark.usefixtures("one_thread")
RTOL, ATOL = 1e-5, 1e-6
IDS = [f"{s}-m{m}" + (f"-v{v}" if v > 1 else "") for s, m, v in fns.CASES_2]


@pytest.fixture(scope="module")
def two():
    """Every 2-rank scenario in one launch: per-rank result dicts."""
    return run_ranks(fns.everything, 2, timeout=240, threads_per_rank=1, show_output=False)


@pytest.fixture(scope="module")
def four():
    return run_ranks(fns.everything, 4, timeout=240, threads_per_rank=1, show_output=False)


@pytest.fixture(scope="module")
def ref():
    return fns.base.reference(fns.GPT)


@pytest.fixture(scope="module")
def ref_accumulated():
    """One fp32 process accumulating m micro-batches (why: pp_rank_fns' docstring)."""
    return {m: fns.base.reference(fns.GPT, micro_batches=m) for m in (1, 2, 4)}


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def merged(results, key, what="grads"):
    """{dense name: tensor} over all ranks (each name lives on exactly one rank)."""
    out = {}
    for r in results:
        for name, t in r[key][what].items():
            assert name not in out, f"{name} on two ranks"
            out[name] = t
    return out


def assert_matches(got, want, label):
    assert got.keys() == want.keys(), (label, sorted(set(got) ^ set(want)))
    for name in want:
        assert close(got[name], want[name]), (label, name, (got[name] - want[name]).abs().max())
    return max((got[n] - want[n]).abs().max().item() for n in want)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("case", fns.CASES_2, ids=IDS)
def test_loss_and_every_gradient_equal_one_process(two, ref, case):
    schedule, m, _ = case
    key = ("torch", schedule, m)
    worst = assert_matches(merged(two, key), ref["grads"], key)
    print(f"torch {schedule} m={m}: max |grad - one process| = {worst:.2e}")
    assert torch.allclose(torch.tensor(two[-1][key]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL)
    assert two[0][key]["losses"] == [None] * fns.STEPS  # the loss lives on the last stage's rank


@pytest.mark.parametrize("case", fns.CASES_2, ids=IDS)
def test_weights_after_adamw_steps_equal_one_process_accumulating_the_same_micro_batches(
        two, ref_accumulated, case):
    schedule, m, _ = case
    key = ("torch", schedule, m)
    worst = assert_matches(merged(two, key, "params"), ref_accumulated[m]["params"], key)
    print(f"torch {schedule} m={m}: max |weight - one process| after {fns.STEPS} AdamW steps = {worst:.2e}")
    # the two copies of the tied token table / LM head got the same update
    assert torch.equal(two[0][key]["params"]["tok_emb.weight"], two[-1][key]["params"]["lm_head.weight"])


@pytest.mark.parametrize("case", fns.CASES_2, ids=IDS)
def test_torch_equals_our_from_scratch_pipeline_step_exactly(two, case):
    """Same arithmetic, so the same bits: loss, gradients, and weights after 3 AdamW steps.
    Interleaved is held to our 1F1B (we have no interleaved runner): per stage the micro-batches
    still accumulate in order 0..m-1."""
    schedule, m, _ = case
    ours = ("scratch", "1f1b" if schedule == "interleaved" else schedule, m)
    theirs = ("torch", schedule, m)
    for what in ("grads", "params"):
        a, b = merged(two, theirs, what), merged(two, ours, what)
        assert a.keys() == b.keys()
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        assert not differ, (theirs, what, differ)
    assert two[-1][theirs]["losses"] == two[-1][ours]["losses"]


def test_interleaved_places_stage_i_on_rank_i_mod_pp(two):
    key = ("torch", "interleaved", 2)
    assert [r[key]["stages"] for r in two] == [[0, 2], [1, 3]]
    assert [r[key]["blocks"] for r in two] == [[[0], [2]], [[1], [3]]]


def test_llama_untied_rope_gqa_interleaved_matches_one_process(two):
    assert_matches(merged(two, "llama_interleaved"), fns.base.reference(fns.LLAMA)["grads"], "llama")


def test_explicit_balance_over_virtual_stages(two, ref):
    assert [r["balanced_interleaved"]["blocks"] for r in two] == [[[0], [2]], [[1], [3]]]
    assert_matches(merged(two, "balanced_interleaved"), ref["grads"], "balance")


def test_four_ranks_gpipe_and_1f1b_equal_one_process_and_ours(four, ref):
    for schedule, m, _ in fns.CASES_4:
        a = merged(four, ("torch", schedule, m))
        assert_matches(a, ref["grads"], (schedule, m))
        b = merged(four, ("scratch", schedule, m))
        assert all(torch.equal(a[n], b[n]) for n in a), (schedule, m)
        assert four[-1][("torch", schedule, m)]["losses"] == four[-1][("scratch", schedule, m)]["losses"]


# ------------------------------------------------------------------ the comparison can fail
def test_sabotage_skipping_the_tied_gradient_sync_is_caught(two, ref):
    grads = merged(two, "no_tied_sync")
    assert not close(grads["tok_emb.weight"], ref["grads"]["tok_emb.weight"])
    assert not close(grads["lm_head.weight"], ref["grads"]["lm_head.weight"])
    assert close(grads["tok_emb.weight"] + grads["lm_head.weight"], ref["grads"]["tok_emb.weight"])
    for name, g in grads.items():
        if name not in ("tok_emb.weight", "lm_head.weight"):
            assert close(g, ref["grads"][name]), name


def test_sabotage_summing_micro_batch_losses_is_caught(two, ref):
    """torch's schedule with a mean loss per micro-batch and scale_grads=False adds m means:
    every gradient is m = 4 times too large, and the comparison says so."""
    grads = {n: g for r in two for n, g in r["sum_loss"].items()}
    assert not any(close(g, ref["grads"][n]) for n, g in grads.items() if ref["grads"][n].abs().max() > 1e-4)
    assert all(close(g / 4, ref["grads"][n]) for n, g in grads.items())


def test_torch_default_scale_grads_is_the_same_mean_up_to_rounding(two, ref):
    """scale_grads=True (torch's default: mean loss, .grad divided by m after the step) gives the
    same gradients within fp32 tolerance; we use the divide-the-loss form for bit-equality."""
    grads = {n: g for r in two for n, g in r["torch_default"].items()}
    assert_matches(grads, ref["grads"], "scale_grads=True")


# ------------------------------------------------------------------ bad input
BAD = {  # key in torch_pp_rank_fns.bad_inputs -> what the ValueError must say
    "schedule": "schedule must be one of 'gpipe', '1f1b', 'interleaved'",
    "micro_batches_1f1b": "micro_batches must be >= pp=2 for schedule '1f1b'",
    "micro_batches_zero": "micro_batches must be >= 1",
    "divisible": r"micro_batches (3) must divide the batch size (8)",
    "virtual_gpipe": "virtual_stages must be 1 for schedule 'gpipe'",
    "virtual_1f1b": "virtual_stages must be 1 for schedule '1f1b'",
    "interleaved_rounds": "micro_batches (5) must be a multiple of its number of rounds",
    "too_many_stages": "virtual_stages must be in [1, 2] for pp=2",
    "balance": "balance must have one entry per stage, pp * virtual_stages = 2",
    "targets": "targets shape (8, 4) must equal idx shape (8, 16)",
    "wrong_stages": "stages must be this rank's stages",
}


def test_bad_input_is_refused_before_any_message(two):
    for r, res in enumerate(two):
        bad = res["bad"]  # the ranks reached a barrier after all of these: nothing was left in flight
        for key, text in BAD.items():
            assert bad[key] is not None and bad[key].startswith("ValueError"), (key, bad[key])
            assert text in bad[key], (key, bad[key])
        assert "must be this process's rank in the pipeline group" in bad["rank"]
        assert bad["pp"].startswith("ValueError")  # pp=1 on a 2-rank group (or rank out of [0, pp-1])


def test_bad_input_without_a_process_group():
    model = fns.base.make_model(fns.GPT)
    with pytest.raises(ValueError, match=r"virtual_stages must be in \[1, 2\] for pp=2"):
        build_torch_stages(model, 0, 2, virtual_stages=4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, pp - 1=1\]"):
        build_torch_stages(model, 2, 2)
    with pytest.raises(ValueError, match="virtual_stages must be >= 1"):
        build_torch_stages(model, 0, 2, virtual_stages=0)
    with pytest.raises(TypeError, match="TinyGPT"):
        build_torch_stages(torch.nn.Linear(2, 2), 0, 1)
    with pytest.raises(RuntimeError, match="process group"):
        build_torch_stages(model, 0, 2)
    x, y = fns.base.batches(1)[0]
    with pytest.raises(TypeError, match="PipelineStage"):
        torch_pipeline_step(model, x, y, schedule="gpipe", micro_batches=2)
    assert TORCH_SCHEDULES == ("gpipe", "1f1b", "interleaved")
