# %% [markdown]
# # Lab 14 — Capstone: one distributed training run, end to end
#
# Every earlier lab took one piece apart. Here they all run together, the way a real job does:
# one config file, `torchrun`, two ranks, and a run that is interrupted twice and still ends with
# the very numbers of a run that never was. In order:
#
# 1. **the config**: one TOML file holds the whole run;
# 2. **the mesh**: which rank does what;
# 3. **the reference run**: DDP, gradient accumulation, the stabilizer, warmup + cosine, async
#    checkpoints with a second tier, a watchdog, and the profiler on a few steps;
# 4. **metrics**: loss, learning rate and throughput from `metrics.jsonl`;
# 5. **the profile**: where a step's time goes; then **checkpoints, twice**: the run's checkpoints
#    on local disk and on a second storage tier (the mirror);
# 6. **a killed worker**: `SIGKILL` mid-run, then a new job resumes from the newest checkpoint;
# 7. **a signal**: `SIGUSR1`, as a scheduler sends before the time limit: a checkpoint at a step
#    boundary, exit code 75, resume;
# 8. **the same run on GPUs**: the commands for 1 GPU, 8 GPUs and 2 nodes x 8 GPUs under SLURM;
# 9. **the final check**: every resumed loss equals the reference, bit for bit.
#
# Ranks are processes on this machine talking over loopback with **gloo**; on GPU nodes the same
# command uses NCCL. Each job is a `torchrun` subprocess started by `course_lib.labs.lab14_capstone`.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
STEPS = 40  # optimizer steps of every run
SAVE_EVERY = 10  # checkpoint interval (steps)
KILL_AFTER = 17  # section 6: SIGKILL a worker once this many steps are logged
SIGNAL_AFTER = 23  # section 7: SIGUSR1 to a worker once this many steps are logged

# %%
import json
import signal
import statistics
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

