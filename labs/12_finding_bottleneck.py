# %% [markdown]
# # Lab 12 — Finding the bottleneck
#
# A training run is slow for one of a handful of reasons: the devices compute slowly (small
# kernels, low MFU), they wait for communication, they wait for each other (one slow rank or
# pipeline stage), they wait for the host (Python, data), they run out of memory and must
# recompute, or one rank has stopped altogether. This lab finds each of them with tools the
# kit's trainer has built in:
#
# 1. **the profiler** (`--profile`): each step split into compute, exposed communication and idle,
#    per rank, with the top operators;
# 2. **communication-bound vs compute-bound**: the same model with few and with many tokens per step;
# 3. **overlap on and off**: gradient buckets that start their all-reduce during backward;
# 4. **a load-imbalanced pipeline**: one stage with more work makes every other stage wait;
# 5. **memory pressure**: batch size against activation recomputation, estimated and measured;
# 6. **utilization and MFU** side by side, from `metrics.jsonl`;
# 7. **a hung rank** caught by the watchdog, with every rank's Python stack.
#
# Ranks are processes on this machine talking over loopback with **gloo**; on GPUs the same
# trainer uses NCCL and the profiler reads the GPU's kernel timeline instead of the CPU's
# operators. Rank functions live in `course_lib.labs.lab12_finding_bottleneck` (spawned ranks can only run
# importable code).

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
WORLD = 2  # data-parallel ranks (sections 1-3)
STEPS = 10  # trainer steps per profiled run
WINDOW = (3, 1, 4)  # profile.wait, profile.warmup, profile.active
D_MODEL, LAYERS = 384, 2  # the model of sections 2-3: ~3.6 M parameters, 14 MiB of fp32 gradients
SMALL_BATCH, BIG_BATCH = (1, 16), (16, 64)  # (sequences per rank, tokens per sequence)
OVERLAP_BATCH = (4, 64)  # section 3
BUCKET_MB = 0.5  # section 3: bucket size with overlap
UTIL_STEPS = 60  # section 6: steps of the utilization run
PP = 4  # section 4: pipeline stages
PIPE_FWD_S = 0.16  # section 4: simulated forward seconds of a 2-block stage for the global batch
MEM_BATCHES = (2, 4, 8, 16)  # section 5
STALL_TIMEOUT_S = 3.0  # section 7: train.watchdog_s

# %% tags=["timing"]
import statistics
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
from course_lib.trainer.metrics import read_rows
from course_lib.model import ModelConfig
from course_lib.parallel import run_ranks
from course_lib.labs import lab11_pipeline_parallel as lab_runs
from course_lib.labs import lab12_finding_bottleneck as bottleneck_runs
from course_lib.parallel.pipeline import measure_bubble, stage_costs, summarize_timeline
from course_lib.trainer.profiling import load_summary
from course_lib.trainer.cpu_peak import stamped_peak

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    STEPS, WINDOW, BIG_BATCH, UTIL_STEPS, PIPE_FWD_S, MEM_BATCHES = 7, (2, 1, 2), (8, 64), 20, 0.06, (2, 8)
    STALL_TIMEOUT_S = 2.0
