# %% [markdown]
# # Lab 13 — Planning and launching a real job
#
# "Llama 2 70B, 64 A100-80GB in 8 nodes, 2T tokens: what do I run?" The planner (`course plan`)
# answers in a fraction of a second. This lab makes you able to check that answer, not just read it:
#
# 1. **the plan** for that job, and how to read a layout's name (`tp4 pp2v8 dp8 ...`);
# 2. **its numbers by hand**: a memory line, the tensor-parallel and data-parallel traffic, the
#    compute and the pipeline bubble, each from the model's shape and the hardware's datasheet,
#    each compared with the planner's own number;
# 3. **one input moved**: a faster network between nodes changes the layout, and your formulas say why;
# 4. **the files** a plan writes, listed, and the checkpoint interval in one of them derived;
# 5. **a plan run for real**: a tiny model planned onto 4 CPU ranks (tensor parallelism and FSDP),
#    started with the same single-node command a GPU node would get.
#
# Nothing here needs a GPU: sections 1-4 are arithmetic, section 5 runs on CPU ranks.

# %% tags=["parameters"]
SMOKE = False  # True: fewer training steps, so the automated tests finish quickly
TRAIN_STEPS = 20  # section 5: optimizer steps of the real run

# %%
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

import course_lib
from course_lib.kit.checks import check
from course_lib.kit.scratch import fresh
from course_lib.launchers.cluster import Cluster
from course_lib.launchers.commands import shell_join, torchrun_single_node
from course_lib.kit.predict import show_prediction
from course_lib.parallel.mesh import mesh_layout
from course_lib.planner import checkpoint_plan, evaluate, make_spec, plan, write_plan
from course_lib.planner.exercise import SCENARIOS
from course_lib.planner.hardware import INTERCONNECTS
from course_lib.planner.report import table
from course_lib.trainer import config as train_config

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    TRAIN_STEPS = 4
ROOT = Path(course_lib.__file__).resolve().parent.parent  # the kit's root (the trainer runs from here)
RUNS = Path(tempfile.mkdtemp(prefix="lab13-"))  # scratch: every file this lab writes
GiB = 2**30


def rel(mine: float, theirs: float) -> float:
    """Relative difference of your number from the planner's."""
    return abs(mine / theirs - 1)


# %% [markdown]
# ## 1. The plan, and how to read it
#
# The job: Llama 2 70B on 64 A100-80GB (8 nodes of 8 GPUs), sequences of 4,096 tokens, a global
# batch of 4Mi = 4,194,304 tokens per step (Llama 2's), 2T tokens. `plan(...)` is `course plan` as
# a function: it tries every legal layout, keeps those that fit in 90% of the GPU's memory, and
# ranks them by a modelled step time. The table shows the best three ideas, then the three layouts
# that *just* miss the memory.

# %% tags=["nbval-check-output"]
JOB = SCENARIOS["70b-8-nodes"]
p = plan(**JOB)
best, spec = p.best, p.spec
print(table(p, 3))
check(spec.usable_bytes == 0.9 * spec.gpu_memory_bytes, "a layout may use 90% of the GPU's memory")

# %% [markdown]
# **Reading a layout's name** (`Layout.label()` in `course_lib/planner/costs.py`), left to right:
#
# * `tp4`: **tensor parallelism**, every layer's matrices split over 4 GPUs (always inside a node);
# * `pp2`: **pipeline parallelism**, the layers cut into 2 stages held by 2 groups of GPUs.
#   `pp2v8`: the interleaved 1F1B schedule, each pipeline rank holding `v` = 8 chunks of layers
#   (virtual stages), so 16 stages in all. A bracket after it, `pp2v7[5*3,6*10,5]`, lists the
#   blocks of each stage, first to last, when they are not all equal; `5*3` means three stages of 5
#   blocks. 80 blocks do not split evenly over 14 stages: four stages get 5 and ten get 6, and the
#   fives go to the end stages first (they also hold the embedding and the output layer), then
#   to the stages next to the first (here stages 1 and 2, as the expanded list below shows);
# * `dp8`: **data parallelism**, 8 replicas, each on its own share of the batch;
# * `cp1`: **context parallelism**, each sequence split over that many GPUs (1: not split);
# * `Z1`: the **ZeRO stage** over the dp x cp ranks: 0 replicates everything (DDP), 1 shards the
#   optimizer state, 2 also the gradients, 3 also the weights (FSDP);
# * `rc=selective`: **recomputation** in the backward: `none`, `selective` (the attention scores)
#   or `full` (whole layers);
# * `mb1x128`: **micro-batch** of 1 sequence, 128 micro-batches per step on each replica.
#
# Two identities must hold: tp x pp x dp x cp = the 64 GPUs, and micro-batch x micro-batches x dp =
# the global batch in sequences. The next cell reads every name in the table that way, checks both,
# and says one of them in words.

# %%
LABEL = re.compile(r"tp(\d+) pp(\d+)(?:v(\d+))?(?:\[([\d*,]+)\])? dp(\d+) cp(\d+) Z(\d) rc=(\w+) mb(\d+)x(\d+)")


def read_label(text: str) -> dict:
    """The fields of a layout name, as numbers (the bracket expanded: '5*3' -> 5, 5, 5)."""
    tp, pp, v, split, dp, cp, zero, rc, mb, acc = LABEL.fullmatch(text).groups()
    blocks = []
    for part in split.split(",") if split else []:
        count, _, times = part.partition("*")  # "6*10": ten stages of 6 blocks
        blocks += [int(count)] * int(times or 1)
    return dict(tp=int(tp), pp=int(pp), v=int(v or 1), blocks=blocks, dp=int(dp), cp=int(cp), zero=int(zero),
                rc=rc, mb=int(mb), acc=int(acc))


