# %% [markdown]
# # Lab 00 — Orientation: ranks, collectives and the cost of talking
#
# Every technique in this course (data parallelism, ZeRO, FSDP, tensor and pipeline parallelism)
# is a way of splitting work across **ranks**, processes that each own a slice of the model or
# the data and talk to each other through **collectives**. This lab:
#
# 1. shows what the kit contains and checks this machine (`course doctor`);
# 2. starts 2 ranks from this notebook;
# 3. runs the four collectives you will meet everywhere, on tiny tensors, so you can see exactly
#    what each rank holds before and after;
# 4. measures how long an all-reduce takes as the message grows, and fits the **alpha-beta**
#    model (time = latency + bytes / bandwidth) that every communication estimate in this course
#    builds on.
#
# Everything runs on a laptop CPU: ranks are processes on this machine, talking over loopback
# with the **gloo** backend. On a GPU cluster the same code uses **NCCL** over NVLink/InfiniBand.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
WORLD_SIZE = 2  # ranks to start; 2 fits a 2-core laptop

# %%
import matplotlib.pyplot as plt

import course_lib
from course_lib.kit import catalog
from course_lib.kit import doctor
from course_lib.kit.checks import check
from course_lib.estimate import comm
from course_lib.labs import lab00_orientation as collectives
from course_lib.parallel import run_ranks

SMOKE = course_lib.smoke(SMOKE)

# %% [markdown]
# ## 1. What is in the kit
#
# * `labs/` (you are here) teach one idea each and run in minutes on a CPU;
# * `exercises/` are the same ideas with gaps for you to fill; `solutions/` fill them;
# * `course_lib/` is the library every lab uses: the launcher, the estimators, the trainer;
# * the `course` command: `course doctor`, `course labs run`, `course estimate`, ...
#
# The course map: each lab and what it needs from the machine (`cpu-standins`: runs here, with a
# CPU stand-in for one GPU-only part, named by `course doctor`, which also lists the labs your
# checkout has):

# %% tags=["nbval-check-output"]
print(f"{'lab':<32} {'needs':<13} title")
for info in catalog.LABS.values():
    print(f"{info.name:<32} {info.needs:<13} {info.title}")

# %% [markdown]
# ## 2. Is this machine ready?
#
# `course doctor` (the same as the command line) reports versions, devices, which process-group
# backends exist and a verdict per lab. If it lists problems, each comes with its fix.

# %%
report = doctor.gather()
print(doctor.format_report(report))
check(report["backends"]["gloo"], "torch.distributed has no gloo backend: no lab here can start "
      "ranks. Reinstall with ./kit setup.")

# %% [markdown]
# ## 3. Starting ranks from a notebook
#
# `run_ranks(fn, world_size, *args)` starts `world_size` fresh Python processes, joins them into
# a process group, runs `fn(rank, world_size, *args)` in each and hands back the return values in
# rank order. Two rules follow from "fresh processes":
#
# * `fn` must be importable: defined in a `.py` file (here, `course_lib.labs.lab00_orientation`),
#   not in a notebook cell;
# * each rank has its own memory: they share nothing unless they send it.

# %%
ranks = run_ranks(collectives.whoami, WORLD_SIZE)
for info in ranks:
    print(f"rank {info['rank']} of {info['world_size']}: process {info['pid']}, "
          f"backend {info['backend']}, {info['threads']} CPU thread(s)")
check([r["rank"] for r in ranks] == list(range(WORLD_SIZE)),
      "results should come back in rank order 0, 1, ...")

# %% [markdown]
# **What you should see:** one line per rank, each a different process id, backend `gloo`. Each
# rank got its share of the CPU cores: two ranks that each used every core would fight over them.
#
# ## 4. The four collectives
#
# Rank `r` starts with `[10r+1, 10r+2, ...]`, so every number tells you where it came from.

# %% tags=["nbval-check-output"]
shown = run_ranks(collectives.show_collectives, WORLD_SIZE, show_output=False)
for name in shown[0]:
    print(name)
    for rank, per_rank in enumerate(shown):
        before, after = per_rank[name]
        print(f"  rank {rank}: before {before}  ->  after {after}")