torch.set_num_threads(1)
TINY = Path(course_lib.__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"
RUNS = Path(tempfile.mkdtemp(prefix="lab12-"))  # scratch: every file this lab writes
# MFU needs a peak: this CPU core's fp32 matmul rate, once for every run (one rank per core). A busy
# moment only makes a timing slower, so the peak is the higher of a measurement now and the one
# `course doctor --measure-peak` stamped on a quiet machine (when there is a stamp).
PEAK = measure.cpu_matmul_peak_flops(512 if SMOKE else 1024, repeats=2).flops_per_second
STAMPED, _ = stamped_peak(torch.float32, threads=1)
PEAK = max(PEAK, STAMPED or 0.0)
print(f"peak used for MFU: {PEAK / 1e9:.1f} GFLOP/s per rank (fp32 matmul on one core, "
      f"{'the stamp' if PEAK == STAMPED else 'measured now'})")


def trainer_cfg(*sets, steps=STEPS):
    """tiny-cpu.toml, profiled over WINDOW, DDP over the ranks, plus `sets` overrides."""
    wait, warmup, active = WINDOW
    base = ["train.progress=false", f"train.peak_flops={PEAK}", f"train.max_steps={steps}",
            "schedule.warmup_steps=1", "train.strategy='ddp'", "train.util_sample_s=0", "profile.enabled=true",
            f"profile.wait={wait}", f"profile.warmup={warmup}", f"profile.active={active}"]
    return train_config.load(TINY, base + list(sets))


def model_sets(batch):
    """The larger model at `batch` = (sequences, tokens each), with AdamW fused into one kernel
    (otherwise per-tensor optimizer overhead blurs the comparison of compute and communication)."""
    micro, seq = batch
    return [f"model.d_model={D_MODEL}", f"model.n_layers={LAYERS}", f"train.micro_batch={micro}",
            f"data.seq_len={seq}", "optim.fused=true"]

# %% [markdown]
# ## 1. Profiling the trainer
#
# `python -m course_lib.train ... --profile` runs `torch.profiler` around a few steps:
# `profile.wait` steps untouched, `profile.warmup` recorded and thrown away (the profiler's own
# start-up), `profile.active` recorded. Each rank writes a Chrome trace (open
# `OUT/profile/trace_rank0.json` in https://ui.perfetto.dev) and a summary; rank 0 gathers them
# into `OUT/profile/summary.md`. The profiler splits each recorded step's wall time into three
# parts that add up to it exactly:
#
# * **compute**: some operator was running (on a GPU: some kernel);
# * **communication (exposed)**: a collective (here gloo's `all_reduce`) was in flight and nothing
#   computed. Waiting inside a collective for a slower rank counts here;
# * **idle**: neither. On a CPU that is Python between operators, data loading, logging; on a GPU,
#   time the GPU had nothing queued.
#
# Collective time that ran *while* something computed is "hidden" by overlap and reported on its
# own. Every run of this lab is launched once, on `WORLD` ranks, one after the other:

# %% tags=["timing"]
JOBS = {
    "tiny-cpu config": trainer_cfg("train.util_sample_s=0.1", steps=UTIL_STEPS),
    "comm-bound (few tokens)": trainer_cfg(*model_sets(SMALL_BATCH), "train.strategy='ddp-scratch'",
                                           "parallel.bucket_mb=0"),
    "compute-bound (many tokens)": trainer_cfg(*model_sets(BIG_BATCH), "train.strategy='ddp-scratch'",
                                               "parallel.bucket_mb=0"),
    "overlap off (one bucket)": trainer_cfg(*model_sets(OVERLAP_BATCH), "train.strategy='ddp-scratch'",
                                            "parallel.bucket_mb=0"),
    f"overlap on ({BUCKET_MB:g} MiB buckets)": trainer_cfg(*model_sets(OVERLAP_BATCH), "train.strategy='ddp-scratch'",
                                                           f"parallel.bucket_mb={BUCKET_MB}"),
}
OUT = {name: fresh(RUNS / f"run{i}") for i, name in enumerate(JOBS)}
done = run_ranks(bottleneck_runs.train_jobs, WORLD, [(cfg, str(OUT[n])) for n, cfg in JOBS.items()],
                 threads_per_rank=1, show_output=False, timeout=900)
print({name: r["steps"] for name, r in zip(JOBS, done[0])})

# %% [markdown]
# The summary of the first run, as the trainer wrote it (rank 0's top operators by self time: the
# time inside the operator itself, not in the operators it calls):

# %%
base = load_summary(OUT["tiny-cpu config"])
print(f"profiled trainer steps: {[s['step'] for s in base['ranks'][0]['steps']]}")
print(f"{'operator':<62} {'calls':>6} {'self ms':>8} {'share':>6}")
for op in bottleneck_runs.top_ops(OUT["tiny-cpu config"], 8):
    print(f"{op['name'][:62]:<62} {op['calls']:>6} {op['self_s'] * 1e3:>8.2f} {op['share']:>6.1%}")
rows1 = bottleneck_runs.breakdown_rows(OUT["tiny-cpu config"], "tiny-cpu config")
bottleneck_runs.print_breakdown(rows1)
fig, ax = plt.subplots(figsize=(9, 2.2))
bottleneck_runs.plot_breakdown(ax, rows1)
ax.set_title("where a step's time goes, per rank")
plt.show()

# %%
for r in base["ranks"]:
    for s in r["steps"]:
        check(abs(s["compute_s"] + s["comm_s"] + s["idle_s"] - s["wall_s"]) < 1e-9,
              "compute + exposed communication + idle must add up to the step's wall time")
check(all(s["comm_total_s"] > 0 for r in base["ranks"] for s in r["steps"]),
      "every DDP step all-reduces gradients: each profiled step should hold some collective time")

# %% [markdown]
# **What you should see:** matrix multiplications (`aten::mm`, `aten::addmm`), GELU, attention
# and their backward at the top, with many small copies; some exposed communication per rank (the
# gradient all-reduce of a 0.1 M-parameter model and the loss all-reduce) and a sizeable idle
# share: with a model this small the Python around each operator is a real part of the step. The
# two ranks' bars differ: the rank that finishes its backward first waits in the all-reduce for
# the other, so its "communication" is really time spent waiting for its peer.
#
# ## 2. Communication-bound or compute-bound?
#
# Gradient all-reduce moves the same bytes whatever the batch (in a ring each rank sends
# 2(N-1)/N x the gradient size: 1x with our 2 ranks, close to 2x with many), while compute grows
# with the tokens per step. So the same model is
# communication-bound with few tokens and compute-bound with many. Both runs use the kit's
# bucketed DDP with one bucket (`parallel.bucket_mb = 0`): the all-reduce starts after backward,
# nothing overlaps.
#
# Predict first: the model of these runs (d_model 384, 2 layers) has the parameter count printed
# below, fp32 gradients. How many MiB does each of the `WORLD` ranks send per step in the ring
# all-reduce of its gradients?

# %%
from course_lib.estimate import ring_bytes_per_rank  # noqa: E402
from course_lib.model import TinyGPT  # noqa: E402

n_params2 = TinyGPT(train_config.build_model_config(JOBS["comm-bound (few tokens)"])).num_params()
print(f"the section 2-3 model: {n_params2:,} parameters, {4 * n_params2 / 2**20:.1f} MiB of fp32 gradients; "
      f"{WORLD} ranks")
my_allreduce_mib = None  # your prediction: MiB each rank sends per step in the gradient all-reduce

# %%
show_prediction("all-reduce bytes sent per rank per step", my_allreduce_mib,
                ring_bytes_per_rank("all-reduce", 4 * n_params2, WORLD) / 2**20, unit="MiB",
                why=f"a ring all-reduce is a reduce-scatter and an all-gather: each rank sends 2(N-1)/N of the "
                    f"buffer, {2 * (WORLD - 1) / WORLD:g} x the gradients with N = {WORLD} (the kit's count, "
                    "estimate.ring_bytes_per_rank; the same whatever the batch)")
check(abs(4 * n_params2 / 2**20 - 14) < 0.5, "the section 2-3 model should carry about 14 MiB of fp32 gradients")

# %%
rows2 = [row for name in ("comm-bound (few tokens)", "compute-bound (many tokens)")
         for row in bottleneck_runs.breakdown_rows(OUT[name], name)]
bottleneck_runs.print_breakdown(rows2)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.0))
bottleneck_runs.plot_breakdown(ax1, rows2)
bottleneck_runs.plot_breakdown(ax2, rows2, shares=False)
ax2.set_yticklabels([])
plt.show()