def in_words(f: dict) -> str:
    stages = f"{f['pp']} pipeline ranks"
    if f["v"] > 1:
        stages += f" x {f['v']} virtual stages = {f['pp'] * f['v']} stages"
    stages += f", blocks per stage {f['blocks']}" if f["blocks"] else ", equal stages"
    return (f"{f['tp']}-way tensor parallel; {stages}; {f['dp']} replicas; {f['cp']} GPU(s) per sequence; "
            f"ZeRO-{f['zero']}; recompute {f['rc']}; {f['acc']} micro-batches of {f['mb']} sequence(s) per replica")


rows = p.runners_up(3) + list(p.closest_misses)
for c in rows:
    f, lay = read_label(c.layout.label()), c.layout
    check((f["tp"], f["pp"], f["v"], f["dp"], f["cp"], f["zero"], f["rc"], f["mb"], f["acc"])
          == (lay.tp, lay.pp, lay.virtual_stages, lay.dp, lay.cp, lay.zero_stage, lay.recompute, lay.micro_batch,
              lay.grad_accum), f"reading {lay.label()} should give the layout's own fields")
    check(f["tp"] * f["pp"] * f["dp"] * f["cp"] == spec.gpus, f"{lay.label()}: tp x pp x dp x cp should be the GPUs")
    check(f["mb"] * f["acc"] * f["dp"] == spec.global_batch,
          f"{lay.label()}: micro-batch x micro-batches x dp should be the global batch in sequences")
    check(not f["blocks"] or (len(f["blocks"]) == f["pp"] * f["v"] and sum(f["blocks"]) == spec.shape.n_layers),
          f"{lay.label()}: the bracket should list one count per stage, adding up to the model's layers")
split_row = next(c for c in rows if "[" in c.layout.label())
for c in (best, split_row):
    print(f"{c.layout.label()}\n  = {in_words(read_label(c.layout.label()))}")
print(f"{len(rows)} names read; every one: tp x pp x dp x cp = {spec.gpus} GPUs, "
      f"mb x micro-batches x dp = {spec.global_batch} sequences")
second = p.runners_up(3)[1]
ends = read_label(split_row.layout.label())["blocks"]
check(second.layout.pp * second.layout.virtual_stages == 16 and max(ends[0], ends[-1]) < max(ends),
      "pp2v8 should have 16 stages, and an uneven split should give its end stages fewer blocks")
check(best.layout.label().startswith("tp4 pp2 dp8 cp1 Z1") and best.links["tp"] == "NVLink",
      "the 70B plan should be tp4 (inside a node) x pp2 x dp8 with ZeRO-1")
check(second.layout.virtual_stages > 1 and rel(second.step_s, best.step_s) < 0.005,
      "the runner-up should interleave and be within 0.5% of the best: a tie the simpler layout wins")

# %% [markdown]
# **What you should see:** the best layout, `tp4 pp2 dp8 cp1 Z1 rc=selective mb1x128`, keeps tensor
# parallelism inside a node, cuts the model into two pipeline stages and shards only the optimizer
# state over 8 replicas. The interleaved runner-up is within 0.5% of it: the planner calls that a tie
# and picks the simpler layout. The misses show the bracket notation: uneven stages.
#
# The best layout on the 64 GPUs, drawn: one row per (pp, dp) coordinate, one column per TP shard.
# Ranks are numbered tp first, so each row of 4 is a TP group inside one node (8 GPUs: two rows);
# the 8 replicas of a GPU (its dp group) sit 4 ranks apart, and its pipeline partner 32 apart.

# %% tags=["nbval-check-output"]
layout70 = mesh_layout(spec.gpus, tp=best.layout.tp, pp=best.layout.pp, cp=best.layout.cp)
print(layout70.draw())
for dim in ("tp", "dp", "pp"):
    print(f"GPU 0's {dim} group: {layout70.group_ranks(dim)[0]}")
check(layout70.group_ranks("dp")[0] == list(range(0, 32, 4)) and layout70.group_ranks("pp")[0] == [0, 32],
      "GPU 0's replicas should be 4 ranks apart, its pipeline partner 32 away")

# %% [markdown]
# The same planner on the kit's two other jobs (exercise 12 plans cousins of all three): Llama 2 7B
# on one node of 8 A100s, with sequences of 4,096 and of 8,192 tokens.

# %%
others = {name: plan(**kw) for name, kw in SCENARIOS.items() if name != "70b-8-nodes"}
for name, other in others.items():
    print(f"{name:<14} {other.best.layout.label():<36} {other.best.step_s:6.1f} s per step")
p7, p8 = others["7b-one-node"].best.layout, others["7b-8k-context"].best.layout
whole = [c for c in others["7b-8k-context"].ranked if c.layout.cp == 1]
with_tp = min((c for c in whole if c.layout.tp > 1), key=lambda c: c.step_s)
without_tp = min((c for c in whole if c.layout.tp == 1), key=lambda c: c.step_s)
for c in (with_tp, without_tp):
    print(f"7b-8k, sequences whole: {c.layout.label():<36} {c.step_s:6.1f} s per step")
check(p7.tp == p7.pp == p7.cp == 1 and p7.zero_stage == 3, "the 7B job should fit with FSDP (Z3) alone")
check(p8.cp == 2 and all(c.layout.recompute != "none" for c in whole if c.layout.tp == 1)
      and min(with_tp.step_s, without_tp.step_s) > others["7b-8k-context"].best.step_s,
      "at 8K the plan should split sequences (cp2); keeping them whole needs tp or recomputation, and is slower")

# %% [markdown]
# **What you should see:** the 7B model needs no model parallelism: FSDP (`Z3`) over the 8 GPUs
# fits it. At 8K tokens the plan splits every sequence over 2 GPUs (`cp2`, a ring passing keys and
# values). Keeping sequences whole costs either tensor-parallel traffic or recomputing the
# attention scores, and both are slower.
#
# ## 2. The planner's numbers, by hand
#
# The planner adds closed forms (`course_lib/planner/costs.py`, built on `course_lib/estimate`). You
# can compute every one of them yourself. First the inputs, all from published numbers; the cell
# checks they are the ones the planner used.
#
# Then five terms, each in three cells. Write your number in the fill-in cell (`my_... = None`),
# from the text above it and these inputs. The next cell sets it beside the planner's and says
# where a gap comes from. The worked answer follows, collapsed: expand it (click the bar to its
# left) once you have tried. Left `None`, a fill-in cell only reminds you, so Run All still works.

