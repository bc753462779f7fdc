# %% [markdown]
# # Lab 08 — Data parallelism
#
# Data parallelism (DP) is the first way to use more than one device: every rank holds the whole
# model, each takes its own slice of the global batch, and before the optimizer step the ranks
# **average their gradients** with an all-reduce. If that is done right, the run is the same
# training run as one process on the global batch, only faster. This lab builds it up and
# measures each piece:
#
# 1. **DDP by hand** (`NaiveDDP`): broadcast the weights once, all-reduce every gradient after
#    backward; proven equal to one process;
# 2. **buckets and overlap** (`BucketedDDP`): a measured timeline of backward compute and each
#    bucket's all-reduce;
# 3. **`DistributedSampler`** and why `set_epoch` matters;
# 4. **gradient accumulation** with `no_sync()`: all-reduce calls counted;
# 5. **equal loss curves**: from-scratch DDP and torch DDP against one process;
# 6. **predict, then measure** the all-reduce time of one step's gradients, with the alpha-beta
#    model from lab 00.
#
# Ranks are processes on this machine talking over loopback with **gloo**; on GPUs the same code
# uses **NCCL**. The rank functions live in `course_lib.labs.lab08_data_parallel`
# (spawned ranks can only run importable code).

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
WORLD_SIZE = 2  # ranks; 2 fits a 2-core laptop
GLOBAL_BATCH = 16  # sequences per optimizer step, over all ranks (32 tokens each)
STEPS = 30  # section 5: training steps per run
TIMELINE_STEPS = 10  # section 2: timed steps per configuration (the last one is drawn)
TIMELINE_D_MODEL, TIMELINE_LAYERS = 128, 4  # sections 2 and 6: a 0.8 M-parameter TinyGPT (3.2 MB of gradients)
TIMELINE_BUCKET_MB = 1.0  # section 2: bucket cap in MiB, a few buckets for that model
SYNC_REPEATS = 10  # section 6: timed syncs per bucket configuration

# %%
import inspect
import statistics

import matplotlib.pyplot as plt
import torch
from torch.utils.data import DistributedSampler

import course_lib
from course_lib.kit.checks import check
from course_lib.estimate import comm
from course_lib.model import ModelConfig, TinyGPT
from course_lib.labs import lab00_orientation as collectives
from course_lib.parallel import NaiveDDP, run_ranks
from course_lib.labs import lab08_data_parallel as lab_runs

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    STEPS, TIMELINE_STEPS, SYNC_REPEATS = 8, 3, 3
    TIMELINE_D_MODEL, TIMELINE_LAYERS, TIMELINE_BUCKET_MB = 64, 2, 0.1
torch.set_num_threads(1)  # the single-process references run in this kernel: one thread, like each rank

# %% [markdown]
# ## 1. DDP by hand
#
# `NaiveDDP` is data parallelism in its simplest correct form. At construction it **broadcasts**
# rank 0's weights, so every replica starts identical. After `loss.backward()` the learner calls
# `finish_gradient_synchronization()`, which is the whole algorithm:

# %%
print(inspect.getsource(NaiveDDP.finish_gradient_synchronization))

# %% [markdown]
# (The small `has_grad` all-reduce first handles a parameter that some rank did not use: every rank
# must issue the same collectives in the same order, or they pair up wrongly and hang.)
#
# Each rank averages the loss over its own `GLOBAL_BATCH / WORLD_SIZE` sequences; summing the
# gradients over ranks and dividing by the world size gives the gradient of the mean loss over the
# global batch: exactly what one process computes on the whole batch. Forgetting the division
# would multiply the learning rate by `WORLD_SIZE`.
#
# The experiment: 5 SGD steps of a tiny TinyGPT on `WORLD_SIZE` ranks and in one process on the
# same global batches.

# %%
FEW = 5
ref_sgd = lab_runs.train_losses(0, 1, "single", FEW, GLOBAL_BATCH, optimizer="sgd", lr=0.1)
naive = run_ranks(lab_runs.compare_runs, WORLD_SIZE, [{"kind": "naive"}], FEW, GLOBAL_BATCH,
                  optimizer="sgd", lr=0.1)
