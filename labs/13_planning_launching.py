# %% [markdown]
# # Lab 13 — Planning and launching a real job
#
# "70B, 64 A100-80GB in 8 nodes, 2T tokens — what do I run?" Every earlier lab measured one
# idea. This one puts them together the way an engineer must before a big job starts:
#
# 1. **three jobs through the planner** (`course plan`): the layout it picks;
# 2. **the runners-up**, and why each lost;
# 3. **what moves the choice**: the attention kernel, the network, the GPU;
# 4. **when nothing fits**: how many GPUs would;
# 5. **the files** a plan writes: DeepSpeed JSON, FSDP settings, the trainer's TOML;
# 6. **the launch scripts** (torchrun, SLURM) line by line;
# 7. **the checkpoint plan** (Young/Daly) and the resource budget;
# 8. **the single-node command, run here for real** on 2 CPU ranks, then resumed;
# 9. **a plan that uses tensor parallelism and FSDP**, for a model small enough to run here, on 4
#    CPU ranks exactly as the plan wrote it.
#
# The planner is closed-form: memory per GPU from `course_lib.estimate` (ZeRO paper bytes,
# Korthikanti et al. activations) and a step time whose every term is printed (compute at an
# assumed 50% of peak, traffic over NVLink or InfiniBand, the pipeline bubble, the part of the
# data-parallel traffic that compute does not hide). Nothing in this lab needs a GPU: sections
# 1-7 are arithmetic, and 8-9 run on CPU ranks.

# %% tags=["parameters"]
SMOKE = False  # True: fewer training steps, so the automated tests finish quickly
TRAIN_STEPS = 20  # sections 8-9: steps of the first real run (section 8's resumed run adds as many again)
SAVE_EVERY = 5  # section 8: checkpoint interval of the real run, in steps
TOP = 5  # rows of each comparison table

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

import course_lib
from course_lib.trainer import config as train_config
from course_lib.kit.checks import check
from course_lib.estimate import format_bytes
from course_lib.launchers.cluster import Cluster
from course_lib.launchers.commands import shell_join, torchrun_single_node
from course_lib.planner import checkpoint_plan, plan, write_plan
from course_lib.planner.exercise import SCENARIOS
from course_lib.planner.report import table

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    TRAIN_STEPS, SAVE_EVERY = 4, 2
ROOT = Path(course_lib.__file__).resolve().parent.parent  # the kit's root (configs, package)
RUNS = Path(tempfile.mkdtemp(prefix="lab13-"))  # scratch: every file this lab writes
print(f"scratch folder: {RUNS}")

# %% [markdown]
# ## 1. Three jobs through the planner
#
# The jobs (all on A100-80GB, sequence 4096 unless said, a global batch of 4Mi = 4,194,304
# tokens per step as Llama 2 used):
#
# * **7b-one-node**: Llama 2 7B on one node of 8 GPUs, 1T tokens;
# * **70b-8-nodes**: Llama 2 70B on 64 GPUs in 8 nodes, 2T tokens;
# * **7b-8k-context**: Llama 2 7B on one node with an 8K context, 1T tokens.
#
# `plan(...)` is `course plan` as a function: it tries every legal layout (tp x pp x dp x cp,
# ZeRO 0-3, recompute none/selective/full, micro-batch 1-16), keeps those that fit in 90% of the
# device memory and ranks them by modelled step time.

# %% tags=["nbval-check-output"]
plans = {name: plan(**kw) for name, kw in SCENARIOS.items()}
print(f"{'job':<14} {'best layout':<40} {'mem/GPU':>10} {'tokens/s':>9} {'days':>7} {'GPU-hours':>11}")
for name, p in plans.items():
    b, spec = p.best, p.spec
    days = spec.tokens / b.tokens_per_s / 86400
    print(f"{name:<14} {b.layout.label():<40} {format_bytes(b.memory_total):>10} {b.tokens_per_s:>9,.0f} "
          f"{days:>7.1f} {days * 24 * spec.gpus:>11,.0f}")

