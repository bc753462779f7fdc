"""SimpleFSDP (ZeRO-3 by hand) against one process on the global batch, on 2 and 4 gloo ranks.

Tolerance: fp32 ``rtol=1e-5`` (the rank-mean adds the same numbers in another order than one mean
over the global batch). bf16 compute: only a loose band on the loss."""

import pytest
import torch

import fsdp_scratch_rank_fns as fns
from course_lib.parallel import SimpleFSDP, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    """Every scenario on `world` ranks, in one launch: (world, per-rank results)."""
    return request.param, run_ranks(fns.everything, request.param, timeout=240, show_output=False)


@pytest.fixture(scope="module")
def ref():
    return fns.reference()


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def test_first_step_gradients_are_the_global_batch_mean_not_the_sum(ranks, ref):
    world, results = ranks
    for r in range(world):
        got = results[r]["fp32"]["grads"]
        assert got.keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            if g is None:  # frozen
                assert got[name] is None, name
                continue
            assert close(got[name], g), (r, name, (got[name] - g).abs().max())
            assert not close(got[name] * world, g), (r, name)  # a sum over ranks fails


def test_three_adamw_steps_match_one_process_under_the_original_names(ranks, ref):
    world, results = ranks
    assert set(results[0]["fp32"]["params"]) == set(ref["state_names"])  # tied: both names
    for r in range(world):
        got = results[r]["fp32"]["params"]
        for name, want in ref["params"].items():
            assert close(got[name], want), (r, name, (got[name] - want).abs().max())
        assert torch.equal(got["head.weight"], got["emb.weight"])
        assert torch.allclose(torch.tensor(results[r]["fp32"]["losses"]), torch.tensor(ref["losses"]),
                              rtol=RTOL)
    start = fns.TinyTiedLM(seed=0)  # frozen parameters never move
    assert torch.equal(results[world - 1]["fp32"]["params"]["frozen.weight"], start.frozen.weight)
    assert torch.equal(results[world - 1]["fp32"]["params"]["offset"], start.offset)


def test_each_rank_holds_about_one_nth_of_the_linear_and_embedding_bytes(ranks, ref):
    world, results = ranks
    full = ref["sharded_bytes"]
    n_tensors = 6  # emb.weight (= head.weight), frozen.weight, frozen.bias, fc.weight, fc.bias, proj.weight
    for r in range(world):
        got = results[r]["fp32"]["sharded_bytes"]
        print(f"{world} ranks, rank {r}: {got} B of {full} B sharded params")
        assert full / world <= got < full / world + n_tensors * 4  # padding: < 1 fp32 each
        res = results[r]["fp32"]
        assert res["tied"] and res["full_attrs_left"] == []  # gathered weights were freed
        assert all(len(s) == 1 for n, s in res["shard_shapes"].items()
                   if not n.startswith("norm") and n != "offset")


def test_bf16_compute_keeps_fp32_masters_and_a_close_loss(ranks, ref):
    world, results = ranks
    res = results[0]["bf16"]
    for name, (dtype, grad_dtype) in res["dtypes"].items():
        assert dtype == torch.float32 and grad_dtype in (None, torch.float32), name
    assert res["opt_dtypes"] == {torch.float32}
    got, want = torch.tensor(res["losses"]), torch.tensor(ref["losses"])
    assert torch.allclose(got, want, rtol=0.02), (got, want)
    assert not torch.equal(got, want)  # it really computed in bf16


def test_prefetch_serves_every_gather_after_the_first_forward_and_changes_nothing(ranks):
    world, results = ranks
    for r in range(world):
        on, off = results[r]["fp32"], results[r]["no_prefetch"]
        # 5 sharded layers per forward; forward 1 records the order, later ones prefetch all but
        # the first layer
        assert on["prefetch_hits"] == (fns.STEPS - 1) * 4 and off["prefetch_hits"] == 0
        for name, t in off["params"].items():
            assert torch.equal(on["params"][name], t), (r, name)


def test_a_module_with_nothing_to_shard_is_refused(ranks):
    world, results = ranks
    assert "nothing to shard" in results[0]["nothing"]


def test_bad_input_errors():
    with pytest.raises(RuntimeError, match="torchrun.*run_ranks"):
        SimpleFSDP(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="module"):
        SimpleFSDP("not a module")
    with pytest.raises(ValueError, match="compute_dtype"):
        SimpleFSDP(torch.nn.Linear(2, 2), compute_dtype=torch.float64)
    with pytest.raises(TypeError, match="prefetch"):
        SimpleFSDP(torch.nn.Linear(2, 2), prefetch="yes")
    with pytest.raises(ValueError, match="nothing to shard"):
        SimpleFSDP(torch.nn.Sequential(torch.nn.LayerNorm(3)))
    layer = torch.nn.Linear(2, 2)  # ignored_params may not hold a weight SimpleFSDP shards
    with pytest.raises(ValueError, match="ignored_params holds the weight of a Linear"):
        SimpleFSDP(layer, ignored_params=[layer.weight])