def mean_share(name, key="comm_share"):
    values = [r[key] for r in bottleneck_runs.breakdown_rows(OUT[name], name)]
    check(None not in values, f"{name}: some steps logged no {key}. The trainer leaves MFU out rather than print "
          "one above 100%, which happens when the peak measured at the top of this lab came out too low (another "
          "program held a core then): run the lab again on a quiet machine")
    return sum(values) / len(values)


comm_bound, compute_bound = mean_share("comm-bound (few tokens)"), mean_share("compute-bound (many tokens)")
print(f"exposed communication: {comm_bound:.0%} of the step with {SMALL_BATCH[0] * SMALL_BATCH[1]} tokens "
      f"per rank, {compute_bound:.0%} with {BIG_BATCH[0] * BIG_BATCH[1]}")
check(comm_bound > compute_bound, "with the same model, the run with fewer tokens per step should spend a larger "
      "share of its step in communication")
means = {name: {key: mean_share(name, key) for key in ("compute_ms", "comm_ms", "wall_ms", "mfu")}
         for name in ("comm-bound (few tokens)", "compute-bound (many tokens)")}
few, many = means["comm-bound (few tokens)"], means["compute-bound (many tokens)"]
print(f"compute {few['compute_ms']:.0f} -> {many['compute_ms']:.0f} ms ({many['compute_ms'] / few['compute_ms']:.1f}x), "
      f"exposed communication {few['comm_ms']:.0f} -> {many['comm_ms']:.0f} ms "
      f"({many['comm_ms'] / few['comm_ms']:.1f}x), MFU {few['mfu']:.1%} -> {many['mfu']:.1%}")