# %% [markdown]
# Read a layout as: `tp` tensor-parallel ranks per layer, `pp` pipeline stages, `dp` data-parallel
# replicas, `cp` context-parallel ranks per sequence, `Z` the ZeRO stage (3 = FSDP full shard),
# `rc` recomputation, `mb1x128` micro-batch 1 accumulated 128 times per step.
#
# **What you should see:** the 7B job shards everything (ZeRO-3 over 8 GPUs on NVLink) and needs
# no model parallelism; the 70B job needs model parallelism and keeps `tp` inside a node; the 8K
# job splits each sequence (`cp`), because the attention scores grow with its square. (The planner
# tries `cp` only from 8K tokens, or when nothing else fits: cutting attention into per-rank chunks
# has costs its step-time model does not count.) The 70B job takes about 1,100 days on 64 GPUs:
# about 1.7 million GPU-hours, the order Meta reported for Llama 2 70B (1.7 million A100-hours). The honest answer to "what do I run?" includes "on how
# many GPUs".
#
# ## 2. The runners-up, and why they lost
#
# One row per distinct layout idea. Layouts within 0.5% of the best count as a tie and lose on
# simplicity (fewer model-parallel ranks), then micro-batch size, ZeRO stage, memory. The last
# rows are the layouts that *just* miss the memory, with what fills it.

# %%
for name, p in plans.items():
    print(f"--- {name}")
    print(table(p, TOP))
    print()

# %% [markdown]
# **What you should see:** for the 70B job, ZeRO-3 over all 64 GPUs (no model parallelism) is not
# among the leaders: it gathers every weight twice per micro-batch across InfiniBand, and hiding
# that needs few, large micro-batches, which fit only with full recomputation. The reasons
# are terms of the model: TP all-reduces, pipeline bubble, exposed data-parallel traffic,
# recomputation.
#
# Every step time is a sum. The plot shows the terms for the best layouts of the 70B job, and
# the memory per GPU next to the usable limit.

# %%
TERMS = [("compute", "compute"), ("recompute", "of which recompute"), ("tp", "TP"), ("cp", "CP"),
         ("pp", "PP sends"), ("bubble", "bubble"), ("dp_exposed", "DP/ZeRO exposed")]
# What is alive at the step's peak (the start of a backward): weights, optimizer state, the gradients
# summed over the earlier micro-batches, the saved activations and the output layer's transients.
MEM = [("params", "params"), ("optimizer", "optimizer"), ("accumulated_grads", "gradients summed so far"),
       ("activations", "activations"), ("transient", "transient")]
p70 = plans["70b-8-nodes"]
z3 = min((c for c in p70.ranked if c.layout.tp == c.layout.pp == c.layout.cp == 1), key=lambda c: c.step_s)
shown = p70.runners_up(TOP) + [z3]
labels = [c.layout.label().replace(" rc=", "\nrc=") for c in shown]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
bottom = [0.0] * len(shown)
for key, name in TERMS:
    vals = [c.time[key] if key != "compute" else c.time["compute"] - c.time["recompute"] for c in shown]
    ax1.bar(range(len(shown)), vals, bottom=bottom, label=name if key != "compute" else "compute (model FLOPs)")
    bottom = [b + v for b, v in zip(bottom, vals)]
ax1.set_xticks(range(len(shown)), labels, rotation=60, ha="right", fontsize=7)
ax1.set_ylabel("seconds per optimizer step")
ax1.set_title("70B on 64 A100s: modelled step time by term")
ax1.legend(fontsize=7)
bottom = [0.0] * len(shown)
for key, name in MEM:
    vals = [c.memory[key] / 2**30 for c in shown]
    ax2.bar(range(len(shown)), vals, bottom=bottom, label=name)
    bottom = [b + v for b, v in zip(bottom, vals)]
ax2.axhline(p70.spec.usable_bytes / 2**30, color="k", ls="--", label="usable (90% of 80 GiB)")
ax2.set_xticks(range(len(shown)), labels, rotation=60, ha="right", fontsize=7)
ax2.set_ylabel("GiB per GPU")
ax2.set_title("memory per GPU by component")
ax2.legend(fontsize=7)
plt.tight_layout()
plt.show()
check(z3.step_s > p70.best.step_s, "ZeRO-3 over InfiniBand should be slower than the best for 70B")
model_compute = [c.time["compute"] - c.time["recompute"] for c in shown]
check(max(model_compute) < 1.02 * min(model_compute),
      "the model FLOPs are the same whatever the layout: their bars should differ only by the pipeline's "
      "stage imbalance, a percent or so")
