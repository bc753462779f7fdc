"""NaiveDDP and BucketedDDP against one process on the global batch, on 2 and 4 gloo ranks.

Tolerance: fp32 ``rtol=1e-5``. Not bitwise against the reference: a rank's mean over its slice,
summed over ranks and divided by the world size, adds the same numbers in another order than one
mean over the global batch. Bitwise where the order is fixed: the replicas among themselves (every
rank gets the same all-reduce result), and NaiveDDP vs BucketedDDP on 2 ranks (a + b is the same
whichever rank adds first; with 4 ranks gloo orders the sum differently for a flat bucket and a
single tensor: measured 1 ulp apart, so there only allclose)."""

import pytest
import torch

import ddp_scratch_rank_fns as fns
from course_lib.parallel import BucketedDDP, NaiveDDP, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    """Every scenario on `world` ranks, in one launch: (world, per-rank results)."""
    out = run_ranks(fns.everything, request.param, timeout=240, show_output=False)
    return request.param, out


@pytest.fixture(scope="module")
def refs():
    return {opt: fns.reference(opt) for opt in ("sgd", "adamw")}


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def test_replicas_stay_bit_identical_across_ranks(ranks):
    world, results = ranks
    for s in fns.SCENARIOS:
        for r in range(1, world):
            for name, t in results[0][s]["params"].items():
                assert torch.equal(results[r][s]["params"][name], t), (s, r, name)


def test_first_step_gradients_are_the_global_batch_mean_not_the_sum(ranks, refs):
    world, results = ranks
    for s in fns.SCENARIOS:
        got, want = results[0][s]["grads"], refs[s[2]]["grads"]
        assert got.keys() == want.keys()
        for name, g in want.items():
            if g is None:  # the unused parameter and the frozen layer, in the reference too
                assert got[name] is None, (s, name)
                continue
            assert close(got[name], g), (s, name, (got[name] - g).abs().max())
            # the check can fail: a sum over ranks instead of the mean is far outside it
            assert not close(got[name] * world, g), (s, name)


def test_several_sgd_and_adamw_steps_match_one_process(ranks, refs):
    world, results = ranks
    for s in fns.SCENARIOS:  # includes no_sync accumulation over 2 micro-batches
        want = refs[s[2]]["params"]
        for name, t in results[world - 1][s]["params"].items():
            assert close(t, want[name]), (s, name, (t - want[name]).abs().max())


def test_broadcast_covers_frozen_params_and_buffers_and_keeps_ties(ranks, refs):
    world, results = ranks
    start = fns.TinyTied(seed=0)
    for s in fns.SCENARIOS:
        last = results[world - 1][s]
        assert last["tied"]
        # rank world-1 started from another seed; frozen weights and the buffer never change
        assert torch.equal(last["params"]["frozen.weight"], start.frozen.weight)
        assert torch.equal(last["params"]["scale"], start.scale)
        assert torch.equal(last["params"]["frozen.weight"], refs[s[2]]["params"]["frozen.weight"])


def test_naive_and_bucketed_agree_bitwise_on_two_ranks(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("4 ranks: gloo sums a bucket and a tensor in different orders (1 ulp apart)")
    for opt in ("sgd", "adamw"):
        naive = results[0][("naive", None, opt, 1)]["params"]
        for mb in (None, fns.TINY_MB, 25.0):
            bucketed = results[0][("bucketed", mb, opt, 1)]["params"]
            for name, t in naive.items():
                assert torch.equal(bucketed[name], t), (opt, mb, name)


def test_all_reduces_overlap_backward_when_there_are_several_buckets(ranks):
    world, results = ranks
    tiny = results[0][("bucketed", fns.TINY_MB, "adamw", 1)]
    assert tiny["buckets"] > 3
    # every bucket but the last one (it holds the unused parameter, so it waits for the finish)
    # starts inside backward, on every step
    assert tiny["launched"] == [tiny["buckets"] - 1] * fns.STEPS
    for mb in (None, 25.0):  # one bucket, holding the unused parameter: all at the finish
        one = results[0][("bucketed", mb, "adamw", 1)]
        assert one["buckets"] == 1 and one["launched"] == [0] * fns.STEPS
    acc = results[0][("bucketed", fns.TINY_MB, "adamw", 2)]
    assert acc["launched"] == [acc["buckets"] - 1] * fns.STEPS  # nothing more from no_sync passes


def test_a_gradient_missing_on_some_ranks_counts_as_zero_there(ranks):
    world, results = ranks
    for key in [k for k in results[0] if k[0] == "partly"]:
        for r in range(world):
            for rep in results[r][key]:
                assert torch.equal(rep["a"], torch.full((3,), (world + 1) / 2)), (key, r)
                assert torch.equal(rep["b"], torch.full((2,), 1.0 / world)), (key, r)
                assert rep["c"] is None, (key, r)  # unused everywhere: stays None


@pytest.mark.parametrize("bad, err", [(0, ValueError), (-1.0, ValueError), ("25", TypeError),
                                      (True, TypeError), (float("nan"), ValueError)])
def test_bad_bucket_mb_is_refused_by_name(bad, err):
    with pytest.raises(err, match="bucket_mb"):
        BucketedDDP(torch.nn.Linear(2, 2), bucket_mb=bad)


@pytest.mark.parametrize("cls", [NaiveDDP, BucketedDDP])
def test_without_a_process_group_the_error_says_how_to_start(cls):
    with pytest.raises(RuntimeError, match="torchrun.*run_ranks"):
        cls(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="module"):
        cls("not a module")
