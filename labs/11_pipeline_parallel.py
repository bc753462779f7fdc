# %% [markdown]
# # Lab 11 — Pipeline parallelism and 3D parallelism
#
# Pipeline parallelism (PP) cuts the model by depth: stage s holds a contiguous run of blocks on
# rank s, the activations of each micro-batch travel forward from stage to stage, their
# gradients travel back. Nobody holds the whole model, and the only messages are one activation
# per micro-batch between neighbours. The price is the **bubble**: at the start and the end of
# every step some stages have nothing to do. This lab measures every claim about it:
#
# 1. **GPipe vs 1F1B**: timelines drawn from real timings, and the same loss as one process;
# 2. **the bubble** measured against `(pp - 1) / m` as the number of micro-batches m grows;
# 3. **activation memory** per stage: GPipe holds m micro-batches, 1F1B at most pp - stage;
# 4. **interleaving** (torch's `ScheduleInterleaved1F1B`, virtual stages): a smaller bubble for
#    a little more memory;
# 5. **stage imbalance**: the output layer makes the last stage slow; a balanced split fixes it;
# 6. **3D parallelism** (tp x pp x dp) in the trainer, the device mesh drawn;
# 7. **sharded data parallelism** under TP and CP (FSDP and ZeRO from the trainer), memory per
#    rank next to the estimator.
#
# Context parallelism (splitting each sequence: ring attention) has a lab of its own, lab 15:
# take it next.
#
# Ranks are processes on this machine talking over loopback with **gloo** (on GPUs the same code
# uses NCCL). A tiny model computes in well under a millisecond, so timed steps add a
# **simulated compute time** (a sleep after each forward and backward) that stands in for the
# GPU kernels of a bigger model: the schedule, the messages and the waiting are real. The rank
# functions live in `course_lib.labs.lab11_pipeline_parallel` (spawned ranks can only run
# importable code).

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
PP = 4  # pipeline stages, one per rank (sections 1-5)
GLOBAL_BATCH = 16  # sequences of 32 tokens per optimizer step
MICRO = (1, 2, 4, 8, 16)  # section 2: micro-batch counts m
GANTT_M = 8  # sections 1, 3, 4, 5: micro-batches of the drawn step
FWD_S = 0.24  # simulated forward seconds of one stage for the whole global batch (backward: 2x)
TORCH_FWD_S = 0.48  # section 4: the same for torch's schedules (their per-op overhead is larger)
REPEATS = 2  # timed steps per configuration; the least disturbed one is kept
TRAIN_STEPS = 5  # AdamW steps whose losses are compared with one process
TRAINER_STEPS = 20  # sections 6-7: trainer steps per layout

# %%
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib import measure
from course_lib.trainer import config as train_config
from course_lib.kit.checks import check
from course_lib.kit.scratch import fresh
from course_lib.kit.predict import show_prediction
from course_lib.estimate import activation_bytes_first_stage, bubble_fraction
from course_lib.model import ModelConfig
from course_lib.parallel import run_ranks
from course_lib.parallel.mesh import mesh_layout
from course_lib.labs import lab11_pipeline_parallel as lab_runs
from course_lib.parallel.pipeline import balanced_split, compute_order, measure_bubble, stage_costs
from course_lib.train import train

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    MICRO, FWD_S, TORCH_FWD_S, REPEATS, TRAIN_STEPS, TRAINER_STEPS = (1, 2, 4, 8), 0.06, 0.24, 1, 2, 4
torch.set_num_threads(1)  # the single-process references run in this kernel: one thread, like each rank
CFG = lab_runs.model_config()  # 8 blocks, d_model 32, vocabulary 64, 32-token context, tied embeddings
SEQ = CFG.block_size
RUNS = Path(tempfile.mkdtemp(prefix="lab11-"))  # scratch: every file this lab writes
print(f"TinyGPT: {CFG.n_layers} blocks, d_model {CFG.d_model}; {PP} stages of {CFG.n_layers // PP} blocks; "
      f"global batch {GLOBAL_BATCH} x {SEQ} tokens")

# %% [markdown]
# ## 1. GPipe vs 1F1B: the timeline
#
# A step splits the global batch into m micro-batches. Each stage runs 2m compute ops, and the
# two classic schedules differ only in their **order** (`course_lib.parallel.pipeline.compute_order`):
#
# * **GPipe** (Huang et al. 2019): all m forwards, then all m backwards;
# * **1F1B** (PipeDream-Flush, Narayanan et al. 2021): stage s runs `pp - s - 1` warm-up
#   forwards, then alternates one forward and one backward, then drains the backwards.
#
# Every stage of 4 with m = 4 (F: forward, B: backward, then the micro-batch):

# %% tags=["nbval-check-output"]
for schedule in ("gpipe", "1f1b"):
    for s in range(PP):
        ops = " ".join(f"{op[0].upper()}{i}" for op, i in compute_order(schedule, PP, 4, s))
        print(f"{schedule:<6} stage {s}: {ops}")

# %% [markdown]
# Sends are non-blocking (`isend`), receives blocking: a stage waits only for data its schedule
# needs next, which is where idle time comes from. One launch of `PP` ranks runs every
# experiment of sections 1, 2, 3 and 5 (starting ranks is the slow part): for each schedule and
# each m, `TRAIN_STEPS` AdamW steps (their losses) and `REPEATS` timed steps with the simulated
# compute (a micro-batch's forward sleeps `FWD_S / m`, its backward twice that, so the ideal
# step time is the same for every m).
#
# The runner each rank executes is the library's `run_schedule`; its heart is one loop over the
# stage's action list (`stage_actions`: the compute order above with the messages around each op).
# Every message is one `dist.recv` (blocks until the neighbour's tensor is there) or one
# `dist.isend` (returns a handle at once; all handles are waited on at the end of the step):

# %%
import inspect  # noqa: E402

from course_lib.parallel.pipeline.schedules import run_schedule  # noqa: E402

runner_src = inspect.getsource(run_schedule)
print(runner_src[runner_src.index("    for op, i in stage_actions("):runner_src.index("        ops.append((op, i))")])

# %% [markdown]
# A forward's output stays in `outputs` until its backward pops it: `len(outputs)` is the number of
# micro-batches in flight that section 3 counts. The last stage divides its loss by m, so the
# gradients of the m micro-batches add up to the global batch's.

# %% tags=["timing"]
HEAVY = lab_runs.model_config(vocab_size=896)  # section 5: an LM head that costs two blocks
BLOCK_FLOPS = stage_costs(HEAVY, HEAVY.n_layers)[0]  # one block's forward FLOPs, one sequence
jobs = [dict(schedule=s, m=m, timed=REPEATS, fwd_s=FWD_S, train_steps=TRAIN_STEPS if m == GANTT_M else 0)
        for s in ("gpipe", "1f1b") for m in MICRO]
