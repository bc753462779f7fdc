# %% [markdown]
# # Lab 09 — ZeRO, FSDP and DeepSpeed
#
# Data parallelism (lab 08) keeps a whole copy of the model state on every rank: weights,
# gradients and the optimizer's moments. ZeRO (Rajbhandari et al., 2020) removes that redundancy
# by **sharding** the state over the N data-parallel ranks: stage 1 shards the optimizer state,
# stage 2 also the gradients, stage 3 also the parameters (FSDP is PyTorch's stage 3). This lab
# puts numbers next to the popular claims and measures each one:
#
# 1. **the 7B question**: why a 7B model "needs 112-126 GB", and what each ZeRO stage leaves on
#    one GPU at N = 8 and 64;
# 2. **the ZeRO table made real**: bytes per rank measured for DDP, ZeRO-1, -2 and -3 on 2 and 4
#    ranks, next to the estimate, to the byte;
# 3. **the claims**: "ZeRO-3 cuts memory 64x", "ZeRO-1 gives 4x lower memory": what they assume;
# 4. **communication**: bytes on the wire per step, measured, against 2Ψ and 3Ψ;
# 5. **FSDP2 in the trainer**: `reshard_after_forward`, bf16 mixed precision, CPU offload;
# 6. **sharded checkpoints**: saved on 2 ranks, consolidated into a plain model, resumed on 1;
# 7. **DeepSpeed** ZeRO 1/2/3 from a generated config.
#
# Ranks are processes on this machine talking over loopback with **gloo** (on GPUs the same code
# uses NCCL), and "memory" is the bytes of CPU tensors each rank holds (on GPUs: CUDA memory).
# Rank functions live in `course_lib.labs.lab09_zero_fsdp_deepspeed`
# (spawned ranks can only run importable code).

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
WORLDS = (2, 4)  # sections 2-4: ranks for the measured one-step runs
STEPS = 40  # sections 5-7: training steps per trainer run
GLOBAL_BATCH = 16  # sequences per optimizer step (each rank of 2 gets half)

# %%
import json
import shutil
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.trainer import config as train_config
from course_lib.kit.checks import check
from course_lib.kit.scratch import fresh
from course_lib.estimate import format_bytes
from course_lib.estimate.comm import comm_elements_per_step
from course_lib.estimate.memory import RECIPES, PrecisionRecipe, model_state_bytes
from course_lib.parallel import run_ranks
from course_lib.checkpoint.dcp import consolidate_sharded
from course_lib.model import TinyGPT
from course_lib.labs import lab09_zero_fsdp_deepspeed as lab09_runs
from course_lib.train import train

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    STEPS = 4  # even: the first run checkpoints at STEPS/2 and a 1-rank run resumes there
torch.set_num_threads(1)  # the single-process reference runs in this kernel: one thread, like each rank
CONFIG = Path(course_lib.__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"
RUNS = Path(tempfile.mkdtemp(prefix="lab09-"))  # scratch: every file this lab writes

# %% [markdown]
# ## 1. The 7B question
#
# A claim you will meet in many places:
#
# > "A 7B model needs 112-126 GB just for weights, gradients and Adam states: more than one
# > 80 GB GPU has."
#
# Both ends are bytes per parameter times 7 x 10^9. **112 GB = 16 B/param**, which two different
# recipes give: mixed precision as the ZeRO paper counts it (bf16 weights 2 + bf16 gradients 2 +
# fp32 master weights 4 + Adam's two fp32 moments 8; recipe `mixed-adam`) or everything in fp32
# (4 + 4 + 8; `fp32-adam`). **126 GB = 18 B/param**: mixed precision that keeps the gradients in
# fp32 (a common way to write it: "6 bytes of weights, an fp32 and a half-precision copy, 4 bytes
# of fp32 gradients, 8 bytes of Adam states"). `course_lib.estimate.memory.model_state_bytes`
# takes the recipe as an argument, so each number comes with its assumptions:

# %% tags=["nbval-check-output"]
PSI_7B = 7e9
FP32_GRADS = PrecisionRecipe(2, 4, 4, 8, "mixed-adam+fp32-grads",
                             "bf16 weights 2, fp32 gradients 4, fp32 master 4, Adam moments 8")
recipes = {"mixed-adam": RECIPES["mixed-adam"], "fp32-adam": RECIPES["fp32-adam"],
           "mixed-adam+fp32-grads": FP32_GRADS, "mixed-adam-fp32-grads": RECIPES["mixed-adam-fp32-grads"]}
print(f"{'recipe':<24}{'params':>7}{'grads':>7}{'master':>7}{'Adam':>6}{'B/param':>9}{'7B total':>10}")
seven_b = {}
for name, r in recipes.items():
    est = model_state_bytes(PSI_7B, recipe=r)
    seven_b[name] = est.total
    print(f"{name:<24}{r.param_bytes:>7g}{r.grad_bytes:>7g}{r.master_bytes:>7g}{r.optimizer_bytes:>6g}"
          f"{r.bytes_per_param:>9g}{format_bytes(est.total, 'GB', 0):>10}")
check(seven_b["mixed-adam"] == seven_b["fp32-adam"] == 112e9, "16 B/param x 7e9 should be 112 GB")
check(seven_b["mixed-adam+fp32-grads"] == 126e9, "18 B/param x 7e9 should be 126 GB")

# %% [markdown]
# **What you should see:** 112 GB from two recipes that agree on the total and disagree on every
# line, 126 GB from fp32 gradients, and a fourth recipe (20 B/param: bf16 gradients *and* an fp32
# accumulation buffer) that the claim's range leaves out. Activations come on top (lab 01).
# Every one is above 80 GB, so plain data parallelism cannot train it on 80 GB GPUs at all:
# each rank would hold the whole 112 GB.
#
# The answer is ZeRO. Per GPU, with the ZeRO paper's 16 B/param recipe:

# %% tags=["nbval-check-output"]
GPU_GB = 80
per_gpu = {}
print(f"{'':<10}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>10}   fits 80 GB?")
for n in (8, 64):
    for stage in range(4):
        est = model_state_bytes(PSI_7B, recipe="mixed-adam", zero_stage=stage, dp=n)
        per_gpu[(n, stage)] = est
        print(f"ZeRO-{stage} N={n:<3}{est.params / 1e9:>9.2f}G{est.grads / 1e9:>9.2f}G{est.optimizer / 1e9:>10.2f}G"
              f"{est.total / 1e9:>9.2f}G   {'yes' if est.total < GPU_GB * 1e9 else 'no'}")
check(per_gpu[(8, 0)].total == 112e9 and per_gpu[(64, 3)].total == 112e9 / 64,
      "ZeRO-0 keeps all 112 GB per GPU; ZeRO-3 divides it by N")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True, layout="constrained")