naive = [per_rank[0] for per_rank in naive]  # one spec: drop the list
print(f"{'step':>4} {'loss, 1 process':>16} {'loss, NaiveDDP':>15} {'|difference|':>13}")
for step, (a, b) in enumerate(zip(ref_sgd["losses"], naive[0]["losses"])):
    print(f"{step:>4} {a:>16.7f} {b:>15.7f} {abs(a - b):>13.2e}")
weight_diff = (naive[0]["params"] - ref_sgd["params"]).abs().max().item()
replicas_equal = all(torch.equal(r["params"], naive[0]["params"]) for r in naive)
print(f"\nweights after {FEW} steps: max |NaiveDDP - 1 process| = {weight_diff:.2e} "
      f"(over {naive[0]['params'].numel():,} numbers)")
print(f"replicas bit-identical on all {WORLD_SIZE} ranks: {replicas_equal}; "
      f"all-reduce calls per step: {naive[0]['allreduce_calls'][0]} (one per parameter tensor + the flags)")

# %%
check(replicas_equal, "every rank applies the same averaged gradient from the same start, so the "
      "replicas must stay bit-identical; if not, the broadcast or the all-reduce is missing somewhere")
check(weight_diff < 1e-5, f"NaiveDDP's weights differ from one process by {weight_diff:.2e}: more than "
      "float rounding. A gradient summed but not divided by the world size does this.")

# %% [markdown]
# **What you should see:** losses equal to 6-7 digits and weights that differ by about 1e-8, not
# 0: a mean over 8 sequences on each rank, then over 2 ranks, adds the same numbers in a different
# order than one mean over 16, and float addition is not associative. Tests use a tolerance for that
# reason. The replicas, on the other hand, are bit-identical: they all receive the same all-reduce
# result.
#
# ## 2. Buckets and overlap: a measured timeline
#
# NaiveDDP is slow for two reasons: it sends one message per tensor (each pays the all-reduce
# latency from lab 00) and it waits for backward to finish before sending anything. `BucketedDDP`
# fixes both:
#
# * gradients are packed into flat **buckets** of up to `bucket_mb` MiB, one all-reduce each;
# * backward produces gradients from the last layer to the first; a hook on every parameter counts
#   a bucket's finished gradients, and when the bucket is full its all-reduce starts **at once,
#   asynchronously** (`async_op=True`), while backward goes on with earlier layers.
#   `finish_gradient_synchronization()` then only waits for what is still in flight.
#
# `BucketedDDP(..., record_timeline=True)` stamps (with `time.perf_counter()`) when each bucket
# became ready, when its all-reduce was launched and when it was seen complete. We time three
# configurations of a larger TinyGPT, `TIMELINE_STEPS` SGD steps each, every step after a barrier
# (the configurations take turns, one step each, so load from elsewhere hits them alike):
# NaiveDDP, BucketedDDP with one bucket, and BucketedDDP with `TIMELINE_BUCKET_MB` MiB buckets.

# %%
SPECS = {"NaiveDDP": {"kind": "naive"},
         "BucketedDDP, one bucket": {"kind": "bucketed", "bucket_mb": None},
         f"BucketedDDP, {TIMELINE_BUCKET_MB:g} MiB buckets": {"kind": "bucketed", "bucket_mb": TIMELINE_BUCKET_MB}}
timed = run_ranks(lab_runs.timeline_runs, WORLD_SIZE, list(SPECS.values()), TIMELINE_STEPS, GLOBAL_BATCH,
                  d_model=TIMELINE_D_MODEL, n_layers=TIMELINE_LAYERS)
timed = {name: [per_rank[i] for per_rank in timed] for i, name in enumerate(SPECS)}  # name -> per rank