stacks = [sum(c.memory[key] for key, _ in MEM) for c in shown]
check(all(abs(t - c.memory_total) <= 1e-6 * c.memory_total or c.memory["peak_at"] != "backward start"
          for t, c in zip(stacks, shown)), "each bar should stack exactly the planner's peak per GPU")
check(all(c.memory_total <= p70.spec.usable_bytes for c in shown),
      "every layout the planner ranks must fit under the usable memory (the dashed line)")

# %% [markdown]
# **What you should see:** the model's compute is nearly the same for every layout (the same FLOPs
# on the same GPUs; an uneven pipeline split makes its busiest stage compute a percent or so more,
# and the others wait for it: that row's reason names it), so the ranking is decided by the thin
# slices on top; the last bar (ZeRO-3 on all 64 GPUs) carries
# a tall slice of exposed data-parallel traffic or the recomputation it needs to fit. On the right,
# each bar stacks what is alive at the step's peak, including the gradients that accumulation keeps
# from one micro-batch to the next, and every bar stays under the dashed line: that is what "fits"
# means (the cell checks both).
#
# ## 3. What moves the choice
#
# The planner is only as good as its inputs. Three questions, each answered by changing one:
#
# * the 8K job with a fused attention kernel (`attention="flash"`: no s x s matrix is stored);
# * the 70B job on nodes with PCIe and a 100 GbE network instead of NVLink and InfiniBand;
# * the 70B job on H100s.

# %%
variants = {
    "7b-8k, eager attention": SCENARIOS["7b-8k-context"],
    "7b-8k, flash attention": dict(SCENARIOS["7b-8k-context"], attention="flash"),
    "70b, NVLink + IB": SCENARIOS["70b-8-nodes"],
    "70b, PCIe + 100GbE": dict(SCENARIOS["70b-8-nodes"], interconnect="pcie-100gbe"),
    "70b, H100": dict(SCENARIOS["70b-8-nodes"], gpu="h100"),
}
print(f"{'variant':<24} {'best layout':<40} {'mem/GPU':>10} {'step s':>7} {'comm s':>7} {'tokens/s':>9}")
for name, kw in variants.items():
    b = plan(**kw).best
    print(f"{name:<24} {b.layout.label():<40} {format_bytes(b.memory_total):>10} {b.step_s:>7.1f} "
          f"{b.comm_s:>7.2f} {b.tokens_per_s:>9,.0f}")
best_of = {name: plan(**kw).best for name, kw in variants.items()}
check(best_of["7b-8k, eager attention"].layout.cp > 1 and best_of["7b-8k, flash attention"].layout.cp == 1,
      "with flash attention the 8K job should no longer need context parallelism")
check(best_of["70b, PCIe + 100GbE"].layout.label() == best_of["70b, NVLink + IB"].layout.label()
      and best_of["70b, PCIe + 100GbE"].comm_s > 3 * best_of["70b, NVLink + IB"].comm_s,
      "on the slow network the 70B job should keep its layout and pay several times the communication")
check(best_of["70b, H100"].step_s < best_of["70b, NVLink + IB"].step_s / 2.5,
      "on H100s the 70B step should be about 3x shorter")

# %% [markdown]
# **What you should see:** with flash attention the 8K job no longer needs to split sequences
# (the scores were what filled the memory), so the plan changes shape: no context parallelism. The
# 70B job keeps its layout on both other variants, and the reason is worth seeing: it already puts
# the heavy traffic (TP's all-reduces) inside a node and only pipeline sends and ZeRO-1's gradient
# traffic across nodes, the least any fitting layout can send. On a slow network that traffic
# costs several times more (the comm column), and tokens/s fall; on H100s the step is about 3x
# shorter, so the same traffic is a larger share of it. A planner earns its keep when an input
# moves the answer, and also when it tells you that no layout does better.
#
# ## 4. When nothing fits
#
# 70B on one node of 8 A100-40GB: 1.1 TB of model state cannot live in 320 GB.

# %%
nothing = plan(model="llama2-70b", gpu="a100-40gb", gpus=8, gpus_per_node=8, tokens="2T")
print(table(nothing, TOP))
print("\nwhat would fit:")
for line in nothing.advice:
    print(" -", line)
check(nothing.best is None and any(a.startswith("more GPUs") for a in nothing.advice),
      "70B on 8 x 40 GB should not fit, and the planner should say how many GPUs would")

