"""Expert parallelism in the trainer (``parallel.ep > 1``, train.strategy "ddp", "ddp-scratch", "zero1",
"zero2", "fsdp" or "fsdp-scratch"): each MoE layer's experts sharded over ep ranks, tokens through all-to-all, the rest
data-parallel over every rank.

Layouts: train.strategy "ddp" (torch DDP over the non-expert weights), "ddp-scratch" (the kit's
BucketedDDP in its place), "zero1"/"zero2" (the kit's ZeRO: dense optimizer state sharded over every
rank, the expert slices' over the expert-DP group), "fsdp" (FSDP2, experts DTensors on an (edp, ep)
mesh sharded over edp, the rest over every rank), "fsdp-scratch" (the kit's SimpleFSDP over the
dense weights, the expert slices whole on their rank, reduced over expert-DP) and, at EP 2 x expert-DP
2 only, "deepspeed" (ZeRO-2; its EP 2 runs, resumes and gradient check are in
tests/test_deepspeed_strategy.py).

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

Beside them, in the same 2-rank launch, two variants, each against one process with the same change
(VARIANTS): zero2 at EP 2 under bf16 autocast (tolerances BF16_STEP1 at step 1 and BF16_REL over
the run, from measurement), and 16 experts with top-1 routing, where some rank's local expert receives
no row in some micro-batch (the dispatchers count it) and the run still equals one process. And FP8
(``train.precision = "fp8"``, the kit's tensorwise recipe): ddp and fsdp at EP 2 against one FP8
process (FP8_REL). The attention's FP8 Linear layers see the same one-sequence micro-batches as one
process's, so their tensorwise scales are the same; the experts (stacked weights, not Linear layers)
run in high precision - bf16 autocast - in both, which is what keeps them equal too (an FP8 expert
GEMM would scale rows of both ranks' micro-batches at once). ddp's first loss is bit-equal to one
process's; after it, bf16 rounding of the expert rows (and under fsdp FSDP2's bf16 parameters) moves
the losses about as much as bf16 EP moves them against one bf16 process (measured: fp8 ddp losses
4.2e-5 relative, weights 6.5e-4 relative L2; fsdp 1.4e-4 and 6.6e-3). fsdp-scratch's EP 2 file resumes under
plain fsdp-scratch (ep 1), and the one-process file at fsdp-scratch EP 2 x expert-DP 2.

Composed with pipeline and tensor parallelism (ModelParallel, course_lib.parallel.composed.experts),
in the same 4-rank launch: pp 2 x dp 2 x ep 2 (ddp, zero1, zero2: each stage's experts over its two
dp ranks), tp 2 with sequence parallelism x dp 2 with ep 2 (ddp), ep 4 (zero1) and ep 1 (ddp): each
tp rank routes its half of every sequence, capacity and balancing decided over both halves. Each
equals one process within 1e-5 (losses, gradient norms, weights) and every MoE tensor's per-step
gradient norm within 1e-4; the one-process file resumes at pp 2 x ep 2, pp 2 x ep 2's file at tp 2 x
ep 4, and pp 2 / tp 2 files in one process.

One launch per world size (the 4-rank one in its own fixture, runs4; the SLOW4 layouts in a second
4-rank launch under -m slow).
"""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

import ep_train_rank_fns as fns
from course_lib.parallel import run_ranks
from course_lib.train import train
from course_lib.trainer import config as train_config
from course_lib.trainer.check_config import check_world
from layout_checks import (FP32_REL, assert_matches_one_process, assert_resumed_bit_exact, max_rel, rel_l2,
                           resume_save_every, rows, tiny_cfg)

STEPS, SEQS = 6, 4  # optimizer steps; sequences per step (the global batch), one per micro-batch
START = STEPS - resume_save_every(STEPS)  # saves at 2, 4, 6; the resumes start from 4 (the newest dropped)
MODEL = dict(model__preset="moe-tiny", model__n_layers=2, model__d_model=16, model__n_heads=2, model__n_kv_heads=2,
             model__moe_experts=4, model__moe_ffn_dim=8, model__moe_bias_update_rate=0.01,
             model__moe_capacity_factor=1.25, data__seq_len=16)