flop_s = FWD_S / (CFG.n_layers // PP) / (BLOCK_FLOPS * GLOBAL_BATCH)  # a block's forward: FWD_S / 2
imbalance_jobs = [dict(schedule="1f1b", m=GANTT_M, timed=REPEATS, model=dict(vocab_size=896), balance=b,
                       flop_s=flop_s) for b in (None, "balanced")]
per_rank = run_ranks(lab_runs.scratch_runs, PP, jobs + imbalance_jobs, GLOBAL_BATCH, threads_per_rank=1,
                     show_output=False, timeout=600)
runs = {(j["schedule"], j["m"]): [r[i] for r in per_rank] for i, j in enumerate(jobs)}
imbalance = {name: [r[len(jobs) + i] for r in per_rank] for i, name in enumerate(("even", "balanced"))}


def best_step(stages):
    """The timed step with the smallest measured bubble (other load on the machine only adds idle
    time), as (per-stage timelines, measure_bubble's dict)."""
    steps = [[st["timed"][k] for st in stages] for k in range(len(stages[0]["timed"]))]
    scored = [(measure_bubble(tl), tl) for tl in steps]
    got, tl = min(scored, key=lambda x: x[0]["measured"])
    return tl, got


ref = lab_runs.reference_losses(CFG, TRAIN_STEPS, GLOBAL_BATCH, GANTT_M)  # one process, same micro-batches
ref_one_pass = lab_runs.reference_losses(CFG, TRAIN_STEPS, GLOBAL_BATCH, 1)
print(f"{'step':>4} {'1 process':>11} {'GPipe':>11} {'1F1B':>11} {'|1F1B - 1 process|':>19}")
for k in range(TRAIN_STEPS):
    g, o = runs["gpipe", GANTT_M][-1]["losses"][k], runs["1f1b", GANTT_M][-1]["losses"][k]
    print(f"{k:>4} {ref[k]:>11.7f} {g:>11.7f} {o:>11.7f} {abs(o - ref[k]):>19.1e}")
worst = max(abs(a - b) / b for s in ("gpipe", "1f1b") for a, b in zip(runs[s, GANTT_M][-1]["losses"], ref))
worst_one = max(abs(a - b) / b for a, b in zip(runs["1f1b", GANTT_M][-1]["losses"], ref_one_pass))
print(f"largest relative difference: {worst:.1e} from one process accumulating the same {GANTT_M} "
      f"micro-batches, {worst_one:.1e} from one pass over the whole batch")

# %%
check(worst < 1e-5, f"the pipeline's losses differ from one process by {worst:.1e} (relative): more than "
      "fp32 rounding. A micro-batch loss not divided by m, or the tied embedding/head gradients not summed "
      "between the first and the last stage, does this.")
check(all(loss is None for st in runs["1f1b", GANTT_M][:-1] for loss in st["losses"]),
      "only the last stage computes the loss; the other stages should report None")
check(worst_one < 1e-6, f"against one pass over the whole batch the losses differ by {worst_one:.1e}: more than "
      "the rounding of summing in another order (around 1e-7)")

# %% [markdown]
# **What you should see:** the losses of both schedules equal one process to about 1e-7: a
# pipeline is gradient accumulation over micro-batches, done by several ranks. (One pass over the
# whole batch adds in another order, and Adam amplifies rounding a little: around 1e-7 as well,
# below 1e-6.)
# Only the last stage holds the loss.
#
# Now the timelines. Each bar is a forward (blue) or backward (orange) of one micro-batch on one
# stage, drawn where it really ran (`time.perf_counter()` stamps, one clock for every process on
# the machine); grey is idle.

# %%
def lanes_of(timelines):
    """Per stage: [(op, micro-batch, chunk, start s, end s)] on the common clock, compute ops only."""
    out = []
    for r in timelines:
        out.append([(e["op"], e["mb"], e.get("stage", r.get("stage", 0)) // PP, r["origin"] + e["start"],
                     r["origin"] + e["end"]) for e in r["events"] if e["op"] in ("forward", "backward")])
    return out


def gantt(ax, timelines, title, t0=None):
    """A Gantt chart of one step: one lane per rank; chunk 1 of an interleaved rank is hatched."""
    lanes = lanes_of(timelines)
    t0 = min(b[3] for lane in lanes for b in lane) if t0 is None else t0
    end = max(b[4] for lane in lanes for b in lane)
    colors = {"forward": "tab:blue", "backward": "tab:orange"}
    for rank, lane in enumerate(lanes):
        ax.barh(rank, (end - t0) * 1e3, left=0, color="0.9", height=0.8)
        for op, mb, chunk, a, b in lane:
            ax.barh(rank, (b - a) * 1e3, left=(a - t0) * 1e3, color=colors[op], height=0.8,
                    edgecolor="white", linewidth=0.5, hatch="//" if chunk else None)
            if (b - a) * 1e3 > 0.025 * (end - t0) * 1e3:
                ax.text((a + b - 2 * t0) / 2 * 1e3, rank, str(mb), ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    return end - t0


fig, axes = plt.subplots(2, 1, figsize=(11, 4.8), sharex=True)
for ax, s in zip(axes, ("gpipe", "1f1b")):
    tl, got = best_step(runs[s, GANTT_M])
    gantt(ax, tl, f"{'GPipe' if s == 'gpipe' else '1F1B'}, {PP} stages, m = {GANTT_M}: "
          f"step {got['span_s'] * 1e3:.0f} ms, bubble {got['measured']:.2f} (formula {got['estimated']:.3f})")
axes[-1].set_xlabel("ms since the step's first op (numbers: micro-batch)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange", "0.9")]
fig.legend(handles, ["forward", "backward", "idle"], loc="lower center", ncol=3, fontsize=8)
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %% [markdown]
# **What you should see:** GPipe's forwards run down the stages as a staircase, then the
# backwards climb back up: a triangle of idle time at the start of each lane (rank 3 waits for
# three forwards before its first) and one at the end (rank 0 waits for the gradient to come
# back). 1F1B starts backwards as soon as the last stage has a loss and then alternates: by the
# formula it has the **same** idle triangles and the same step time. Measured, 1F1B usually idles
# a little less (the two titles, and section 2's bubble columns at m >= 4, held by a check to no
# more than GPipe's): the formula's pp - 1 idle slots are the same for both; what differs is the
# idle time *above* the formula, the fixed cost per op that section 2 measures. The step times
# also carry the machine's other load, so they need not follow at every m. 1F1B does not shrink
# the formula's bubble; section 3 shows what it does shrink.
#
# ## 2. The bubble against `(pp - 1) / m`
#
# Both schedules idle for `pp - 1` forward+backward slots per stage, while the useful work is m
# slots: bubble / ideal time = `(pp - 1) / m` (Narayanan et al. 2021). The GPipe paper quotes the
# share of the *whole* step instead, `(pp - 1) / (m + pp - 1)`: the same idle time, another
# denominator (`bubble_fraction(..., relative_to="total")`). First the formula:

# %% tags=["nbval-check-output"]
print(f"pp = {PP}   {'m':>3} {'bubble / ideal':>15} {'bubble / total':>15}")
for m in (1, 2, 4, 8, 16, 32, 64):
    print(f"{'':<8} {m:>3} {bubble_fraction(PP, m):>15.3f} {bubble_fraction(PP, m, relative_to='total'):>15.3f}")

# %% [markdown]
# Then the measurement, for every m of the launch above. `measure_bubble` sums over stages: idle
# = the step's span minus the stage's forward and backward time (so waiting in a receive, Python
# overhead between ops and the triangles all count), bubble = total idle / total busy.

# %%
bubble = {key: best_step(stages)[1] for key, stages in runs.items()}
print(f"{'m':>3} {'formula':>8} {'GPipe':>8} {'1F1B':>8} {'GPipe step':>11} {'1F1B step':>10} {'ideal step':>11}")
for m in MICRO:
    g, o = bubble["gpipe", m], bubble["1f1b", m]
    print(f"{m:>3} {g['estimated']:>8.3f} {g['measured']:>8.3f} {o['measured']:>8.3f} {g['span_s'] * 1e3:>8.0f} ms "
          f"{o['span_s'] * 1e3:>7.0f} ms {3 * FWD_S * 1e3:>8.0f} ms")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
fine = [x / 4 for x in range(4, 4 * max(MICRO) + 1)]
ax1.plot(fine, [(PP - 1) / m for m in fine], "k-", lw=1, label="(pp - 1) / m")
for s, marker in (("gpipe", "o"), ("1f1b", "s")):
    ax1.plot(MICRO, [bubble[s, m]["measured"] for m in MICRO], marker, ms=7, alpha=0.7, label=f"{s} measured")
    ax2.plot(MICRO, [bubble[s, m]["span_s"] * 1e3 for m in MICRO], marker + "-", alpha=0.7, label=f"{s} measured")
ax2.plot(fine, [3 * FWD_S * 1e3 * (1 + (PP - 1) / m) for m in fine], "k-", lw=1, label="ideal x (1 + (pp-1)/m)")
ax2.axhline(3 * FWD_S * 1e3, color="0.5", ls=":", label="ideal (no bubble)")
ax1.set(xscale="log", yscale="log", xlabel="micro-batches m", ylabel="bubble / ideal time",
        title=f"measured bubble, {PP} stages")
ax2.set(xscale="log", xlabel="micro-batches m", ylabel="step time (ms)", title="step time for the same global batch")
for ax in (ax1, ax2):
    ax.set_xticks(MICRO, [str(m) for m in MICRO])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %%
for (s, m), got in bubble.items():
    check(got["measured"] > 0.9 * got["estimated"] - 0.02,
          f"{s}, m={m}: the measured bubble {got['measured']:.3f} is below the formula {got['estimated']:.3f}; "
          "a pipeline cannot idle less than (pp - 1) slots per stage. Are the stages' timelines complete?")
    check(got["measured"] < got["estimated"] + 0.25 + 0.15 * got["estimated"],
          f"{s}, m={m}: the measured bubble {got['measured']:.3f} is far above the formula {got['estimated']:.3f}; "
          "the machine may be very busy (run the launch again), or a stage waits for something the schedule "
          "does not need")
check(bubble["1f1b", MICRO[-1]]["measured"] < bubble["1f1b", 1]["measured"] / 3,
      "more micro-batches should shrink the bubble several-fold")
if 2 in MICRO:
    check(all(bubble[s, 2]["measured"] < 0.6 * bubble[s, 1]["measured"] for s in ("gpipe", "1f1b")),
          "going from 1 to 2 micro-batches should about halve the bubble, as the formula does")
excess = {s: bubble[s, MICRO[-1]]["measured"] - bubble[s, MICRO[-1]]["estimated"] for s in ("gpipe", "1f1b")}
print("above the formula at m = %d: " % MICRO[-1] + ", ".join(f"{s} +{e:.3f} ({e / bubble[s, MICRO[-1]]['estimated']:+.0%})"
                                                         for s, e in excess.items()))
check(all(e > 0 for e in excess.values()),
      f"at m = {MICRO[-1]} the measured bubble should sit above the formula: the fixed cost per op does not "
      f"shrink with the micro-batch; measured {excess}")
if not SMOKE:  # the smoke run's shorter simulated compute leaves the fixed cost per op a larger share
    check(all(e < 0.2 for e in excess.values()),
          f"at m = {MICRO[-1]} the excess over the formula should stay under a fifth of the ideal time; measured "
          f"{excess} (a busy machine adds idle time: run the launch again)")
    check(all(bubble["1f1b", m]["measured"] <= bubble["gpipe", m]["measured"] + 0.05 for m in MICRO if m >= 4),
          "1F1B should idle no more than GPipe (the formula gives both the same bubble)")

# %% [markdown]
# **What you should see:** the measured points on the line at small m, GPipe and 1F1B alike: 3.0 at
# m = 1 (one stage works, three wait), about halving from m = 1 to 2. At large m they stop halving
# and sit above the line by a tenth of the ideal time or more (the printed line; under a fifth, by
# the check), which at m = 16 is a large share of the formula's small value, more for GPipe than
# for 1F1B: each micro-batch's compute is short there,
# while the fixed cost per op (a receive, Python between ops, the gloo thread waiting for one of
# 2 shared cores) is not, so the measured bubble approaches that floor instead of zero. The
# step time falls toward the ideal. So why not m = 1000? Each micro-batch gets smaller: on a GPU a
# micro-batch of one sequence uses the hardware badly, and GPipe's memory grows with m
# (section 3). Practice: m >= 4 pp or so, and interleaving (section 4).
#
# ## 3. Activation memory per stage
#
# A stage keeps each micro-batch's activations from its forward until its backward. GPipe runs
# all m forwards first, so every stage holds m at its peak. Under 1F1B stage s holds at most
# `min(m, pp - s)`: its warm-up forwards, then one in, one out. The runner counts the
# micro-batches in flight and the bytes autograd saves for them (a saved-tensors hook, each
# storage once, parameters excluded; as lab 01). Korthikanti et al. 2022 give the first stage's
# peak under 1F1B as pp micro-batches of `n_layers / pp` layers, i.e. **all n_layers' worth,
# whatever pp** (`activation_bytes_first_stage`; its per-layer bytes described for TinyGPT in fp32
# by `measure.tinygpt_activation_kwargs`). The estimator counts the blocks; each micro-batch in
# flight also keeps its token ids and position ids (8 bytes per id, int64), added here.

# %%
def stage0_estimate(schedule, m):
    kw = measure.tinygpt_activation_kwargs(CFG, seq_len=SEQ, micro_batch=GLOBAL_BATCH // m)
    layers = activation_bytes_first_stage(n_layers=CFG.n_layers, pp=PP, schedule=schedule, micro_batches=m, **kw)
    in_flight = m if schedule == "gpipe" else min(m, PP)
    ids = in_flight * (8 * SEQ * GLOBAL_BATCH // m + 8 * SEQ)
    return layers, ids


KIB = 1024
print(f"m = {GANTT_M}, per stage: micro-batches in flight and saved activation KiB at the peak")
print(f"{'':<8}" + "".join(f"{'stage ' + str(s):>16}" for s in range(PP)))
for s in ("gpipe", "1f1b"):
    mem = [st["memory"] for st in runs[s, GANTT_M]]
    print(f"{s:<8}" + "".join(f"{x['peak_in_flight']:>4} {x['peak_activation_bytes'] / KIB:>9.1f} KiB" for x in mem))
print(f"{'1f1b rule':<8}" + "".join(f"{min(GANTT_M, PP - s):>4} = min(m, pp - s)" for s in range(PP)))
print("\nstage 0 against the estimator, every m:")
print(f"{'m':>3} {'schedule':>8} {'in flight':>9} {'measured B':>11} {'estimate B':>11} {'+ ids B':>8} "
      f"{'difference':>10}")
mem_rows = []
for m in MICRO:
    for s in ("gpipe", "1f1b"):
        got = runs[s, m][0]["memory"]
        layers, ids = stage0_estimate(s, m)
        mem_rows.append((s, m, got, layers + ids))
        print(f"{m:>3} {s:>8} {got['peak_in_flight']:>9} {got['peak_activation_bytes']:>11,} {layers:>11,.0f} "
              f"{ids:>8,} {got['peak_activation_bytes'] - layers - ids:>10,.0f}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
xs = range(PP)
for off, s in ((-0.2, "gpipe"), (0.2, "1f1b")):
    ax1.bar([x + off for x in xs], [st["memory"]["peak_activation_bytes"] / KIB for st in runs[s, GANTT_M]],
            width=0.38, label=s)
ax1.set(xticks=list(xs), xlabel="stage", ylabel="saved activations at the peak (KiB)",
        title=f"m = {GANTT_M}: GPipe holds m, 1F1B pp - stage")
for s, marker in (("gpipe", "o"), ("1f1b", "s")):
    ax2.plot(MICRO, [runs[s, m][0]["memory"]["peak_activation_bytes"] / KIB for m in MICRO], marker + "-",
             label=f"{s} measured")
    ax2.plot(MICRO, [sum(stage0_estimate(s, m)) / KIB for m in MICRO], "k+", ms=12)
ax2.plot([], [], "k+", label="estimate")
ax2.set(xscale="log", xlabel="micro-batches m (same global batch)", ylabel="stage 0 peak (KiB)",
        title="stage 0: GPipe stays at the whole batch, 1F1B falls")
ax2.set_xticks(MICRO, [str(m) for m in MICRO])
ax2.xaxis.set_minor_locator(plt.NullLocator())
for ax in (ax1, ax2):
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %%
for s, m, got, want in mem_rows:
    check(got["peak_activation_bytes"] == want, f"{s}, m={m}: stage 0 saved {got['peak_activation_bytes']:,} B at "
          f"its peak but the estimate (blocks + ids) is {want:,.0f} B: either the micro-batches in flight are "
          "not what the schedule says, or the model saves something the accounting does not know")
for s in range(PP):
    check(runs["1f1b", GANTT_M][s]["memory"]["peak_in_flight"] == min(GANTT_M, PP - s),
          f"1F1B stage {s} should hold min(m, pp - s) = {min(GANTT_M, PP - s)} micro-batches at most")
    check(runs["gpipe", GANTT_M][s]["memory"]["peak_in_flight"] == GANTT_M, "GPipe should hold all m micro-batches")

# %% [markdown]
# **What you should see:** the estimate equals the measurement to the byte. GPipe's stage 0 holds
# the activations of the *whole* global batch whatever m is (m micro-batches of B/m sequences),
# so micro-batching buys it no memory. 1F1B holds `min(m, pp - s)` micro-batches: with m = 8 on
# stage 0, 4 of 8, and less the more micro-batches there are; the later stages hold fewer still.
# That is why 1F1B replaced GPipe: the same bubble, and memory bounded by pp instead of m, which
# frees m to grow and shrink the bubble. The last stage's bars are taller than its count
# suggests: it also keeps the fp32 logits for the loss (vocabulary-wide, one per token).
#
# ## 4. Interleaving: torch's `ScheduleInterleaved1F1B`
#
# Narayanan et al. 2021 cut the model into `pp x v` smaller stages and give rank r the stages
# r, r + pp, ... (v "virtual stages" or model chunks per rank). A micro-batch now visits every
# rank v times; each visit is 1/v of the work, so the warm-up and drain triangles are v times
# shorter: bubble `(pp - 1) / (v m)`. The price: v times as many messages, and a little more
# memory (the first rank holds `1 + (pp - 1) / (pp v)` times 1F1B's activations, Korthikanti et
# al. 2022). This is the production path: `course_lib.parallel.pipeline.torch_pipelining` hands
# our stages to `torch.distributed.pipelining` (`Schedule1F1B`, and `ScheduleInterleaved1F1B`
# with v = 2: 8 stages of one block on 4 ranks). Torch runs the schedule itself, so the lab
# records its timeline with an identity autograd function at each stage's output (which also
# adds the simulated compute, `TORCH_FWD_S` per rank for the whole batch, split over its chunks:
# longer than section 1's, because torch spends more time per op than our runner) and counts the
# live saved bytes.

# %% tags=["timing"]
torch_jobs = [dict(schedule=s, v=v, m=GANTT_M, train_steps=TRAIN_STEPS, timed=REPEATS, fwd_s=TORCH_FWD_S)
              for s, v in (("1f1b", 1), ("interleaved", 2))]
torch_res = run_ranks(lab_runs.torch_runs, PP, torch_jobs, GLOBAL_BATCH, threads_per_rank=1, show_output=False,
                      timeout=600)
tr = {j["schedule"]: [r[i] for r in torch_res] for i, j in enumerate(torch_jobs)}
for name, stages in tr.items():
    print(f"torch {name:<12} stages per rank: {[st['stages'] for st in stages]}; "
          f"losses {['%.7f' % x for x in stages[-1]['losses']]}")
print(f"{'one process':<18} {'':<34} losses {['%.7f' % x for x in ref]}")


def torch_best(stages):
    steps = [[st["timed"][k] for st in stages] for k in range(len(stages[0]["timed"]))]
    scored = [(lab_runs.torch_bubble(tl, PP), tl) for tl in steps]
    return min(scored, key=lambda x: x[0]["measured"])[::-1]


fig, axes = plt.subplots(2, 1, figsize=(11, 4.8), sharex=True)
torch_bubbles = {}
for ax, (name, stages) in zip(axes, tr.items()):
    tl, got = torch_best(stages)
    v = 2 if name == "interleaved" else 1
    est = bubble_fraction(PP, GANTT_M, schedule=name, virtual_stages=v)
    torch_bubbles[name] = (got, est)
    gantt(ax, tl, f"torch {name} (v = {v}), m = {GANTT_M}: step {got['span_s'] * 1e3:.0f} ms, bubble "
          f"{got['measured']:.2f} (formula {est:.3f})")
axes[-1].set_xlabel("ms since the step's first op (numbers: micro-batch; hatched: the rank's second chunk)")
fig.legend(handles, ["forward", "backward", "idle"], loc="lower center", ncol=3, fontsize=8)
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %% [markdown]
# The memory side, rank 0 (the busiest) against the estimator. "Layers in flight" is counted by
# the recorder: blocks' worth of micro-batch activations held at once (1F1B: pp micro-batches of
# 2 blocks = 8).

# %%
print(f"{'schedule':<12} {'bubble':>7} {'formula':>8} {'step ms':>8} {'layers in flight':>17} {'Korthikanti':>12} "
      f"{'saved KiB':>10} {'estimate KiB':>13}")
mem_torch = {}
kw_m = measure.tinygpt_activation_kwargs(CFG, seq_len=SEQ, micro_batch=GLOBAL_BATCH // GANTT_M)
for name, stages in tr.items():
    v = 2 if name == "interleaved" else 1
    est_bytes = activation_bytes_first_stage(n_layers=CFG.n_layers, pp=PP, virtual_stages=v, schedule=name,
                                             micro_batches=GANTT_M, **kw_m)
    est_layers = CFG.n_layers * (1 + (PP - 1) / (PP * v)) if v > 1 else CFG.n_layers
    got, est = torch_bubbles[name]
    mem_torch[name] = (stages[0]["peak_in_flight_layers"], est_layers, stages[0]["peak_saved_bytes"], est_bytes)
    print(f"{name:<12} {got['measured']:>7.3f} {est:>8.3f} {got['span_s'] * 1e3:>8.0f} "
          f"{stages[0]['peak_in_flight_layers']:>17} {est_layers:>12g} {stages[0]['peak_saved_bytes'] / KIB:>10.1f} "
          f"{est_bytes / KIB:>13.1f}")

# %%
for name, stages in tr.items():
    rel = max(abs(a - b) / b for a, b in zip(stages[-1]["losses"], ref))
    check(rel < 1e-5, f"torch {name}: losses differ from one process by {rel:.1e}; the schedule must compute "
          "the same gradients as gradient accumulation")
check(torch_bubbles["interleaved"][0]["measured"] < torch_bubbles["1f1b"][0]["measured"],
      "the interleaved schedule should idle less than 1F1B: its warm-up and drain are half as long. If the "
      "machine is very busy, per-op overhead can hide that: run the launch again")
for name, (layers, est_layers, got_b, est_b) in mem_torch.items():
    check(layers == est_layers, f"torch {name}: rank 0 held {layers} layers' worth of activations, the formula "
          f"says {est_layers:g}")
    check(abs(got_b - est_b) < 0.01 * est_b, f"torch {name}: rank 0's saved bytes {got_b:,} should be within 1% of "
          f"the estimate {est_b:,.0f} (the rest is token and position ids)")

# %% [markdown]
# **What you should see:** the same losses as one process for both torch schedules. In the
# interleaved chart each rank runs twice as many bars of half the length (hatched: its second
# chunk, stages 4-7), and the idle triangles are about half as wide: a shorter step, the measured
# bubble near `(pp - 1) / (2 m)` (the measurement counts torch's own overhead between ops and the
# real backward compute as idle, so it sits a little above). Rank 0 holds 11 layers' worth of
# activations instead of 8 (`8 x (1 + 3/8)`), exactly Korthikanti's factor, and the bytes follow
# (the small rest: token and position ids). Interleaving trades 37% more activation memory on the
# first rank, and twice the messages, for half the bubble.
#
# ## 5. Stage imbalance: the output layer
#
# The bubble formula assumes equal stages. A real model's ends are not blocks: the first stage
# also looks up the embeddings (almost no FLOPs) and the last one runs the LM head, a
# `d_model x vocab` matmul on every token, and the loss. A synchronous pipeline runs at the pace
# of its slowest stage. `stage_costs` counts each stage's forward FLOPs (blocks, plus the head
# on the last), and `balanced_split` picks the split that minimises the largest.
#
# Count it yourself first. Per token, a GPT-2 block's forward costs about `24 h^2 + 4 s h` FLOPs
# (`h` = d_model: the projections and the 4h-wide MLP, then attention's scores and weighted sum
# over `s` tokens), and the head `2 h V` (V = vocabulary). GPT-2 small has h = 768, s = 1024,
# V = 50257. And our lab model: 8 equal blocks and a head that costs 2 blocks, on 4 stages. Which
# contiguous split makes the slowest stage cheapest?

# %%
my_gpt2_head_in_blocks = None  # your count: GPT-2 small's head FLOPs / one block's FLOPs
my_balanced_split = None  # your split of the lab model: blocks per stage, e.g. [2, 2, 2, 2]

# %% [markdown]
# The library's count, for GPT-2 small and two bigger vocabularies, in units of one block:

# %% tags=["nbval-check-output"]
shapes = {"GPT-2 small (V 50257, 1K context)": ModelConfig.preset("gpt2-small"),
          "Llama-2 7B (V 32000, 4K)": ModelConfig.preset("llama2-7b"),
          "Llama-3 8B shape (V 128256, 8K)": ModelConfig.preset("llama2-7b", vocab_size=128256, d_ff=14336,
                                                                 n_kv_heads=8, block_size=8192)}
print(f"{'model':<34} {'head':>5} {'even split':>13} {'stage costs':>22} {'balanced':>13} {'stage costs':>22}")
for name, c in shapes.items():
    blk = stage_costs(c, c.n_layers)[0]
    head = stage_costs(c, c.n_layers)[-1] / blk - 1
    even, bal = [x / blk for x in stage_costs(c, PP)], [x / blk for x in stage_costs(c, PP, "balanced")]
    fmt = lambda xs: "[" + ", ".join(f"{x:.1f}" for x in xs) + "]"  # noqa: E731
    print(f"{name:<34} {head:>5.2f} {str([c.n_layers // PP] * PP):>13} {fmt(even):>22} "
          f"{str(balanced_split(c, PP)):>13} {fmt(bal):>22}")
gpt2 = shapes["GPT-2 small (V 50257, 1K context)"]
gpt2_head = stage_costs(gpt2, gpt2.n_layers)[-1] / stage_costs(gpt2, gpt2.n_layers)[0] - 1
print()
show_prediction("GPT-2 small's head, in blocks", my_gpt2_head_in_blocks, gpt2_head,
                why="24 h^2 + 4 s h = 17.3 M FLOPs per token for a block, 2 h V = 77.2 M for the head: 4.46 "
                    "(the embedding lookup and the norms are not counted: they are not matmuls)")
show_prediction("the lab model's balanced split", my_balanced_split, balanced_split(HEAVY, PP),
                why="the slowest stage can do no better than 3 blocks of work (10 blocks over 4 stages); "
                    "the head stage then gets 1 block, and of the splits reaching 3 the library takes "
                    "the most even, giving the earlier stages fewer blocks")
check(abs(gpt2_head - 4.46) < 0.01, f"GPT-2 small's head should cost 4.46 blocks, the count gives {gpt2_head:.2f}")

# %% [markdown]
# GPT-2 small's head costs 4.5 blocks (a 50K vocabulary on a 768-wide model): with 3 blocks per
# stage the last stage does 7.5 blocks of work while the others do 3. The balanced split moves
# two blocks off it. A Llama-2 7B head is about half a block, not worth moving a block for; the
# 128K vocabulary of the Llama-3 shape makes it almost two, and moving one block helps a little.
# Our lab model gets a vocabulary of 896, so its head costs two blocks, and the launch of section
# 1 ran it with the even split `[2, 2, 2, 2]` and the balanced one, each stage sleeping in
# proportion to its FLOPs.

# %%
print(f"{'split':<9} {'blocks':<14} {'costs (blocks)':<22} {'step ms':>8} {'bubble':>7} {'formula':>8}")
imb = {}
for name, stages in imbalance.items():
    tl, got = best_step(stages)
    imb[name] = (tl, got)
    costs = [x / BLOCK_FLOPS for x in stage_costs(HEAVY, PP, stages[0]["balance"])]
    print(f"{name:<9} {str(stages[0]['balance']):<14} {str([round(x, 2) for x in costs]):<22} "
          f"{got['span_s'] * 1e3:>8.0f} {got['measured']:>7.3f} {got['estimated']:>8.3f}")
# ideal step, in block-units of forward+backward: the first micro-batch crosses every stage (the sum
# of the costs: fill and drain), the other m - 1 follow at the pace of the slowest stage
ideal_units = {name: sum(c) + (GANTT_M - 1) * max(c) for name, c in
               ((n, [x / BLOCK_FLOPS for x in stage_costs(HEAVY, PP, st[0]["balance"])]) for n, st in imbalance.items())}
ideal_cut = 1 - ideal_units["balanced"] / ideal_units["even"]
measured_cut = 1 - imb["balanced"][1]["span_s"] / imb["even"][1]["span_s"]
print(f"the balanced split shortens the step by {measured_cut:.0%} measured, {ideal_cut:.0%} ideally "
      f"(sum of the stage costs + (m - 1) x the slowest: {ideal_units['even']:g} -> {ideal_units['balanced']:g} "
      f"block-units at m = {GANTT_M})")
fig, axes = plt.subplots(2, 1, figsize=(11, 4.8), sharex=True)
for ax, (name, (tl, got)) in zip(axes, imb.items()):
    gantt(ax, tl, f"{name} split {imbalance[name][0]['balance']}: step {got['span_s'] * 1e3:.0f} ms, "
          f"bubble {got['measured']:.2f}")
axes[-1].set_xlabel("ms since the step's first op")
fig.legend(handles, ["forward", "backward", "idle"], loc="lower center", ncol=3, fontsize=8)
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %%
check(imbalance["even"][0]["balance"] == [2, 2, 2, 2] and imbalance["balanced"][0]["balance"] == [2, 2, 3, 1],
      "the balanced split of 8 blocks with a two-block head on 4 stages should be [2, 2, 3, 1]")
check(imb["even"][1]["span_s"] > 1.1 * imb["balanced"][1]["span_s"],
      "the even split's step should be clearly longer: its last stage does 4 blocks of work per micro-batch "
      "where the balanced split's slowest stage does 3")
check(imb["even"][1]["measured"] > imb["balanced"][1]["measured"],
      "the even split should idle more: three stages wait for the head stage every micro-batch")
if not SMOKE:
    check(0.5 * ideal_cut < measured_cut < ideal_cut + 0.08,
          f"the measured shortening {measured_cut:.0%} should be near the ideal {ideal_cut:.0%}")
check(abs(ideal_cut - 0.18) < 0.005, f"the ideal shortening should be 18% (38 -> 31 block-units), got {ideal_cut:.1%}")

# %% [markdown]
# **What you should see:** with the even split the last lane is nearly solid, with long ops, and
# ranks 0-2 show gaps between every pair of ops: they finish their 2-block work and wait for
# the 4-block stage, micro-batch after micro-batch. The measured bubble is well above the formula,
# which assumes equal stages. The balanced split `[2, 2, 3, 1]` (costs 2 : 2 : 3 : 3) shortens
# the step clearly, by the printed share: close to the ideal 18% (the old step is 38 / 31 = 1.23
# times the new one: the "about 1.2x" lab 12 quotes for the same experiment). Not by a quarter, although the
# slowest stage went from 4 blocks of work to 3: the fill and the drain (the first micro-batch
# crossing all stages, 10 blocks' worth either way) do not shrink. It is not
# perfect: 10 blocks of work cannot split into 4 equal whole-block stages, so ranks 0-1 still
# wait a little. (Megatron-LM and torchtitan offer the same knob: uneven layer counts at the
# ends.)
#
# ## 6. 3D parallelism: tp x pp x dp in the trainer
#
# Large runs combine three forms: **tensor** parallelism (tp, lab 10) splits each layer's matrices
# and all-reduces activations twice per layer, **pipeline** parallelism splits the layers, and
# **data** parallelism replicates the whole arrangement. `course_lib.parallel.mesh` lays the
# ranks out with tp innermost (TP peers are adjacent ranks, i.e. on the same node, on NVLink),
# then dp, then pp outermost (pipeline messages are the smallest: they can cross nodes). On 8
# GPUs, tp 2 x pp 2 x dp 2:

# %% tags=["nbval-check-output"]
TRAIN_CFG = Path(course_lib.__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"
tiny = train_config.build_model_config(train_config.load(TRAIN_CFG))
layout8 = mesh_layout(8, tp=2, pp=2)
print(layout8.draw(layout8.describe(n_layers=tiny.n_layers, n_heads=tiny.n_heads, vocab_size=tiny.vocab_size)))
print()
for dim in ("tp", "dp", "pp"):
    print(f"{dim} groups: {layout8.group_ranks(dim)}")

# %% [markdown]
# The same mesh as a picture of who talks to whom, and what travels on each link:

# %%
def holds(layout, r, stage_names):
    c = layout.coords_of(r)
    heads = tiny.n_heads // layout.tp
    return f"{stage_names[c['pp']]}\nheads {c['tp'] * heads}-{(c['tp'] + 1) * heads - 1}"


fig, ax = plt.subplots(figsize=(7.5, 5.2))
lab_runs.draw_data_flow(ax, layout8, {r: holds(layout8, r, ["emb, block 0", "block 1, head"]) for r in range(8)},
                        ("tp", "pp", "dp"), "tp 2 x pp 2 x dp 2: columns are pipeline stages")
fig.tight_layout()
plt.show()

# %% [markdown]
# Our machine gets 4 ranks, so the trainer runs each pair of dimensions (one of the three is 1):
# `parallel.tp = 2, parallel.pp = 2` (a model replica on 4 ranks), `pp = 2` with dp 2, `tp = 2`
# with dp 2, each for `TRAINER_STEPS` steps of the tiny config on the same global batch as one
# process (`train.strategy = "ddp"` is the data-parallel dimension; each dp replica reads half of
# each micro-batch; the `train.grad_accum` micro-batches are the pipeline's). The mesh of the
# first layout, and what each rank holds:

# %% tags=["nbval-check-output"]
layout4 = mesh_layout(4, tp=2, pp=2)
print(layout4.draw(layout4.describe(n_layers=tiny.n_layers, n_heads=tiny.n_heads, vocab_size=tiny.vocab_size)))

# %%
def trainer_cfg(*sets):
    base = ["train.progress=false", "train.peak_flops=1e12", "train.metrics_flush_s=0", "train.grad_accum=2",
            f"train.max_steps={TRAINER_STEPS}", f"schedule.warmup_steps={max(1, TRAINER_STEPS // 10)}",
            "checkpoint.async_save=false"]
    return train_config.load(TRAIN_CFG, base + list(sets))


def losses_of(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


MB = 8  # sequences per micro-batch of one process; a dp replica of 2 reads 4
LAYOUTS = {"tp2 x pp2 (dp 1)": ["parallel.tp=2", "parallel.pp=2", f"train.micro_batch={MB}"],
           "pp2 x dp2 (1F1B)": ["parallel.pp=2", f"train.micro_batch={MB // 2}"],
           "tp2 x dp2": ["parallel.tp=2", f"train.micro_batch={MB // 2}"]}
if SMOKE:
    LAYOUTS = dict(list(LAYOUTS.items())[:1])
single = train(trainer_cfg(f"train.micro_batch={MB}"), fresh(RUNS / "single"))  # one process, in this kernel
single_losses = losses_of(RUNS / "single")
jobs3d = [(trainer_cfg("train.strategy=ddp", *sets), str(fresh(RUNS / f"layout{i}")))
          for i, sets in enumerate(LAYOUTS.values())]
res3d = run_ranks(lab_runs.train_layouts, 4, jobs3d, threads_per_rank=1, show_output=False, timeout=600)
print(f"{'layout':<20}" + "".join(f"{'rank ' + str(r) + ' (pp,dp,tp)':>20}" for r in range(4)))
for i, name in enumerate(LAYOUTS):
    coords = [res3d[r][i]["coords"] for r in range(4)]
    print(f"{name:<20}" + "".join(f"{str((c['pp'], c['dp'], c['tp'])):>20}" for c in coords))
print("\nrank 0's groups (global ranks along each dimension):")
for i, name in enumerate(LAYOUTS):
    g = res3d[0][i]["groups"]
    print(f"{name:<20} tp {g['tp']}, pp {g['pp']}, dp {g['dp']}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
steps = range(1, len(single_losses) + 1)
ax1.plot(steps, single_losses, "k-", lw=4, alpha=0.3, label="1 process")
rel3d = {}
for i, name in enumerate(LAYOUTS):
    got = losses_of(jobs3d[i][1])
    rel3d[name] = [abs(a - b) / b for a, b in zip(got, single_losses)]
    ax1.plot(steps, got, lw=1, label=f"{name}, 4 ranks")
    ax2.semilogy(steps, [max(r, 1e-10) for r in rel3d[name]], "o", ms=3, alpha=0.7, label=name)
ax1.set(xlabel="step", ylabel="loss (nats/token)", title="trainer: model-parallel layouts vs one process")
ax2.axhline(1e-4, color="red", ls=":", label="tolerance 1e-4")
ax2.set(xlabel="step", ylabel="relative difference", ylim=(5e-11, 1e-3),
        title="|layout - 1 process| / 1 process (bottom row: equal)")
for ax in (ax1, ax2):
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()
for name, r in rel3d.items():
    print(f"{name:<20} max relative loss difference over {TRAINER_STEPS} steps: {max(r):.1e}")

# %%
for name, r in rel3d.items():
    check(max(r) <= 1e-4, f"{name}: the losses differ from one process by up to {max(r):.1e} (relative). TP shards, "
          "pipeline micro-batches and dp replicas must compute the same global-batch gradient; look for a dp "
          "mean or a tied-embedding sum that is missing")
first = [res3d[r][0]["coords"] for r in range(4)]
check([c["tp"] for c in first] == [0, 1, 0, 1] and [c["pp"] for c in first] == [0, 0, 1, 1],
      "tp should be the innermost dimension: ranks 0,1 are TP peers on stage 0, ranks 2,3 on stage 1")

# %% [markdown]
# **What you should see:** every layout on the one-process curve, relative differences around
# 1e-7 (the same arithmetic, added in another order). In the tp2 x pp2 run ranks 0 and 1 are the
# two tensor-parallel halves of stage 0 (embeddings and block 0), ranks 2 and 3 of stage 1 (block
# 1, head and loss): each rank holds a quarter of the model. The groups are what each rank talks
# to: its TP peer every layer, its pipeline neighbour every micro-batch, its dp peer once per step.
# How to choose the sizes for a real model: tp up to the GPUs of one node (activations cross the
# link twice per layer), pp until the model state fits (with m >= 4 pp micro-batches to keep the
# bubble small), dp for the rest (`course plan` does this arithmetic).
#
# ## 7. Sharding the data-parallel dimension: FSDP and ZeRO under TP and CP
#
# Section 6 replicated every weight and optimizer state across the dp ranks. Real jobs shard that
# dimension too: **FSDP2** (`train.strategy = "fsdp"`, ZeRO-3: weights, gradients and Adam state)
# over dp on a tensor-parallel model built from DTensors (torch's distributed tensor: one logical
# tensor whose shards live on several ranks, each shard knowing how it was cut; lab 10's
# production path), the way torchtitan composes them, or **ZeRO-1/2**
# (`"zero1"`, `"zero2"`: Adam state, and with ZeRO-2 the gradients) on the from-scratch TP model.
# Context parallelism (`parallel.cp`: each sequence split over cp ranks, ring attention between
# them; lab 15 builds it step by step) adds ranks that hold the *same* weights and read other
# tokens of the same sequences, so the sharding spans dp x cp: the mesh's `dp_cp` group.
# Two layouts on our 4 ranks, each against one process on the same global batch:
#
# * **2-D**: fsdp x tp, dp 2 x tp 2: every weight cut twice, by TP into column/row halves, then by
#   FSDP into halves of those;
# * **3-D**: zero2 x cp 2 x tp 2 (dp 1): TP halves, each sequence split between the two cp ranks
#   (ring attention), and ZeRO-2 shards Adam state and gradients across the cp peers.

# %%
layout_cp = mesh_layout(4, tp=2, cp=2)
print(layout_cp.draw(layout_cp.describe(n_layers=tiny.n_layers, n_heads=tiny.n_heads, vocab_size=tiny.vocab_size)))
print(f"\ndp_cp groups (ranks holding the same weights, ZeRO shards over them): {layout_cp.group_ranks('dp_cp')}")
fig, ax = plt.subplots(figsize=(6.5, 4.2))
lab_runs.draw_data_flow(ax, layout_cp, {r: holds(layout_cp, r, ["all blocks, head"]) + f"\ntokens: chunk "
                                           f"{layout_cp.coords_of(r)['cp']}" for r in range(4)},
                        ("tp", "cp", "dp_cp"), "zero2 x cp 2 x tp 2: rows are cp chunks of each sequence")
fig.tight_layout()
plt.show()

# %% [markdown]
# Predict first: one process holds 16 bytes per parameter of model state (fp32 weight, gradient
# and two Adam moments) for the tiny config, 1,732,608 bytes in all (printed below). How many
# bytes does one rank of **fsdp x tp** (dp 2 x tp 2) hold?

# %%
my_fsdp_tp_bytes = None  # your prediction: model-state bytes on one rank of fsdp x tp

# %%
from course_lib.estimate import model_state_bytes  # noqa: E402
from course_lib.measure import tinygpt_shape  # noqa: E402

SHARDED = {"fsdp x tp (dp2 x tp2)": ("fsdp", 3, 2, ["train.strategy=fsdp", "parallel.tp=2", f"train.micro_batch={MB // 2}"]),
           "zero2 x cp2 x tp2": ("zero2", 2, 2, ["train.strategy=zero2", "parallel.tp=2", "parallel.cp=2",
                                                  f"train.micro_batch={MB}"])}
if SMOKE:
    SHARDED = dict(list(SHARDED.items())[1:])
jobs_sh = [(trainer_cfg(*sets), str(fresh(RUNS / f"sharded{i}"))) for i, (_, _, _, sets) in enumerate(SHARDED.values())]
res_sh = run_ranks(lab_runs.sharded_layouts, 4, jobs_sh, threads_per_rank=1, show_output=False, timeout=900)
shape = tinygpt_shape(tiny, seq_len=tiny.block_size)
print(f"{'layout':<24}{'rank':>5} {'(pp,dp,cp,tp)':>14} {'params':>9} {'grads':>9} {'Adam':>9} {'total':>9} "
      f"{'estimate':>9}   bytes per rank")
mem_sh = {}
for i, (name, (strategy, stage, shard, _)) in enumerate(SHARDED.items()):
    n_rank = shape.params_on_rank(tp=2)  # the TP shard of the model every rank of this layout holds
    est = model_state_bytes(n_rank, recipe="fp32-adam", zero_stage=stage, dp=shard)
    for r in range(4):
        c, m = res_sh[r][i]["coords"], res_sh[r][i]["census"]
        mem_sh[name, r] = (m["total"], est.total)
        print(f"{name:<24}{r:>5} {str((c['pp'], c['dp'], c['cp'], c['tp'])):>14} {m['params']:>9,} {m['grads']:>9,} "
              f"{m['optimizer_moments']:>9,} {m['total']:>9,} {est.total:>9,.0f}")
dense_bytes = 16 * shape.num_params()
print(f"\none process holds {dense_bytes:,.0f} bytes of model state (16 B per parameter, fp32 AdamW)")
fsdp_name = next((n for n in SHARDED if n.startswith("fsdp")), None)
if fsdp_name:
    show_prediction("model state on one fsdp x tp rank", my_fsdp_tp_bytes, mem_sh[fsdp_name, 0][0], unit="bytes",
                    why=f"a quarter of one process would be {dense_bytes / 4:,.0f}; the rest is what TP does not cut: "
                        f"a TP rank holds {shape.params_on_rank(tp=2):,} of the {shape.num_params():,} parameters "
                        "(the norms, the row-parallel biases and the learned position table are whole on both "
                        "halves), and FSDP halves that")
check(dense_bytes == 1_732_608, f"the tiny config's model state should be 1,732,608 bytes, got {dense_bytes:,.0f}")

# %%
rel_sh = {}
for i, name in enumerate(SHARDED):
    got = losses_of(jobs_sh[i][1])
    rel_sh[name] = max(abs(a - b) / b for a, b in zip(got, single_losses))
    print(f"{name:<24} max relative loss difference over {TRAINER_STEPS} steps vs one process: {rel_sh[name]:.1e}")
for name, rel in rel_sh.items():
    check(rel <= 1e-4, f"{name}: the losses differ from one process by up to {rel:.1e}; the sharded optimizer and "
          "the ring must compute the global-batch step exactly (look at the dp x cp mean)")
for (name, r), (got, want) in mem_sh.items():
    check(got == want, f"{name} rank {r}: {got:,} bytes of model state measured, the estimator says {want:,.0f}")
check(all(got < dense_bytes / 2 for got, _ in mem_sh.values()),
      "every rank should hold less than half of one process's model state in these layouts")

# %% [markdown]
# **What you should see:** both layouts on the one-process curve (relative differences around
# 1e-7), and every rank's measured bytes equal to `model_state_bytes` for the parameters it holds:
# TP halves the parameters each rank owns, then FSDP halves everything again (weights, gradients
# and Adam state: ZeRO stage 3 over dp 2), while ZeRO-2 across the two cp peers halves only the
# gradients and Adam state and keeps the TP half of the weights whole. The same arithmetic, on
# a 70B model over 1,024 GPUs, is what makes the model fit at all (`course plan`, lab 13).
#
# ## Where next
#
# * **Lab 15** (next in the teaching order): context parallelism. When one sequence's activations
#   no longer fit, split the sequence itself: ring attention, zig-zag chunks, `parallel.cp` in the
#   trainer, and the 7B / 8K-context numbers.
# * **Exercise 11** asks you to write the 1F1B action list of one stage (and proves it deadlock-free
#   before any rank starts).
# * `benchmarks/bench_pipeline.py` times torch's schedules against ours without simulated compute
#   (where Python overhead dominates a tiny model, and interleaving's extra messages show).
# * Lab 10 for the tensor-parallel layers the 3D runs use; lab 09 for what ZeRO adds to dp.