import course_lib
from course_lib.kit.predict import show_prediction
from course_lib.trainer import config as train_config
from course_lib.labs import lab14_capstone as capstone
from course_lib.kit.checks import check
from course_lib.kit.scratch import fresh
from course_lib.trainer.metrics import read_rows
from course_lib.trainer.profiling import load_summary
from course_lib.parallel.mesh import mesh_layout
from course_lib.watch import STOP_EXIT_CODE

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    STEPS, SAVE_EVERY, KILL_AFTER, SIGNAL_AFTER = 12, 4, 6, 7
RUNS = Path(tempfile.mkdtemp(prefix="lab14-"))  # scratch: every file this lab writes
MIRROR = RUNS / "mirror"  # the second checkpoint tier (on a cluster: another disk, NFS, s3://...)
# The same overrides for every run, so every run is the same computation.
COMMON = ["--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY)]

# %% [markdown]
# ## 1. The config
#
# One file describes the run; the command line only overrides it (`--set section.key=value`).
# Every key is checked before anything starts: a typo is an error naming the key, not a silent
# default.

# %% tags=["nbval-check-output"]
print(capstone.CONFIG.read_text())

# %% [markdown]
# `train_config.load` gives the checked config with every default filled in. The lines that
# matter most for a distributed run:

# %%
cfg = train_config.load(capstone.CONFIG, [f"train.max_steps={STEPS}", f"checkpoint.save_every={SAVE_EVERY}"])
t, c = cfg["train"], cfg["checkpoint"]
world = 2
print(f"strategy {t['strategy']}, precision {t['precision']} (section 8's GPU commands add train.precision=bf16)")
print(f"global batch = {t['micro_batch']} sequences x {t['grad_accum']} micro-batches x {world} ranks "
      f"= {t['micro_batch'] * t['grad_accum'] * world} sequences of {cfg['data']['seq_len']} tokens")
print(f"schedule {cfg['schedule']['kind']}, warmup {cfg['schedule']['warmup_steps']} steps, "
      f"lr {cfg['optim']['lr']} -> {cfg['optim']['min_lr']}; clip at grad norm {cfg['stability']['max_grad_norm']}, "
      f"spikes: {cfg['stability']['spike_policy']}")
print(f"checkpoints every {c['save_every']} steps, async {c['async_save']}, keep {c['keep_last']}, "
      f"format {c['format']}; watchdog {t['watchdog_s']:.0f} s; checkpoint on signal {t['checkpoint_on_signal']}")
check((t["strategy"], t["precision"], t["micro_batch"] * t["grad_accum"] * world) == ("ddp", "fp32", 32),
      "the text below expects DDP in fp32 with a global batch of 32 sequences; was the config edited?")

# %% [markdown]
# **What you should see:** DDP in fp32, a global batch of 32 sequences made of 2 micro-batches
# of 8 on each of 2 ranks, warmup then cosine decay, and checkpoints that are written in the
# background. Why fp32: this CPU has no bf16 units, so autocast to bf16 would only emulate it
# (lab 03), several times slower; on a GPU the same run takes bf16 (section 8).
#
# Two names in the file's comments: **DCP** is torch's distributed checkpoint format
# (`torch.distributed.checkpoint`: every rank writes its own shards, lab 07), the one FSDP needs;
# **fsspec** is the Python library behind the mirror's URLs, one interface for local folders
# (`file://`), S3 (`s3://`), Google Cloud Storage (`gs://`) and more.
#
# ## 2. The mesh
#
# With DDP every rank holds the whole model and a share of each batch: a mesh of 2 data-parallel
# ranks and no tensor, pipeline or context parallelism. The same helper draws 3-D meshes
# (`mesh_layout(16, tp=4, pp=2)`) for larger jobs.

# %% tags=["nbval-check-output"]
layout = mesh_layout(world)
print(layout.draw())
for rank, role in layout.describe().items():
    print(f"rank {rank}: {role}")

# %% [markdown]
# ## 3. The reference run
#
# Two ranks under `torchrun`, to the end, with `--profile` (torch.profiler on a few steps) and a
# second checkpoint tier (`checkpoint.mirror`): each verified checkpoint is copied in the
# background to another store. This is the run every interrupted run below must reproduce.

# %%
print("torchrun", " ".join(capstone.torchrun_command("$RUNS/reference", extra=COMMON + ["--profile"])[3:])
      .replace(str(capstone.CONFIG), "labs/configs/capstone-cpu.toml"))
ref = capstone.run_job(fresh(RUNS / "reference"),  # fresh (and its mirror): a re-run of this cell starts over
                       extra=COMMON + ["--profile", "--set", f"checkpoint.mirror=file://{fresh(MIRROR)}"])
check(ref.returncode == 0, f"the reference run failed:\n{ref.log[-3000:]}")
print(f"{ref.seconds:.1f} s wall; " + ref.log.strip().splitlines()[-1])

# %% [markdown]
# ## 4. Metrics
#
# Rank 0 writes one row per optimizer step to `metrics.jsonl`: the loss, the learning rate, the
# throughput, the gradient norm, and what the stabilizer did.

# %%
rows = read_rows(RUNS / "reference" / "metrics.jsonl")
steps = [r["step"] for r in rows]
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.2))
ax1.plot(steps, [r["loss"] for r in rows])
ax1.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
ax2.plot(steps, [r["lr"] for r in rows])
ax2.set(xlabel="step", ylabel="learning rate", title="warmup + cosine")
ax3.plot(steps, [r["tokens_per_s"] for r in rows])
ax3.set(xlabel="step", ylabel="tokens/s (both ranks)", title="throughput")
fig.tight_layout()
plt.show()
print(f"{len(rows)} rows; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; "
      f"{sum(r['skipped'] for r in rows)} steps skipped, {sum(r['clipped'] for r in rows)} clipped")