# %% [markdown]
# **What you should see:** every layout is over the limit, led by the optimizer states; the
# advice names the smallest number of whole nodes that fits, and what offloading the optimizer
# to the CPU would leave.
#
# ## 5. The files of a plan
#
# `write_plan` (what `course plan --out DIR` does) writes the layout as configuration, the launch
# scripts, the checkpoint plan and the budget. Each file is written to a temporary name and
# renamed, and only the planner's own file names are ever replaced.

# %%
plan_dir = RUNS / "plan-70b"
paths = write_plan(plans["70b-8-nodes"], plan_dir)
for path in paths:
    print(f"{path.name:<24} {path.stat().st_size:>7,} bytes")

# %% [markdown]
# There is no `ds_config.json` and no `launch_deepspeed.sh` for the 70B plan: the kit's DeepSpeed
# strategy runs data parallelism only, so a DeepSpeed script for tp 4 x pp 2 would be refused by
# the trainer. `plan.md` says so. The 7B job's plan is pure data parallelism, so it gets one: the
# config is built by the kit's own `build_ds_config` and passed through DeepSpeed's parser
# (`DeepSpeedConfig`) before it is written. The batch identity `train_batch_size = micro-batch x
# accumulation x data-parallel ranks` must hold for the ranks DeepSpeed will start.

# %%
best70 = plans["70b-8-nodes"].best.layout
check(not (plan_dir / "ds_config.json").exists() and not (plan_dir / "launch_deepspeed.sh").exists(),
      "a tp/pp plan should write no DeepSpeed files: the kit's DeepSpeed strategy would refuse the layout")
print([line for line in (plan_dir / "plan.md").read_text().splitlines() if "No DeepSpeed" in line][0])
write_plan(plans["7b-one-node"], RUNS / "plan-7b")
ds = json.loads((RUNS / "plan-7b" / "ds_config.json").read_text())
print(json.dumps(ds, indent=2))
best7 = plans["7b-one-node"].best.layout
check(ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * best7.dp,
      "DeepSpeed's train_batch_size must be micro-batch x accumulation x dp")

# %% [markdown]
# FSDP2 settings (`torch.distributed.fsdp.fully_shard`): they apply when the plan shards weights
# over data-parallel ranks (ZeRO-2/3, no pipeline); here they are shown for the 7B job, whose plan
# is exactly that.

# %%
print((RUNS / "plan-7b" / "fsdp_settings.json").read_text())

# %% [markdown]
# The trainer TOML carries the same layout for this kit's trainer: tp, pp, cp, the ZeRO stage as
# the data-parallel strategy under them (`zero1` here: Megatron's distributed optimizer), and the
# planned recomputation. That trainer trains TinyGPT: it is a teaching trainer, not tuned for a
# 70B model, but the layout is one it runs. It loads with the same validator the trainer uses:

# %%
toml_text = (plan_dir / "train.toml").read_text()
print("\n".join(line for line in toml_text.splitlines() if line.startswith(("[", "tp", "pp", "dp", "cp", "strategy",
                                                                          "zero", "micro", "grad", "save", "check"))))
cfg = train_config.load(plan_dir / "train.toml")
check(cfg["parallel"]["tp"] == best70.tp and cfg["parallel"]["pp"] == best70.pp,
      "the TOML should carry the plan's tp and pp")
check(cfg["train"]["strategy"] == "zero1" and best70.zero_stage == 1,
      "the 70B plan shards the optimizer (ZeRO-1): the TOML should run it as train.strategy = 'zero1'")
check(not [line for line in toml_text.splitlines() if "# plan:" in line and not line.startswith("#")],
      "every key the plan chose should be one the trainer runs, with no 'plan:' comment")
print("\ntrain_config.load: OK")

# %% [markdown]
# ## 6. The launch scripts, line by line
#
# The scripts come from `course_lib.launchers`, the same generators as `course launch`. The
# multi-node torchrun script:

# %%
print((plan_dir / "launch_torchrun.sh").read_text())