check(many["compute_ms"] > 0.5 * many["wall_ms"], "with many tokens per rank compute should be most of the step")
check(many["mfu"] > few["mfu"], "with more tokens per step the MFU should rise")
check(many["compute_ms"] / few["compute_ms"] > many["comm_ms"] / few["comm_ms"],
      "more tokens should multiply the compute by far more than the communication (the same bytes move)")

# %% [markdown]
# **What you should see:** with a handful of tokens per rank communication takes a large share
# of the step (tens of percent; more on the rank whose backward ends first, which waits in the
# all-reduce for its peer) and the MFU is tiny; with many tokens compute is most of the step and
# MFU rises. The all-reduce moves the same bytes in both runs, so the milliseconds of exposed
# communication grow far less than the compute (the last line; they still move, because they
# include waiting for the slower rank).
# The remedies for a communication-bound run follow: more tokens per step per rank (larger
# micro-batches or gradient accumulation, which all-reduces once per optimizer step), overlap
# (next section), fewer bytes (bf16 gradients, ZeRO's reduce-scatter), or a faster link.
#
# ## 3. Overlap on and off
#
# Backward produces gradients from the last layer to the first. With buckets of `BUCKET_MB`
# MiB, each bucket's all-reduce starts as soon as its gradients are ready, while backward goes on
# with earlier layers; with one bucket nothing can start before backward ends. The profiler shows
# the difference as collective time **hidden** behind compute.

# %%
names3 = ("overlap off (one bucket)", f"overlap on ({BUCKET_MB:g} MiB buckets)")
rows3 = [row for name in names3 for row in bottleneck_runs.breakdown_rows(OUT[name], name)]
bottleneck_runs.print_breakdown(rows3)
fig, ax = plt.subplots(figsize=(12, 3.0))
bottleneck_runs.plot_breakdown(ax, rows3, shares=False)
plt.show()
hidden = {n: sum(r["overlapped_ms"] for r in rows3 if r["label"] == n) / WORLD for n in names3}
step = {n: sum(r["wall_ms"] for r in rows3 if r["label"] == n) / WORLD for n in names3}
print(f"hidden communication: {hidden[names3[0]]:.1f} ms off, {hidden[names3[1]]:.1f} ms on; "
      f"step {step[names3[0]]:.1f} ms off, {step[names3[1]]:.1f} ms on ({step[names3[0]] / step[names3[1]]:.2f}x)")
check(hidden[names3[1]] > hidden[names3[0]], "with several buckets some all-reduce should run during backward "
      "(hidden communication) and more of it than with a single bucket")

# %% [markdown]
# **What you should see:** with buckets, most of the all-reduce time is hidden behind backward
# (the hidden column grows by an order of magnitude); with one bucket almost nothing is.
#
# Two things in the table deserve a second look. First, the **total** collective time (hidden
# plus exposed) is larger with buckets than with one: many small all-reduces each pay a fixed
# start-up cost (lab 08's latency term), and each waits for the slower rank's backward to reach
# it. Overlap does not make communication cheaper; it moves it under the compute, and what the
# step pays is only the exposed part. Second, **on this 2-core CPU read the step times with
# care:** the gloo thread that runs the hidden all-reduces needs a core too while the two ranks
# already use both, so it *can* slow backward down, and load from other programs can hit one run
# and not the other. Compare the compute columns first: when they are about equal, the overlap made
# the difference; when they differ by much more than the hidden time, the machine did (run the
# lab again when it is quieter). On GPUs NCCL runs on its own stream, on a few of the GPU's SMs
# (streaming multiprocessors, the GPU's compute units) next to the backward kernels, and the
# exposed communication drops to about the last bucket's all-reduce.
#
# ## 4. A load-imbalanced pipeline
#
# A synchronous pipeline runs at the pace of its slowest stage. Give the model a large
# vocabulary and the last stage, which also runs the output layer, does more work than the
# others. We reuse the pipeline runner (`course_lib.parallel.pipeline`) on `PP` ranks with
# 1F1B and 8 micro-batches; each stage sleeps in proportion to its forward FLOPs (a stand-in for
# GPU kernels, so the waiting is real and the machine's load matters less). The even split gives
# every stage 2 blocks; `balanced_split` moves one off the last stage.