def gantt(ax, step, title, buckets, lane_names):
    """One rank's step: forward and backward on the compute lane, one lane per bucket's all-reduce."""
    ms = 1e3
    ax.broken_barh([(0, step["forward_end"] * ms)], (0.6, 0.8), color="tab:cyan", label="forward")
    ax.broken_barh([(step["forward_end"] * ms, (step["backward_end"] - step["forward_end"]) * ms)],
                   (0.6, 0.8), color="tab:blue", label="backward")
    ev = step["events"]
    for b in range(buckets):
        launch = next(e["t"] for e in ev if e["event"] == "launch" and e["bucket"] == b)
        done = next(e["t"] for e in ev if e["event"] == "complete" and e["bucket"] == b)
        ax.broken_barh([(launch * ms, (done - launch) * ms)], (-b - 0.4, 0.8), color="tab:orange",
                       label="all-reduce in flight" if b == 0 else None)
        ready = [e["t"] for e in ev if e["event"] == "ready" and e["bucket"] == b]
        if ready:
            ax.plot([ready[0] * ms] * 2, [-b - 0.45, -b + 0.45], color="black", lw=1.5,
                    label="bucket ready" if b == 0 else None)
    ax.axvline(step["backward_end"] * ms, color="grey", ls="--", lw=1, label="backward returned")
    ax.axvline(step["sync_end"] * ms, color="red", ls=":", lw=1.2, label="sync done: optimizer may step")
    ax.set_yticks([1] + [-b for b in range(buckets)], ["compute"] + lane_names)
    ax.set_title(title, fontsize=9)


names = list(SPECS)
fig, axes = plt.subplots(len(names), WORLD_SIZE, figsize=(6 * WORLD_SIZE, 7), sharex=True, squeeze=False)
for row, name in enumerate(names):
    for rank in range(WORLD_SIZE):
        run = timed[name][rank]
        if name == "NaiveDDP":  # one lane: its all-reduces run one after another, each blocking
            lanes = [f"{run['buckets'] + 1} all-reduces"]
        else:
            lanes = [f"bucket {b}" for b in range(run["buckets"])]
        gantt(axes[row][rank], run["steps"][-1], f"{name}: rank {rank}", len(lanes), lanes)
for ax in axes[-1]:
    ax.set_xlabel("ms since the step's forward started")
fig.legend(*axes[-1][-1].get_legend_handles_labels(), loc="lower center", ncol=6, fontsize=8)
fig.suptitle("one training step, measured: compute lane and one lane per all-reduce", fontsize=10)
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %% [markdown]
# The numbers behind the picture, over all timed steps (medians; for the times, the slowest rank,
# which is what the optimizer step waits for). **Exposed communication** is the time from the end
# of backward until the gradients are synchronised: communication that compute did not hide.
# **Hidden** is the share of the all-reduces' in-flight time (launch to completion) that lies
# inside backward, for the rank that hid least. A completion is stamped when it is *seen* (at a
# later hook, or when `wait()` returns), so in-flight times are upper bounds.

# %%
def summary(runs):
    """Median over steps, max over ranks: backward ms, exposed ms, step ms, share hidden."""
    def per_rank(run):
        back = [s["backward_end"] - s["forward_end"] for s in run["steps"]]
        exposed = [s["sync_end"] - s["backward_end"] for s in run["steps"]]
        total = [s["sync_end"] for s in run["steps"]]
        hidden, flight = 0.0, 0.0
        for s in run["steps"]:
            launches = {e["bucket"]: e["t"] for e in s["events"] if e["event"] == "launch"}
            for e in s["events"]:
                if e["event"] == "complete":
                    flight += e["t"] - launches[e["bucket"]]
                    hidden += max(0.0, min(e["t"], s["backward_end"]) - launches[e["bucket"]])
        return [statistics.median(x) * 1e3 for x in (back, exposed, total)] + [hidden / flight]
    rows = [per_rank(run) for run in runs]
    return [max(r[i] for r in rows) for i in range(3)] + [min(r[3] for r in rows)]


