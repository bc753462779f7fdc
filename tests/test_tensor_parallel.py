"""Tensor parallelism from scratch against the dense layers, on 2 and 4 gloo ranks.

Every rank gets the same inputs as the dense reference (TP splits the model, not the batch);
sharded gradients are concatenated over ranks along ``tp_partition_dim`` and compared with the
dense gradient, replicated ones must equal it on every rank. Tolerance: fp32 ``rtol=1e-5,
atol=1e-6`` (sums over ranks add the same numbers in another order); for the whole 2-block model
atol is 1e-6 x the largest entry (max |logit| ~ 4, so atol ~ 4e-6): the reordered sums' rounding
passes through every block. Communication is counted with
``course_lib.parallel.wire.count_collectives`` and compared with
``course_lib.estimate.comm.tp_comm_bytes_per_layer`` exactly."""

import pytest
import torch
import torch.nn.functional as F

import tp_rank_fns as fns
from course_lib.estimate.comm import tp_comm_bytes_per_layer
from course_lib.parallel import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
RTOL, ATOL = 1e-5, 1e-6
B, T = fns.B, fns.T


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    """Every case on `world` ranks, in one launch: (world, per-rank results)."""
    return request.param, run_ranks(fns.everything, request.param, timeout=240, show_output=False)


def close(a, b, scaled=False):
    """fp32 allclose; ``scaled``: atol relative to the tensor's largest entry (for the whole model,
    where rounding from summing over ranks in another order passes through every block)."""
    atol = ATOL * max(1.0, b.abs().max().item()) if scaled else ATOL
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=atol)


def maxdiff(a, b):
    return (a - b).abs().max().item()


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def kinds(wire):
    """{kind: count} of one counted region."""
    return {k: v["count"] for k, v in wire["by_kind"].items()}


def check_grads(world, per_rank_grads, dense_module, where="", scaled=False):
    """Sharded gradients, concatenated over ranks, and replicated ones (on every rank) equal the
    dense module's, name by name. Returns the largest absolute difference."""
    worst = 0.0
    dense = dict(dense_module.named_parameters(remove_duplicate=False))
    assert set(per_rank_grads[0]) == set(dense), where
    for name, p in dense.items():
        dim = per_rank_grads[0][name][1]
        if dim is None:
            got = [per_rank_grads[r][name][0] for r in range(world)]
        else:
            got = [torch.cat([per_rank_grads[r][name][0] for r in range(world)], dim=dim)]
        for g in got:
            assert close(g, p.grad, scaled), (where, name, dim, maxdiff(g, p.grad))
            worst = max(worst, maxdiff(g, p.grad))
    return worst


# ---- f, g and the sequence-parallel operators ---------------------------------------------------
def test_f_g_and_sequence_operators_forward_and_backward(ranks):
    world, results = ranks
    inp = [fns.op_inputs(r, world) for r in range(world)]
    total = lambda key: sum(i[key] for i in inp)  # noqa: E731 - the all-reduce sum
    cat = lambda key, dim: torch.cat([i[key] for i in inp], dim=dim)  # noqa: E731 - the all-gather
    for r in range(world):
        mine = lambda t, dim: t.chunk(world, dim=dim)[r]  # noqa: E731
        want = {  # name: (forward output, input gradient, forward kinds, backward kinds)
            "f": (inp[r]["full"], total("grad_full"), {}, {"all-reduce": 1}),
            "g": (total("full"), inp[r]["grad_full"], {"all-reduce": 1}, {}),
            "gather_seq": (cat("seq", 1), mine(total("grad_full"), 1), {"all-gather": 1}, {"reduce-scatter": 1}),
            "reduce_scatter_seq": (mine(total("full"), 1), cat("grad_seq", 1), {"reduce-scatter": 1},
                                   {"all-gather": 1}),
            "scatter_seq": (mine(fns.shared_full(), 1), cat("grad_seq", 1), {}, {"all-gather": 1}),
            "gather_tp": (cat("chan", -1), mine(inp[r]["grad_wide"], -1), {"all-gather": 1}, {}),
            "scatter_tp": (mine(inp[r]["grad_wide"], -1), cat("grad_chan", -1), {}, {"all-gather": 1}),
        }
        for name, (y, grad, fwd, bwd) in want.items():
            got = results[r]["ops"][name]
            assert close(got["y"], y), (r, name, "forward")
            assert close(got["grad"], grad), (r, name, "backward")
            assert kinds(got["fwd"]) == fwd and kinds(got["bwd"]) == bwd, (r, name, got["fwd"], got["bwd"])