check(steps == list(range(1, STEPS + 1)), "the reference should log every step once")
check(rows[-1]["loss"] < rows[0]["loss"] - 1.0, "the loss should fall by more than 1 nat/token")
check(abs(rows[0]["loss"] - 5.5) < 0.2 and rows[-1]["loss"] < (3.5 if SMOKE else 3.0),
      "the loss should start near ln 256 = 5.5 nats/token and end under 3 (3.5 in a smoke run)")

# %% [markdown]
# **What you should see:** the loss falls from about 5.5 nats/token (uniform over 256 bytes) to
# under 3 (under 3.5 in a smoke run), with every step clipped at first (a fresh model's gradient norms are above
# 1); the learning rate climbs for the warmup steps, then decays along a cosine; throughput is flat
# apart from a few dips: the profiled steps (the profiler has a cost), checkpoint steps, and
# whatever else this machine was doing.
#
# ## 5. The profile
#
# `--profile` recorded a few steps on every rank. The summary splits each profiled step into
# compute, communication the CPU waited for ("exposed"), and idle time, and lists the operators
# that took the time. On a GPU the same files hold the CUDA kernels.

# %%
summary = (RUNS / "reference" / "profile" / "summary.md").read_text()
print("\n".join(summary.splitlines()[:22]))
print(f"... traces for chrome://tracing or ui.perfetto.dev: "
      f"{sorted(p.name for p in (RUNS / 'reference' / 'profile').glob('trace_rank*.json'))}")
peak = json.loads((RUNS / "reference" / "mfu_peak.json").read_text())
print(f"MFU divides by {peak['flops'] / 1e9:.1f} GFLOP/s per rank: {peak['detail'] or peak['source']}")
profiled = load_summary(RUNS / "reference")["ranks"]
mfus = [s["mfu"] for r in profiled for s in r["steps"]]
check(peak["source"] in ("stamp", "start-up"), f"on a CPU the peak comes from course doctor's stamp or, without one, "
      f"from a measurement at start-up; this run used {peak['source']!r}")
check(all(m is not None and 0 < m < 0.6 for m in mfus),
      f"every rank's profiled steps should have an MFU, under 60% at this size; got {mfus}")