# %% tags=["timing"]
HEAVY = lab_runs.model_config(vocab_size=896)  # the output layer costs about two blocks
BLOCK_FLOPS = stage_costs(HEAVY, HEAVY.n_layers)[0]
flop_s = PIPE_FWD_S / 2 / (BLOCK_FLOPS * 16)  # seconds per FLOP: a block's forward = PIPE_FWD_S / 2
pipe_jobs = [dict(schedule="1f1b", m=8, timed=3, model=dict(vocab_size=896), balance=b, flop_s=flop_s)
             for b in (None, "balanced")]
pipe = run_ranks(lab_runs.scratch_runs, PP, pipe_jobs, 16, threads_per_rank=1, show_output=False, timeout=600)
print(f"{'split':<10} {'blocks':<14} {'step ms':>8} " + " ".join(f"{'stage ' + str(s):>20}" for s in range(PP)))
pipe_rows = {}
for j, name in enumerate(("even", "balanced")):
    stages = [pipe[r][j] for r in range(PP)]
    steps = [[st["timed"][k] for st in stages] for k in range(len(stages[0]["timed"]))]
    tl = min(steps, key=lambda t: measure_bubble(t)["span_s"])  # the least disturbed step
    got = measure_bubble(tl)
    parts = [summarize_timeline(t) for t in tl]
    pipe_rows[name] = (got, parts, stages[0]["balance"])
    cells = " ".join(f"{p['compute_s'] * 1e3:>7.0f} busy {(got['span_s'] - p['compute_s']) * 1e3:>5.0f} wait"
                     for p in parts)
    print(f"{name:<10} {str(stages[0]['balance']):<14} {got['span_s'] * 1e3:>8.0f} {cells}")
fig, axes = plt.subplots(1, 2, figsize=(12, 2.6), sharey=True)
for ax, (name, (got, parts, balance)) in zip(axes, pipe_rows.items()):
    busy = [p["compute_s"] * 1e3 for p in parts]
    ax.bar(range(PP), busy, color="tab:blue", label="forward + backward")
    ax.bar(range(PP), [got["span_s"] * 1e3 - b for b in busy], bottom=busy, color="tab:gray", label="waiting / idle")
    ax.set_title(f"{name} split {balance}: step {got['span_s'] * 1e3:.0f} ms")
    ax.set_xlabel("stage (rank)")
axes[0].set_ylabel("ms of the step")
axes[0].legend(fontsize=8)
plt.show()
# The split sets each stage's work (its sleeps are proportional to its FLOPs), so a within-run
# ratio of busy times is what the mechanism guarantees; the step times of two runs are compared
# only for their direction (the schedule's arithmetic predicts about 1.2x, a busy machine less).
busy_even = [p["compute_s"] for p in pipe_rows["even"][1]]
check(busy_even[-1] > 1.5 * statistics.median(busy_even[:-1]),
      "with the even split the last stage should be busy about twice as long as each other stage "
      "(two blocks plus the output layer): compare the busy bars")
check(pipe_rows["even"][0]["span_s"] > pipe_rows["balanced"][0]["span_s"],
      "the even split's step should be longer than the balanced one's: every stage waits for the slowest")

# %% [markdown]
# **What you should see:** with the even split the last stage is busy most of the step and the
# others wait for it (gray). The balanced split `[2, 2, 3, 1]` evens out the busy bars and the
# step gets shorter. In a profile of a real pipeline job the same picture appears as one rank with
# little idle time and its neighbours with a lot, spent in receives.
#
# ## 5. Memory pressure: batch size against recomputation
#
# When a run does not fit, the first lever is the micro-batch: activations grow linearly with it.
# Activation checkpointing (full recomputation) keeps only each block's input and recomputes the
# rest in backward, for one more forward (~33% more compute). We measure the bytes one forward
# saves for backward (`measure.saved_activation_bytes`: a saved-tensor hook, each storage counted
# once) next to the closed-form estimate (`course_lib.estimate`, Korthikanti et al. adapted to
# TinyGPT), for the model of sections 2-3.