stats = {name: summary(timed[name]) for name in names}
print(f"{'configuration':<30} {'messages':>8} {'backward':>10} {'exposed comm':>13} {'step':>9} {'hidden':>7}")
for name in names:
    back, exposed, total, hidden = stats[name]
    msgs = timed[name][0]["buckets"] + (1 if name == "NaiveDDP" else 0)
    print(f"{name:<30} {msgs:>8} {back:>7.1f} ms {exposed:>10.1f} ms {total:>6.1f} ms {hidden:>6.0%}")

# %%
many = names[-1]
launched_early = [sum(e["event"] == "launch" and e["in_backward"] for e in s["events"])
                  for s in timed[many][0]["steps"]]
check(all(n == timed[many][0]["buckets"] for n in launched_early),
      "every bucket of this model fills during backward, so every all-reduce should be launched from "
      f"a hook, before backward ends; launched early per step: {launched_early}")
check(stats[many][1] < stats["NaiveDDP"][1],
      "bucketed DDP should leave less communication exposed after backward than NaiveDDP's "
      "one-message-per-tensor sync; is the machine very busy? Run the cell again")

# %% [markdown]
# **What you should see:** NaiveDDP's compute lane ends, then one long bar: one blocking all-reduce
# after another, nothing started before backward finished. With one bucket there is one message
# (much shorter), but it can only start at the very end of backward, so all of it is exposed.
# With several buckets the black ticks (a bucket's last gradient arrived) appear *during* backward,
# from the last layer's bucket (bucket 0) to the first, and each bucket's all-reduce is launched
# right after (once its gradients are copied into the flat buffer; on a busy CPU a gap here is the
# rank waiting for a core): every all-reduce is *launched* while backward still computes the
# earlier layers (the check above counts them). Whether they also *run* then needs a free core:
# on this CPU the exposed communication in the table may hardly shrink from one bucket to several,
# while on GPUs only the last bucket's all-reduce is left after backward ends (below).
# Compare the ranks, too: an all-reduce cannot finish before *every* rank has launched it, so a rank
# whose backward ran fast sees its bars stretch until the slowest rank catches up. DDP runs at the
# pace of its slowest rank.
#
# **On this 2-core CPU, read the numbers with care.** Each rank computes on one core and gloo's
# communication runs on a background thread that needs a core too, and the machine may be shared:
# how much really overlaps changes from run to run (a bar that ends long after its tick, or a rank
# whose bars all finish after backward, is the communication thread waiting for a core). Backward
# itself also gets slower when communication competes with it. Part of the win over NaiveDDP is not
# overlap at all but sending a few large messages instead of one per tensor (section 6 measures
# that alone).
#
# **What you should see on GPUs:** NCCL runs the all-reduces on a separate CUDA stream and its own
# copy engines/SMs, concurrently with the backward kernels. The bucket bars then overlap the compute
# lane, and the exposed communication shrinks to about the last bucket's all-reduce (the one that
# can only start when backward ends). That is why torch DDP fills buckets in reverse layer order
# and keeps them ~25 MB: big enough to amortise latency, small enough that the first ones start
# early.
#
# ## 3. `DistributedSampler` and epochs
#
# Each rank must see a different slice of the data, and together the slices must cover the data
# set once per epoch. `torch.utils.data.DistributedSampler` does that: it shuffles the indices
# with a seed, then rank `r` takes every `WORLD_SIZE`-th index starting at `r`. The seed used for
# the shuffle is `seed + epoch`, and the sampler only knows the epoch if you tell it:
# `sampler.set_epoch(epoch)` at the start of every epoch. The sampler needs no process group, so we
# build one per rank right here.

# %%
N_EXAMPLES, EPOCHS = 12, 3
dataset = list(range(N_EXAMPLES))


def orders(call_set_epoch):
    """epoch -> per-rank index lists, as each rank's sampler would produce them."""
    samplers = [DistributedSampler(dataset, num_replicas=WORLD_SIZE, rank=r, shuffle=True, seed=0)
                for r in range(WORLD_SIZE)]
    out = []
    for epoch in range(EPOCHS):
        if call_set_epoch:
            for s in samplers:
                s.set_epoch(epoch)
        out.append([list(s) for s in samplers])
    return out