# %% [markdown]
# Line by line:
#
# * `set -euo pipefail`: stop at the first failing command, unset variable or broken pipe;
# * the `export NCCL_...` block (GPU jobs only), every value overridable from the environment:
#   `NCCL_DEBUG=WARN` logs only problems; `NCCL_IB_DISABLE=0` uses InfiniBand; `NCCL_SOCKET_IFNAME`
#   keeps NCCL off loopback and docker bridges; `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` turns a hung or
#   failed collective into a crash that torchrun can restart instead of a silent hang;
# * `export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (several nodes with restarts): every restart
#   attempt gets a fresh rendezvous store, so no rank reads a dead attempt's addresses;
#   `OMP_NUM_THREADS` gives each rank its share of the node's cores (torchrun would set 1);
# * `RDZV_HOST=...:?`: the script refuses to start until you say which node hosts the rendezvous;
# * `torchrun --nnodes 8 --nproc-per-node 8`: one agent per node, 8 ranks each;
#   `--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id`: the agents find each other and agree
#   on ranks, so no node needs to be told its rank; `--max-restarts 3`: after a failure the whole
#   group restarts;
# * `-m course_lib.train --config .../train.toml --out runs/... --resume auto`: every (re)start
#   continues from the newest valid checkpoint in `--out`.
#
# The SLURM script runs the same agent once per node:

# %%
print((plan_dir / "job.sbatch").read_text())

# %% [markdown]
# Line by line:
#
# * `#SBATCH --nodes=8 --ntasks-per-node=1 --gpus-per-node=8`: one task per node, the torchrun
#   agent, which starts the 8 ranks; `--cpus-per-task` gives it the node's cores;
# * `--time=48:00:00 --requeue --signal=B:USR1@120`: a 48-hour allocation; 120 s before the limit
#   SLURM sends USR1 to the batch shell, whose trap stops the ranks and requeues the job;
#   `--open-mode=append` keeps one log across requeues;
# * `SRUN`/`SCONTROL`/`TORCHRUN` can be replaced from the environment (the kit's tests run this
#   script with SLURM faked);
# * `HEAD_NODE` is the allocation's first host: it hosts the rendezvous; `OMP_NUM_THREADS` gives
#   each rank its share of the cores;
# * `mkdir -p runs/... && sbatch ...` (the header's submit line): SLURM opens the `--output` log
#   before the script runs, so its folder must exist first;
# * `GRACE=(--shutdown-timeout ...)` only if this node's `torchrun --help` lists it: an older torch
#   would stop at the unknown option;
# * `srun --cpus-per-task=...`: since Slurm 22.05 srun does not inherit sbatch's, and the agent with
#   its 8 ranks would be bound to one core;
# * `srun ... &` then `wait`: the step runs in the background so that the shell can run its
#   trap the moment USR1 arrives.
#
# ## 7. The checkpoint plan and the budget
#
# How often to save? Saving costs C seconds each time; a failure loses on average half an
# interval. With a job MTBF of M (per-node MTBF / nodes), the expected overhead per unit of time
# is C/tau + tau/(2M), smallest at **tau = sqrt(2 C M)** (Young 1974, Daly 2006).

# %%
b70 = plans["70b-8-nodes"].best
ck = checkpoint_plan(plans["70b-8-nodes"].spec, b70)
mtbf_s, c_s = ck.mtbf_job_h * 3600, ck.save_cost_s
taus = [ck.interval_s * f for f in [0.1 * 1.1**k for k in range(60)]]
overhead = [c_s / t + t / (2 * mtbf_s) for t in taus]
plt.figure(figsize=(7, 4))
plt.plot([t / 3600 for t in taus], [100 * o for o in overhead])
plt.axvline(ck.interval_s / 3600, color="k", ls="--", label=f"sqrt(2CM) = {ck.interval_s / 3600:.1f} h")
plt.xscale("log")
plt.xlabel("checkpoint interval (hours)")
plt.ylabel("expected time lost (% of the run)")
plt.title(f"70B, 8 nodes: save {c_s:.0f} s, job MTBF {ck.mtbf_job_h:.0f} h")
plt.legend()
plt.show()
print(f"checkpoint {format_bytes(ck.checkpoint_bytes, 'GB')}, save {c_s:.0f} s, every {ck.save_every_steps} steps "
      f"({ck.interval_s / 3600:.2f} h); overhead {ck.overhead:.2%}; keep {ck.keep_last}")
print("format:", ck.format_reason)
check(abs(taus[overhead.index(min(overhead))] / ck.interval_s - 1) < 0.1,
      "the curve's minimum should sit at sqrt(2 C M)")