def cfg(world=1, ep=1, strategy="ddp", par=None, **sets):
    """One sequence per micro-batch, SEQS / dp micro-batches per data-parallel replica (dp = world
    / (tp * pp)): the same global batch. ``par``: more [parallel] keys (tp, pp, sequence_parallel)."""
    par = dict(par or {})
    dp = world // (par.get("tp", 1) * par.get("pp", 1))
    return tiny_cfg(SEQS // dp, train__micro_batch=1, train__max_steps=STEPS,
                    train__strategy="single" if world == 1 else strategy, parallel__ep=ep,
                    checkpoint__save_every=resume_save_every(STEPS),
                    **{**MODEL, **{f"parallel__{k}": v for k, v in par.items()}, **sets})


SP = {"tp": 2, "sequence_parallel": True}
LAYOUTS = {  # name -> (world, ep, strategy[, more [parallel] keys])
    "ddp-ep2": (2, 2, "ddp"), "fsdp-ep2": (2, 2, "fsdp"),
    "zero1-ep2": (2, 2, "zero1"), "zero2-ep2": (2, 2, "zero2"), "ddp-scratch-ep2": (2, 2, "ddp-scratch"),
    "fsdp-scratch-ep2": (2, 2, "fsdp-scratch"), "zero2-ep2-bf16": (2, 2, "zero2"), "ddp-ep2-idle": (2, 2, "ddp"),
    "ddp-ep2-fp8": (2, 2, "ddp"), "fsdp-ep2-fp8": (2, 2, "fsdp"),
    "ddp-ep2-edp2": (4, 2, "ddp"), "fsdp-ep2-edp2": (4, 2, "fsdp"),
    "zero1-ep2-edp2": (4, 2, "zero1"), "zero2-ep2-edp2": (4, 2, "zero2"),
    "ddp-scratch-ep2-edp2": (4, 2, "ddp-scratch"), "fsdp-scratch-ep2-edp2": (4, 2, "fsdp-scratch"),
    # composed with model parallelism (course_lib.parallel.composed.experts): the experts of each
    # pipeline stage folded over its dp x tp ranks; under tp each rank routes its sequence slice
    "ddp-pp2-dp2-ep2": (4, 2, "ddp", {"pp": 2}), "zero1-pp2-dp2-ep2": (4, 2, "zero1", {"pp": 2}),
    "zero2-pp2-dp2-ep2": (4, 2, "zero2", {"pp": 2}),
    "ddp-tp2sp-dp2-ep2": (4, 2, "ddp", SP), "zero1-tp2sp-dp2-ep4": (4, 4, "zero1", SP),
    "ddp-tp2sp-dp2-ep1": (4, 1, "ddp", SP),  # every expert on every rank: expert-DP is the whole stage
}
if importlib.util.find_spec("deepspeed"):  # DeepSpeed's engine (ZeRO-2, the default stage) reducing the
    # experts over its own expert-DP groups; its EP 2 runs are in tests/test_deepspeed_strategy.py
    LAYOUTS["deepspeed-ep2-edp2"] = (4, 2, "deepspeed")
COMPOSED = [n for n, v in LAYOUTS.items() if len(v) > 3]
# the from-scratch data parallelism around the experts
ZERO_EP2 = ["zero1-ep2", "zero2-ep2", "ddp-scratch-ep2", "fsdp-scratch-ep2"]
# Layouts run with config changes, each held against one process run with the same changes (its
# name): bf16 autocast; and 16 experts with top-1 routing, so a rank's 8 experts share the 32 routed
# slots of the two ranks' micro-batches and some of them get no token (test_an_idle_expert_...).
FP8 = dict(train__precision="fp8", fp8__backend="kit", fp8__recipe="tensorwise")
VARIANTS = {"zero2-ep2-bf16": ("single-bf16", dict(train__precision="bf16")),
            "ddp-ep2-idle": ("single-idle", dict(model__moe_experts=16, model__moe_top_k=1)),
            "ddp-ep2-fp8": ("single-fp8", FP8), "fsdp-ep2-fp8": ("single-fp8", FP8)}