without, with_epoch = orders(False), orders(True)
print(f"{'epoch':>5}  {'without set_epoch':<{14 * WORLD_SIZE}}  with set_epoch(epoch)")
for epoch in range(EPOCHS):
    a = "  ".join(f"r{r}:{without[epoch][r]}" for r in range(WORLD_SIZE))
    b = "  ".join(f"r{r}:{with_epoch[epoch][r]}" for r in range(WORLD_SIZE))
    print(f"{epoch:>5}  {a}   |   {b}")

# %%
for epoch_orders in without + with_epoch:
    seen = [i for per_rank in epoch_orders for i in per_rank]
    check(sorted(seen) == dataset, "each epoch the ranks' shards must be disjoint and together cover "
          "the data set exactly once")
check(all(e == without[0] for e in without), "without set_epoch every epoch should repeat epoch 0's order")
check(len({str(e) for e in with_epoch}) == EPOCHS, "with set_epoch each epoch should get a new order")
uneven = DistributedSampler(list(range(N_EXAMPLES + 1)), num_replicas=WORLD_SIZE, rank=0, shuffle=False)
print(f"\n{N_EXAMPLES + 1} examples on {WORLD_SIZE} ranks: each rank gets {len(uneven)} "
      f"(drop_last=False pads by repeating {len(uneven) * WORLD_SIZE - N_EXAMPLES - 1} example(s))")

# %% [markdown]
# **What you should see:** the shards of one epoch are disjoint and cover all 12 examples. Without
# `set_epoch` every epoch repeats exactly the same order (the shuffle is "random" once, then fixed);
# with it each epoch is reshuffled. Forgetting it rarely crashes anything; it silently trains on the
# same batch sequence every epoch, which can cost accuracy. When the data set does not divide
# evenly, `DistributedSampler` repeats a few examples (or drops them with `drop_last=True`) so that
# every rank runs the same number of steps: a rank with one batch fewer would leave the others
# waiting in an all-reduce forever. (The kit's trainer uses its own resumable sampler,
# `course_lib.data.ShardedSampler`, with the same rule: a fresh permutation per epoch.)
#
# ## 4. Gradient accumulation under DDP: `no_sync()`
#
# With gradient accumulation each optimizer step runs `k` micro-batches and adds up their
# gradients. Under DDP every backward would normally trigger the all-reduces; but only the sum
# matters, so the first `k - 1` backward passes can run inside `with model.no_sync():` (hooks
# off, gradients accumulate locally) and only the last one synchronises. All-reduce is linear, so
# the result is the same either way; only the traffic differs. We **count** the `dist.all_reduce`
# calls per optimizer step (counting, not timing: the rank function wraps `dist.all_reduce` with a
# counter), for k = 4 micro-batches.

# %%
ACCUM = 4
acc_specs = {"BucketedDDP (25 MiB), no_sync": {"kind": "bucketed", "micro": ACCUM},
             "BucketedDDP (25 MiB), every backward syncs": {"kind": "bucketed", "micro": ACCUM, "use_no_sync": False},
             "torch DDP, no_sync": {"kind": "torch-ddp", "micro": ACCUM},
             "torch DDP, every backward syncs": {"kind": "torch-ddp", "micro": ACCUM, "use_no_sync": False},
             "NaiveDDP, sync once after the last": {"kind": "naive", "micro": ACCUM}}
acc = run_ranks(lab_runs.compare_runs, WORLD_SIZE, list(acc_specs.values()), 3, GLOBAL_BATCH,
                optimizer="sgd", lr=0.1)[0]
ref_acc = lab_runs.train_losses(0, 1, "single", 3, GLOBAL_BATCH, micro=ACCUM, optimizer="sgd", lr=0.1)
print(f"{'wrapper':<44} {'all-reduce calls/step':>21} {'max |weights - 1 process|':>26}")
acc_rows = {}
for name, res in zip(acc_specs, acc):
    diff = (res["params"] - ref_acc["params"]).abs().max().item()
    acc_rows[name] = (res["allreduce_calls"][0], diff)
    print(f"{name:<44} {res['allreduce_calls'][0]:>21} {diff:>26.2e}")

