"""Expert parallelism in the trainer (``parallel.ep > 1``, train.strategy "ddp", "ddp-scratch", "zero1",
"zero2" or "fsdp"): each MoE layer's experts sharded over ep ranks, tokens through all-to-all, the rest
data-parallel over every rank.

Layouts: train.strategy "ddp" (torch DDP over the non-expert weights), "ddp-scratch" (the kit's
BucketedDDP in its place), "zero1"/"zero2" (the kit's ZeRO: dense optimizer state sharded over every
rank, the expert slices' over the expert-DP group), "fsdp" (FSDP2, experts DTensors on an (edp, ep)
mesh sharded over edp, the rest over every rank) and, at EP 2 x expert-DP 2 only, "deepspeed"
(ZeRO-2; its EP 2 runs, resumes and gradient check are in tests/test_deepspeed_strategy.py).

The model is moe-tiny shrunk to 2 layers of 4 experts (d_model 16; capacity factor 1.25: an
expert takes at most 10 of a micro-batch's 32 routed slots; the balancing loss and the DeepSeek-V3
bias update on, the bias moving because the routing is uneven). The reference
is ONE process on the same global batch of 4 sequences a step, taken as 4 micro-batches of one
sequence: a rank's micro-batch is one of those (the sampler deals the global batch out in that
order), and MoE's balancing loss and capacity are per micro-batch, so that is the one-process run
an EP layout must equal. EP 2 (world 2, 2 micro-batches a rank) and EP 2 x expert-DP 2 (world 4)
match its per-step losses, gradient norms and final weights within 1e-4 relative (fp32: summation
order only), with the expert biases equal on every rank.

Checkpoints: ddp's, ddp-scratch's and zero1/zero2's are full, in the one-process layout (experts and
their AdamW moments gathered; ZeRO's shards consolidated), fsdp's sharded (DCP). Each EP 2 run resumes
bit-exact at EP 2; ddp's and zero1's EP 2 files resumed in one process, the one-process file resumed at
EP 2, fsdp's and zero2's EP 2 checkpoints resumed at ep 1, and zero1's EP 2 file (2 ranks) resumed at
EP 2 x expert-DP 2 (4 ranks) end where the uninterrupted runs end (within 1e-4).

One launch per world size (the 4-rank one in its own fixture, runs4).
"""
from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

import ep_train_rank_fns as fns
from course_lib.parallel import run_ranks
from course_lib.train import train
from course_lib.trainer import config as train_config
from course_lib.trainer.check_config import check_world
from layout_checks import (assert_matches_one_process, assert_resumed_bit_exact, rel_l2, resume_save_every,
                           rows, tiny_cfg)

STEPS, SEQS = 6, 4  # optimizer steps; sequences per step (the global batch), one per micro-batch
START = STEPS - resume_save_every(STEPS)  # saves at 2, 4, 6; the resumes start from 4 (the newest dropped)
MODEL = dict(model__preset="moe-tiny", model__n_layers=2, model__d_model=16, model__n_heads=2, model__n_kv_heads=1,
             model__moe_experts=4, model__moe_ffn_dim=8, model__moe_bias_update_rate=0.01,
             model__moe_capacity_factor=1.25, data__seq_len=16)


def cfg(world=1, ep=1, strategy="ddp", **sets):
    """One sequence per micro-batch, SEQS / world micro-batches per rank: the same global batch."""
    return tiny_cfg(SEQS // world, train__micro_batch=1, train__max_steps=STEPS,
                    train__strategy="single" if world == 1 else strategy, parallel__ep=ep,
                    checkpoint__save_every=resume_save_every(STEPS), **MODEL, **sets)