for ax, n in zip(axes, (8, 64)):
    bottom = [0.0] * 4
    for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        vals = [getattr(per_gpu[(n, s)], part) / 1e9 for s in range(4)]
        ax.bar([f"ZeRO-{s}" for s in range(4)], vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(GPU_GB, color="tab:red", linestyle="--", label="80 GB GPU")
    ax.set(title=f"7B, mixed-adam, N = {n}", ylabel="GB per GPU (model state)")
    ax.grid(alpha=0.3, axis="y")
axes[0].legend(fontsize=8)
plt.show()

# %% [markdown]
# **What you should see:** at N = 8, ZeRO-1 already brings the 112 GB to 38.5 GB (the 84 GB of
# optimizer state is split eight ways), ZeRO-2 to 26.25 GB, ZeRO-3 to 14 GB. At N = 64, ZeRO-1
# and -2 level off towards the replicated state they cannot shard (the 2-byte weights and, for
# stage 1, gradients),
# while ZeRO-3 reaches 1.75 GB. So the answer to "does a 7B model fit?" is "with ZeRO-1 on 8
# GPUs, yes, if the activations fit in the rest".
#
# ## 2. The ZeRO table made real
#
# Now the same bookkeeping, measured. `lab09_runs.measure_step` builds the same small model on
# every rank (4 bias-free `Linear(32, 32)`: Ψ = 4096 parameters, fp32), wraps it for one strategy,
# runs **one** real training step (forward, backward, gradient sync, AdamW step) and then counts
# the bytes this rank holds for parameters, gradients and optimizer moments
# (`course_lib.parallel.memory_census`: every tensor's storage once). Strategies: torch DDP
# (stage 0), the course's `ShardedOptimizer` (ZeRO-1 keeping full gradients, ZeRO-2
# reduce-scattering them), the course's `SimpleFSDP` and torch FSDP2 `fully_shard` (both ZeRO-3).
# Everything is fp32, so the estimate uses recipe `fp32-adam` (4 + 4 + 8 B/param). Two launches:
# one per world size, every strategy in each.

# %%
STRATS = ["ddp", "ddp-naive", "zero1", "zero2", "zero3-scratch", "fsdp2"]
PADDED = {"dim": 31}  # 961 elements per weight: not a multiple of 2 or 4
cases = [(s, None) for s in STRATS] + [("zero3-scratch", PADDED), ("fsdp2", PADDED)]
measured = {}
for n in WORLDS:
    per_rank = run_ranks(lab09_runs.measure_all, n, cases, threads_per_rank=1, show_output=False, timeout=300)
    for rank, rows in enumerate(per_rank):
        for (s, spec), row in zip(cases, rows):
            measured[(s, n, "padded" if spec else "even", rank)] = row
PSI = measured[("ddp", WORLDS[0], "even", 0)]["num_params"]

print(f"Ψ = {PSI:,} parameters, fp32; bytes per rank (rank 0; every rank holds the same)\n")
print(f"{'strategy':<15}{'N':>2}{'stage':>6}{'params':>8}{'grads':>8}{'moments':>9}{'total':>8}"
      f"{'estimate':>10}{'equal':>7}{'step ctrs':>10}")
for n in WORLDS:
    for s in STRATS:
        row = measured[(s, n, "even", 0)]
        m, e = row["memory_measured"], row["memory_estimated"]
        print(f"{s:<15}{n:>2}{row['zero_stage']:>6}{m['params']:>8}{m['grads']:>8}{m['optimizer']:>9}{m['total']:>8}"
              f"{e['total']:>10.0f}{str(row['memory_equal']):>7}{row['optimizer_step_bytes']:>10}")

# %%
fig, axes = plt.subplots(1, len(WORLDS), figsize=(12, 3.8), sharey=True, layout="constrained")
for ax, n in zip(axes, WORLDS):
    xs = range(len(STRATS))
    for offset, key, label in ((-0.2, "memory_estimated", "estimated"), (0.2, "memory_measured", "measured")):
        bottom = [0.0] * len(STRATS)
        for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
            vals = [measured[(s, n, "even", 0)][key][part] / 1024 for s in STRATS]
            ax.bar([x + offset for x in xs], vals, width=0.38, bottom=bottom, color=color,
                   alpha=0.45 if label == "estimated" else 1.0,
                   label=f"{part} ({label})" if n == WORLDS[0] else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(xs), STRATS, rotation=30, fontsize=8)
    ax.set(title=f"N = {n}: estimated (pale, left) vs measured", ylabel="KiB per rank")
    ax.grid(alpha=0.3, axis="y")
axes[0].legend(fontsize=7, ncol=2)
plt.show()

# %%
for (s, n, kind, rank), row in measured.items():
    if kind != "even":
        continue
    check(row["memory_equal"], f"{s} on {n} ranks, rank {rank}: measured {row['memory_measured']} should equal "
          f"the estimate {row['memory_estimated']} byte for byte; a difference means some state is held "
          "that the ZeRO table does not count (a bucket, padding, an unsharded copy)")
print(f"all {sum(k[2] == 'even' for k in measured)} rank measurements equal the estimate to the byte")

# %% [markdown]
# **What you should see:** the pale and solid bars are the same height everywhere: DDP holds
# 16 B x Ψ = 65,536 B, ZeRO-1 shards only the 8 B/param of moments, ZeRO-2 also the gradients,
# and both ZeRO-3 engines hold 16Ψ/N. Two things the table needs to be exact:
#
# * **AdamW's `step` counters** (last column) are not in the estimate: AdamW keeps one 0-d fp32
#   tensor per parameter *tensor* it updates (4 bytes, not per element), so 4 weights cost 16
#   bytes whatever their size. A sharding engine that gives each rank a *piece of every* tensor
#   (FSDP) keeps all 4 counters on every rank; `ShardedOptimizer` gives each rank whole tensors
#   (here 4 equal weights: N = 2 owns 2, N = 4 owns 1, which is why its shards are exactly Ψ/N),
#   so it keeps only its own tensors' counters. Negligible for a real model, but they are bytes.
# * **Even shards.** Ψ = 4096 divides by 2 and 4. With `Linear(31, 31)` (961 elements, divisible
#   by neither) the engines pad, and the measured bytes exceed the estimate by exactly the padding:

# %%
print(f"{'engine':<15}{'N':>2}{'Ψ':>6}{'held elements':>15}{'estimate':>10}{'padding/rank':>14}   how it pads")
for n in WORLDS:
    for s, how in (("zero3-scratch", "flat shard rounded up to a multiple of N"),
                   ("fsdp2", "dim 0 (rows) rounded up to a multiple of N")):
        row = measured[(s, n, "padded", 0)]
        psi_p = row["num_params"]
        held = row["census"]["param_elements"]
        pad = held - psi_p / n
        print(f"{s:<15}{n:>2}{psi_p:>6}{held:>15}{psi_p / n:>10.2f}{pad:>14.2f}   {how}")
        m, e = row["memory_measured"], row["memory_estimated"]
        check(m["total"] - e["total"] == 16 * pad, f"{s}, N={n}: the excess over the estimate should be the "
              f"padding: 16 B x {pad} elements, got {m['total'] - e['total']}")

# %% [markdown]
# **What you should see:** `SimpleFSDP` flattens each weight and pads it to a multiple of N (at
# most N-1 elements per tensor); FSDP2 shards along rows, so it pads whole rows (up to (N-1) x 31
# elements per weight). The padding is held as parameters, gradients and both moments (16 B per
# element) and is sent on the wire too. Real engines pad further for alignment; the estimator
# deliberately divides exactly.
#
# ## 3. The claims next to the measurement
#
# Two more claims:
#
# > "ZeRO-3 cuts memory 64x." and "ZeRO-1 gives 4x lower memory."
#
# Both are the ZeRO paper's numbers for **one** setting (N = 64, mixed precision). The reduction
# factor is (model state without ZeRO) / (model state per rank with ZeRO). Stage 3 divides
# everything by N, so its factor *is* N. Stage 1 divides only the optimizer's K = 12 B/param of
# 16: the factor 16 / (4 + 12/N) approaches 4 only as N grows without bound. In fp32 (what we
# measure: 8 of 16 bytes sharded) the limit is 2. The curves are the estimator; the dots are the
# measured bytes from section 2.

# %%
NS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def factor(recipe, stage, n):
    return model_state_bytes(1, recipe=recipe, zero_stage=0, dp=1).total / \
        model_state_bytes(1, recipe=recipe, zero_stage=stage, dp=n).total


fig, axes = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
for ax, recipe in zip(axes, ("mixed-adam", "fp32-adam")):
    for stage, color in ((1, "tab:blue"), (2, "tab:orange"), (3, "tab:green")):
        ax.plot(NS, [factor(recipe, stage, n) for n in NS], "-", color=color, label=f"ZeRO-{stage} (estimate)")
    ax.set(xscale="log", yscale="log", xlabel="data-parallel ranks N", ylabel="memory reduction factor",
           title=f"recipe {recipe}")
    ax.set_xticks(NS, [str(n) for n in NS])
    ax.grid(alpha=0.3, which="both")
for stage, s, color in ((1, "zero1", "tab:blue"), (2, "zero2", "tab:orange"), (3, "fsdp2", "tab:green")):
    got = [measured[("ddp", n, "even", 0)]["memory_measured"]["total"] /
           measured[(s, n, "even", 0)]["memory_measured"]["total"] for n in WORLDS]
    axes[1].plot(WORLDS, got, "o", color=color, markersize=8, label=f"{s} measured")
axes[1].legend(fontsize=8)
axes[0].legend(fontsize=8)
plt.show()

# %%
print(f"{'N':>5}{'ZeRO-1 mixed':>14}{'ZeRO-2 mixed':>14}{'ZeRO-3':>8}{'ZeRO-1 fp32':>13}{'measured zero1':>16}"
      f"{'measured zero3':>16}")
for n in (2, 4, 8, 64, 1024):
    line = (f"{n:>5}{factor('mixed-adam', 1, n):>13.2f}x{factor('mixed-adam', 2, n):>13.2f}x"
            f"{factor('mixed-adam', 3, n):>7.0f}x{factor('fp32-adam', 1, n):>12.2f}x")
    if n in WORLDS:
        base = measured[("ddp", n, "even", 0)]["memory_measured"]["total"]
        z1 = base / measured[("zero1", n, "even", 0)]["memory_measured"]["total"]
        z3 = base / measured[("fsdp2", n, "even", 0)]["memory_measured"]["total"]
        line += f"{z1:>15.2f}x{z3:>15.2f}x"
        check(abs(z1 - factor("fp32-adam", 1, n)) < 1e-12 and abs(z3 - n) < 1e-12,
              f"N={n}: the measured factors should be the estimator's ({factor('fp32-adam', 1, n):.2f}x, {n}x)")
    print(line)
check(factor("mixed-adam", 3, 64) == 64 and factor("mixed-adam", 1, 64) < 4,
      "ZeRO-3's factor at N=64 is 64; ZeRO-1's is below 4 at every finite N")

# %% [markdown]
# **What you should see:** ZeRO-3's line is the diagonal (factor = N): 64x holds at N = 64, and
# it is 2x on 2 ranks, 8x on 8. ZeRO-1 in mixed precision gives 1.6x at N = 2, 2.29x at 4,
# 2.91x at 8, 3.82x at 64, and creeps toward 4x; in fp32 (the measured dots) it gives 1.33x and
# 1.6x on 2 and 4 ranks, toward 2x. The measured dots sit on the curves. ZeRO-2 in mixed
# precision tends to 8x (only the 2 B/param of weights stays replicated).
#
# ## 4. Communication: what the sharding costs on the wire
#
# The ZeRO paper's accounting per rank per step, with ring collectives (each rank sends (N-1)/N
# of the buffer per reduce-scatter or all-gather): DDP all-reduces the gradients, **2Ψ(N-1)/N**
# elements (a reduce-scatter + an all-gather); ZeRO-1 and -2 reduce-scatter the gradients and
# all-gather the updated parameters, the same **2Ψ(N-1)/N**; ZeRO-3 gathers the parameters
# before forward *and* again before backward, **3Ψ(N-1)/N**. `course_lib.parallel.wire` counted
# every collective inside the measured step of section 2, charged with the same ring convention.

# %%
print(f"{'strategy':<15}{'N':>2}{'measured B':>12}{'estimate B':>12}{'flags B':>9}{'rest':>6}   collectives (count)")
for n in WORLDS:
    for s in STRATS:
        row = measured[(s, n, "even", 0)]
        rest = row["wire_measured_bytes"] - row["wire_estimated_bytes"] - row["wire_overhead_bytes"]
        kinds = ", ".join(f"{k} {v['count']}" for k, v in row["wire_by_kind"].items())
        print(f"{s:<15}{n:>2}{row['wire_measured_bytes']:>12.0f}{row['wire_estimated_bytes']:>12.0f}"
              f"{row['wire_overhead_bytes']:>9.0f}{rest:>6.0f}   {kinds}")
        check(abs(rest) < 1e-9, f"{s}, N={n}: measured bytes should be the estimate plus the documented flags")
        est_factor = 3 if lab09_runs.COMM_STRATEGY[s] == "zero3" else 2
        est = comm_elements_per_step(PSI, lab09_runs.COMM_STRATEGY[s], world_size=n).bytes_per_rank(4)
        check(row["wire_estimated_bytes"] == est == est_factor * PSI * (n - 1) / n * 4,
              f"{s}: the estimate should be {est_factor}Ψ(N-1)/N x 4 bytes")

# %% [markdown]
# **What you should see:** for every engine, measured = estimate + flags, with "rest" 0.
# DDP, ZeRO-1 and ZeRO-2 send 2Ψ(N-1)/N x 4 B (16,384 B at N = 2, 24,576 B at N = 4) and ZeRO-3
# 1.5x that: ZeRO-1 and -2 cost nothing extra on the wire, ZeRO-3 costs one more parameter
# all-gather per step. The **flags**: the course's from-scratch engines (`NaiveDDP`,
# `ShardedOptimizer`) first all-reduce one int32 per parameter *tensor* saying "this rank has a
# gradient for it", so every rank issues the same collectives even when some parameter went
# unused: 4 tensors x 4 B, all-reduced: 2(N-1)/N x 16 B. torch DDP and FSDP2 know their parameter
# set up front and send none. `ShardedOptimizer` (ZeRO-1 and -2) reduce-scatters the gradients
# and then sends the updated parameters as one broadcast per owner instead of an all-gather: the
# same (N-1)/N x 4Ψ bytes under the ring convention.
#
# ## 5. FSDP2 in the trainer
#
# Now a real training run: `course_lib.train` with `train.strategy = "fsdp"` (torch FSDP2, one
# `fully_shard` unit per transformer block plus the root) on 2 ranks, each with half the global
# batch, against `single` in this kernel. Three options, each a trade:
#
# * `reshard_after_forward = True` (ZeRO-3): a block's gathered weights are freed after its
#   forward and gathered again for its backward: least memory, 3Ψ on the wire.
#   `False` (ZeRO-2-like): the weights stay until backward: one all-gather fewer (2Ψ), but every
#   block's full weights are held from forward to backward.
# * bf16 mixed precision: FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16,
#   reduce_dtype=float32)`: the shards stay fp32 (the master weights), the all-gather and the
#   compute are in bf16 (half the gather bytes), gradients are reduced in fp32.
# * `cpu_offload`: shards, gradients and the optimizer step live in CPU memory (on a GPU this
#   frees device memory for PCIe traffic every step; on this CPU it changes nothing but the path).
#
# Each rank counts its collectives for the whole run, and after training measures the parameter
# bytes it holds between one forward and its backward. The first run also saves checkpoints
# (section 6). One launch for all runs.

# %%
def trainer_cfg(*sets):
    base = ["train.progress=false", "train.peak_flops=1e12", "train.metrics_flush_s=0",
            f"train.max_steps={STEPS}", f"schedule.warmup_steps={max(1, STEPS // 10)}",
            "checkpoint.async_save=false"]
    return train_config.load(CONFIG, base + list(sets))


def losses_of(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


single_cfg = trainer_cfg(f"train.micro_batch={GLOBAL_BATCH}")
single = train(single_cfg, fresh(RUNS / "single"))  # the one-process reference, in this kernel
single_losses = losses_of(RUNS / "single")
HALF = f"train.micro_batch={GLOBAL_BATCH // 2}"
FSDP_RUNS = {
    "fsdp": trainer_cfg(HALF, "train.strategy=fsdp", f"checkpoint.save_every={STEPS // 2}"),
    "fsdp, reshard_after_forward=False": trainer_cfg(HALF, "train.strategy=fsdp",
                                                     "parallel.reshard_after_forward=false"),
    "fsdp, bf16": trainer_cfg(HALF, "train.strategy=fsdp", "train.precision=bf16"),
    "fsdp, cpu_offload": trainer_cfg(HALF, "train.strategy=fsdp", "parallel.cpu_offload=true"),
}
runs = [dict(cfg=c, out_dir=str(fresh(RUNS / name.replace(", ", "-").replace("=", ""))), want_weights=name == "fsdp",
             probe_memory=True) for name, c in FSDP_RUNS.items()]
fsdp = dict(zip(FSDP_RUNS, run_ranks(lab09_runs.train_runs, 2, runs, threads_per_rank=1, show_output=False,
                                      timeout=600)[0]))
NUM_PARAMS = single.model.num_params()
print(f"TinyGPT, Ψ = {NUM_PARAMS:,} parameters; {STEPS} steps, global batch {GLOBAL_BATCH}")
for name, rep in fsdp.items():
    print(f"{name:<36} final loss {rep['final_loss']:.6f}")
print(f"{'single (1 process)':<36} final loss {single.final_loss:.6f}")

# %%
def plot_vs_single(runs, title):
    """Loss curves of ``runs`` ({name: report with "losses"}) over the single-process curve, and
    their relative difference from it."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
    steps = range(1, len(single_losses) + 1)
    ax1.plot(steps, single_losses, linewidth=4, alpha=0.3, color="black", label="single")
    for name, rep in runs.items():
        ax1.plot(steps, rep["losses"], linewidth=1, label=name)
        ax2.plot(steps, [(a - b) / b for a, b in zip(rep["losses"], single_losses)], "o-", markersize=3,
                 label=name)
    ax1.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax2.set(xlabel="step", ylabel="(loss - single) / single", title="relative difference")
    ax2.set_yscale("symlog", linthresh=1e-7)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    plt.show()


ok = fsdp
plot_vs_single(fsdp, "FSDP2 on 2 ranks vs one process")


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


rel = {name: max_rel(rep["losses"], single_losses) for name, rep in ok.items()}
for name, r in rel.items():
    print(f"{name:<36} largest relative difference from single: {r:.1e}")
for name in ("fsdp", "fsdp, reshard_after_forward=False"):
    check(rel[name] <= 1e-4, f"{name} in fp32 should follow the one-process run (relative difference "
          f"{rel[name]:.1e}); a larger one means the two ranks did not see the global batch, or the "
          "gradients were not averaged")
check(rel["fsdp, bf16"] <= 2e-2, "bf16 compute should stay within 2% of fp32 over this short run")
offload_rel = max_rel(ok["fsdp, cpu_offload"]["losses"], ok["fsdp"]["losses"])
print(f"cpu_offload vs fsdp: largest relative difference {offload_rel:.1e}")
check(offload_rel <= 1e-6, "on a CPU machine cpu_offload moves nothing: its losses should equal plain fsdp's")

# %%
G = (2 - 1) / 2 * 4 * NUM_PARAMS  # one ring pass over Ψ fp32 elements, bytes per rank on 2 ranks
print(f"bytes per rank per step; one pass over Ψ in fp32 = (N-1)/N x 4Ψ = {G:,.0f} B\n")
print(f"{'run':<36}{'all-gather':>22}{'reduce-scatter':>22}{'other':>8}{'held fwd->bwd':>15}")
for name, rep in ok.items():
    ps = rep["wire"]["per_step"]
    ag = {k.split()[1]: v for k, v in ps.items() if k.startswith("all-gather") and v["bytes"] >= 1000}
    rs = {k.split()[1]: v for k, v in ps.items() if k.startswith("reduce-scatter")}
    other = rep["wire"]["bytes_per_step"] - sum(v["bytes"] for v in ag.values()) - sum(v["bytes"] for v in rs.values())
    fmt = lambda d: ", ".join(f"{v['bytes'] / G:.2f} pass {k}" for k, v in d.items())  # noqa: E731
    print(f"{name:<36}{fmt(ag):>22}{fmt(rs):>22}{other:>8.0f}{rep['held_fwd']:>15,}")
    rep["passes"] = (sum(v["bytes"] for v in ag.values()) / G, sum(v["bytes"] for v in rs.values()) / G)
check(abs(ok["fsdp"]["passes"][0] - 2) < 1e-9 and abs(ok["fsdp"]["passes"][1] - 1) < 1e-9,
      "reshard_after_forward=True should gather every parameter twice (forward, backward) and "
      "reduce-scatter the gradients once: 3 passes")
check(abs(ok["fsdp, reshard_after_forward=False"]["passes"][0] - 1) < 1e-9,
      "reshard_after_forward=False should gather each parameter once per step")
check(abs(ok["fsdp, bf16"]["passes"][0] - 1) < 1e-9,
      "bf16 gathers twice, at half the bytes: the same bytes as one fp32 pass")
check(ok["fsdp"]["held_fwd"] == 4 * NUM_PARAMS // 2 and
      ok["fsdp, reshard_after_forward=False"]["held_fwd"] == 4 * NUM_PARAMS + 4 * NUM_PARAMS // 2,
      "between forward and backward, resharding holds only the fp32 shards (4Ψ/N); keeping the "
      "gathered weights holds 4Ψ more")

# %% [markdown]
# **What you should see:** every fp32 curve lies on the single-process one (relative differences
# around 1e-7: the same arithmetic, summed in another order); bf16 drifts a little (its
# matmuls round to 8 mantissa bits) and still trains. In the table, "pass" is one ring pass over
# Ψ fp32 elements. Resharding after forward costs 2 gather passes + 1 reduce-scatter pass
# (3Ψ, ZeRO-3's number) and holds only the shards between forward and backward; keeping the
# weights saves one gather pass (2Ψ) and holds the full weights (4Ψ bytes) on top of its own shard
# in that window, three times the resharded run's bytes (in
# a real model with many blocks, that is the whole model on every GPU again, the memory that
# ZeRO-3 exists to avoid). bf16 gathers twice at 2 bytes/element: the bytes of one fp32 pass.
# Gradients are reduce-scattered in fp32 either way (`reduce_dtype`). "other" is the trainer's
# own traffic: one fp32 loss all-reduce per step (4 B) plus the checkpoint's planning messages,
# spread over the steps.
#
# `cpu_offload` gives the fsdp losses and the fsdp bytes: on this machine the "device" already
# is CPU memory, so only the code path changes. On a GPU node it is a real trade: shards,
# gradients and the optimizer step live in host memory, so the GPU holds only the weights being
# gathered and the activations; the price is a PCIe copy of the parameters to the GPU and of the
# gradients back every step, and an optimizer step at CPU speed. (`CPUOffloadPolicy` pins host
# memory by default for fast copies; pinning needs a GPU, so the strategy turns it off on CPU.)
#
# ## 6. Sharded checkpoints
#
# FSDP2 saves **sharded** checkpoints with `torch.distributed.checkpoint` (DCP): every rank
# writes its own shards, nobody gathers the model. The first run of section 5 saved at step
# `STEPS/2` and at the end. Two things a sharded checkpoint must allow:
#
# * **consolidation**: `course_lib.checkpoint.dcp.consolidate_sharded(path)` stitches the shards
#   into a plain state dict (no process group needed) for a single-process `TinyGPT`;
# * **resuming on another world size**: we delete the final checkpoint and resume the run from
#   step `STEPS/2` on **1** rank; DCP reshards on load. Its losses must follow the 2-rank run's.

# %%
out_fsdp = RUNS / "fsdp"
ckpts = sorted((out_fsdp / "checkpoints").glob("step_*"))
print("checkpoints:", [p.name for p in ckpts])
print("files of the last one:", sorted(p.name for p in ckpts[-1].rglob("*") if p.is_file())[:8])
plain = TinyGPT(train_config.build_model_config(FSDP_RUNS["fsdp"]))
plain.load_state_dict(consolidate_sharded(ckpts[-1]), strict=True)
trained = fsdp["fsdp"]["weights"]
same = [k for k, v in plain.state_dict().items() if torch.equal(v, trained[k])]
print(f"consolidated into a plain TinyGPT: {len(same)} of {len(trained)} tensors bit-identical to the "
      "weights the 2 ranks trained")
check(len(same) == len(trained), "every consolidated tensor should equal the trained full weights exactly")

cut = fresh(RUNS / "fsdp-resumed-on-1")
shutil.copytree(out_fsdp, cut)
shutil.rmtree(cut / "checkpoints" / ckpts[-1].name)  # as if the run had died before its last save
one_cfg = trainer_cfg(f"train.micro_batch={GLOBAL_BATCH}", "train.strategy=fsdp")
back = run_ranks(lab09_runs.train_runs, 1, [dict(cfg=one_cfg, out_dir=str(cut), resume=True)],
                 threads_per_rank=1, show_output=False, timeout=300)[0][0]
resumed_losses = losses_of(cut)
half = STEPS // 2
r_rel = max_rel(resumed_losses[half:], fsdp["fsdp"]["losses"][half:])
print(f"resumed on 1 rank from step {back['resumed_from']} to {back['steps']}; "
      f"largest relative difference from the 2-rank run after the resume: {r_rel:.1e}")
check(back["resumed_from"] == half and back["steps"] == STEPS, f"the 1-rank run should resume from step {half}")
check(r_rel <= 1e-4, "after resuming on 1 rank the losses should follow the 2-rank run: same weights, "
      "optimizer state, data position and global batch")

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.plot(range(1, len(fsdp["fsdp"]["losses"]) + 1), fsdp["fsdp"]["losses"], linewidth=4, alpha=0.3, label="FSDP2, 2 ranks")
ax.plot(range(half + 1, STEPS + 1), resumed_losses[half:], "o-", markersize=3, label="resumed on 1 rank")
ax.axvline(half, color="tab:green", linestyle="--", label=f"checkpoint {half}")
ax.set(xlabel="step", ylabel="loss", title="a sharded checkpoint changes world size")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **What you should see:** the checkpoint folder holds one shard file per rank plus DCP's
# metadata; consolidated, it loads into a plain one-process model with every tensor
# bit-identical; and the run resumed on 1 rank continues on the 2-rank curve. A sharded save
# scales (every rank writes its part in parallel, nobody needs memory for the whole model), and
# the world size of the next run is free.
#
# ## 7. DeepSpeed ZeRO 1/2/3
#
# DeepSpeed implements the same stages behind one engine: `deepspeed.initialize` wraps model
# and optimizer, and `engine.backward(loss)`, `engine.step()` replace the usual calls. The
# trainer's `train.strategy = "deepspeed"` generates the DeepSpeed config from the trainer's own
# config (`parallel.zero_stage`, `parallel.offload_optimizer`, `parallel.offload_param`, batch
# sizes, AdamW, clipping, precision), lets DeepSpeed's parser check it, and writes it to
# `ds_config.json` in the run folder, so the same file can be used with the `deepspeed` launcher
# on a GPU cluster. The same run as above under stages 1, 2 and 3, one launch:

# %%
DS_RUNS = {f"deepspeed ZeRO-{z}": trainer_cfg(HALF, "train.strategy=deepspeed", f"parallel.zero_stage={z}")
           for z in (1, 2, 3)}
ds_runs = [dict(cfg=c, out_dir=str(fresh(RUNS / f"ds-z{z}"))) for z, c in zip((1, 2, 3), DS_RUNS.values())]
ds = dict(zip(DS_RUNS, run_ranks(lab09_runs.train_runs, 2, ds_runs, threads_per_rank=1, show_output=False,
                                 timeout=600)[0]))
print("ds_config.json written by the ZeRO-3 run:")
print(json.dumps(ds["deepspeed ZeRO-3"]["ds_config"], indent=1))
print("zero_optimization across the three runs:",
      {name: ds[name]["ds_config"]["zero_optimization"] for name in DS_RUNS})

# %%
plot_vs_single(ds, "DeepSpeed on 2 ranks vs one process")
print(f"{'run':<20}{'final loss':>12}{'max rel. diff':>15}{'fp32 passes':>12}   collectives per step")
for name, rep in ds.items():
    r = max_rel(rep["losses"], single_losses)
    ps = rep["wire"]["per_step"]
    passes = sum(v["bytes"] for k, v in ps.items() if k.endswith("float32")) / G  # G: one pass, section 5
    kinds = ", ".join(f"{k} x{v['count']:.1f}" for k, v in ps.items() if v["bytes"] >= 1000)
    print(f"{name:<20}{rep['final_loss']:>12.6f}{r:>15.1e}{passes:>12.2f}   {kinds}")
    check(r <= 1e-4, f"{name} should follow the one-process run in fp32 (relative difference {r:.1e})")
    check(rep["ds_config"]["zero_optimization"]["stage"] == int(name[-1]),
          f"{name}: the generated ds_config.json should ask for that stage")

# %% [markdown]
# **What you should see:** a ds_config.json that says what the run does (micro-batch 8 per GPU,
# 2 GPUs, `train_batch_size` 16 = the global batch, AdamW with the trainer's hyper-parameters,
# clipping at 1.0, bf16 off, `zero_optimization.stage`), and three loss curves on the
# single-process one: sharding changes where the state lives, not the mathematics. The
# "fp32 passes" column (fp32 bytes on the wire per step / one ring pass over Ψ) shows that an
# engine's real traffic is not the textbook's: on this version and backend DeepSpeed's ZeRO-1/2
# average the gradient buckets with all-reduces and then all-gather
# the updated partitions (3 passes over Ψ, not 2: this is what the counter sees of the
# `torch.distributed` calls DeepSpeed makes underneath), and its ZeRO-3 keeps small parameters
# whole (`stage3_param_persistence_threshold`) so it gathers them less often (fewer than 3
# passes). The uint8 broadcasts carry
# pickled Python objects (`broadcast_object_list`), not model state. Measure before you trust a
# formula.
#
# ## Where next
#
# * **Exercise 09**: write a ZeRO-1 optimizer: each rank steps only the parameters it owns, then
#   hands the updated weights to the others.
# * **Exercise 02**: the ZeRO stage table by hand: what each stage shards, memory per rank,
#   traffic per step.
# * **Lab 01** for activations, which ZeRO does not shard; **lab 08** for DDP's buckets.
# * `course plan` sizes ZeRO stage, data parallelism and offload for a real model and cluster.