# ---- layers -----------------------------------------------------------------------------------
def test_column_row_and_vocab_layers_equal_the_dense_layers(ranks):
    world, results = ranks
    d = fns.dense_layers()
    refs = {}
    for name, layer, x, gy in (("col", d["col"], d["x"], d["gy_col"]), ("row", d["row"], d["x_row"], d["gy_row"]),
                               ("emb", d["emb"], d["idx"], d["gy_emb"])):
        x = leaf(x) if x.is_floating_point() else x
        y = layer(x)
        y.backward(gy)
        refs[name] = (y.detach(), getattr(x, "grad", None), layer)
    cases = {"col_gather": ("col", False, False), "col_local": ("col", True, False),
             "row_full_input": ("row", False, False), "row_parallel_input": ("row", False, True),
             "emb": ("emb", False, False)}
    worst = 0.0
    for case, (ref, y_sharded, x_sharded) in cases.items():
        y, x_grad, layer = refs[ref]
        for r in range(world):
            got = results[r]["layers"][case]
            want_y = y.chunk(world, dim=-1)[r] if y_sharded else y
            assert close(got["y"], want_y), (case, r, maxdiff(got["y"], want_y))
            if x_grad is not None:
                want_x = x_grad.chunk(world, dim=-1)[r] if x_sharded else x_grad
                assert close(got["x_grad"], want_x), (case, r, maxdiff(got["x_grad"], want_x))
                worst = max(worst, maxdiff(got["y"], want_y), maxdiff(got["x_grad"], want_x))
        worst = max(worst, check_grads(world, [results[r]["layers"][case]["grads"] for r in range(world)], layer, case))
    print(f"{world} ranks: layers, max |TP - dense| = {worst:.2e}")


def test_vocab_parallel_cross_entropy_equals_cross_entropy_without_gathering_logits(ranks):
    world, results = ranks
    for scale in (3.0, 200.0):
        logits, targets, weights = fns.ce_inputs(scale)
        for reduction in ("mean", "sum", "none"):
            full = leaf(logits)
            loss = F.cross_entropy(full.reshape(-1, fns.VOCAB), targets.reshape(-1), reduction=reduction)
            loss = loss.view(B, T) if reduction == "none" else loss
            loss.backward(weights if reduction == "none" else None)
            got = [results[r]["ce"][(scale, reduction)] for r in range(world)]
            grad = torch.cat([g["grad"] for g in got], dim=-1)
            assert close(grad, full.grad), (scale, reduction, maxdiff(grad, full.grad))
            for r, g in enumerate(got):
                assert close(g["loss"], loss.detach()), (scale, reduction, r, g["loss"], loss)
                # two all-reduces of per-token numbers (a max; two sums in one call), nothing else
                assert kinds(g["fwd"]) == {"all-reduce": 2} and kinds(g["bwd"]) == {}
                assert g["fwd"]["by_kind"]["all-reduce"]["payload_elements"] == 3 * B * T  # not B*T*V
            print(f"{world} ranks: CE scale {scale} {reduction}: max |loss diff| "
                  f"{max(maxdiff(g['loss'], loss.detach()) for g in got):.2e}, grad {maxdiff(grad, full.grad):.2e}")