# %%
mem = {}
for recompute in ("none", "full"):
    cfg = ModelConfig.preset("tiny", vocab_size=64, block_size=64, d_model=D_MODEL, n_layers=LAYERS,
                             checkpointing=recompute)
    for b in MEM_BATCHES:
        total = measure.compare_tinygpt_activations(cfg, seq_len=64, micro_batch=b)[-1]
        mem[recompute, b] = total
MIB = 2**20
print(f"{'micro-batch':>11} {'none: estimate':>15} {'measured':>9} {'full: estimate':>15} {'measured':>9} {'saved':>6}")
for b in MEM_BATCHES:
    n, f = mem["none", b], mem["full", b]
    print(f"{b:>11} {n['estimated'] / MIB:>12.2f} MiB {n['measured'] / MIB:>9.2f} {f['estimated'] / MIB:>12.2f} MiB "
          f"{f['measured'] / MIB:>9.2f} {1 - f['measured'] / n['measured']:>6.0%}")
fig, ax = plt.subplots(figsize=(6, 3))
for recompute, marker in (("none", "o"), ("full", "s")):
    ax.plot(MEM_BATCHES, [mem[recompute, b]["measured"] / MIB for b in MEM_BATCHES], marker + "-",
            label=f"recompute {recompute}: measured")
    ax.plot(MEM_BATCHES, [mem[recompute, b]["estimated"] / MIB for b in MEM_BATCHES], "k+", ms=12)
ax.plot([], [], "k+", label="estimate")
ax.set_xlabel("micro-batch (sequences of 64 tokens)")
ax.set_ylabel("saved activations (MiB)")
ax.legend(fontsize=8)
plt.show()
for key, row in mem.items():
    check(abs(row["measured"] / row["estimated"] - 1) < 0.05,
          f"the estimate should match the measured saved bytes within 5% (recompute {key[0]}, batch {key[1]})")

# %% [markdown]
# **What you should see:** both lines are straight in the batch size; full recomputation cuts the
# slope several-fold, and the estimate sits on the measured points. Under a fixed memory budget,
# recomputation buys a micro-batch several times larger, and section 2 showed why a larger batch
# can pay for the extra forward: it moves a communication-bound run toward compute. On GPUs the
# same accounting predicts `torch.cuda.max_memory_allocated` (lab 01, lab 04).
#
# ## 6. Utilization and MFU side by side
#
# With `train.util_sample_s > 0` a background thread samples this process's CPU use and memory
# (and, on GPUs, the utilization and memory NVML reports: NVIDIA's management library, what
# `nvidia-smi` reads) and the trainer adds them to `metrics.jsonl`
# next to tokens/s and MFU. It reads no tensor, so it adds no device synchronisation. Memory is the
# process's RSS (resident set size: the bytes of RAM it occupies now). The first run of section 1
# sampled every 0.1 s:

# %%
rows6 = read_rows(OUT["tiny-cpu config"] / "metrics.jsonl")
profiled = [s["step"] for s in base["ranks"][0]["steps"]]
util = [r for r in rows6 if "cpu_util_pct" in r]
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 4.4), sharex=True)
ax1.plot([r["step"] for r in rows6], [r["mfu"] * 100 for r in rows6], "tab:green", label="MFU (%)")
ax1.axvspan(min(profiled) - 0.5, max(profiled) + 0.5, color="tab:orange", alpha=0.25, label="profiled steps")
ax1.set_ylabel("MFU (%)")
ax1.legend(fontsize=8)
ax2.plot([r["step"] for r in util], [r["cpu_util_pct"] for r in util], "o-", label="rank 0 process CPU (% of one core)")
ax2.plot([r["step"] for r in util], [r["sys_cpu_pct"] for r in util], "s-", label="whole machine CPU (%)")
ax2.set_ylabel("%")
ax2.set_xlabel("step")
ax2.legend(fontsize=8)
plt.show()
steady = [r["mfu"] for r in rows6[1:] if r["step"] not in profiled and r["step"] != max(profiled) + 1]
print(f"{len(util)} of {len(rows6)} rows carry utilization columns; median MFU {sorted(steady)[len(steady) // 2]:.1%} "
      f"outside the profile, {sum(s['mfu'] for s in base['ranks'][0]['steps']) / len(profiled):.1%} in it; "
      f"rank 0 RSS {max(r['rss_gib'] for r in util):.2f} GiB")