# %%
sums = [sum(10 * r + i + 1 for r in range(WORLD_SIZE)) for i in range(WORLD_SIZE)]
for rank, per_rank in enumerate(shown):
    check(per_rank["all_reduce (sum)"][1] == sums,
          f"after all-reduce every rank should hold the elementwise sum {sums}")
    check(per_rank["reduce_scatter (sum)"][1] == [sums[rank]],
          f"after reduce-scatter rank {rank} should hold only element {rank} of the sum")
    check(per_rank["broadcast (from rank 0)"][1] == shown[0]["broadcast (from rank 0)"][0],
          "after broadcast every rank should hold rank 0's tensor")
print("all four collectives did what the table says")

# %% [markdown]
# Read the table as the vocabulary of the rest of the course:
#
# | collective | result | where you will meet it |
# | --- | --- | --- |
# | all-reduce | everyone gets the sum | DDP's gradient sync |
# | reduce-scatter | everyone gets *one slice* of the sum | ZeRO-2/3 and FSDP gradients |
# | all-gather | everyone gets every slice | ZeRO-3/FSDP parameters before each layer |
# | broadcast | everyone gets rank 0's copy | initial weights, configs |
#
# An all-reduce *is* a reduce-scatter followed by an all-gather; exercise 00 builds it that way.
#
# ## 5. The cost of talking: latency and bandwidth
#
# The **alpha-beta model** says one message of `n` bytes costs `alpha + n / bandwidth`: a fixed
# start-up cost (latency) plus a cost per byte. A ring all-reduce over `p` ranks sends
# `2 (p-1)/p x n` bytes per rank. We time gloo's all-reduce over a range of sizes and fit both.

# %%
sizes = [2**k for k in range(10, 21 if SMOKE else 27, 2)]  # bytes per rank: 1 KiB .. 64 MiB
repeats = 3 if SMOKE else 10
seconds = run_ranks(collectives.time_all_reduce, WORLD_SIZE, sizes, repeats)[0]
fit = comm.fit_alpha_beta(sizes, seconds, collective="all-reduce", n_ranks=WORLD_SIZE)
print(f"{'message':>10} {'measured':>11} {'model':>11}")
for n, t in zip(sizes, seconds):
    print(f"{n / 2**10:>7.0f} KiB {t * 1e3:>8.3f} ms {fit.predict(n) * 1e3:>8.3f} ms")
print(f"\nlatency alpha = {fit.alpha_s * 1e6:.1f} us per all-reduce; "
      f"bus bandwidth = {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s; R^2 = {fit.r_squared:.3f}")
check(fit.bandwidth_bytes_per_s > 0 and fit.alpha_s >= 0,
      "the fit should find a positive bandwidth: did the timings come back empty?")

# %%
fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(sizes, seconds, "o", label="measured (slowest rank, median)")
model_x = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 50) for i in range(51)]
ax.loglog(model_x, [fit.predict(x) for x in model_x], "-",
          label=f"fit: {fit.alpha_s * 1e6:.0f} us + 2(p-1)/p x n / {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
ax.set_xlabel("message size per rank (bytes)")
ax.set_ylabel("all-reduce time (s)")
ax.set_title(f"gloo all-reduce on {WORLD_SIZE} CPU ranks")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **What you should see:** a flat line on the left (small messages cost about `alpha` whatever
# their size: latency-bound) bending into a slope of 1 on the right (large messages cost
# bytes / bandwidth: bandwidth-bound). Where the two meet, `n = alpha x bandwidth`, is the message
# size below which sending more, smaller messages is a bad idea; it is why DDP packs gradients
# into ~25 MB buckets instead of all-reducing each tensor on its own. On a shared machine single
# points can jump well off the line: read the trend, as the fit's R^2 says.
#
# On CPU over loopback, bandwidth is a few GB/s at best. NVLink moves hundreds of GB/s and
# InfiniBand tens of GB/s per link, so the same formulas give very different answers on a
# cluster; the estimators in `course_lib.estimate` take the bandwidth as an input, and you can feed
# them the one you just measured.

# %%
bucket = 25 * 10**6
print(f"the model's all-reduce time for one 25 MB bucket on these {WORLD_SIZE} ranks: "
      f"{fit.predict(bucket) * 1e3:.1f} ms; latency and bandwidth cost equal at "
      f"{fit.alpha_s * fit.bandwidth_bytes_per_s / 2**10 / (2 * (WORLD_SIZE - 1) / WORLD_SIZE):.0f} KiB")

# %% [markdown]
# ## Where next
#
# * **Exercise 00**: build this all-reduce yourself from `send` and `recv` (a ring).
# * **Lab 01**: where the memory of a training run goes, and how ZeRO shards it.