# %%
sh = spec.shape
L, h, V, f_mlp = 80, 8192, 32000, 28672  # Llama 2 70B: layers, width, vocabulary, MLP width (HF config.json)
heads, kv_heads = 64, 8  # grouped-query attention: 8 key/value heads of 128 channels
s, B = 4096, 1024  # tokens per sequence; sequences per step (4Mi tokens / 4096)
GPUS, PEAK = 64, 312e12  # A100 dense bf16: 312 TFLOP/s
MFU, OVERLAP = 0.5, 0.5  # the planner's assumptions: matmuls at 50% of peak; DP traffic hides behind 50% of compute
NVLINK = 600e9 / 2  # A100 NVLink: 600 GB/s per GPU, both directions together -> 300 GB/s each way
IB = 8 * 200e9 / 8 / 8  # 8 x 200 Gb/s HDR InfiniBand per node, bits -> bytes, shared by 8 GPUs: 25 GB/s each
lay = best.layout
tp, pp, dp, v, mb, m = lay.tp, lay.pp, lay.dp, lay.virtual_stages, lay.micro_batch, lay.grad_accum
head_dim = h // heads
print(f"layout {lay.label()}: tp {tp}, pp {pp}, dp {dp}, v {v}, micro-batch {mb}, {m} micro-batches per step")
print(f"NVLink {NVLINK / 1e9:.0f} GB/s, InfiniBand {IB / 1e9:.0f} GB/s per GPU per direction")
check((sh.n_layers, sh.d_model, sh.vocab_size, sh.ffn_dim, sh.n_heads, sh.kv_heads)
      == (L, h, V, f_mlp, heads, kv_heads), "your model inputs should be the planner's Llama 2 70B shape")
check((spec.seq, spec.global_batch, spec.gpus, spec.gpu_peak_flops, spec.mfu, spec.overlap)
      == (s, B, GPUS, PEAK, MFU, OVERLAP), "your job and GPU inputs should be the planner's")
check((spec.intra_node_bytes_per_s, spec.inter_node_bytes_per_s) == (NVLINK, IB),
      "your link bandwidths should be the planner's (datasheet numbers, bytes per second per direction)")

# %% [markdown]
# **A memory line: model state per GPU.** The busiest GPU is on the last pipeline stage: 40 blocks
# with their matrices split over tp (the two norm vectors of each block are kept whole), plus the
# output layer (V x h, split over tp) and the final norm. The first stage holds the embedding table,
# the same size, but no final norm. Bytes per parameter, mixed precision with Adam (the ZeRO paper):
# bf16 weights 2 + bf16 gradients 2 + fp32 master copy 4 + Adam's two moments 8. ZeRO-1 shards only
# the last 12 over the dp replicas.

# %%
my_state_gib = None  # model state on the busiest GPU, in GiB (2**30 bytes): its parameters x bytes per parameter

# %%
planner_state = best.memory["params"] + best.memory["grads"] + best.memory["optimizer"]
show_prediction("model state per GPU", my_state_gib, planner_state / GiB, unit="GiB",
                against="the planner",
                why="count the last stage's parameters (40 blocks split over tp, the norms whole, the output layer), "
                    "then 2 + 2 bytes unsharded and 12 sharded over dp")

# %% jupyter={"source_hidden": true}
attn = 2 * h * h + 2 * h * (kv_heads * head_dim)  # q and o: h x h; k and v: h x (8 heads x 128)
mlp = 3 * h * f_mlp  # SwiGLU: gate, up and down
block = (attn + mlp) / tp + 2 * h  # matrices split over tp, the two RMSNorm weights replicated
n_gpu = L // pp * block + V * h / tp + h  # 40 blocks, the output layer, the final norm
state = n_gpu * (2 + 2 + (4 + 8) / dp)  # ZeRO-1: master weights and moments sharded over dp
print(f"parameters on the busiest GPU: {n_gpu:,.0f}")
check([sh.params_on_rank(tp=tp, pp=pp, stage=r) for r in range(pp)] == [n_gpu - h, n_gpu],
      "your count should be the last stage's, the first stage's the same less the final norm")
print(f"model state by hand: {n_gpu:,.0f} x (2 + 2 + 12/{dp}) B = {state / GiB:.3f} GiB; "
      f"planner: {planner_state / GiB:.3f} GiB (difference {rel(state, planner_state):.1e})")
mem = {k: v / GiB for k, v in best.memory.items() if k != "peak_at"}
print(f"the rest of the planner's peak: activations {mem['activations']:.2f} GiB, gradients summed over "
      f"micro-batches {mem['accumulated_grads']:.2f} GiB, transients {mem['transient']:.2f} GiB; "
      f"peak {mem['peak']:.2f} of {spec.usable_bytes / GiB:.0f} GiB usable")
check(rel(state, planner_state) < 1e-6,
      "your model state should equal the planner's: same formula, so only floating-point rounding (< 1e-6) may differ")

# %% [markdown]
# **A communication time: tensor parallelism.** With sequence parallelism (on whenever tp > 1) each
# layer does 2 all-gathers and 2 reduce-scatters of the activation (s x micro-batch x h, bf16) in the
# forward and as many in the backward. In a ring of tp ranks each rank sends (tp - 1)/tp of the
# buffer per collective. Selective recomputation re-runs only the attention scores, which need no
# traffic. Over NVLink, every layer on the GPU, every micro-batch:

# %%
my_tp_s = None  # seconds per step one GPU spends on tensor-parallel traffic (all layers, all micro-batches)

# %%
show_prediction("TP traffic per step", my_tp_s, best.time["tp"], unit="s",
                against="the planner",
                why="8 collectives per layer and micro-batch, each (tp-1)/tp of one bf16 activation, over NVLink")