# %% [markdown]
# **What you should see:** a flat-bottomed curve with its minimum at the dashed line: saving twice
# as often or half as often costs little, ten times off costs a lot.
#
# The budget (`budget.json`): memory per GPU by component, throughput, time and the SLURM
# request.

# %%
budget = json.loads((plan_dir / "budget.json").read_text())
for key, gib in budget["memory_gib_per_gpu"].items():
    print(f"  {key:<18} {gib:8.2f} GiB")
print(f"tokens/s {budget['tokens_per_s']:,.0f}, {budget['steps']:,} steps, {budget['days']:.0f} days, "
      f"{budget['gpu_hours']:,.0f} GPU-hours; SLURM {budget['slurm']}")
print(f"to finish in 30 days: about {budget['gpus_for_30_days']:,} GPUs")

# %% [markdown]
# ## 8. Run the single-node command here for real
#
# The same launcher, a job this machine can run: TinyGPT from `labs/configs/tiny-cpu.toml` with
# torch DDP on 2 CPU ranks (gloo). `course launch` without `--dry-run` writes the scripts and runs
# the single-node torchrun command, `--resume auto` included. The run saves a checkpoint every
# `SAVE_EVERY` steps.

# %%
CONFIG = str(ROOT / "labs" / "configs" / "tiny-cpu.toml")
train_out = RUNS / "tiny-ddp"


def launch(max_steps: int) -> subprocess.CompletedProcess:
    """`course launch` on 2 CPU ranks, in a fresh interpreter (never fork a notebook kernel)."""
    argv = [sys.executable, "-m", "course_lib.launchers.cli", "--config", CONFIG,
            "--set", "train.strategy=ddp", "--set", f"checkpoint.save_every={SAVE_EVERY}",
            "--set", "schedule.warmup_steps=2", "--nproc-per-node", "2", "--max-steps", str(max_steps),
            "--out", str(RUNS / "launch-tiny"), "--train-out", str(train_out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


first = launch(TRAIN_STEPS)
print(first.stdout[first.stdout.index("running:"):] if "running:" in first.stdout else first.stdout[-1500:])
check(first.returncode == 0, f"the launch failed (exit {first.returncode}): {first.stderr[-1500:]}")
print((RUNS / "launch-tiny" / "launch_torchrun.sh").read_text())

# %% [markdown]
# A job that is requeued runs the same command again. Here we extend the finished run by as many
# steps, with the torchrun command line the same generator builds
# (`course_lib.launchers.commands.torchrun_single_node`), run directly: `--resume auto` finds the
# newest checkpoint and continues from it (the trainer warns that the schedule's length changed,
# which is what we asked for).

# %%
overrides = ["train.strategy=ddp", f"checkpoint.save_every={SAVE_EVERY}", "schedule.warmup_steps=2",
             f"train.max_steps={2 * TRAIN_STEPS}"]
argv = torchrun_single_node(CONFIG, overrides, Cluster(nodes=1, nproc_per_node=2), str(train_out))
print(shell_join(argv))
argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]  # `torchrun` of this interpreter
second = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                        text=True, timeout=300)
print(next((line for line in second.stdout.splitlines() if line.startswith("trained")), second.stderr[-1500:]))
schedule_warning = [line.strip() for line in second.stderr.splitlines() if "schedule" in line.lower()]
print(*schedule_warning[:1])
check(schedule_warning, "the resumed run should warn that the schedule's length changed")
check(second.returncode == 0, f"the resumed run failed (exit {second.returncode}): {second.stderr[-1500:]}")
rows = [json.loads(line) for line in (train_out / "metrics.jsonl").read_text().splitlines() if line.strip()]
steps = [r["step"] for r in rows]
check(steps == list(range(1, 2 * TRAIN_STEPS + 1)),
      f"the two runs together should log steps 1..{2 * TRAIN_STEPS} once each, got {steps}")
check("resumed from step" in second.stdout, "the second run should say it resumed from a checkpoint")
plt.figure(figsize=(7, 3.5))
plt.plot(steps[:TRAIN_STEPS], [r["loss"] for r in rows[:TRAIN_STEPS]], "o-", label="first launch")
plt.plot(steps[TRAIN_STEPS:], [r["loss"] for r in rows[TRAIN_STEPS:]], "o-", label="resumed launch")
plt.xlabel("step")
plt.ylabel("loss (nats/token)")
plt.title("2 CPU ranks, torch DDP under torchrun")
plt.legend()
plt.show()