# %%
quiet, loud = acc_rows["BucketedDDP (25 MiB), no_sync"][0], acc_rows["BucketedDDP (25 MiB), every backward syncs"][0]
check(loud == ACCUM * quiet, f"without no_sync every one of the {ACCUM} backward passes should sync "
      f"(expected {ACCUM} x {quiet} calls, got {loud})")
check(acc_rows["torch DDP, every backward syncs"][0] == ACCUM * acc_rows["torch DDP, no_sync"][0],
      "torch DDP without no_sync should all-reduce its buckets after every micro-batch")
check(all(d < 1e-5 for _, d in acc_rows.values()),
      "with or without no_sync, accumulation under DDP should give the weights of one process on the "
      "whole batch: the all-reduce is linear, so syncing partial sums changes only the traffic")

# %% [markdown]
# **What you should see:** with `no_sync` one all-reduce per bucket per optimizer step (this model
# fits one 25 MiB bucket; torch DDP caps its first bucket at 1 MiB, which also holds all of it); without
# it `k` times as many, for the *same* weights. NaiveDDP needs no `no_sync`: it only communicates
# when you call `finish_gradient_synchronization()`, so you call it once, after the last
# micro-batch. On a cluster, `k - 1` of every `k` gradient all-reduces are pure waste without
# `no_sync`.
#
# ## 5. Equal curves: DDP against one process
#
# Now a real (short) training run: `STEPS` AdamW steps of TinyGPT on the synthetic Markov task, the
# global batch split over `WORLD_SIZE` ranks, with NaiveDDP, BucketedDDP (one 25 MiB bucket and
# tiny ~100-byte buckets, about one tensor each) and torch's `DistributedDataParallel`, against one
# process on the whole batch. The loss plotted for DDP is the mean of the ranks' losses, i.e. the
# loss on the global batch.

# %%
curve_specs = {"NaiveDDP": {"kind": "naive"},
               "BucketedDDP, 25 MiB": {"kind": "bucketed", "bucket_mb": 25.0},
               "BucketedDDP, tiny buckets": {"kind": "bucketed", "bucket_mb": 1e-4},
               "torch DDP": {"kind": "torch-ddp"}}