check(len(util) > 0 and all(r["rss_gib"] > 0 for r in util), "the sampler should have written utilization columns")

# %% [markdown]
# Compute one MFU yourself before trusting the column: MFU = FLOPs per token x tokens/s / (peak
# FLOP/s per rank x ranks), with the usual count of training FLOPs per token, 6 N (N parameters:
# 2 per multiply-add, forward once, backward twice). The numbers of one step of that run:

# %%
from course_lib.trainer.mfu import model_flops_per_token  # noqa: E402

tiny_cfg = JOBS["tiny-cpu config"]
tiny_model = TinyGPT(train_config.build_model_config(tiny_cfg))
row_k = sorted((r for r in rows6[1:] if r["step"] not in profiled and r["step"] != max(profiled) + 1),
               key=lambda r: r["mfu"])[len(steady) // 2]  # the median step
print(f"step {row_k['step']}: {row_k['tokens_per_s']:,.0f} tokens/s over {WORLD} ranks; N = {tiny_model.num_params():,} "
      f"parameters; peak {PEAK / 1e9:.1f} GFLOP/s per rank")
my_mfu = None  # your prediction: that step's MFU, as a fraction (0.25 = 25%)

# %%
fpt = model_flops_per_token(tiny_model, tiny_cfg["data"]["seq_len"])
six_n = 6 * tiny_model.num_params() * row_k["tokens_per_s"] / (PEAK * WORLD)
show_prediction(f"MFU of step {row_k['step']}", my_mfu, row_k["mfu"],
                why=f"6 N alone gives {six_n:.1%}; the trainer counts {fpt:,.0f} FLOPs per token, PaLM's 6 N plus "
                    f"the attention's score matmuls ({fpt - 6 * tiny_model.num_params():,.0f} per token at "
                    f"{tiny_cfg['data']['seq_len']} tokens of context), which 6 N leaves out")
check(abs(fpt * row_k["tokens_per_s"] / (PEAK * WORLD) / row_k["mfu"] - 1) < 1e-6,
      "the logged MFU should be FLOPs per token x tokens/s / (peak x ranks)")

# %% [markdown]
# **What you should see:** the process uses up to one full core (100%): each rank computes on one
# thread. MFU is far below the measured single-core matmul peak: the tiny model's small matrices
# and the Python around them cost the rest. The step right after the profiled ones shows a deep
# dip (it exported the trace). Utilization and MFU also move together with load from elsewhere:
# when the machine is shared, `sys_cpu_pct` near 100% and a falling MFU say that other processes
# took the cores, not that the run changed. On a GPU, `gpu_util_pct` near 100% with a low MFU means the kernels are
# there but small or memory-bound; a low `gpu_util_pct` means the GPU waits (for the host, data
# or communication): look at the profile's idle and communication shares.
#
# ## 7. A hung rank, caught by the watchdog
#
# The worst bottleneck is a rank that stops: its peers wait in the next collective, forever or
# until the process group's timeout (often 10-30 minutes), and nothing says which rank is at
# fault. The trainer's watchdog (`train.watchdog_s`) has every rank publish a heartbeat per step;
# when one goes silent for longer than the timeout, every rank writes its Python stack to
# `OUT/hang/` and the job exits. Three parts make the demo. First the job: a real `torchrun`
# command of the trainer, with the watchdog's timeout and an injected fault that makes one rank
# sleep at step 2:

# %%
import inspect  # noqa: E402

from course_lib.watch import run_stall_demo  # noqa: E402
from course_lib.watch.demo import stall_command  # noqa: E402
from course_lib.watch.watchdog import StaleTracker  # noqa: E402

print(" ".join(str(a) for a in stall_command(RUNS / "stall", 2, 1, 2, STALL_TIMEOUT_S)[1:]))

# %% [markdown]
# Second, the watchdog: a thread in every rank reads every rank's heartbeat (`"STEP:SEQ"`, the step
# it last started and the collectives it has issued, published in the rendezvous store) and
# keeps, per rank, when that value last changed. When one has not changed for longer than the
# timeout, `blame` names the rank furthest behind: its peers sit inside a collective it never
# issued.

# %%
print(inspect.getsource(StaleTracker.update))

# %% [markdown]
# Third, what it leaves: each rank's Python stack and a `summary.json` naming the stalled rank,
# which the cell after the run reads. `run_stall_demo` runs the command above and collects them:

# %%

report = run_stall_demo(world_size=2, stall_rank=1, timeout_s=STALL_TIMEOUT_S, out_dir=fresh(RUNS / "stall"))
# torchrun's own exit code is 1 when a worker fails; the ranks' codes are read from its failure report
rank_codes = list(report.rank_exit_codes.values())
print(f"stalled rank named by the watchdog: {report.stalled_rank} (last step {report.last_step}); "
      f"exit code {report.exit_code} (torchrun's); the ranks exited with {sorted(set(rank_codes))}")
detect = "n/a" if report.seconds_to_detect is None else f"{report.seconds_to_detect:.1f} s"
abort = "n/a" if report.seconds_to_abort is None else f"{report.seconds_to_abort:.1f} s"
print(f"timeout {STALL_TIMEOUT_S:g} s; detected after {detect}, whole job gone after {abort}")
for rank, text in sorted(report.stacks.items()):
    print(f"--- rank {rank}: where its main thread was (innermost frames last)")
    print(bottleneck_runs.main_thread_tail(text, 5))
check(report.stalled_rank == 1, "the watchdog should blame rank 1, the rank that stopped sending heartbeats")
check(len(rank_codes) == 2 and set(rank_codes) == {report.hang_exit_code} and report.exit_code == 1,
      f"every rank should exit with the watchdog's code {report.hang_exit_code}, and torchrun, seeing its workers "
      f"fail, with 1; got ranks {rank_codes}, torchrun {report.exit_code}")
check(report.seconds_to_abort is not None and report.seconds_to_abort < STALL_TIMEOUT_S + 30,
      "the job should end within seconds of the timeout, not at the process group's timeout")
print(f"\nfiles in {report.out_dir.name}/hang/: {sorted(p.name for p in (report.out_dir / 'hang').iterdir())}")
print("summary.json:", {k: v for k, v in report.summary.items() if k in ("stalled", "timeout_s", "world_size")})

# %% [markdown]
# **What you should see:** the watchdog names rank 1, within about `STALL_TIMEOUT_S` seconds of
# the stall, and every rank exits with 86, the watchdog's code. The `exit code 1` is torchrun's
# own: a launcher whose workers failed exits 1 whatever their codes, and lists each rank's code
# (`exitcode : 86`) in its failure report, where the cell reads them. A job script that wants to
# tell a hang from a crash reads the ranks' codes, or the watchdog's `OUT/hang/summary.json`. The
# stacks tell the story: rank 1 sits in the stall (`time.sleep` inside the
# injected fault), rank 0 inside the step's backward, where DDP waits for the gradient
# all-reduce that rank 1 never joins. Without the watchdog both would sit there until the
# process group timed out.
#
# ## Summary: symptom, where to look, what to try
#
# | symptom | where it shows | what to try |
# | --- | --- | --- |
# | high exposed communication | profile: comm share; more with more ranks | more tokens per rank, overlap (buckets), bf16 gradients, ZeRO/FSDP reduce-scatter |
# | high idle | profile: idle share; low `gpu_util_pct` | bigger kernels (batch, `train.compile`), faster data loading, less Python per step |
# | one rank or stage slower | its peers wait in collectives / receives | rebalance (pipeline split, data lengths), check that rank's machine |
# | runs out of memory | estimator vs measured activations | smaller micro-batch + accumulation, recomputation, sharding |
# | low MFU at full utilization | `gpu_util_pct` high, MFU low | small or memory-bound kernels: larger matrices, fused kernels, bf16 |
# | no progress at all | heartbeats stop; watchdog stacks in `OUT/hang/` | read the stalled rank's stack |