# %% jupyter={"source_hidden": true}
message = s * mb * h * 2  # one micro-batch's activation, bf16 bytes
per_layer = 8 * (tp - 1) / tp * message  # 4 all-gathers + 4 reduce-scatters, ring factor (tp-1)/tp
tp_s = per_layer * (L // pp) * m / NVLINK
print(f"per layer and micro-batch: 8 x {tp - 1}/{tp} x {message / 2**20:.0f} MiB = {per_layer / 2**20:.0f} MiB")
print(f"TP time by hand: {per_layer / 2**20:.0f} MiB x {L // pp} layers x {m} micro-batches / {NVLINK / 1e9:.0f} GB/s "
      f"= {tp_s:.3f} s; planner: {best.time['tp']:.3f} s")
check(rel(tp_s, best.time["tp"]) < 1e-6, "your TP time should equal the planner's (same formula; rounding only)")

# %% [markdown]
# **The compute.** Matmul FLOPs of one step, as Narayanan et al. count them: 2 per multiply-add for
# the projections and the MLP, 4 B s² h per layer for the attention scores, the logits; the backward
# costs twice the forward, and selective recomputation runs the scores once more. Divided by the
# GPUs at 50% of peak. The planner also lets the pipeline wait for its busiest stage: the last one
# also computes the logits. That factor is the only difference allowed (under 1%).

# %%
my_compute_s = None  # seconds of matmuls per step: FLOPs of the step / (GPUs x peak x MFU)

# %%
show_prediction("compute per step", my_compute_s, best.time["compute"], unit="s",
                against="the planner",
                why=f"the planner waits for the busiest stage, {best.time['stage_imbalance']:.4f} x the mean: "
                    "a correct count lands a fraction of a percent below it")

# %% jupyter={"source_hidden": true}
proj = 2 * B * s * (h * (h + 2 * kv_heads * head_dim) + h * h + 3 * h * f_mlp)  # q, k, v, o and the MLP
scores = 4 * B * s * s * h  # QK^T and scores x V
logits = 2 * B * s * h * V
flops = 3 * (L * (proj + scores) + logits) + L * scores  # forward + backward (2x), + selective recompute
compute_s = flops / (GPUS * PEAK * MFU)
imbalance = best.time["stage_imbalance"]  # busiest stage's FLOPs / the mean stage's
print(f"FLOPs per step {flops:.4e}; compute by hand {compute_s:.2f} s; planner {best.time['compute']:.2f} s "
      f"(difference {rel(compute_s, best.time['compute']):.2%}; busiest stage / mean stage = {imbalance:.4f})")
check(compute_s < best.time["compute"] and rel(compute_s, best.time["compute"]) < 0.01,
      "your compute should be below the planner's, by less than 1%")
check(rel(compute_s * imbalance, best.time["compute"]) < 1e-6,
      "times the busiest stage's share, your compute should equal the planner's exactly")

# %% [markdown]
# **Another communication time: the data-parallel traffic.** ZeRO-1 synchronises once per step:
# reduce-scatter the bf16 gradients, all-gather the updated bf16 weights, each (dp - 1)/dp of the
# GPU's parameters. Ranks are numbered tp first, then dp, so the 8 replicas of a GPU sit 4 ranks
# apart, on 4 different nodes: the traffic crosses InfiniBand. The planner assumes half the compute
# time can hide it; only the rest is exposed.

# %%
my_dp_s = None  # seconds of ZeRO-1 traffic per step for one GPU, over InfiniBand (before any hiding)

# %%
show_prediction("DP traffic per step", my_dp_s, best.time["dp_total"], unit="s",
                against="the planner",
                why="a reduce-scatter and an all-gather, each (dp-1)/dp of the GPU's bf16 parameters, at 25 GB/s")

# %% jupyter={"source_hidden": true}
dp_bytes = 2 * (dp - 1) / dp * n_gpu * 2
dp_s = dp_bytes / IB
exposed = max(0.0, dp_s - OVERLAP * compute_s * imbalance)
nodes = {(0 + tp * k) // 8 for k in range(dp)}  # GPU 0's replicas: ranks 0, 4, 8, ... 28, 8 GPUs per node
print(f"DP traffic by hand: 2 x {dp - 1}/{dp} x {n_gpu / 1e9:.2f}e9 params x 2 B / {IB / 1e9:.0f} GB/s = {dp_s:.3f} s; "
      f"planner: {best.time['dp_total']:.3f} s ({best.links['dp']})")
print(f"exposed: max(0, {dp_s:.2f} - {OVERLAP} x {compute_s * imbalance:.1f}) = {exposed:.2f} s; "
      f"planner: {best.time['dp_exposed']:.2f} s")
check(len(nodes) == 4 and best.links["dp"] == "inter-node" and rel(dp_s, best.time["dp_total"]) < 1e-6,
      "your DP time over InfiniBand should equal the planner's (same formula; rounding only)")
check(exposed == best.time["dp_exposed"] == 0, "all of ZeRO-1's traffic should hide behind the compute")

# %% [markdown]
# **The pipeline bubble, and the whole step.** In 1F1B each of the pp ranks idles for pp - 1
# micro-batch slots while the pipeline fills and drains, against v x m slots of work: the planner
# takes bubble = (pp - 1)/(v m) of the busy time (Narayanan et al. 2021). Busy time is compute plus
# the TP traffic plus the stage-to-stage sends (one activation forward and one gradient backward per
# micro-batch, 1/tp of it per GPU under sequence parallelism, across nodes here). Then
# step = busy x (1 + bubble) + exposed DP traffic.

# %%
my_bubble_fraction = None  # the bubble as a fraction of the busy time (a number like 0.05)
my_step_s = None  # the whole step, in seconds

# %%
show_prediction("bubble fraction", my_bubble_fraction, best.time["bubble_fraction"],
                against="the planner",
                why=f"pp - 1 idle slots against v x m of work: pp {pp}, v {v}, m {m}")
show_prediction("step time", my_step_s, best.step_s, unit="s",
                against="the planner",
                why="busy = compute x the stage imbalance + TP + stage-to-stage sends; then x (1 + bubble) + exposed DP")

# %% jupyter={"source_hidden": true}
bubble = (pp - 1) / (v * m)
pp_s = 2 * (message / tp) * m * v / IB
busy = compute_s * imbalance + tp_s + pp_s
step = busy * (1 + bubble) + exposed
share = busy * bubble / (busy * (1 + bubble))  # the bubble as a share of the step's pipeline time
print(f"bubble (pp-1)/(v m) = {pp - 1}/({v} x {m}) = {bubble:.4%}; planner {best.time['bubble_fraction']:.4%}")
print(f"as a share of the step: (pp-1)/(v m + pp-1) = {(pp - 1) / (v * m + pp - 1):.4%} (the GPipe paper's form)")
print(f"stage-to-stage sends {pp_s:.3f} s (planner {best.time['pp']:.3f}); bubble {busy * bubble:.3f} s "
      f"(planner {best.time['bubble']:.3f}); step {step:.2f} s (planner {best.step_s:.2f})")
check(bubble == best.time["bubble_fraction"] and rel(pp_s, best.time["pp"]) < 1e-6,
      "your bubble fraction and stage-to-stage sends should equal the planner's")
check(abs(share - (pp - 1) / (v * m + pp - 1)) < 1e-12,
      "(pp-1)/(v m) of the busy time is (pp-1)/(v m + pp-1) of busy + bubble: the two forms say the same")
check(rel(step, best.step_s) < 1e-6, "your step time should equal the planner's")

# %% [markdown]
# All of it in one table:

# %%
by_hand = {"model state per GPU (GiB)": (state / GiB, planner_state / GiB),
           "compute (s)": (compute_s, best.time["compute"]),
           "TP traffic (s)": (tp_s, best.time["tp"]), "DP traffic (s)": (dp_s, best.time["dp_total"]),
           "stage-to-stage sends (s)": (pp_s, best.time["pp"]), "bubble (s)": (busy * bubble, best.time["bubble"]),
           "step (s)": (step, best.step_s)}
yours = {"model state per GPU (GiB)": my_state_gib, "compute (s)": my_compute_s, "TP traffic (s)": my_tp_s,
         "DP traffic (s)": my_dp_s, "bubble (s)": None, "stage-to-stage sends (s)": None, "step (s)": my_step_s}
print(f"{'term':<27} {'yours':>9} {'worked':>9} {'planner':>9} {'difference':>10}")
for name, (mine, theirs) in by_hand.items():
    your = "-" if yours[name] is None else f"{yours[name]:.3f}"
    print(f"{name:<27} {your:>9} {mine:>9.3f} {theirs:>9.3f} {rel(mine, theirs):>10.2%}")
overheads = {"TP": tp_s, "bubble": busy * bubble, "sends": pp_s, "exposed DP": exposed}
check(all(rel(a, b) < 1e-6 for k, (a, b) in by_hand.items() if k != "compute (s)"),
      "every row but compute should agree to rounding")
check(compute_s * imbalance / step > 0.9 and max(overheads, key=overheads.get) == "TP" and bubble < 0.01,
      "compute should be over 90% of the step, TP traffic the largest overhead, the bubble under 1%")

# %% [markdown]
# **What you should see:** every worked row agrees to rounding except compute, where the count is a
# fraction of a percent below the planner's: the pipeline waits for its busiest stage. Compute is
# over 90% of the step; TP traffic is the largest overhead; the bubble is under 1% because 128
# micro-batches keep the two stages busy; and all the DP traffic hides behind compute. A planner you
# can recompute is one you can argue with.
#
# ## 3. Move one input: the network between nodes
#
# 25 GB/s per GPU is 8 x 200 Gb/s HDR InfiniBand per node of 8 GPUs; NDR (the planner's H100
# preset) doubles it. Plan the same job over a range of inter-node bandwidths (`inter_node_gbps`, GB/s
# per GPU), and score the winning layouts at every one of them.
#
# Predict first, with section 2's formulas. Without a pipeline, tp4 leaves 16 replicas; with ZeRO-3
# over them each GPU holds 17.25e9 parameters (all 80 blocks, the embedding and the output layer,
# split over tp 4) and, every micro-batch (32 of them, of 2 sequences), gathers the bf16 weights
# twice and reduce-scatters the bf16 gradients once: your DP formula with 3 passes instead of 2,
# times the micro-batches. From which bandwidth (GB/s per GPU) does that traffic hide behind half
# of the compute (191 s per step, as in section 2)? Above it, tp4 with ZeRO-3 and no pipeline
# can win.

# %%
my_switch_gbps = None  # your prediction: GB/s per GPU from which tp4 ZeRO-3's traffic hides

# %%
BANDWIDTHS = [6.25, 12.5, 25, 50, 100, 200]
bests = {g: plan(**dict(JOB, inter_node_gbps=g)).best for g in BANDWIDTHS}
winners = list(dict.fromkeys(c.layout for c in bests.values()))  # each distinct winner once, in order
scored = {g: [evaluate(make_spec(**dict(JOB, inter_node_gbps=g)), w) for w in winners] for g in BANDWIDTHS}
# From which bandwidth a layout's DP traffic hides behind OVERLAP x its compute: its bytes / (OVERLAP x compute)
hides_from = {w: c.time["dp_total"] * 25e9 / (OVERLAP * c.time["compute"]) / 1e9 for w, c in zip(winners, scored[25])}
print(f"{'GB/s':>6}  {'best layout':<40} {'step s':>7} {'DP traffic s':>12} {'exposed s':>9} {'bubble s':>8}")
for g, c in bests.items():
    print(f"{g:>6}  {c.layout.label():<40} {c.step_s:>7.1f} {c.time['dp_total']:>12.1f} {c.time['dp_exposed']:>9.1f} "
          f"{c.time['bubble']:>8.2f}")
fig, ax = plt.subplots(figsize=(8, 4))
for i, w in enumerate(winners):
    ax.plot(BANDWIDTHS, [scored[g][i].step_s for g in BANDWIDTHS], "o-", label=w.label())
    if hides_from[w] >= BANDWIDTHS[0]:  # ZeRO-1's once-a-step traffic hides far below the sweep
        ax.axvline(hides_from[w], color=ax.get_lines()[-1].get_color(), ls=":", lw=1)
ax.set_xscale("log", base=2)
ax.set_xticks(BANDWIDTHS, [f"{g:g}" for g in BANDWIDTHS])
ax.set_ylim(0.97 * min(c.step_s for c in bests.values()), 1.3 * max(c.step_s for c in bests.values()))
ax.set_xlabel("inter-node bandwidth, GB/s per GPU (dotted: where each layout's DP traffic hides)")
ax.set_ylabel("modelled seconds per step")
ax.set_title("70B on 64 A100s: each winning layout scored at every bandwidth")
ax.legend(fontsize=8)
plt.show()
z3 = [w for w in winners if w.zero_stage == 3]
check(bests[25].layout == best.layout and len(winners) >= 3, "the plan should change at least twice across the sweep")
check(all(bests[g].layout.pp > 1 and bests[g].layout.zero_stage == 1 for g in BANDWIDTHS if g <= 25)
      and all(bests[g].layout.pp == 1 and bests[g].layout.zero_stage == 3 for g in BANDWIDTHS if g >= 50),
      "up to 25 GB/s the plan should keep ZeRO-1 with a pipeline; from 50 GB/s it should be ZeRO-3 without one")
# The rule behind the table: the least-tp ZeRO-3 layout whose traffic hides, else ZeRO-1 with a pipeline.
for g in BANDWIDTHS:
    hidden = [w for w in z3 if hides_from[w] <= g]
    expect = min(hidden, key=lambda w: w.tp) if hidden else winners[0]
    check(bests[g].layout == expect, f"at {g} GB/s the best should be the rule's {expect.label()}")
check(INTERCONNECTS["h100-nvlink-ndr"].inter_node_bytes_per_s == 2 * IB, "NDR should give twice HDR's bandwidth")

# %%
z3_tp4 = next(w for w in winners if w.zero_stage == 3 and w.tp == 4 and w.pp == 1)
n_z3_tp4 = sh.params_on_busiest_rank(tp=4, pp=1)
show_prediction("bandwidth from which tp4 ZeRO-3 hides", my_switch_gbps, hides_from[z3_tp4], unit="GB/s",
                why=f"3 x 15/16 x {n_z3_tp4 / 1e9:.2f}e9 x 2 B x 32 = {3 * 15 / 16 * n_z3_tp4 * 2 * 32 / 1e9:,.0f} GB "
                    f"per step, over 0.5 x {scored[25][winners.index(z3_tp4)].time['compute']:.1f} s; the plan "
                    "switches at the next bandwidth of the sweep above it (50 GB/s), where the exposed traffic is 0")
check(abs(n_z3_tp4 / 1e9 - 17.25) < 0.005 and (z3_tp4.dp, z3_tp4.grad_accum, z3_tp4.micro_batch) == (16, 32, 2),
      "tp4 without a pipeline should hold 17.25e9 parameters per GPU, 16 replicas, 32 micro-batches of 2")
check(25 < hides_from[z3_tp4] < 50, "tp4 ZeRO-3's traffic should hide between 25 and 50 GB/s")

# %% [markdown]
# **What you should see:** up to 25 GB/s the plan does not move; from 50 GB/s it is ZeRO-3 without a
# pipeline, and from 100 GB/s with tp2 instead of tp4. The cell checks the rule behind the table:
# the ZeRO-3 layout with the least tp whose DP traffic hides (right of its dotted line), otherwise
# ZeRO-1 with a pipeline.
#
# **Why, with section 2's formulas.** ZeRO-1 sends little across nodes, once per step, but every
# replica keeps whole bf16 weights and gradients: with tp4 and no pipeline that alone would not fit.
# ZeRO-3 shards them too, and pays for it in traffic: it gathers the weights twice and
# reduce-scatters the gradients on every micro-batch, your DP formula with 3 passes instead of 2,
# times the micro-batches.

# %%
n_tp4 = L * block + 2 * V * h / tp + h  # tp4 without a pipeline: all 80 blocks, the embedding, the output layer
no_pipe = n_tp4 * (2 + 2 + 12 / 16)  # ZeRO-1 over the 16 replicas that are left
print(f"tp4 pp1 dp16 with ZeRO-1: {n_tp4 / 1e9:.2f}e9 params x (2 + 2 + 12/16) B = {no_pipe / GiB:.1f} GiB "
      f"> {spec.usable_bytes / GiB:.0f} GiB usable")
check(tp == 4 and no_pipe > spec.usable_bytes, "tp4 with ZeRO-1 and no pipeline should not fit the model state")
for w in z3:
    c, n = scored[25][winners.index(w)], sh.params_on_busiest_rank(tp=w.tp, pp=w.pp)
    z3_bytes = 3 * (w.dp - 1) / w.dp * n * 2 * w.grad_accum  # 3 ring passes of bf16 per micro-batch
    print(f"{w.label()}: 3 x {w.dp - 1}/{w.dp} x {n / 1e9:.2f}e9 params x 2 B x {w.grad_accum} micro-batches "
          f"= {z3_bytes / 1e9:,.0f} GB per step, {z3_bytes / 25e9:.1f} s at 25 GB/s against "
          f"{OVERLAP * c.time['compute']:.1f} s that can hide; hides behind {OVERLAP} x {c.time['compute']:.1f} s from "
          f"{z3_bytes / (OVERLAP * c.time['compute']) / 1e9:.1f} GB/s; at 25 GB/s {c.time['dp_exposed']:.1f} s "
          f"exposed, TP {c.time['tp']:.2f} s")
    check(rel(z3_bytes / 25e9, c.time["dp_total"]) < 1e-6 and z3_bytes > 1e12,
          "your ZeRO-3 traffic (thousands of GB per step) should be the planner's")
    check(c.time["dp_total"] > OVERLAP * c.time["compute"] and rel(c.time["dp_exposed"], c.time["dp_total"]
                                                                    - OVERLAP * c.time["compute"]) < 1e-6,
          "at 25 GB/s the ZeRO-3 traffic should be more than the half of the compute it may hide behind, the "
          "rest exposed")
    check(c.time["dp_exposed"] > 10 * bests[25].time["bubble"],
          "at 25 GB/s a ZeRO-3 layout should leave far more traffic exposed than the pipeline's bubble")
tp2, tp4 = sorted(z3, key=lambda w: w.tp)
c4 = scored[25][winners.index(tp4)]
check((round(c4.time["dp_total"]), round(OVERLAP * c4.time["compute"], 1), round(c4.time["dp_exposed"], 1),
       round(bests[25].time["bubble"], 2)) == (124, 95.6, 28.5, 1.55),
      "tp4 ZeRO-3 at 25 GB/s: 124 s of traffic, 95.6 s that can hide, 28.5 s exposed, against a 1.55 s bubble")
check(tp2.tp < tp4.tp and scored[25][winners.index(tp2)].time["tp"] < scored[25][winners.index(tp4)].time["tp"],
      "of the two ZeRO-3 winners the smaller tp should send less TP traffic")

# %% [markdown]
# **What you should see:** the no-pipeline ZeRO-1 layout over the memory, and ZeRO-3 sending
# thousands of GB per GPU and step: at 25 GB/s even tp4's traffic takes longer (124 s) than the
# half of the compute it may hide behind (95.6 s), and the exposed rest (28.5 s) costs far more
# than the bubble it would save (1.55 s). Once the network carries it in the shadow of the
# compute, sharding the weights is free: the pipeline goes, with its bubble and its stage
# imbalance; with more bandwidth still, tp2's ZeRO-3 traffic hides too, and it beats tp4 on TP
# traffic.
#
# Try it: a slider (in JupyterLab) that re-plans at any bandwidth.

# %%
def best_at(gbps: float) -> None:
    c = plan(**dict(JOB, inter_node_gbps=gbps)).best
    print(f"{gbps:.1f} GB/s: {c.layout.label()}, {c.step_s:.1f} s per step")


try:
    import ipywidgets as widgets

    widgets.interact(best_at, gbps=widgets.FloatLogSlider(value=25, base=2, min=1, max=8, step=0.25,
                                                          description="GB/s per GPU"))
except ImportError:
    print("ipywidgets is not installed: call best_at(gbps) instead")

# %% [markdown]
# ## 4. The files of a plan
#
# `write_plan` (what `course plan --out DIR` does) writes the layout as configuration for several
# engines, the launch scripts and the budget. Listed, not printed: `print((plan_dir / name).read_text())`
# shows one whole.

# %%
plan_dir = fresh(RUNS / "plan-70b")
paths = write_plan(p, plan_dir)
PURPOSE = {
    "plan.md": "the choice in words: why each degree, the runners-up, how to start it",
    "train.toml": "this kit's trainer config with the layout (python -m course_lib.train)",
    "fsdp_settings.json": "FSDP2 (fully_shard) settings, or why FSDP2 does not fit the plan",
    "budget.json": "memory per GPU by component, tokens/s, days, GPU-hours, SLURM request",
    "launch_torchrun.sh": "torchrun on every node: rendezvous, restarts, --resume auto",
    "job.sbatch": "SLURM: one torchrun agent per node, requeued at the time limit",
    "accelerate_config.yaml": "Hugging Face accelerate's config for the same cluster",
    "launch_accelerate.sh": "accelerate launch with that config",
    "megatron_args.txt": "the layout as Megatron-LM arguments",
    "torchtitan.toml": "the layout as a torchtitan job config",
    "torchtitan_model.py": "registers the plan's exact model with torchtitan",
    "ds_config.json": "DeepSpeed config (data-parallel plans only)",
    "launch_deepspeed.sh": "deepspeed launcher (data-parallel plans only)",
    "hostfile": "DeepSpeed's list of nodes (data-parallel plans only)",
}
for path in sorted(paths):
    print(f"{path.name:<23} {path.stat().st_size:>6,} B  {PURPOSE.get(path.name, '?')}")
names = {path.name for path in paths}
check(names <= set(PURPOSE), f"a file without a purpose line: {sorted(names - set(PURPOSE))}")
check(10 <= len(names) <= 14 and "ds_config.json" not in names,
      "about a dozen files, and none of DeepSpeed's for a tp x pp plan: the kit's DeepSpeed strategy runs "
      "data parallelism only (plan.md says so)")

# %% [markdown]
# The trainer's TOML carries the layout; its key lines (it loads with the trainer's own validator):

# %%
toml_text = (plan_dir / "train.toml").read_text()
print("\n".join(line for line in toml_text.splitlines()
                if line.startswith(("strategy", "micro_batch", "grad_accum", "tp ", "pp ", "dp ", "save_every"))))
cfg = train_config.load(plan_dir / "train.toml")
check((cfg["parallel"]["tp"], cfg["parallel"]["pp"], cfg["parallel"]["dp"], cfg["train"]["strategy"])
      == (lay.tp, lay.pp, lay.dp, "zero1"), "the TOML should carry tp, pp, dp and ZeRO-1 (strategy zero1)")
check((cfg["train"]["micro_batch"], cfg["train"]["grad_accum"]) == (lay.micro_batch, lay.grad_accum),
      "the TOML should carry the micro-batch and the micro-batches per step")

# %% [markdown]
# **The checkpoint interval** (`save_every`) is Young and Daly's: saving costs C seconds, a failure
# loses half an interval on average, so the interval that loses least is tau = sqrt(2 C M), M the
# job's mean time between failures. C: the whole model's weights, fp32 master copy and Adam moments
# (2 + 4 + 8 bytes per parameter) at the planner's assumed 10 GB/s of storage; M: 5,000 h per node
# (the planner's default, from Llama 3's failure reports) over 8 nodes.

# %%
N = sh.num_params()
C = N * (2 + 4 + 8) / 10e9
M = 5000 / 8 * 3600
tau = (2 * C * M) ** 0.5
every = round(tau / best.step_s)
ck = checkpoint_plan(spec, best)
print(f"C = {N / 1e9:.2f}e9 params x 14 B / 10 GB/s = {C:.0f} s; M = {M / 3600:.0f} h; tau = {tau / 3600:.2f} h "
      f"= {every} steps of {best.step_s:.1f} s; planner: every {ck.save_every_steps} steps")
check((spec.mtbf_hours, spec.nodes, spec.storage_bytes_per_s) == (5000, 8, 10e9),
      "your failure rate, node count and storage bandwidth should be the planner's")
check(every == ck.save_every_steps and f"save_every = {every}" in toml_text,
      "your interval in steps should be the planner's and the TOML's save_every")

# %% [markdown]
# **What you should see:** about a dozen files, none of them DeepSpeed's (the kit runs DeepSpeed for
# data-parallel plans only), a TOML whose `[parallel]` lines are the layout's name spelled out, and
# your checkpoint interval in steps equal to its `save_every`.
#
# ## 5. A plan run for real
#
# The plans above are for GPUs this machine does not have. Shrink the job until it fits 4 CPU
# ranks: a 2-block Llama-style model (width 64, a byte vocabulary), sequences of 64 tokens, 8
# sequences a step, on 4 "GPUs" of about 1 MiB each (the planner takes a custom device: memory and
# peak FLOP/s). So little memory forces a split: the planner shards the model state with FSDP
# (ZeRO-3) over 2 replicas *and* cuts each layer in two with tensor parallelism.

# %%
tiny_plan = plan(gpu="custom", gpu_memory_gib=0.001, gpu_tflops=0.05, gpus=4, gpus_per_node=4, tokens="2M",
                 seq=64, global_batch_tokens=8 * 64,
                 shape_overrides=dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256))
tiny = tiny_plan.best
tiny_dir = fresh(RUNS / "plan-tiny")
write_plan(tiny_plan, tiny_dir)
print(f"best: {tiny.layout.label()}, {tiny.memory_total / 2**10:.0f} KiB of {tiny_plan.spec.usable_bytes / 2**10:.0f} "
      f"KiB usable per 'GPU'")
tiny_toml = (tiny_dir / "train.toml").read_text()
print("\n".join(line for line in tiny_toml.splitlines() if line.startswith(("strategy", "tp ", "dp "))))
tl = tiny.layout
check(tl.tp == 2 and tl.zero_stage == 3 and tl.dp == 2,
      f"the tiny job should need tp 2 and FSDP over dp 2 at this memory; the planner chose {tl.label()}")
tiny_cfg = train_config.load(tiny_dir / "train.toml")
check(tiny_cfg["train"]["strategy"] == "fsdp" and tiny_cfg["parallel"]["tp"] == 2,
      "the plan's TOML should run FSDP2 with tp 2 in the kit's trainer")

# %% [markdown]
# The single-node command is what `launch_torchrun.sh` and `course launch` run on one node
# (`course_lib.launchers.commands.torchrun_single_node`). Here it starts 4 CPU ranks on the plan's
# own `train.toml`; only the step count (and with it the warm-up) is overridden.

# %%
tiny_out = fresh(RUNS / "tiny-run")  # fresh: a re-run of this cell trains again
argv = torchrun_single_node(str(tiny_dir / "train.toml"), [f"train.max_steps={TRAIN_STEPS}", "schedule.warmup_steps=2"],
                            Cluster(nodes=1, nproc_per_node=4), str(tiny_out))
print(shell_join(argv))
check("--resume auto" in shell_join(argv), "the command should resume from the newest checkpoint by itself")
argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]  # `torchrun` of this interpreter
ran = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                     timeout=600)
print(next((line for line in ran.stdout.splitlines() if line.startswith("trained")), ran.stderr[-1500:]))
check(ran.returncode == 0, f"the plan's run failed (exit {ran.returncode}): {ran.stderr[-1500:]}")
tiny_rows = [json.loads(line) for line in (tiny_out / "metrics.jsonl").read_text().splitlines() if line.strip()]
check([r["step"] for r in tiny_rows] == list(range(1, TRAIN_STEPS + 1)),
      f"the run should log steps 1..{TRAIN_STEPS} once each")
