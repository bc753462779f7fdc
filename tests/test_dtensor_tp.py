"""The DTensor tensor-parallel TinyGPT against the dense model and the from-scratch ``tp_tinygpt``.

Every rank feeds the same batch as the dense reference (TP splits the model, not the batch). The
DTensor model's loss, logits (``full_tensor()``) and every gradient (``full_tensor()``, the same on
every rank) must equal the dense model's and the scratch model's (whose shards the test
concatenates along ``tp_partition_dim``); a few AdamW steps must give the scratch model's weights.
Tolerances as in tests/test_tensor_parallel.py: fp32 ``rtol=1e-5, atol=1e-6``, atol scaled by the
largest entry for whole-model tensors (sums over ranks add the same numbers in another order).
Measured on 2 ranks: DTensor logits and loss bitwise equal to the scratch model's, gradients within
3e-7 of it and 8e-7 of the dense model; after 3 AdamW steps weights within 2e-7 of the scratch
model's (llama-style, SP) and 3e-6 (GPT-2 style: Adam magnifies rounding in gradient entries near
its eps; 0.1% of the update), key biases aside (see the AdamW test).
One launch of 2 ranks runs every case (~5 s); the 4-rank launch (25-35 s on 2 busy cores) is ``slow``.
"""
import pytest
import torch

import dtensor_rank_fns as fns
import tp_rank_fns as tpf
from course_lib.parallel import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
RTOL, ATOL = 1e-5, 1e-6
KINDS = ["gpt", "llama"]  # gpt: LayerNorm, GELU, biases, tied, learned positions; llama: GQA, RoPE, SwiGLU


@pytest.fixture(scope="module")
def ranks2():
    """Every case on 2 ranks in one launch: per-rank results."""
    return run_ranks(fns.everything, 2, timeout=240, show_output=False)


def close(a, b, scaled=False):
    atol = ATOL * max(1.0, b.abs().max().item()) if scaled else ATOL
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=atol)


def maxdiff(a, b):
    return (a - b).abs().max().item()


def scratch_full(results, world, key, name):
    """The scratch model's whole gradient of ``name``: shards concatenated, replicas from rank 0."""
    grads = [results[r]["models"][key]["scratch"]["grads"][name] for r in range(world)]
    dim = grads[0][1]
    return grads[0][0] if dim is None else torch.cat([g[0] for g in grads], dim=dim)


def compare_models(results, world, kind, sp):
    """Assert DTensor == dense and DTensor == scratch (loss, logits, every gradient); return the
    largest differences for the log."""
    model, idx, targets = tpf.dense_model(kind)
    logits, loss = model(idx, targets)
    loss.backward()
    key = (kind, sp)
    scratch_logits = torch.cat([results[r]["models"][key]["scratch"]["logits"] for r in range(world)], dim=-1)
    dense = dict(model.named_parameters(remove_duplicate=False))
    worst = {"logits": 0.0, "loss": 0.0, "grad_vs_dense": 0.0, "grad_vs_scratch": 0.0}
    for r in range(world):
        got = results[r]["models"][key]
        assert got["logits_placements"] == "(Shard(dim=2),)"  # vocab-sharded, never gathered by the model
        assert close(got["logits"], logits.detach(), scaled=True), (r, maxdiff(got["logits"], logits.detach()))
        assert close(got["logits"], scratch_logits, scaled=True), (r, maxdiff(got["logits"], scratch_logits))
        assert close(got["loss"], loss.detach()), (r, got["loss"], loss)
        assert close(got["loss"], got["scratch"]["loss"]), (r, got["loss"], got["scratch"]["loss"])
        assert got["tied"] == model.cfg.tie_embeddings
        cfg = model.cfg
        assert got["local_heads"] == (cfg.n_heads // world, cfg.kv_heads // world)
        assert got["q_local_shape"] == (cfg.d_model // world, cfg.d_model)
        assert got["grad_unlike_param"] == {}, got["grad_unlike_param"]  # none left Partial after backward
        assert set(got["grads"]) == set(dense), set(got["grads"]) ^ set(dense)
        for name, p in dense.items():
            g = got["grads"][name][0]
            s = scratch_full(results, world, key, name)
            assert close(g, p.grad, scaled=True), (r, name, got["grads"][name][1], maxdiff(g, p.grad))
            assert close(g, s, scaled=True), (r, name, maxdiff(g, s))
            worst["grad_vs_dense"] = max(worst["grad_vs_dense"], maxdiff(g, p.grad))
            worst["grad_vs_scratch"] = max(worst["grad_vs_scratch"], maxdiff(g, s))
        worst["logits"] = max(worst["logits"], maxdiff(got["logits"], logits.detach()))
        worst["loss"] = max(worst["loss"], abs(got["loss"].item() - loss.item()))
    return worst


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_dtensor_tinygpt_equals_dense_and_scratch(ranks2, kind, sp):
    w = compare_models(ranks2, 2, kind, sp)
    print(f"2 ranks {kind} sp={sp}: max |logit - dense| {w['logits']:.2e}, |loss - dense| {w['loss']:.2e}, "
          f"|grad - dense| {w['grad_vs_dense']:.2e}, |grad - scratch| {w['grad_vs_scratch']:.2e}")


@pytest.mark.slow
def test_dtensor_tinygpt_equals_dense_and_scratch_on_4_ranks():
    results = run_ranks(fns.models_only, 4, timeout=240, show_output=False)
    for kind in KINDS:
        for sp in (False, True):
            w = compare_models(results, 4, kind, sp)
            print(f"4 ranks {kind} sp={sp}: " + ", ".join(f"{k} {v:.2e}" for k, v in w.items()))


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_collectives_match_the_scratch_model(ranks2, sp):
    """DTensor issues the scratch model's collectives: in backward one all-reduce per sub-layer
    (q/k/v's input gradients summed locally first) plus the lm_head's; under SP the same
    reduce-scatters. Forward: the loss takes 3 all-reduces (max, sum, target logit) where the scratch
    loss packs the two sums into one; the position table's gradient is all-gathered, not all-reduced."""
    for r in range(2):
        for kind in KINDS:
            comm = ranks2[r]["models"][(kind, sp)]["comm"]
            if not sp:
                assert comm["bwd"] == comm["scratch_bwd"] == {"all-reduce": 2 * 2 + 1}, comm
                assert comm["fwd"] == {"all-reduce": comm["scratch_fwd"]["all-reduce"] + 1}, comm
            else:
                for k in ("reduce-scatter", "all-gather"):
                    assert comm["fwd"][k] == comm["scratch_fwd"][k], (kind, k, comm)
                assert comm["bwd"]["reduce-scatter"] == comm["scratch_bwd"]["reduce-scatter"], comm
            print(f"rank {r} {kind} sp={sp}: {comm}")


def dense_adamw(kind):
    """The dense model after the same STEPS AdamW steps: {name: weight}, and its initial weights."""
    model, idx, targets = tpf.dense_model(kind)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=fns.LR)
    for _ in range(fns.STEPS):
        model(idx, targets)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}, start