# ---- blocks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_blocks_equal_the_dense_block(ranks, kind, sp):
    world, results = ranks
    for part in ("block", "mlp", "attn"):
        block, x, gy, cos, sin = fns.dense_block(kind)
        dense = {"block": block, "mlp": block.mlp, "attn": block.attn}[part]
        x = leaf(x)
        y = dense(x, cos, sin) if part in ("block", "attn") else dense(x)
        y.backward(gy)
        worst = 0.0
        for r in range(world):
            got = results[r]["blocks"][(kind, sp, part)]
            want_y = y.detach().chunk(world, dim=1)[r] if sp else y.detach()  # SP: this rank's tokens
            want_x = x.grad.chunk(world, dim=1)[r] if sp else x.grad
            assert close(got["y"], want_y), (part, r, maxdiff(got["y"], want_y))
            assert close(got["x_grad"], want_x), (part, r, maxdiff(got["x_grad"], want_x))
            worst = max(worst, maxdiff(got["y"], want_y), maxdiff(got["x_grad"], want_x))
        if part == "block" or not sp:  # SP parts alone: row biases keep per-rank partial gradients
            worst = max(worst, check_grads(world, [results[r]["blocks"][(kind, sp, part)]["grads"]
                                                   for r in range(world)], dense, part))
        print(f"{world} ranks {kind} sp={sp} {part}: max |TP - dense| = {worst:.2e}")


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_block_communication_equals_the_estimator(ranks, sp):
    """2 all-reduces forward + 2 backward of B*T*C elements per block (SP: all-gather +
    reduce-scatter pairs), charged at ring volume, equal to tp_comm_bytes_per_layer exactly."""
    world, results = ranks
    for kind in ("gpt", "llama"):
        C = fns.block_cfg(kind).d_model
        est = tp_comm_bytes_per_layer(seq_len=T, micro_batch=B, d_model=C, tp=world, bytes_per_element=4,
                                      sequence_parallel=sp)
        per_pass = {k: n // 2 for k, n in est.collectives.items()}  # half forward, half backward
        for r in range(world):
            got = results[r]["blocks"][(kind, sp, "block")]
            assert kinds(got["fwd"]) == per_pass and kinds(got["bwd"]) == per_pass, (kind, r)
            calls = got["fwd"]["calls"] + got["bwd"]["calls"]
            assert all(c["payload_elements"] == B * T * C and c["dtype"] == "torch.float32" for c in calls)
            measured = got["fwd"]["bytes_per_rank"] + got["bwd"]["bytes_per_rank"]
            assert measured == pytest.approx(est.bytes_per_rank, rel=1e-12), (measured, est)
            assert got["synced"] == (6 if kind == "gpt" else 2) * sp  # SP: norm weights (+ norm, row biases)
            for part in ("mlp", "attn"):  # one each way per sub-layer
                sub = results[r]["blocks"][(kind, sp, part)]
                assert kinds(sub["fwd"]) == {k: n // 2 for k, n in per_pass.items()} == kinds(sub["bwd"])
        print(f"{world} ranks {kind} sp={sp}: measured {measured:.0f} B/rank/layer, "
              f"estimator {est.bytes_per_rank:.0f}, collectives {est.collectives}")


# ---- the whole model --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_tp_tinygpt_loss_logits_and_gradients_equal_the_dense_model(ranks, kind, sp):
    world, results = ranks
    model, idx, targets = fns.dense_model(kind)
    logits, loss = model(idx, targets)
    loss.backward()
    got = [results[r]["models"][(kind, sp)] for r in range(world)]
    shards = torch.cat([g["logits"] for g in got], dim=-1)  # only the test assembles full logits
    assert close(shards, logits.detach(), scaled=True), maxdiff(shards, logits.detach())
    for g in got:
        assert close(g["loss"], loss.detach()), (g["loss"], loss)
        assert g["tied"] == model.cfg.tie_embeddings
    worst = check_grads(world, [g["grads"] for g in got], model, kind, scaled=True)
    print(f"{world} ranks {kind} sp={sp}: loss {loss.item():.6f}, max |logit diff| "
          f"{maxdiff(shards, logits.detach()):.2e} (max |logit| {logits.abs().max().item():.2f}), "
          f"max |loss diff| {max(abs(g['loss'].item() - loss.item()) for g in got):.2e}, max |grad diff| {worst:.2e}")


# ---- the comparison can fail ------------------------------------------------------------------
def test_sabotage_a_missing_f_or_g_is_caught(ranks):
    world, results = ranks
    d = fns.dense_layers()
    x = leaf(d["x"])
    d["col"](x).backward(d["gy_col"])
    y_row = d["row"](d["x_row"]).detach()
    got = [results[r]["sabotage"] for r in range(world)]
    for g in got:
        assert not close(g["no_f_x_grad"], x.grad)  # each rank holds only a partial input gradient
        assert not close(g["no_g_y"], y_row)        # each rank holds only a partial output
    # ... and what is missing is exactly the all-reduce (sum over ranks; the bias counted once)
    assert close(sum(g["no_f_x_grad"] for g in got), x.grad)
    assert close(sum(g["no_g_y"] for g in got) - (world - 1) * d["row"].bias.detach(), y_row)


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_input_errors_name_the_argument(ranks):
    world, results = ranks
    for r in range(world):
        e = results[r]["errors"]
        assert e["n_heads"].startswith("ValueError") and f"tp ({world})" in e["n_heads"]
        assert "n_heads (3)" in e["n_heads"]
        assert "n_kv_heads (1)" in e["n_kv_heads"] and "tp" in e["n_kv_heads"]
        assert "n_heads (3)" in e["model_heads"]
        assert "num_embeddings" in e["vocab"] and "tp" in e["vocab"]
        assert "out_features (5)" in e["col_out"] and "in_features (5)" in e["row_in"]
        assert "ffn_dim" in e["ffn"] and "dropout" in e["dropout"]
        assert "sequence length" in e["seq_len"] and "divisible" in e["seq_len"]
        assert "sequence length" in e["sp_model_seq"] and "tp" in e["sp_model_seq"]
        assert e["ce_shape"].startswith("ValueError") and "targets shape" in e["ce_shape"]
        assert f"targets must be token ids in [0, {4 * world})" in e["ce_target"]
        assert e["not_linear"].startswith("TypeError") and "linear" in e["not_linear"]


def test_bad_input_errors_without_ranks():
    from torch import nn

    from course_lib.model import ModelConfig
    from course_lib.model.layers import Attention
    from course_lib.parallel.tensor_parallel import (ColumnParallelLinear, TPAttention, TPBlock, copy_to_tp_region,
                                                     tp_tinygpt, vocab_parallel_cross_entropy)

    with pytest.raises(RuntimeError, match="torchrun.*run_ranks"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="TPAttention"):
        TPAttention.from_dense(Attention(ModelConfig(n_heads=4, d_model=16)))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        copy_to_tp_region([1.0])
    with pytest.raises(TypeError, match="model must be a course_lib.model.TinyGPT"):
        tp_tinygpt(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="block must be"):
        TPBlock.from_dense(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="targets"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), reduction="avg")