check(tiny_rows[-1]["loss"] < tiny_rows[0]["loss"], "the loss of the planned run should fall")
plt.figure(figsize=(7, 3.5))
plt.plot([r["step"] for r in tiny_rows], [r["loss"] for r in tiny_rows], "o-")
plt.xlabel("step")
plt.ylabel("loss (nats/token)")
plt.title(f"the plan {tl.label()} on 4 CPU ranks: FSDP2 x DTensor TP")
plt.show()

# %% [markdown]
# **What you should see:** the command line a GPU node would run, with `--resume auto` so a
# restarted job continues from its newest checkpoint, then a falling loss curve from 4 ranks: each
# layer split in two over a tensor-parallel pair of ranks, and each half sharded by FSDP over the two
# pairs. On a cluster only the node count, the GPUs and the NCCL settings differ.
#
# ## Summary
#
# * A plan is a search over legal layouts, filtered by memory and ranked by a step time that is a
#   sum of closed forms: model state in bytes per parameter, ring traffic over the link it crosses,
#   FLOPs at an assumed fraction of peak, a bubble of (pp - 1)/(v m). You can recompute each one.
# * A layout's name is its degrees (tp, pp with virtual stages and split, dp, cp), ZeRO stage,
#   recomputation and micro-batching; the GPUs and the global batch are products of them.
# * Inputs move plans: a faster network makes ZeRO-3's traffic hide, and sharding the weights then
#   beats cutting the model.
# * A plan is also files: configs for several engines, launch scripts that resume by themselves, a
#   checkpoint interval from the failure rate.
#
# ## Where next
#
# * **Exercise 12**: choose the layouts yourself, rule by rule, and hold your choice against the
#   planner's memory and step-time model.
# * **Lab 14**: one distributed run end to end: launched, killed, resumed and profiled.