@pytest.mark.parametrize("case", [("llama", True), ("gpt", False)], ids=["llama-sp", "gpt-tied"])
def test_adamw_steps_give_the_scratch_weights(ranks2, case):
    """3 AdamW steps (lr 1e-3) on the same batch: llama-style with SP, GPT-2 style (tied) without.

    Adam divides each gradient entry by its own running RMS, so an entry whose gradient is tiny
    turns a 1e-7 relative rounding difference into a visibly different step; weights are compared
    on their *updates*: |w_dtensor - w_scratch| <= 1% of the scratch update |w_scratch - w_0| +
    1e-6. The key biases are left out: their exact gradient is 0 (q.(k + b) shifts every score of a
    query by the same q.b, which softmax ignores), so both models hold rounding noise (~1e-9) that
    Adam turns into steps of ~lr of either sign; they are held to Adam's bound, |w| <= STEPS * lr.
    """
    world, kind = 2, case[0]
    dense_after, start = dense_adamw(kind)
    bound = fns.STEPS * fns.LR * 1.01
    worst, worst_dense = 0.0, 0.0
    for r in range(world):
        got = ranks2[r]["adamw"][case]
        for dt_loss, s_loss in got["losses"]:
            assert dt_loss == pytest.approx(s_loss, rel=1e-6, abs=1e-6)
        assert got["losses"][-1][0] < got["losses"][0][0]  # it trains
        assert got["opt_comm"] == {}  # gradients arrive whole: the optimizer step sends nothing
        assert set(got["weights"]) == set(got["scratch_weights"]) == set(start)
        for name, weight in got["weights"].items():
            shards = [ranks2[q]["adamw"][case]["scratch_weights"][name] for q in range(world)]
            dim = shards[0][1]
            want = shards[r][0] if dim is None else torch.cat([s[0] for s in shards], dim=dim)
            if name.endswith("attn.k_proj.bias"):
                assert weight.abs().max() <= bound and want.abs().max() <= bound, name
                continue
            update = (want - start[name]).abs().max().item()
            assert maxdiff(weight, want) <= 0.01 * update + 1e-6, (r, name, maxdiff(weight, want), update)
            worst = max(worst, maxdiff(weight, want))
            worst_dense = max(worst_dense, maxdiff(dense_after[name], want))
    first = ranks2[0]["adamw"][case]
    print(f"{case} after {fns.STEPS} AdamW steps: losses {first['losses']}; max |weight diff| DTensor vs scratch "
          f"{worst:.2e} (scratch vs dense {worst_dense:.2e}; key biases aside)")