LAYOUTS = {  # name -> (world, ep, strategy)
    "ddp-ep2": (2, 2, "ddp"), "fsdp-ep2": (2, 2, "fsdp"),
    "zero1-ep2": (2, 2, "zero1"), "zero2-ep2": (2, 2, "zero2"), "ddp-scratch-ep2": (2, 2, "ddp-scratch"),
    "ddp-ep2-edp2": (4, 2, "ddp"), "fsdp-ep2-edp2": (4, 2, "fsdp"),
    "zero1-ep2-edp2": (4, 2, "zero1"), "zero2-ep2-edp2": (4, 2, "zero2"),
    "ddp-scratch-ep2-edp2": (4, 2, "ddp-scratch"),
}
if importlib.util.find_spec("deepspeed"):  # DeepSpeed's engine (ZeRO-2, the default stage) reducing the
    # experts over its own expert-DP groups; its EP 2 runs are in tests/test_deepspeed_strategy.py
    LAYOUTS["deepspeed-ep2-edp2"] = (4, 2, "deepspeed")
ZERO_EP2 = ["zero1-ep2", "zero2-ep2", "ddp-scratch-ep2"]  # the from-scratch data parallelism around the experts
# (resumed layout's cfg, source run folder, name): a checkpoint resumed at another EP size
# (ddp's ep 2 file at ep 1 is the one-process state dict in a plain model: the one-process resume
# below reads it)
CROSSES = [((2, 2, "ddp"), "single", "single-at-ddp-ep2"), ((2, 1, "fsdp"), "fsdp-ep2/full", "fsdp-ep2-at-ep1"),
           # zero2's ep 2 file (experts and their moments consolidated into the one-process layout)
           # resumed by plain zero2 at ep 1
           ((2, 1, "zero2"), "zero2-ep2/full", "zero2-ep2-at-ep1")]
# ... and in the 4-rank launch: zero1's ep 2 file (2 ranks) resumed at ep 2 x expert-DP 2, each rank
# keeping its EDP shard of its EP slice of every expert's moments
CROSSES4 = [((4, 2, "zero1"), "zero1-ep2/full", "zero1-ep2-at-ep2-edp2")]