# The run's MFU: the median over every logged step after the warm-up ones, the profiled ones left out
# (they pay the profiler). A busy moment slows a few steps; the median does not move with them.
profiled_steps = {s["step"] for r in profiled for s in r["steps"]}
steady = [r["mfu"] for r in rows[3:] if r["step"] not in profiled_steps and r.get("mfu") is not None]
run_mfu = statistics.median(steady)
per_rank = ", ".join(f"rank {r['rank']} {statistics.mean(s['mfu'] for s in r['steps']):.2%}" for r in profiled)
print(f"MFU of the run: {run_mfu:.2%} (median of {len(steady)} steps); the {len(profiled_steps)} profiled steps: {per_rank}")
check(len(steady) >= len(rows) // 2, f"most steps should log an MFU; {len(steady)} of {len(rows)} did")
check(0 < run_mfu < 0.6, f"the run's MFU should be tens of percent at this size, under 60%; got {run_mfu:.2%}. "
      "Above that, the peak in mfu_peak.json is too low: rerun `course doctor --measure-peak` on a quiet machine")

# %% [markdown]
# **What you should see:** attention and the matmuls (`aten::mm`, `aten::addmm`) on top; a few to
# a few tens of percent of each step in exposed communication (the gradient all-reduce over
# loopback that backward could not hide). The MFU column, on every rank, divides the step's model
# FLOP/s by this CPU's peak as `course doctor --measure-peak` (run by `./kit setup`) stamped it on a
# quiet machine; the next line says which peak the run used (`RUNS/reference/mfu_peak.json`). Expect
# tens of percent, under 60% (the check): each rank's matrices are small (128 wide), and layer norms,
# softmax, the optimizer step and Python do work that is not counted as model FLOPs. A busy machine
# only slows the steps, so it can lower this MFU but not raise it. Without a stamp the trainer
# measures at start-up instead, says so, and a busy start-up can then make MFU look higher.
#
# The last line is the number to quote: the **run's** MFU, the median over every step after the
# first three, profiled ones left out. Three profiled steps are a small sample that pays the
# profiler's cost, and one busy moment on the machine (another notebook, a test run) can slow all
# three; it slows only a few of the run's steps, which the median ignores.
#
# ## Checkpoints, twice
#
# Every `SAVE_EVERY` steps rank 0 wrote a checkpoint in the background (async: training went on
# while it was serialised), verified it, kept the newest `keep_last`, and the mirror copied each
# one to the second tier. The mirror's commit point is its manifest (a small file naming every file
# of the checkpoint with its sha256 hash, uploaded last): a checkpoint without one is a
# half-upload and is never used.

# %%
local = capstone.checkpoint_steps(RUNS / "reference" / "checkpoints")
mirrored = capstone.checkpoint_steps(MIRROR)
print(f"local tier:  steps {local}")
print(f"second tier: steps {mirrored}")
check(local and local[-1] == STEPS, "the last checkpoint should be the end of the run")
check(set(local) <= set(mirrored), "every local checkpoint should also be in the second tier")

# %% [markdown]
# ## 6. A killed worker
#
# A process can die at any instant (`kill -9`, the out-of-memory killer, a lost node): no handler
# runs, nothing is saved. Once `KILL_AFTER` steps are logged, rank 1 is killed with `SIGKILL`;
# rank 0 finds its peer gone in the next collective and torchrun ends the job with an error. Then
# the job is started again with `--resume auto`, as a scheduler's requeue (or torchrun's
# `--max-restarts`, lab 07) would, and continues from the newest checkpoint.
#
# Predict first, from `SAVE_EVERY` and `KILL_AFTER` (the parameters cell): from which step does the
# second job resume, and how many steps are computed twice (at least)?

# %%
my_resume_step = None  # your prediction: the step the second job resumes from
my_steps_recomputed = None  # your prediction: steps computed twice (at least)

# %%
crashed, restarted = capstone.run_with_killed_worker(fresh(RUNS / "killed"), KILL_AFTER, extra=COMMON)
print(f"{crashed.event}; torchrun exit code {crashed.returncode}; checkpoints on disk: {crashed.checkpoints}")
print(f"second job: exit code {restarted.returncode}, resumed from step {restarted.resumed_from}, "
      f"{restarted.seconds:.1f} s wall")
check(crashed.returncode != 0, "the crashed job should fail: one of its ranks was killed")
failures = [line.strip() for line in crashed.log.splitlines() if "exitcode" in line]
print("torchrun's report:", *failures[:4], sep="\n  ")
check(failures, "torchrun's log should list the failed ranks with their exit codes")
check(restarted.returncode == 0, f"the second job should finish:\n{restarted.log[-3000:]}")
check(restarted.resumed_from is not None and 0 < restarted.resumed_from <= KILL_AFTER
      and restarted.resumed_from == crashed.checkpoints[-1],
      "the second job should resume from the newest checkpoint saved before the kill")
lost = KILL_AFTER - restarted.resumed_from
print(f"steps {restarted.resumed_from + 1}..{KILL_AFTER} ({lost} steps, maybe one more in flight) were "
      f"computed twice: the cost of the crash")
print()
show_prediction("resumed from step", my_resume_step, restarted.resumed_from,
                why=f"the newest checkpoint before the kill: the last multiple of SAVE_EVERY = {SAVE_EVERY} at or "
                    f"below {KILL_AFTER} logged steps (an async save still being written would not count)")
show_prediction("steps computed twice", my_steps_recomputed, lost,
                why=f"{KILL_AFTER} - {restarted.resumed_from}: every step after the checkpoint, up to the kill")

# %% [markdown]
# **What you should see:** the first job fails: torchrun exits non-zero and lists the failed ranks
# with their exit codes (-9 is the SIGKILL; the surviving rank shows how it ended: -15 when
# torchrun's SIGTERM stopped it first, 1 when it failed on its peer's absence), the
# newest checkpoint is the last multiple of `SAVE_EVERY` before the kill, and the second job resumes
# there: the steps after that checkpoint were computed again. What a crash costs is bounded by the
# checkpoint interval.
#
# ## 7. A signal: checkpoint now, then stop
#
# A scheduler warns before it stops a job: SLURM's `--signal=USR1@120` sends SIGUSR1 two minutes
# before the time limit, a preemption sends SIGTERM. The trainer's handler only sets a flag. Every
# rank contributes its flag to a tiny all-reduce each step, read in the same single host read as
# the loss, so all ranks learn *in the same step* that one of them was signalled. They finish that
# step, save a checkpoint there, and exit with code 75; nothing is computed twice.
#
# Here SIGUSR1 goes to rank 1 only, then a second job resumes. Predict first: the signal arrives
# once `SIGNAL_AFTER` steps are logged. At which step is the checkpoint?

# %%
my_signal_checkpoint = None  # your prediction: the step of the checkpoint the signal causes

# %%
stopped, resumed = capstone.run_with_signal(fresh(RUNS / "signal"), SIGNAL_AFTER, sig=signal.SIGUSR1, extra=COMMON)
stop_steps = stopped.checkpoints  # what was on disk when the stopped job had exited
print(f"{stopped.event}; signal -> job exit {stopped.event_to_exit_s:.2f} s; checkpoints then: {stop_steps}")
print([line for line in stopped.log.splitlines() if line.startswith(("course:", "stopped by"))])
print(f"resumed job: exit {resumed.returncode}, resumed from step {resumed.resumed_from}")
check(stopped.event_to_exit_s < 30, f"the job should end within seconds of the signal, not "
      f"{stopped.event_to_exit_s:.1f} s later")
check(stopped.returncode != 0 and f"exitcode  : {STOP_EXIT_CODE}" in stopped.log,
      f"the stopped job's ranks should exit with code {STOP_EXIT_CODE}:\n{stopped.log[-2000:]}")
print(f"torchrun reports the ranks' exit code {STOP_EXIT_CODE} (and exits {stopped.returncode} itself: a rank "
      f"exited non-zero)")
check("stopped by a peer rank's signal" in stopped.log, "rank 0 should have stopped because rank 1 was signalled")
check(stop_steps and SIGNAL_AFTER <= stop_steps[-1] < STEPS,
      "the checkpoint should be at the step where the ranks stopped, after the signal, before the end")
check(resumed.returncode == 0 and resumed.resumed_from == stop_steps[-1],
      f"the second job should resume from the signal's checkpoint:\n{resumed.log[-2000:]}")
print()
show_prediction("checkpoint after the signal", my_signal_checkpoint, stop_steps[-1],
                why=f"at least {SIGNAL_AFTER}: the signalled rank's flag joins the next step's all-reduce, every "
                    "rank finishes that step and saves there, so within a step or two of the signal; the "
                    "resumed job starts at that very step and computes nothing twice")

# %% [markdown]
# **What you should see:** rank 1 prints that it got SIGUSR1; rank 0, which got nothing, stops at
# the same step ("stopped by a peer rank's signal"); the checkpoint is at that step, within a step
# or two of the signal, and the job ends within a few seconds of the signal (the step in flight, one
# checkpoint, torchrun's shutdown), long before any time limit. The resumed job starts exactly
# there.
#
# ## 8. The same run on GPUs
#
# `course_lib.launchers` (the `course launch` command) writes the commands for a cluster shape.
# Nothing changes in the trainer: `train.device = "cuda"` puts each rank on its GPU and the process
# group uses NCCL; `train.precision = "bf16"` turns on autocast, which a GPU's tensor cores run at
# several times fp32's rate (weights and optimizer state stay fp32). For the SLURM job, look at the signal line and the trap: USR1 reaches the batch
# shell (`B:`), which forwards SIGTERM through `srun` to the torchrun agents and their ranks, waits
# for the checkpoint, and requeues the job; the requeued job resumes with `--resume auto`.

# %%
commands = capstone.launch_commands()
print("# 1 GPU\n" + commands["1 GPU"] + "\n\n# 8 GPUs, one node\n" + commands["8 GPUs"])
sbatch = commands["2 x 8 GPUs (SLURM)"]
lines = sbatch.splitlines()
trap = lines.index(next(line for line in lines if line.startswith("on_time_limit()")))
step = lines.index(next(line for line in lines if line.startswith('"$SRUN"')))
print("\n# 2 nodes x 8 GPUs: job.sbatch (excerpt: the header, the USR1 handler, the job step)")
trap_end = lines.index("}", trap)
print("\n".join([line for line in lines if line.startswith("#SBATCH")] + ["..."] + lines[trap:trap_end + 1]
                + ["..."] + lines[step:step + 2]))
check("--signal=B:USR1@" in sbatch and "requeue" in sbatch, "the sbatch script should trap USR1 and requeue")
check(all("train.precision=bf16" in text for text in commands.values()),
      "every GPU command should switch the run to bf16 autocast")

# %% [markdown]
# ## 9. The final check: same losses, bit for bit
#
# Two interrupted runs, one crash and one signal, against the run that never stopped: every loss
# must be *equal*, not close. A checkpoint that missed anything (an optimizer moment, the data
# position, a random generator, the scheduler) would show here as a drift.

# %%
reference = capstone.losses(RUNS / "reference")
after_kill = capstone.losses(RUNS / "killed")  # the first job's rows, rewritten from the resumed step on
after_signal = capstone.losses(RUNS / "signal")
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(*zip(*reference), label="reference", linewidth=3, alpha=0.4)
ax.plot(*zip(*after_kill), label=f"SIGKILL after step {KILL_AFTER} (line), resumed from {restarted.resumed_from}", linestyle="--")
ax.plot(*zip(*after_signal), label=f"SIGUSR1 after step {SIGNAL_AFTER}; stopped, saved and resumed at {stop_steps[-1]} (line)", linestyle=":")
ax.axvline(KILL_AFTER, color="tab:orange", linewidth=0.8)
ax.axvline(stop_steps[-1], color="tab:green", linewidth=0.8)
ax.set(xlabel="step", ylabel="loss (nats/token)", title="three runs, one curve")
ax.legend()
plt.show()
diff_kill = sum(a != b for a, b in zip(reference, after_kill))
diff_signal = sum(a != b for a, b in zip(reference, after_signal))
print(f"steps whose loss differs from the reference: killed run {diff_kill}, signalled run {diff_signal}")
check(after_kill == reference, "the killed and resumed run should give exactly the reference's losses")
check(after_signal == reference, "the signalled and resumed run should give exactly the reference's losses")
print(f"all {STEPS} losses of both interrupted runs equal the reference's exactly")

# %% [markdown]
# **What you should see:** one curve: the dashed and dotted lines lie exactly on the reference, and
# 0 steps differ for both runs.
#
# ## Where next
#
# * Scale the model: in a copy of the config, keep only `preset = "gpt2-small"` under `[model]`
#   (the two lines below it would shrink any preset), and on a GPU add `train.compile = true` and
#   `optim.fused = true`; `course plan` picks a layout and a checkpoint interval for a
#   real cluster.
# * Hangs: `--set train.watchdog_s=600` names a stalled rank and dumps every rank's stacks to
#   `OUT/hang/` instead of waiting out the collective timeout (lab 12 runs one).
# * Long sequences: lab 15 splits each sequence over ranks (`parallel.cp`, ring attention). It
#   belongs right after lab 11; take it now if you skipped it.