def test_sabotage_a_row_layer_without_its_reduction_is_caught(ranks2):
    """A plan whose row-parallel layers declare their output Partial() hands each rank its partial
    sum: the comparison used above must fail on loss, logits and gradients."""
    model, idx, targets = tpf.dense_model("gpt")
    logits, loss = model(idx, targets)
    loss.backward()
    for r in range(2):
        got = ranks2[r]["sabotage"]
        assert not close(got["loss"], loss.detach())
        assert not close(got["logits"], logits.detach(), scaled=True)
        assert not close(got["grads"]["blocks.0.attn.q_proj.weight"][0],
                         model.blocks[0].attn.q_proj.weight.grad, scaled=True)
        print(f"rank {r} sabotaged: loss {got['loss'].item():.4f} vs dense {loss.item():.4f}, "
              f"max |logit diff| {maxdiff(got['logits'], logits.detach()):.2f}")


def test_bad_input_errors_name_the_argument(ranks2):
    for r in range(2):
        e = ranks2[r]["errors"]
        assert e["n_heads"].startswith("ValueError") and "tp (2) must divide n_heads (3)" in e["n_heads"]
        assert "accepted tp values: 1, 3" in e["n_heads"] and "mesh.size()" in e["n_heads"]
        assert e["n_kv_heads"].startswith("ValueError") and "n_kv_heads (1)" in e["n_kv_heads"]
        assert "accepted tp values: 1" in e["n_kv_heads"]
        assert e["mesh_2d"].startswith("ValueError") and "mesh must be 1-D" in e["mesh_2d"]
        assert "shape (1, 2)" in e["mesh_2d"]
        assert e["mesh_type"].startswith("TypeError") and "DeviceMesh" in e["mesh_type"]
        assert e["model_type"].startswith("TypeError") and "TinyGPT" in e["model_type"]
        assert e["dropout"].startswith("ValueError") and "dropout=0" in e["dropout"]
        assert "ffn_dim (5)" in e["ffn"] and "vocab_size (33)" in e["vocab"]
        assert "accepted tp values: 1, 3, 11, 33" in e["vocab"]
        assert e["checkpointing"].startswith("ValueError") and "checkpointing='full'" in e["checkpointing"]
        assert e["twice"].startswith("ValueError") and "already parallelized" in e["twice"]
        for key in ("sp_seq_len", "sp_seq_len_kwarg"):
            assert e[key].startswith("ValueError") and "sequence length (3)" in e[key] and "tp (2)" in e[key]
        assert e["plan_type"].startswith("TypeError") and "plan must be a dict" in e["plan_type"]


def test_plan_layout_without_ranks():
    """The plan is pure description: built without a process group, it names the right styles."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    from course_lib.model import TinyGPT
    from course_lib.parallel.tensor_parallel import parallelize_tinygpt, tinygpt_tp_plan

    gpt, llama = TinyGPT(tpf.block_cfg("gpt")), TinyGPT(tpf.block_cfg("llama"))
    plan = tinygpt_tp_plan(gpt)
    assert isinstance(plan["tok_emb"], RowwiseParallel) and plan["tok_emb"].output_layouts == (Replicate(),)
    assert isinstance(plan["blocks.*.attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["blocks.*.attn.out_proj"], RowwiseParallel)
    assert isinstance(plan["blocks.*.attn"], PrepareModuleInput)
    assert plan["lm_head"].output_layouts == (Shard(-1),) and plan["lm_head"].use_local_output is False
    assert "blocks.*.mlp.gate" not in plan and not any(isinstance(s, SequenceParallel) for s in plan.values())
    sp = tinygpt_tp_plan(gpt, sequence_parallel=True)
    assert isinstance(sp["pos_emb"], PrepareModuleOutput)
    assert all(isinstance(sp[k], SequenceParallel) for k in ("blocks.*.norm1", "blocks.*.norm2", "norm_f"))
    assert sp["tok_emb"].output_layouts == (Shard(1),) and sp["blocks.*.mlp.down"].output_layouts == (Shard(1),)
    lsp = tinygpt_tp_plan(llama, sequence_parallel=True)
    assert isinstance(lsp["blocks.*.mlp.gate"], ColwiseParallel) and "pos_emb" not in lsp  # RoPE: no table
    with pytest.raises(TypeError, match="model must be a course_lib.model.TinyGPT"):
        tinygpt_tp_plan(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        tinygpt_tp_plan(gpt, sequence_parallel=1)
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh"):
        parallelize_tinygpt(gpt, mesh=None)


def test_exported_from_the_package():
    import course_lib.parallel.tensor_parallel as tp
    from course_lib.parallel.tensor_parallel import dtensor_plan

    assert tp.parallelize_tinygpt is dtensor_plan.parallelize_tinygpt
    assert tp.tinygpt_tp_plan is dtensor_plan.tinygpt_tp_plan
    assert {"parallelize_tinygpt", "tinygpt_tp_plan"} <= set(tp.__all__)