curves = run_ranks(lab_runs.compare_runs, WORLD_SIZE, list(curve_specs.values()), STEPS, GLOBAL_BATCH)[0]
ref = lab_runs.train_losses(0, 1, "single", STEPS, GLOBAL_BATCH)
rel = {name: [abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"])]
       for name, res in zip(curve_specs, curves)}

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
ax1.plot(ref["losses"], "k-", lw=3, alpha=0.4, label="1 process, global batch")
for (name, res), style, marker in zip(zip(curve_specs, curves), ["-", "--", ":", "-."], "oxs+"):
    ax1.plot(res["losses"], style, label=f"{name}, {WORLD_SIZE} ranks")
    ax2.semilogy([max(r, 1e-9) for r in rel[name]], marker, ls="none", alpha=0.7, label=name)
ax1.set(xlabel="step", ylabel="loss (nats/token)", title="loss curves: on top of each other")
ax2.axhline(1e-4, color="red", ls=":", label="tolerance 1e-4")
ax2.set(xlabel="step", ylabel="|DDP - 1 process| / 1 process", ylim=(5e-10, 1e-3),
        title="relative difference (bottom row: exactly equal)")
ax1.legend(fontsize=7)
ax2.legend(fontsize=7)
fig.tight_layout()
plt.show()
worst = max(max(r) for r in rel.values())
for name in curve_specs:
    print(f"{name:<28} max relative loss difference over {STEPS} steps: {max(rel[name]):.1e}")

# %%
check(worst <= 1e-4, f"a DDP loss curve differs from one process by up to {worst:.1e} (relative): more "
      "than fp32 rounding (1e-4). Check the mean over ranks and that each rank gets its own slice.")
check(ref["losses"][-1] < ref["losses"][0] - 0.3, "the loss should fall clearly in this run: is the "
      "learning rate or the data wrong?")

# %% [markdown]
# **What you should see:** four DDP curves exactly on top of the single-process one; the relative
# difference is either exactly 0 or about 1e-7 (float rounding: one ulp of the loss), and stays far
# below 1e-4 (over long runs it may grow slowly: Adam divides by the square root of small second
# moments, which amplifies rounding). Data
# parallelism changes *how fast* a step runs, not *what* it computes. The trainer offers the same
# choice at the command line: `train.strategy = "ddp"` (torch DDP) or `"ddp-scratch"`
# (BucketedDDP), e.g. `torchrun --nproc-per-node 2 -m course_lib.train --config
# labs/configs/tiny-cpu.toml --set train.strategy=ddp-scratch`.
#
# ## 6. Predict, then measure: what a step's all-reduce costs
#
# Lab 00's alpha-beta model: one all-reduce of `n` bytes costs `alpha + 2 (p-1)/p x n / bandwidth`.
# A step that sends its gradients in `m` messages pays the latency `m` times:
#
# `t_sync = sum over buckets (alpha + 2 (p-1)/p x bytes_b / bandwidth) = m x alpha + 2 (p-1)/p x total bytes / bandwidth`
#
# First we fit alpha and the bandwidth on this machine, as in lab 00:

# %%
sizes = [2**k for k in range(10, 23 if SMOKE else 25, 2)]  # bytes per rank: 1 KiB .. 4 MiB (smoke), 16 MiB
seconds = run_ranks(collectives.time_all_reduce, WORLD_SIZE, sizes, 5 if SMOKE else 10)[0]
fit = comm.fit_alpha_beta(sizes, seconds, collective="all-reduce", n_ranks=WORLD_SIZE)
print(f"alpha = {fit.alpha_s * 1e6:.0f} us per all-reduce, bus bandwidth = "
      f"{fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s (R^2 = {fit.r_squared:.2f})")

# %% [markdown]
# Then we predict the sync time of the section-2 model's gradients for several bucket sizes, and
# measure it: backward runs with the hooks off (inside `no_sync`), then, after a barrier,
# `finish_gradient_synchronization()` is timed, which launches every bucket back to back and waits
# (no compute to hide behind: this is the pure communication cost). The bucket sizes come from
# BucketedDDP itself (its timeline records each message's bytes).

# %%
configs = [None, 25.0, TIMELINE_BUCKET_MB, 0.05, 1e-4, "naive"]
measured = run_ranks(lab_runs.sync_cost, WORLD_SIZE, configs, SYNC_REPEATS,
                     d_model=TIMELINE_D_MODEL, n_layers=TIMELINE_LAYERS)[0]


def describe(config):
    if config is None or config == "naive":
        return "one bucket" if config is None else "NaiveDDP (per tensor, blocking)"
    return f"{config:g} MiB buckets"


print(f"{'configuration':<32} {'messages':>8} {'MB':>6} {'latency part':>13} {'predicted':>10} "
      f"{'measured':>9} {'meas/pred':>9}")
pred_ms, meas_ms, n_msgs = [], [], []
for row in measured:
    sizes_b = row["bucket_bytes"]
    predicted = sum(fit.predict(b) for b in sizes_b)
    pred_ms.append(predicted * 1e3)
    meas_ms.append(row["seconds"] * 1e3)
    n_msgs.append(len(sizes_b))
    print(f"{describe(row['config']):<32} {len(sizes_b):>8} {sum(sizes_b) / 1e6:>6.2f} "
          f"{len(sizes_b) * fit.alpha_s * 1e3:>10.2f} ms {predicted * 1e3:>7.2f} ms "
          f"{row['seconds'] * 1e3:>6.2f} ms {row['seconds'] / predicted:>9.1f}")

fig, ax = plt.subplots(figsize=(6, 3.8))
ax.loglog(n_msgs, pred_ms, "o--", label="predicted: m x alpha + bytes / bandwidth")
ax.loglog(n_msgs, meas_ms, "s-", label="measured (median, slowest rank)")
ax.set(xlabel="messages per step (buckets)", ylabel="gradient sync time (ms)",
       title=f"{sum(measured[0]['bucket_bytes']) / 1e6:.1f} MB of gradients, {WORLD_SIZE} ranks")
ax.legend(fontsize=8)
plt.show()

# %%
check(meas_ms[4] > meas_ms[0], "many tiny buckets should take longer than one bucket: each message "
      "pays the latency alpha. If not, the timings are noise: run the cell again on a quieter machine")
check(all(p > 0 for p in pred_ms), "every prediction should be positive: did the fit come back empty?")

# %% [markdown]
# **What you should see:** one bucket and 25 MiB buckets are the same configuration here (the whole
# model is ~3 MB: one bucket either way; the two rows differ only by measurement noise), and the
# time grows with the number of messages, as predicted: the latency part `m x alpha` dominates
# once there are tens of messages. The measured times depart from the model by a factor that
# varies with how busy the machine is: each sync also pays for copying gradients in and out of the
# flat buffers, Python hooks and thread hand-offs, and on a shared 2-core CPU every rank waits for
# a core, which puts a few large messages above the model; for many small ones the measurement can
# come out below it, because alpha was fitted on one noisy sweep. Trust the trend more than any
# single number.
#
# **When bucket count matters:** when `m x alpha` is comparable to `bytes / bandwidth`, i.e. when
# the average message is smaller than `alpha x bandwidth` (a few hundred KB here; with NCCL over
# NVLink, alpha is tens of microseconds but the bandwidth hundreds of GB/s, so the crossover is
# larger still, in the MBs). Below it, fewer and bigger buckets win; above it, the bucket size
# hardly changes the total, and smaller buckets are worth it because they start earlier (overlap).
#
# The same model for GPT-2 small (124 M parameters, 0.5 GB of fp32 gradients), predicted with this
# machine's fit:

# %%
with torch.device("meta"):
    big = TinyGPT(ModelConfig.preset("gpt2-small"))
numels = [p.numel() for p in big.parameters()]
print(f"{'GPT-2 small, buckets':<24} {'messages':>8} {'latency part':>13} {'predicted':>10}")
predicted = {}
for mb in (None, 25.0, 1e-4):
    b = lab_runs.bucket_sizes_bytes(numels, mb)
    predicted[mb] = sum(fit.predict(x) for x in b)
    print(f"{('one bucket' if mb is None else 'per tensor' if mb < 1 else f'{mb:g} MiB'):<24} {len(b):>8} "
          f"{len(b) * fit.alpha_s * 1e3:>10.1f} ms {predicted[mb] * 1e3:>8.0f} ms")
extra = predicted[25.0] - predicted[None]
print(f"25 MiB buckets cost {extra * 1e3:.1f} ms more than one bucket: {extra / predicted[None]:.1%} of the "
      f"{predicted[None]:.2f} s all-reduce")
check(0 <= extra < 0.10 * predicted[None],  # a tenth: alpha comes from one noisy sweep (see its R^2)
      "at this size the bandwidth term should dominate: 25 MiB buckets should add only a few latencies, "
      f"under a tenth of the all-reduce; got {extra / predicted[None]:.1%}")

# %% [markdown]
# At this size the bandwidth term dominates: 25 MiB buckets cost a handful of latencies more than
# one bucket (the printed line: a few percent of the whole gradient all-reduce over this machine's
# loopback, always under a tenth), and in exchange the first buckets can start while backward is still running. That is
# the trade torch DDP's default `bucket_cap_mb=25` makes.
#
# ## Where next
#
# * **Exercise 08**: build the bucketed DDP of section 2 yourself: buckets launched during
#   backward, `no_sync` for accumulation; the checks count when each all-reduce starts.
#
# Every DP rank holds a full copy of the weights, the gradients and the optimizer state. The next
# step is to shard what is duplicated: ZeRO-1/2 (`course_lib.parallel.ShardedOptimizer`) and
# ZeRO-3/FSDP (`course_lib.parallel.SimpleFSDP`, then FSDP2's `fully_shard`).