def launch(root, world, resume, crosses=()) -> dict:
    """The LAYOUTS of ``world`` ranks (and ``crosses``) in one launch: {name: {"first": every rank's
    entry, "second": rank 0's resume (with ``resume``)}, cross name: rank 0's entry}."""
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
    ranks = run_ranks(fns.train_and_cross_resume, world, [(cfg(*LAYOUTS[n]), str(root / n)) for n in names],
                      [(cfg(*c), str(root / src), str(root / dst)) for c, src, dst in crosses], resume, timeout=600)
    out = {n: {"first": [r["first"][i] for r in ranks], "second": ranks[0]["second"][i] if resume else None}
           for i, n in enumerate(names)}
    return {**out, **{dst: ranks[0]["cross"][j] for j, (_, _, dst) in enumerate(crosses)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, then the 2-rank launch (layouts, their resumes, the resumes across EP sizes)."""
    root = tmp_path_factory.mktemp("expert_parallel")
    single = train(cfg(), root / "single")
    return {"root": root, "single": single, **launch(root, 2, True, CROSSES)}


@pytest.fixture(scope="module")
def runs4(runs):
    """The 4-rank launch (EP 2 x expert-DP 2), beside the same one-process run."""
    return {**runs, **launch(runs["root"], 4, False, CROSSES4)}


def check_layout(runs, name):
    got, ref = rows(runs["root"] / name / "full"), rows(runs["root"] / "single")
    first = runs[name]["first"][0]
    want = runs["single"].model.state_dict()
    assert_matches_one_process(name, got, ref, first["weights"], runs["single"].model)
    print(f"{name}: max |loss - one process| = {max(abs(a['loss'] - b['loss']) for a, b in zip(got, ref)):.2e}, "
          f"weights max abs diff = {max((first['weights'][k] - v).abs().max().item() for k, v in want.items()):.2e}")
    assert all(torch.allclose(first["weights"][k], want[k], atol=1e-5) for k in want)
    # MFU counts the whole model's active parameters, not a rank's share of the experts:
    # mfu / tokens_per_s = FLOPs per token / (peak * world)
    world = LAYOUTS[name][0]
    assert got[-1]["mfu"] / got[-1]["tokens_per_s"] * world == pytest.approx(ref[-1]["mfu"] / ref[-1]["tokens_per_s"])
    for r in runs[name]["first"]:  # the bias update sums every rank's loads: one bias everywhere, and it moved
        assert all(torch.equal(b, b0) for b, b0 in zip(r["bias"], first["bias"]))
    assert sum(b.abs().sum() for b in first["bias"]) > 0
    # ... while the capacity dropped tokens and the routing was uneven (last micro-batch of each rank)
    assert sum(sum(r["dropped"]) for r in runs[name]["first"]) > 0, name
    assert any(max(load) > min(load) for r in runs[name]["first"] for load in r["load"]), name


@pytest.mark.parametrize("name", ["ddp-ep2", "fsdp-ep2", *ZERO_EP2])
def test_ep2_matches_one_process(runs, name):
    check_layout(runs, name)


@pytest.mark.parametrize("name", ["ddp-ep2-edp2", "fsdp-ep2-edp2", *(n + "-edp2" for n in ZERO_EP2),
                                  *(["deepspeed-ep2-edp2"] if "deepspeed-ep2-edp2" in LAYOUTS else [])])
def test_ep2_edp2_matches_one_process(runs4, name):
    """Expert gradients reduced over the expert-DP group (FSDP2: its divide factor, gloo's sum; ZeRO:
    the expert slices' reduce-scatter over it, divided by the world; DeepSpeed: its engine's ZeRO-2
    partitions of the expert groups, reduced over its own expert-DP groups)."""
    check_layout(runs4, name)


def test_zero_ep2_edp2_shards_the_expert_state_over_expert_dp(runs4):
    """Under zero1/zero2 at EP 2 x expert-DP 2 each rank holds the AdamW moments of part of its
    slices only (the other expert-DP rank the rest), and of part of the dense weights."""
    for name in ("zero1-ep2-edp2", "zero2-ep2-edp2"):
        counts = [r["state_numel"] for r in runs4[name]["first"]]
        for kind in ("dense", "expert"):
            per_rank = [c[kind] for c in counts]
            whole = counts[0][kind + "_params"]  # this layout's elements of that kind on one rank
            assert all(0 < n < 2 * whole for n in per_rank), (name, kind, per_rank, whole)
        # expert-DP pairs (0, 2) and (1, 3) split their slices' moments: 2 moments x the slice, once
        for a, b in ((0, 2), (1, 3)):
            assert counts[a]["expert"] + counts[b]["expert"] == 2 * counts[a]["expert_params"], (name, counts)
        assert sum(c["dense"] for c in counts) == 2 * counts[0]["dense_params"], (name, counts)
        assert all(c["all"] == c["dense"] + c["expert"] for c in counts)  # optimizer.state: both parts


@pytest.mark.parametrize("name", ["ddp-ep2", "fsdp-ep2", *ZERO_EP2])
def test_resume_at_the_same_ep_is_bit_exact(runs, name):
    assert_resumed_bit_exact(name, runs[name]["first"][0], runs[name]["second"], START, STEPS, runs["root"] / name)


@pytest.mark.parametrize("name, want", [("single-at-ddp-ep2", "single"), ("fsdp-ep2-at-ep1", "fsdp-ep2"),
                                        ("zero2-ep2-at-ep1", "zero2-ep2"), ("zero1-ep2-at-ep2-edp2", "zero1-ep2")])
def test_resume_across_ep_sizes(runs4, name, want):
    """A full checkpoint saved in one process resumed at ep 2 (ddp); a sharded one (fsdp, DCP) saved
    at ep 2 resumed at ep 1; zero2's full one saved at ep 2 resumed by plain zero2 (ep 1), zero1's
    saved at ep 2 on 2 ranks resumed at ep 2 x expert-DP 2 on 4: each ends where the uninterrupted
    run ends."""
    runs = runs4
    got = runs[name]
    ref = ({k: v.float() for k, v in runs["single"].model.state_dict().items()} if want == "single"
           else runs[want]["first"][0]["weights"])
    assert got["resumed_from"] == START and got["steps"] == STEPS
    print(f"{name}: relative L2 to the uninterrupted run = {rel_l2(got['weights'], ref):.2e}")
    assert rel_l2(got["weights"], ref) <= 1e-4


@pytest.mark.parametrize("name", ["ddp-ep2", "zero1-ep2"])
def test_ep2_full_checkpoint_resumes_in_one_process(runs, tmp_path, name):
    """ddp's and zero1's ep 2 checkpoints are the one-process state dict (experts and AdamW moments
    gathered; zero1's optimizer shards consolidated first)."""
    out = tmp_path / "ep2-in-one-process"  # the ep 2 file is the one-process state dict
    shutil.copytree(runs["root"] / name / "full", out)
    shutil.rmtree(sorted((out / "checkpoints").glob("step_*"))[-1])
    resumed = train(cfg(), out, resume=True)
    assert resumed.resumed_from == START
    assert rel_l2({k: v.float() for k, v in resumed.model.state_dict().items()},
                  runs[name]["first"][0]["weights"]) <= 1e-4


# ---------------------------------------------------------------- no ranks
@pytest.mark.parametrize("sets, match", [
    ({"parallel__ep": 2, "model__moe_experts": None}, r"parallel.ep = 2 shards the experts of an MoE model"),
    ({"parallel__ep": 3}, r"parallel.ep = 3 must divide model.moe_experts \(4\)"),
    ({"parallel__ep": 2, "parallel__tp": 2}, r"parallel.ep = 2 with parallel.tp = 2 is not built: Megatron .*ETP = TP or 1"),
    ({"parallel__ep": 2, "train__strategy": "fsdp-scratch"}, r"parallel.ep = 2 does not run with train.strategy = "
                                                             r"'fsdp-scratch'.*must be one of 'ddp', 'ddp-scratch', "
                                                             r"'zero1', 'zero2', 'fsdp', 'deepspeed'"),
    ({"parallel__ep": 2, "train__strategy": "deepspeed", "parallel__zero_stage": 3},
     r"parallel.ep = 2 with train.strategy = 'deepspeed' needs parallel.zero_stage 0, 1 or 2 \(got 3\): DeepSpeed "
     r"does not support MoE"),
    ({"parallel__ep": 2, "train__strategy": "deepspeed", "parallel__offload_optimizer": "cpu"},
     r"parallel.ep = 2 with train.strategy = 'deepspeed' runs without parallel.offload_optimizer"),
    ({"parallel__ep": 2, "checkpoint__format": "sharded"}, r"checkpoint.format = 'sharded' does not fit parallel.ep"),
    ({"parallel__ep": 2, "train__strategy": "ddp-scratch", "checkpoint__format": "sharded"},
     r"checkpoint.format = 'sharded' does not fit parallel.ep = 2 with train.strategy = 'ddp-scratch'"),
    ({"parallel__ep": 2, "train__strategy": "zero1", "checkpoint__format": "sharded"},
     r"checkpoint.format = 'sharded' does not fit train.strategy = 'zero1'"),
    ({"parallel__ep": 2, "model__checkpointing": "full"}, r"parallel.ep = 2 does not run with model.checkpointing"),
    ({"parallel__ep": 0}, r"parallel.ep must be >= 1"),
])
def test_bad_ep_is_refused_by_the_config(sets, match):
    if sets.get("model__moe_experts", 0) is None:  # a dense model: the default preset, no experts
        model, sets = {"data__seq_len": 16}, {k: v for k, v in sets.items() if k != "model__moe_experts"}
    else:
        model = {k: v for k, v in MODEL.items() if k not in sets}
    with pytest.raises(train_config.ConfigError, match=match):
        tiny_cfg(1, **model, **{"train__strategy": "ddp", **sets})


def test_ep_must_divide_the_world():
    c = cfg(2, 2)
    check_world(c, 4, has_group=True)
    with pytest.raises(train_config.ConfigError, match=r"parallel.ep = 2 must divide the world size \(3 ranks"):
        check_world(c, 3, has_group=True)