FP8_REL = {"loss": 1e-3, "grad_norm": 1e-2, "weights": 2e-2}  # bf16 rounding (measured <= 1.4e-4, 2.9e-3, 6.6e-3)
# The layouts added with fsdp-scratch are held tighter than FP32_REL: measured at most 1.2e-7
# (losses), 5.3e-8 (grad norms), 6.7e-8 (weights, relative L2; 4.5e-7 largest element).
TIGHT = {"fsdp-scratch-ep2": 1e-6, "fsdp-scratch-ep2-edp2": 1e-6, "ddp-ep2-idle": 1e-6}
# bf16 against one bf16 process. At step 1 both start from the same weights, so the only difference
# is the order of the sums (EP's all-to-all and the expert-DP reduction): measured 1.1e-7 (loss) and
# 4e-8 (grad norm) relative, while one bf16 process is 1.3e-6 and 1.1e-4 from one fp32 process there;
# BF16_STEP1 sits between, so a layout that silently computed in fp32 fails. Later steps drift: a
# weight near a bf16 rounding boundary lands one bf16 unit (2^-8 relative) away and the difference
# grows step by step, to about the size of the bf16-fp32 gap itself (measured over the 6 steps:
# losses 1.8e-5, grad norms 1.3e-4, final weights 6.8e-4 relative L2; one bf16 process from one fp32
# process 1.3e-5, 1.9e-4, 9.0e-4). BF16_REL bounds that drift (~3x the measured).
BF16_STEP1 = {"loss": 5e-7, "grad_norm": 1e-6}
BF16_REL = {"loss": 5e-5, "grad_norm": 5e-4, "weights": 2e-3}
# (resumed layout's cfg, source run folder, name): a checkpoint resumed at another EP size
# (ddp's ep 2 file at ep 1 is the one-process state dict in a plain model: the one-process resume
# below reads it)
CROSSES = [((2, 2, "ddp"), "single", "single-at-ddp-ep2"), ((2, 1, "fsdp"), "fsdp-ep2/full", "fsdp-ep2-at-ep1"),
           # zero2's ep 2 file (experts and their moments consolidated into the one-process layout)
           # resumed by plain zero2 at ep 1
           ((2, 1, "zero2"), "zero2-ep2/full", "zero2-ep2-at-ep1"),
           # fsdp-scratch's ep 2 file (its shards and the experts in the one-process layout) resumed by
           # plain fsdp-scratch (ep 1)
           ((2, 1, "fsdp-scratch"), "fsdp-scratch-ep2/full", "fsdp-scratch-ep2-at-ep1")]
# ... and in the 4-rank launch: zero1's ep 2 file (2 ranks) resumed at ep 2 x expert-DP 2, each rank
# keeping its EDP shard of its EP slice of every expert's moments
CROSSES4 = [((4, 2, "zero1"), "zero1-ep2/full", "zero1-ep2-at-ep2-edp2"),
            # ... and the one-process file resumed by fsdp-scratch at ep 2 x expert-DP 2 (ep 1 -> 2)
            ((4, 2, "fsdp-scratch"), "single", "single-at-fsdp-scratch-ep2-edp2"),
            # the one-process file resumed at pp 2 x dp 2 x ep 2; pp 2 x ep 2's file at tp 2 (SP) x ep 4
            ((4, 2, "ddp", {"pp": 2}), "single", "single-at-ddp-pp2-dp2-ep2"),
            ((4, 4, "zero1", SP), "ddp-pp2-dp2-ep2/full", "ddp-pp2-dp2-ep2-at-zero1-tp2sp-dp2-ep4")]