# %% [markdown]
# **What you should see:** the first launch trains `TRAIN_STEPS` steps from scratch on 2 ranks;
# the second says "resumed from step ..." and continues the same loss curve without starting
# over. On a GPU cluster the commands are the ones in section 6: only the node count, the GPUs and
# the NCCL block differ.
#
# ## 9. A plan with tensor parallelism and FSDP, run as written
#
# The plans above are for GPUs this machine does not have. To run one end to end here, shrink the
# job until it fits 4 CPU ranks: a 2-block Llama-style model (d = 64, byte vocabulary), sequences
# of 64 tokens, 8 sequences a step, on 4 "GPUs" of about 1 MiB each (the planner takes a custom
# device: memory and peak FLOP/s). So little memory forces the planner to split the model: its
# answer shards the model state with FSDP (ZeRO-3) over 2 data-parallel ranks *and* cuts each layer
# in half with tensor parallelism. The plan's `train.toml` says so (`train.strategy = "fsdp"`,
# `parallel.tp = 2`), and the kit's trainer runs exactly that file under torchrun on 4 CPU ranks
# (DTensor TP inside FSDP2 on one device mesh); only the step count (and with it the warm-up) is
# overridden.

# %%
tiny_plan = plan(gpu="custom", gpu_memory_gib=0.001, gpu_tflops=0.05, gpus=4, gpus_per_node=4, tokens="2M",
                 seq=64, global_batch_tokens=8 * 64,
                 shape_overrides=dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256))
print(table(tiny_plan, 3))
print(f"\n(usable per 'GPU': {format_bytes(tiny_plan.spec.usable_bytes, 'KiB')}: the table picks units that suit the job)")
tiny_dir = RUNS / "plan-tiny"
write_plan(tiny_plan, tiny_dir)
tiny_toml = (tiny_dir / "train.toml").read_text()
print("\n".join(line for line in tiny_toml.splitlines() if line.startswith(("strategy", "tp ", "dp ", "micro", "grad"))))
lay = tiny_plan.best.layout
check(lay.tp == 2 and lay.zero_stage == 3 and lay.dp == 2,
      f"the tiny job should need tp 2 and FSDP over dp 2 at this memory; the planner chose {lay.label()}")
tiny_cfg = train_config.load(tiny_dir / "train.toml")
check(tiny_cfg["train"]["strategy"] == "fsdp" and tiny_cfg["parallel"]["tp"] == 2,
      "the plan's TOML should run FSDP2 with tp 2 in the kit's trainer")

# %%
tiny_out = RUNS / "tiny-fsdp-tp"
argv = torchrun_single_node(str(tiny_dir / "train.toml"), [f"train.max_steps={TRAIN_STEPS}", "schedule.warmup_steps=2"],
                            Cluster(nodes=1, nproc_per_node=4), str(tiny_out))
print(shell_join(argv))
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
plt.title(f"the plan {lay.label()} on 4 CPU ranks: FSDP2 x DTensor TP")
plt.show()

# %% [markdown]
# **What you should see:** a table whose best row has `tp2` and `Z3` (FSDP), the TOML lines that
# say `strategy = "fsdp"` and `tp = 2`, and a falling loss curve from 4 ranks: ranks 0-1 and 2-3
# are the two tensor-parallel pairs, each pair one FSDP shard of the pair's half-layers. The same
# file, with the real model's shape and more GPUs, is what `course plan` hands to a cluster.
#
# ## Summary
#
# * A plan is a search over a few legal layouts, filtered by memory and ranked by a step-time model
#   whose terms you can read; ties go to the simpler layout.
# * Keep tensor parallelism inside a node, shard the model state before splitting layers, split the
#   sequence when attention scores dominate, and put the slow network under the least traffic.
# * A plan is also files: a validated DeepSpeed/FSDP/trainer config, launch scripts that resume by
#   themselves, a checkpoint interval from the failure rate, and a budget that says how long.
#
# ## Where next
#
# * **Exercise 12**: choose the layouts yourself, rule by rule, and hold your choice against the
#   planner's memory and step-time model.
# * **Lab 14**: one distributed run end to end: launched, killed, resumed and profiled.