# 4-rank layouts whose code path a default layout already runs (zero2's expert state at expert-DP 2:
# zero1's, with zero2's gradient release held at EP 2; ddp-scratch's expert-DP reduction: ddp's;
# zero2 inside pipeline stages: zero1's flat ranges there): their own launch, under -m slow, for time.
# ep 1 under tp + SP: the sequence split without a dispatch, run by the ep 2 and ep 4 tp layouts too.
# And one resume: the one-process file at fsdp-scratch ep 2 x expert-DP 2 (fsdp-scratch's EP views
# are resumed across EP sizes by the 2-rank ep 2 -> ep 1 case).
SLOW4 = ("zero2-ep2-edp2", "ddp-scratch-ep2-edp2", "zero2-pp2-dp2-ep2", "ddp-tp2sp-dp2-ep1")
SLOW_CROSSES4 = ("single-at-fsdp-scratch-ep2-edp2",)


def on4(name):
    """A 4-rank layout's pytest parameter: marked slow when it is one of SLOW4."""
    return pytest.param(name, marks=pytest.mark.slow) if name in SLOW4 else name


def launch(root, world, resume, crosses=(), slow=False) -> dict:
    """The LAYOUTS of ``world`` ranks (and ``crosses``) in one launch: {name: {"first": every rank's
    entry, "second": rank 0's resume (with ``resume``)}, cross name: rank 0's entry}. ``slow``: the
    SLOW4 layouts only (the default launch leaves them out)."""
    names = [n for n, v in LAYOUTS.items() if v[0] == world and (n in SLOW4) == slow]
    ranks = run_ranks(fns.train_and_cross_resume, world,
                      [(cfg(*LAYOUTS[n], **VARIANTS.get(n, (None, {}))[1]), str(root / n)) for n in names],
                      [(cfg(*c), str(root / src), str(root / dst)) for c, src, dst in crosses], [str(root / n) for n in names if n in RESUMED] if resume else (), timeout=600)
    out = {n: {"first": [r["first"][i] for r in ranks], "second": ranks[0]["second"][i]}
           for i, n in enumerate(names)}
    return {**out, **{dst: ranks[0]["cross"][j] for j, (_, _, dst) in enumerate(crosses)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, then the 2-rank launch (layouts, their resumes, the resumes across EP sizes)."""
    root = tmp_path_factory.mktemp("expert_parallel")
    fns.record_grad_norms()  # this process's GradientMonitor records MoE norms from here (see ep_train_rank_fns)
    fns.take_grad_norms()
    singles = {"single": train(cfg(), root / "single"), "single_norms": fns.take_grad_norms()}
    singles.update({ref: train(cfg(**sets), root / ref) for ref, sets in dict(VARIANTS.values()).items()})
    fns.take_grad_norms()
    return {"root": root, **singles, **launch(root, 2, True, CROSSES)}


@pytest.fixture(scope="module")
def runs4(runs):
    """The 4-rank launch (EP 2 x expert-DP 2), beside the same one-process run."""
    return {**runs, **launch(runs["root"], 4, False, [c for c in CROSSES4 if c[2] not in SLOW_CROSSES4])}


@pytest.fixture(scope="module")
def runs4_slow(runs):
    """The SLOW4 layouts' own 4-rank launch (-m slow)."""
    return {**runs, **launch(runs["root"], 4, False, [c for c in CROSSES4 if c[2] in SLOW_CROSSES4], slow=True)}


def four(request, name):
    """The 4-rank results that hold ``name``: runs4, or runs4_slow for SLOW4 and SLOW_CROSSES4."""
    return request.getfixturevalue("runs4_slow" if name in SLOW4 + SLOW_CROSSES4 else "runs4")


def check_layout(runs, name, rel=None):
    single = VARIANTS.get(name, ("single",))[0]
    got, ref = rows(runs["root"] / name / "full"), rows(runs["root"] / single)
    first = runs[name]["first"][0]
    want = runs[single].model.state_dict()
    col = lambda rs, k: [x[k] for x in rs]  # noqa: E731
    print(f"{name}: max |loss - one process| / loss = {max_rel(col(got, 'loss'), col(ref, 'loss')):.2e}, "
          f"grad norms {max_rel(col(got, 'grad_norm'), col(ref, 'grad_norm')):.2e}, "
          f"weights relative L2 {rel_l2(first['weights'], want):.2e}, "
          f"max abs diff {max((first['weights'][k] - v).abs().max().item() for k, v in want.items()):.2e}")
    rel = rel or TIGHT.get(name, FP32_REL)
    assert_matches_one_process(name, got, ref, first["weights"], runs[single].model, rel=rel)
    assert all(torch.allclose(first["weights"][k], want[k], atol=min(rel, 1e-5)) for k in want)
    # MFU counts the whole model's active parameters, not a rank's share of the experts:
    # mfu / tokens_per_s = FLOPs per token / (peak * world)
    world = LAYOUTS[name][0]
    assert got[-1]["mfu"] / got[-1]["tokens_per_s"] * world == pytest.approx(ref[-1]["mfu"] / ref[-1]["tokens_per_s"])
    stage = lambda r: r["coords"]["pp"] if r["coords"] else 0  # noqa: E731  (a stage holds its own layers)
    for r in runs[name]["first"]:  # the bias update sums every rank's loads: one bias per layer, and it moved
        same = next(q for q in runs[name]["first"] if stage(q) == stage(r))
        assert all(torch.equal(b, b0) for b, b0 in zip(r["bias"], same["bias"]))
    assert sum(b.abs().sum() for b in first["bias"]) > 0
    # ... while the capacity dropped tokens and the routing was uneven (last micro-batch of each rank)
    assert sum(sum(r["dropped"]) for r in runs[name]["first"]) > 0, name
    assert any(max(load) > min(load) for r in runs[name]["first"] for load in r["load"]), name
    assert all(log is None for r in runs[name]["first"] for log in r["logs"]), f"{name}: a dispatcher kept a log"


@pytest.mark.parametrize("name", ["ddp-ep2", "fsdp-ep2", *ZERO_EP2])
def test_ep2_matches_one_process(runs, name):
    check_layout(runs, name)


@pytest.mark.parametrize("name", [on4(n) for n in ["ddp-ep2-edp2", "fsdp-ep2-edp2", *(n + "-edp2" for n in ZERO_EP2),
                                                   *(["deepspeed-ep2-edp2"] if "deepspeed-ep2-edp2" in LAYOUTS else [])]])
def test_ep2_edp2_matches_one_process(request, name):
    """Expert gradients reduced over the expert-DP group (FSDP2: its divide factor, gloo's sum; ZeRO:
    the expert slices' reduce-scatter over it, divided by the world; DeepSpeed: its engine's ZeRO-2
    partitions of the expert groups, reduced over its own expert-DP groups)."""
    check_layout(four(request, name), name)


def test_bf16_ep2_matches_one_bf16_process(runs):
    """zero2 at EP 2 under bf16 autocast against one bf16 process: at step 1 within BF16_STEP1, which
    one fp32 process is not; over the run within BF16_REL (see their comment)."""
    got, bf16, fp32 = (rows(runs["root"] / n) for n in ("zero2-ep2-bf16/full", "single-bf16", "single"))
    for k, tol in BF16_STEP1.items():
        measured, gap = (abs(a[0][k] - b[0][k]) / b[0][k] for a, b in ((got, bf16), (bf16, fp32)))
        print(f"zero2-ep2-bf16 {k} at step 1: {measured:.2e} from one bf16 process (tolerance {tol:.0e}); "
              f"one bf16 process from one fp32 process: {gap:.2e}")
        assert measured <= tol < gap, (k, measured, tol, gap)  # bf16 like one process, and not fp32
    weights = runs["zero2-ep2-bf16"]["first"][0]["weights"]
    want = {k: v.float() for k, v in runs["single-bf16"].model.state_dict().items()}
    col = lambda rs, k: [x[k] for x in rs]  # noqa: E731
    drift = {k: max_rel(col(got, k), col(bf16, k)) for k in ("loss", "grad_norm")}
    drift["weights"] = rel_l2(weights, want)
    print(f"zero2-ep2-bf16 over {STEPS} steps, from one bf16 process: "
          + ", ".join(f"{k} {v:.2e} (tolerance {BF16_REL[k]:.0e})" for k, v in drift.items()))
    assert all(v <= BF16_REL[k] for k, v in drift.items()), drift
    assert [x["clipped"] for x in got] == [x["clipped"] for x in bf16]


@pytest.mark.parametrize("name", ["ddp-ep2-fp8", "fsdp-ep2-fp8"])
def test_fp8_ep2_matches_one_fp8_process(runs, name):
    """train.precision = "fp8" at EP 2 against one FP8 process on the same one-sequence micro-batches
    (the module docstring says why the experts stay in high precision, and what FP8_REL holds)."""
    got, ref = rows(runs["root"] / name / "full"), rows(runs["root"] / "single-fp8")
    want = {k: v.float() for k, v in runs["single-fp8"].model.state_dict().items()}
    col = lambda rs, k: [x[k] for x in rs]  # noqa: E731
    diffs = {k: max_rel(col(got, k), col(ref, k)) for k in ("loss", "grad_norm")}
    diffs["weights"] = rel_l2(runs[name]["first"][0]["weights"], want)
    print(f"{name}: relative differences to one FP8 process {diffs}")
    assert all(diffs[k] <= FP8_REL[k] for k in diffs), (name, diffs)
    if name.startswith("ddp"):  # the same FP8 values on the same micro-batches: step 1 bit for bit
        assert got[0]["loss"] == ref[0]["loss"], (name, got[0]["loss"], ref[0]["loss"])
    report = json.loads((runs["root"] / name / "full" / "fp8.json").read_text())
    assert len(report["converted"]) == 8 and report["kept_batched"] == ["blocks.0.mlp.experts",
                                                                         "blocks.1.mlp.experts"], report


def test_an_idle_expert_in_the_trainer_still_matches_one_process(runs):
    """With 16 experts and top-1 routing some rank's local expert receives no row in some micro-batch
    (the dispatchers' counts say so); it still runs, on zero rows, and the run equals one process."""
    idle = [r["idle"] for r in runs["ddp-ep2-idle"]["first"]]
    print(f"ddp-ep2-idle: local experts with no rows, per rank and MoE layer, over the run: {idle}")
    assert sum(map(sum, idle)) > 0, idle
    check_layout(runs, "ddp-ep2-idle")


@pytest.mark.parametrize("name", [on4(n) for n in COMPOSED])
def test_ep_composed_with_pp_or_tp_matches_one_process(request, name):
    """EP inside ModelParallel: pipeline stages (each stage's experts over its dp ranks, the balancing
    loss of stage 0 joining its backward), tp 2 with sequence parallelism (each tp rank routes its
    half of every sequence, capacity and balancing loss decided over both halves, experts over tp
    and dp ranks); ddp, zero1 and zero2 as the data-parallel dimension. Held within 1e-5, not 1e-4
    (measured <= 3e-7): the experts are a small share of the total gradient norm, and an expert
    counted twice in it moves the norm by ~6e-5."""
    runs4 = four(request, name)
    check_layout(runs4, name, rel=1e-5)
    # Per step, the gradient norm of every MoE tensor (each expert stack whole: its slices' squares
    # summed over the EP group; the router's summed over tp under SP) equals one process's.
    ref, worst = runs4["single_norms"], 0.0
    for step, want in enumerate(ref):
        got = {}
        for r in runs4[name]["first"]:  # a rank reports its stage's layers; its EP peers the same numbers
            got.update(r["grad_norms"][step])
        assert {k for k in want if ".experts." in k} <= set(got) <= set(want), (name, step, sorted(got))
        worst = max(worst, max(abs(v - want[k]) / want[k] for k, v in got.items()))
    print(f"{name}: MoE tensors' gradient norms within {worst:.2e} (relative) of one process")
    assert worst <= 1e-4, name


@pytest.mark.parametrize("name", [on4("zero1-ep2-edp2"), on4("zero2-ep2-edp2")])
def test_zero_ep2_edp2_shards_the_expert_state_over_expert_dp(request, name):
    """Under zero1/zero2 at EP 2 x expert-DP 2 each rank holds the AdamW moments of part of its
    slices only (the other expert-DP rank the rest), and of part of the dense weights."""
    counts = [r["state_numel"] for r in four(request, name)[name]["first"]]
    for kind in ("dense", "expert"):
        per_rank = [c[kind] for c in counts]
        whole = counts[0][kind + "_params"]  # this layout's elements of that kind on one rank
        assert all(0 < n < 2 * whole for n in per_rank), (name, kind, per_rank, whole)
    # expert-DP pairs (0, 2) and (1, 3) split their slices' moments: 2 moments x the slice, once
    for a, b in ((0, 2), (1, 3)):
        assert counts[a]["expert"] + counts[b]["expert"] == 2 * counts[a]["expert_params"], (name, counts)
    assert sum(c["dense"] for c in counts) == 2 * counts[0]["dense_params"], (name, counts)
    assert all(c["all"] == c["dense"] + c["expert"] for c in counts)  # optimizer.state: both parts


# The 2-rank layouts resumed at the same ep (each strategy's checkpoint code once, and bf16's); the
# fp8 and idle-expert variants save through the same code as their fp32 layouts (their resumes were
# bit-exact when built) and are trained only, for time.
RESUMED = ["ddp-ep2", "fsdp-ep2", *ZERO_EP2, "zero2-ep2-bf16"]


@pytest.mark.parametrize("name", RESUMED)
def test_resume_at_the_same_ep_is_bit_exact(runs, name):
    assert_resumed_bit_exact(name, runs[name]["first"][0], runs[name]["second"], START, STEPS, runs["root"] / name)


@pytest.mark.parametrize("name, want", [("single-at-ddp-ep2", "single"), ("fsdp-ep2-at-ep1", "fsdp-ep2"),
                                        ("zero2-ep2-at-ep1", "zero2-ep2"), ("zero1-ep2-at-ep2-edp2", "zero1-ep2"),
                                        ("fsdp-scratch-ep2-at-ep1", "fsdp-scratch-ep2"),
                                        pytest.param("single-at-fsdp-scratch-ep2-edp2", "single", marks=pytest.mark.slow),
                                        ("single-at-ddp-pp2-dp2-ep2", "single"),
                                        ("ddp-pp2-dp2-ep2-at-zero1-tp2sp-dp2-ep4", "ddp-pp2-dp2-ep2")])
def test_resume_across_ep_sizes(request, name, want):
    """A full checkpoint saved in one process resumed at ep 2 (ddp); a sharded one (fsdp, DCP) saved
    at ep 2 resumed at ep 1; zero2's full one saved at ep 2 resumed by plain zero2 (ep 1), zero1's
    saved at ep 2 on 2 ranks resumed at ep 2 x expert-DP 2 on 4: each ends where the uninterrupted
    run ends."""
    runs = four(request, name)
    got = runs[name]
    ref = ({k: v.float() for k, v in runs["single"].model.state_dict().items()} if want == "single"
           else runs[want]["first"][0]["weights"])
    assert got["resumed_from"] == START and got["steps"] == STEPS
    print(f"{name}: relative L2 to the uninterrupted run = {rel_l2(got['weights'], ref):.2e}")
    assert rel_l2(got["weights"], ref) <= 1e-4


def resume_in_one_process(runs, tmp_path, name):
    out = tmp_path / "ep2-in-one-process"  # the ep 2 file is the one-process state dict
    shutil.copytree(runs["root"] / name / "full", out)
    shutil.rmtree(sorted((out / "checkpoints").glob("step_*"))[-1])
    resumed = train(cfg(), out, resume=True)
    assert resumed.resumed_from == START
    diff = rel_l2({k: v.float() for k, v in resumed.model.state_dict().items()}, runs[name]["first"][0]["weights"])
    print(f"{name} resumed in one process: relative L2 to the uninterrupted run = {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("name", ["ddp-ep2", "zero1-ep2"])
def test_ep2_full_checkpoint_resumes_in_one_process(runs, tmp_path, name):
    """ddp's and zero1's ep 2 checkpoints are the one-process state dict (experts and AdamW moments
    gathered; zero1's optimizer shards consolidated first)."""
    resume_in_one_process(runs, tmp_path, name)


@pytest.mark.parametrize("name", ["zero1-pp2-dp2-ep2", "zero1-tp2sp-dp2-ep4"])
def test_composed_full_checkpoint_resumes_in_one_process(runs4, tmp_path, name):
    """pp 2 x ep 2 and tp 2 x ep 4 files are the one-process state dict too (experts and their
    moments gathered over the EP group, which spans dp replicas; zero1's ranges gathered)."""
    resume_in_one_process(runs4, tmp_path, name)


# ---------------------------------------------------------------- no ranks
@pytest.mark.parametrize("sets, match", [
    ({"parallel__ep": 2, "model__moe_experts": None}, r"parallel.ep = 2 shards the experts of an MoE model"),
    ({"parallel__ep": 3}, r"parallel.ep = 3 must divide model.moe_experts \(4\)"),
    ({"parallel__ep": 2, "parallel__tp": 2}, r"model.moe_experts with parallel.tp = 2 needs parallel.sequence_parallel "
                                             r"= true.*Expert-tensor-parallel = tp \(experts cut by tp\) is not built"),
    ({"parallel__tp": 2}, r"model.moe_experts with parallel.tp = 2 needs parallel.sequence_parallel"),  # ep 1 too
    ({"parallel__ep": 2, "parallel__tp": 2, "parallel__cp": 2, "parallel__sequence_parallel": True},
     r"model.moe_experts with parallel.tp = 2 and parallel.cp = 2 is not built: context parallelism"),
    ({"parallel__ep": 2, "parallel__pp": 2, "parallel__pp_schedule": "interleaved", "parallel__virtual_stages": 2,
      "model__n_layers": 4}, r"runs with parallel.pp_schedule = 'gpipe' or '1f1b'"),
    ({"parallel__ep": 2, "parallel__tp": 2, "parallel__sequence_parallel": True, "train__strategy": "fsdp"},
     r"model.moe_experts with parallel.tp = 2 does not run with train.strategy = 'fsdp'"),
    ({"parallel__ep": 2, "parallel__pp": 2, "train__precision": "fp16"},
     r"model.moe_experts with parallel.pp = 2 does not run with train.precision = 'fp16'"),
    ({"parallel__ep": 2, "parallel__pp": 2, "model__checkpointing": "full"},
     r"model.moe_experts with parallel.pp = 2 does not run with model.checkpointing"),
    ({"parallel__ep": 2, "train__strategy": "single"}, r"parallel.ep = 2 does not run with train.strategy = "
                                                      r"'single'.*must be one of 'ddp', 'ddp-scratch', 'zero1', "
                                                      r"'zero2', 'fsdp', 'fsdp-scratch', 'deepspeed'"),
    ({"parallel__ep": 2, "train__strategy": "deepspeed", "parallel__zero_stage": 3},
     r"parallel.ep = 2 with train.strategy = 'deepspeed' needs parallel.zero_stage 0, 1 or 2 \(got 3\): DeepSpeed "
     r"does not support MoE"),
    ({"parallel__ep": 2, "train__strategy": "deepspeed", "parallel__offload_optimizer": "cpu"},
     r"parallel.ep = 2 with train.strategy = 'deepspeed' runs without parallel.offload_optimizer"),
    ({"parallel__ep": 2, "train__strategy": "deepspeed", "train__precision": "fp8"},
     r"parallel.ep = 2 does not run with train.precision = 'fp8' \(not tried with DeepSpeed's expert groups"),
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


def test_ep_must_divide_a_pipeline_stage():
    """Each stage folds its experts over its own ranks: ep 4 on pp 2 x 2 ranks does not fit."""
    check_world(cfg(4, 2, "ddp", {"pp": 2}), 4, has_group=True)
    with pytest.raises(train_config.ConfigError, match=r"parallel.ep = 4 must divide the 2 ranks of a pipeline stage"):
        check_world(cfg(4, 4, "ddp", {"pp": 2}), 4, has_group=True)
