# %% [markdown]
# # Lab 07 — Checkpointing and fault tolerance
#
# On a thousand GPUs something fails every few hours: a node dies, a process is killed, a disk
# fills up, a file is corrupted. A run survives if it can always go back to a recent, complete,
# correct checkpoint and continue *exactly* where it was. This lab kills processes on purpose
# and measures:
#
# 1. **naive vs atomic saving** under `kill -9`: how many checkpoints a crash destroys;
# 2. **retention**: keep the last K and the best, and never delete before the new one is good;
# 3. **async saving**: how long training stalls for a save, synchronous and asynchronous;
# 4. **bit-exact resume**: a run killed mid-way and resumed gives the *same* losses as one that
#    never stopped;
# 5. **corruption**: a flipped byte is detected and the previous checkpoint is used;
# 6. **`torchrun --max-restarts`**: a worker killed mid-run is restarted and resumes by itself;
# 7. **leaving the kit**: a sharded run's checkpoint turned into one file, and into a folder
#    Hugging Face `transformers` loads, with what each format costs on disk and to load.
#
# The library: `course_lib.checkpoint.CheckpointManager` (atomic, verified, async checkpoints with
# retention) and the trainer `course_lib.train` (`--save-every N --resume auto`), which uses it.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
SEED = 0
KILL_CYCLES, KILL_NUMEL = 20, 2_000_000  # section 1: kills per saving method; floats per checkpoint (8 MB)
ASYNC_D_MODEL, ASYNC_REPEATS = 256, 3  # section 3: model width for the stall measurement
RESUME_STEPS, SAVE_EVERY, KILL_AFTER = 60, 10, 35  # sections 4-6: steps, checkpoint interval, kill point
EXPORT_STEPS, LOAD_REPEATS = 6, 5  # section 7: steps of the sharded run; timed loads per format

# %%
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import psutil  # installed with DeepSpeed; finds torchrun's worker process in section 6
import torch
from safetensors.torch import load_file

import course_lib
from course_lib.trainer import config as train_config
from course_lib.checkpoint import CheckpointError, CheckpointManager
from course_lib.labs.lab07_checkpoints import kill_while_saving, loaded_step
from course_lib.kit.checks import check
from course_lib.kit.scratch import fresh
from course_lib.kit.predict import show_prediction
from course_lib.trainer.metrics import read_rows
from course_lib.model import ModelConfig, TinyGPT

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    KILL_CYCLES, ASYNC_D_MODEL, ASYNC_REPEATS = 4, 128, 2
    RESUME_STEPS, SAVE_EVERY, KILL_AFTER = 30, 5, 17
    EXPORT_STEPS, LOAD_REPEATS = 2, 2
torch.set_num_threads(1)
CONFIG = Path(course_lib.__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"
RUNS = Path(tempfile.mkdtemp(prefix="lab07-"))  # scratch: every file this lab writes
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # child processes: one thread each, like this kernel

# %% [markdown]
# ## 1. Naive vs atomic saving under `kill -9`
#
# Many tutorials save with `torch.save(state, "checkpoint.pt")`. `torch.save` opens the file
# (truncating the old one) and writes for as long as the state takes; a process killed in
# between leaves a torn file, and the *previous* checkpoint is gone too: it was that file.
#
# `CheckpointManager.save` writes everything into a temporary directory next to the final one,
# fsyncs the files and the directory, and only then **renames** it to its final name. A rename
# within one file system is atomic: a crash at any instant leaves either no new checkpoint or a
# complete one.
#
# The experiment: `kill_while_saving` (from `course_lib.labs.lab07_checkpoints`) starts a fresh writer
# process per cycle that saves over and over, each time a state of `KILL_NUMEL` floats that all
# equal the step it was saved at, so a loaded file shows whether it is complete. It kills the
# writer with `SIGKILL` (what `kill -9`, the out-of-memory killer and a node failure do: no handler
# runs) on even cycles at a random moment within one save period, on odd cycles at a moment a
# write is certainly in progress, and lists what each cycle left on disk. Then we restart from
# every folder the way a training run would.

# %%
WRITERS = "course_lib.labs.lab07_checkpoints:"  # the two save functions under test live there
reports = {"naive": kill_while_saving(WRITERS + "torch_save_in_place", fresh(RUNS / "naive"), cycles=KILL_CYCLES,
                                      seed=SEED, numel=KILL_NUMEL, final="latest.pt"),
           "atomic": kill_while_saving(WRITERS + "save_with_manager", fresh(RUNS / "atomic"), cycles=KILL_CYCLES,
                                       seed=SEED, numel=KILL_NUMEL)}


def restart_atomic(folder):
    """Restart the way the trainer does: clean up, load the newest valid checkpoint. Returns its
    step, or None when nothing usable is left."""
    net = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.empty(KILL_NUMEL))})
    res = CheckpointManager(folder, keep_last=2).load(model=net, restore_rng=False)
    return res.step if res is not None and bool((net["w"] == res.step).all()) else None


naive = [loaded_step(r.folder / "latest.pt") for r in reports["naive"]]  # torch.load, as a restart would
atomic = [restart_atomic(r.folder) for r in reports["atomic"]]

# %%
print(f"{KILL_CYCLES} kills per method (half at a random moment, half mid-write)")
print(f"{'method':<10} {'save period':>12} {'loadable':>9} {'unusable':>9} {'kills mid-write (evidence)':>28}")
n_bad_naive = sum(s is None for s in naive)
n_bad_atomic = sum(s is None for s in atomic)
n_tmp = sum(bool(r.leftovers) for r in reports["atomic"])  # temporary dirs a kill left behind
for mode, bad, evidence in (("naive", n_bad_naive, f"{n_bad_naive} torn files"),
                            ("atomic", n_bad_atomic, f"{n_tmp} temp dirs left")):
    period = statistics.median(r.period_s for r in reports[mode])
    print(f"{mode:<10} {period * 1e3:>9.0f} ms {KILL_CYCLES - bad:>9} {bad:>9} {evidence:>28}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(["naive torch.save", "CheckpointManager"], [n_bad_naive, n_bad_atomic], color=["tab:red", "tab:green"])
ax.set(ylabel=f"unusable after a kill (of {KILL_CYCLES})", title="checkpoints destroyed by kill -9")
ax.grid(alpha=0.3, axis="y")
plt.show()

# %%
check(all(s is None for s, r in zip(naive, reports["naive"]) if r.targeted),
      "every naive save killed mid-write should leave an unloadable file (the old checkpoint is lost too)")
check(n_bad_atomic == 0, "no atomic checkpoint may be unusable after a kill, wherever it landed")
check(n_tmp >= 1, "at least one atomic save should have been killed mid-write, or the test proved nothing")
check(all(s is not None and s >= 1 for s in atomic), "every atomic run should restart from a saved step")
print(f"naive: {n_bad_naive}/{KILL_CYCLES} checkpoints destroyed; atomic: 0/{KILL_CYCLES}, "
      f"though {n_tmp} kills landed inside a write")
errors = {}  # what torch.load says about each file a mid-write kill left
for r in reports["naive"]:
    if r.targeted:
        try:
            torch.load(r.folder / "latest.pt", map_location="cpu", weights_only=True)
            errors[r.cycle] = None
        except Exception as exc:  # noqa: BLE001 - whatever a restart would hit
            size = (r.folder / "latest.pt").stat().st_size if (r.folder / "latest.pt").exists() else None
            errors[r.cycle] = f"{type(exc).__name__}: {str(exc)[:70] or '(no message)'} ({size:,} bytes on disk)"
print("torch.load on the files killed mid-write:")
for text in sorted(set(errors.values()), key=str):
    print(f"  {sum(e == text for e in errors.values())} x {text}")
check(all(e is not None for e in errors.values()),
      "torch.load should refuse every naive file killed mid-write: torch.save had already truncated it")
random_kills = [s for s, r in zip(naive, reports["naive"]) if not r.targeted]
print(f"random kills: {sum(s is None for s in random_kills)} of {len(random_kills)} destroyed the checkpoint")
if len(random_kills) >= 6:  # with fewer, all missing a write is not unlikely enough to fail on
    check(any(s is None for s in random_kills),
          "some kills at a random moment should land inside a write and destroy the checkpoint: this writer "
          "does little but save")

# %% [markdown]
# **What you should see:** every naive save killed mid-write leaves a file `torch.load` cannot
# read (the lines under the table say what it reported: `torch.save` truncates the old file
# first, and the kill came before the new archive was complete), and since it overwrote the only
# checkpoint, the run has nothing to go back to. A kill at a random moment loses the checkpoint
# whenever it lands inside a write, and this writer does little but save, so many of the random
# kills did too (the last line counts them); those that fell between two saves left the previous
# checkpoint readable. A real run saves less often, so fewer crashes hit a save, but one that
# does loses everything. The atomic saves were killed mid-write just as often (the temporary directories left
# behind prove it), and every restart found a complete checkpoint: the half-written one had no
# final name, and `CheckpointManager` deletes such leftovers when it starts.
#
# ## 2. Retention: the last K, the best, and never delete first
#
# Checkpoints are large, so old ones are deleted. `keep_last=2, keep_best=1` keeps the two
# newest plus the one with the best `loss` metric. Each save is verified (re-read, checksums,
# loaded) **before** anything older is deleted: a common retention loop prunes first and saves second
# (`os.remove(oldest); torch.save(state, newest)`), so a crash in between leaves one checkpoint fewer than promised, and with `keep_last=1`, none.

# %% tags=["nbval-check-output"]
losses = [3.0, 2.4, 1.9, 2.2, 2.5, 2.3, 2.6, 2.8]  # the loss at each save: the best is the third
mgr = CheckpointManager(fresh(RUNS / "retention"), keep_last=2, keep_best=1, best_metric="loss", async_save=False)
tiny = torch.nn.Linear(4, 4)
print(f"{'save':>5} {'loss':>5}  on disk after the save")
for i, loss in enumerate(losses, start=1):
    mgr.save(i * 100, model=tiny, metrics={"loss": loss})
    on_disk = [f"{m['step']} (loss {m['metrics']['loss']})" for _, m in mgr.checkpoints()]
    print(f"{i * 100:>5} {loss:>5}  {', '.join(on_disk)}")
kept = [m["step"] for _, m in mgr.checkpoints()]
check(kept == [300, 700, 800], f"keep_last=2 plus keep_best=1 should keep steps 300 (best), 700 and 800, got {kept}")

# %%
class Unsaveable:
    """A state the writer cannot serialize (in real life: a full disk, a lost mount)."""

    def state_dict(self):
        return {"callback": lambda: None}


before = [n for n, _ in mgr.checkpoints()]
try:
    mgr.save(900, model=tiny, stateful={"bad": Unsaveable()}, metrics={"loss": 0.1})
    failed = None
except CheckpointError as exc:
    failed = exc
after = [n for n, _ in mgr.checkpoints()]
print(f"save 900 failed: {type(failed).__name__}: {str(failed)[:110]}...")
print(f"on disk before: {before}\non disk after:  {after}")
check(failed is not None and after == before, "a save that fails must leave every existing checkpoint in place")

# %% [markdown]
# **What you should see:** after each save the newest two and the best (step 300, loss 1.9)
# remain; older ones go only once the new one has verified. A save that fails (here: state that
# cannot be serialized; in life a full disk) raises, and the checkpoints on disk are untouched.
#
# ## 3. Async saving: how long does training wait?
#
# A synchronous save stops training for the whole write: serialize, write, fsync, verify. An
# async save only copies the state to CPU memory on the training path (with a reused buffer,
# after the first save), then a background thread does the rest while training continues. We
# save a TinyGPT and its AdamW state both ways and time what the training loop waits for.

# %%
torch.manual_seed(SEED)
big = TinyGPT(ModelConfig.preset("tiny", d_model=ASYNC_D_MODEL, n_layers=4, n_heads=4))
opt = torch.optim.AdamW(big.parameters(), lr=1e-3)
idx = torch.randint(0, 256, (4, 64))
big(idx, idx)[1].backward()
opt.step()  # creates Adam's two moments: the state is now weights + 2 x weights
timing = {}
for mode in ("sync", "async"):
    mgr_t = CheckpointManager(fresh(RUNS / f"stall-{mode}"), keep_last=2, async_save=mode == "async")
    rows = []
    for rep in range(ASYNC_REPEATS + 1):  # the first save allocates the copy buffers: not counted
        t0 = time.perf_counter()
        mgr_t.save(rep + 1, model=big, optimizer=opt)
        stall = time.perf_counter() - t0
        mgr_t.wait()  # in a real run: the next training steps; here, let the write finish
        rows.append((stall, mgr_t.last_write_s, dict(mgr_t.last_timings)))
    mgr_t.close()
    timing[mode] = rows[1:]
size = mgr_t.last_bytes
print(f"checkpoint size {size / 2**20:.1f} MiB ({big.num_params():,} parameters + AdamW state)")
print(f"{'mode':<6} {'training waited':>16} {'background write':>17}  phases of the write")
med = {}
for mode, rows in timing.items():
    med[mode] = statistics.median(s for s, _, _ in rows)
    bg = statistics.median(w for _, w, _ in rows) if mode == "async" else 0.0
    phases = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in rows[-1][2].items())
    print(f"{mode:<6} {med[mode] * 1e3:>13.1f} ms {bg * 1e3:>14.1f} ms  {phases}")
print(f"async stall = {med['async'] / med['sync']:.1%} of the synchronous one")

# %%
fig, ax = plt.subplots(figsize=(7, 3))
ax.barh(["sync", "async"], [med["sync"] * 1e3, med["async"] * 1e3], color=["tab:red", "tab:green"])
ax.set(xlabel="training stall per save (ms)", title=f"saving {size / 2**20:.0f} MiB")
ax.grid(alpha=0.3, axis="x")
plt.show()
check(med["async"] < 0.5 * med["sync"], "an async save should stall training far less than a synchronous one: "
      "only the copy to CPU memory happens on the training path")
check(statistics.median(w for _, w, _ in timing["async"]) > med["async"],
      "the background write should take longer than the async stall (it does the real work)")

# %% [markdown]
# **What you should see:** the synchronous save makes training wait for every phase of the
# write; the async one for a memory copy, a small fraction of that (the last line). The price is
# one CPU copy of the state held between saves, and one rule: the next save waits for the
# previous one (`wait()`), and `close()` at the end of training never drops the last checkpoint.
# On a GPU the copy is a device-to-host transfer into pinned memory, which is where large runs
# spend their checkpoint stall.
#
# ## 4. Resume, bit for bit
#
# A checkpoint must hold *everything* the next step depends on: weights, optimizer moments, LR
# scheduler, the data position, every random number generator, even the spike detector's window.
# Miss one and the resumed run drifts away from the one that never stopped. The test: train
# `RESUME_STEPS` steps without interruption; train again in a separate process, `SIGKILL` it
# mid-run, resume it with `--resume auto`, and compare every loss **exactly** (`==`, not approx).

#
# The trainer normally buffers `metrics.jsonl` for up to a second (and always writes it out before a
# checkpoint, so a crash loses only rows the resumed run rewrites). Here we watch the rows to decide
# when to kill, so `train.metrics_flush_s=0` writes each row the moment its step ends.

# %%
ARGS = ["--config", str(CONFIG), "--max-steps", str(RESUME_STEPS), "--save-every", str(SAVE_EVERY),
        "--seed", str(SEED), "--no-progress", "--set", "train.peak_flops=1e12",
        "--set", "train.metrics_flush_s=0"]


def trainer(out, *extra):
    """`python -m course_lib.train ...` as a separate process."""
    return [sys.executable, "-m", "course_lib.train", *ARGS, "--out", str(out), *extra]


def resumed_step(log):
    """The step a trainer's output says it resumed from ("resumed from step N"), or None."""
    found = re.search(r"resumed from step (\d+)", log)
    return int(found.group(1)) if found else None


# The reference runs as a process of its own too, at the same time as the victim (one core
# each): the same program in the same kind of process (a loss summed in another process's memory
# layout can differ in its last bit).
ref = subprocess.Popen(trainer(fresh(RUNS / "reference")), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       env=ENV)


def wait_for_rows(path, n, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while len(read_rows(path)) < n and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


victim = fresh(RUNS / "victim")  # fresh: re-running this cell repeats the experiment
proc = subprocess.Popen(trainer(victim), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
wait_for_rows(victim / "metrics.jsonl", KILL_AFTER, proc)
proc.send_signal(signal.SIGKILL)
_, err = proc.communicate()
killed_at = len(read_rows(victim / "metrics.jsonl"))
saved = sorted(p.name for p in (victim / "checkpoints").iterdir())
print(f"killed (exit code {proc.returncode}) after {killed_at} of {RESUME_STEPS} steps; on disk: {saved}")
resumed = subprocess.run(trainer(victim, "--resume", "auto"), capture_output=True, text=True, env=ENV, timeout=600)
_, ref_err = ref.communicate(timeout=600)
check(ref.returncode == 0, f"the reference run failed:\n{ref_err[-2000:]}")
ref_rows = read_rows(RUNS / "reference" / "metrics.jsonl")
print(resumed.stdout.strip())
check(proc.returncode == -signal.SIGKILL and killed_at < RESUME_STEPS,
      f"the run should have been killed mid-way, not finished: {err[-500:]}")
check(resumed.returncode == 0, f"the resumed run failed:\n{resumed.stderr[-2000:]}")

# %%
got = read_rows(victim / "metrics.jsonl")
resumed_from = resumed_step(resumed.stdout)
check(resumed_from is not None, f"the resumed run should say which step it resumed from:\n{resumed.stdout}")
diff = [a["loss"] - b["loss"] for a, b in zip(got, ref_rows)]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
ax1.plot([r["step"] for r in ref_rows], [r["loss"] for r in ref_rows], label="uninterrupted", linewidth=3, alpha=0.4)
ax1.plot([r["step"] for r in got], [r["loss"] for r in got], label="killed, then resumed", linewidth=1)
ax1.axvline(killed_at, color="tab:red", linestyle=":", label=f"SIGKILL after step {killed_at}")
ax1.axvline(resumed_from, color="tab:green", linestyle="--", label=f"resumed from checkpoint {resumed_from}")
ax1.set(xlabel="step", ylabel="loss", title="the same run, twice")
ax2.plot([r["step"] for r in got], diff, "o", markersize=3)
ax2.set(xlabel="step", ylabel="resumed minus uninterrupted", title="difference (exactly zero)")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
ax1.legend(fontsize=8)
plt.show()
w_ref = load_file(RUNS / "reference" / "checkpoints" / max(os.listdir(RUNS / "reference" / "checkpoints")) / "model.safetensors")
w_got = load_file(victim / "checkpoints" / max(os.listdir(victim / "checkpoints")) / "model.safetensors")
check([r["step"] for r in got] == list(range(1, RESUME_STEPS + 1)),
      "the resumed metrics must hold every step exactly once (rows after the checkpoint are rewritten)")
check(resumed_from < killed_at and resumed_from % SAVE_EVERY == 0, "the run should resume from a saved step before the kill")
check([r["loss"] for r in got] == [r["loss"] for r in ref_rows],
      "every loss of the resumed run must equal the uninterrupted run's exactly: some state was not restored")
check(all(torch.equal(w_ref[k], w_got[k]) for k in w_ref), "the final weights must be bit-for-bit identical")
print(f"{len(got)} losses identical (max |difference| {max(abs(d) for d in diff)}), final weights identical; "
      f"steps {resumed_from + 1}..{killed_at} were computed twice")

# %% [markdown]
# **What you should see:** two curves on top of each other and a row of exact zeros. The steps
# between the last checkpoint and the kill were lost and computed again, identically; that lost
# work is the cost of a crash, and why the checkpoint interval matters. The kill may land while
# a metrics line is half-written: the resumed run drops torn lines and the rows after its
# checkpoint, so the file ends with every step once.
#
# ## 5. A corrupted checkpoint
#
# Disks and networks flip bits. Each file's sha256 is in the checkpoint's manifest; loading
# checks it, and a checkpoint that fails is moved aside (`.corrupt-*`) with a warning, and the
# previous one is used. We flip one byte in the middle of the newest checkpoint's weights.

# %%
corrupt = fresh(RUNS / "corrupt")
shutil.copytree(victim / "checkpoints", corrupt)
names = sorted(p.name for p in corrupt.iterdir() if p.name.startswith("step_"))
weights_file = corrupt / names[-1] / "model.safetensors"
blob = bytearray(weights_file.read_bytes())
blob[len(blob) // 2] ^= 0x01  # one bit
weights_file.write_bytes(bytes(blob))
net = TinyGPT(train_config.build_model_config(train_config.load(CONFIG)))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    res = CheckpointManager(corrupt).load(model=net, restore_rng=False)
print(f"checkpoints: {names}; flipped one bit in {names[-1]}/model.safetensors")
for w in caught:
    print("warning:", w.message)
print(f"loaded step {res.step}; the folder now holds {sorted(p.name for p in corrupt.iterdir())}")
expected = load_file(victim / "checkpoints" / names[-2] / "model.safetensors")
check(res.step == int(names[-2].split("_")[1]), f"loading should fall back to the previous checkpoint {names[-2]}")
check(any("checksum" in str(w.message) for w in caught), "the fallback should warn that a checksum did not match")
check(all(torch.equal(net.state_dict()[k], v) for k, v in expected.items()),
      "the loaded weights should be exactly the previous checkpoint's")

# %% [markdown]
# **What you should see:** a warning naming the checkpoint and the file whose checksum failed,
# the corrupt directory moved aside (kept for forensics, never loaded again), and the previous
# checkpoint loaded. `torch.load` alone would have loaded the flipped weights without a word (a
# bit flip in a float is still a float). Loading also never unpickles code (`weights_only=True`
# and safetensors), so a forged checkpoint cannot run anything.
#
# ## 6. `torchrun --max-restarts`: a killed worker comes back
#
# On a cluster the launcher restarts failed workers. `torchrun --max-restarts 2` watches its
# workers; when one dies it stops the others and starts the whole group again, up to 2 times.
# With `--resume auto` the restarted worker loads the newest checkpoint and carries on. We start
# the same run as section 4 under torchrun, kill its worker process (not torchrun) with SIGKILL
# when `KILL_AFTER` steps are logged, and let torchrun do the rest.

# %%
out6 = fresh(RUNS / "torchrun")
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
       "--max-restarts", "2", "--monitor-interval", "0.2",
       "-m", "course_lib.train", *ARGS, "--out", str(out6), "--resume", "auto"]
print("torchrun", " ".join(cmd[3:]).replace(str(CONFIG), "labs/configs/tiny-cpu.toml").replace(str(RUNS), "$RUNS"))
# LOGLEVEL=INFO: torchrun logs its restarts ("... attempts left; will restart worker group") at INFO,
# below its default level (WARNING), which would print only the failure.
agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(ENV, LOGLEVEL="INFO"))
wait_for_rows(out6 / "metrics.jsonl", KILL_AFTER, agent)
workers = [p for p in psutil.Process(agent.pid).children(recursive=True)
           if "course_lib.train" in " ".join(p.cmdline())]
killed_pid = workers[0].pid if workers else None
if killed_pid:
    os.kill(killed_pid, signal.SIGKILL)
rows_at_kill = len(read_rows(out6 / "metrics.jsonl"))
log, _ = agent.communicate(timeout=600)
interesting = [line for line in log.splitlines()
               if any(w in line for w in ("FAILED", "attempts left", "resumed from", "Signals.SIGKILL", "exitcode"))]
print(f"killed worker pid {killed_pid} after {rows_at_kill} steps; torchrun exited with {agent.returncode}")
print("\n".join(line[:160] for line in interesting[:8]))

# %%
rows6 = read_rows(out6 / "metrics.jsonl")
restart_from = resumed_step(log)
check(killed_pid is not None and len(workers) == 1, "there should be exactly one worker process to kill")
check(agent.returncode == 0, f"torchrun should finish successfully after restarting the worker:\n{log[-2000:]}")
check(any("exitcode: -9" in line for line in interesting) and any("will restart worker group" in line
                                                                  for line in interesting),
      "torchrun's log should show the worker's failure (exitcode -9) and the restart of the worker group")
check(restart_from is not None and 0 < restart_from <= rows_at_kill,
      "the restarted worker should resume from a checkpoint saved before the kill")
check([r["step"] for r in rows6] == list(range(1, RESUME_STEPS + 1)),
      "the final metrics must hold every step exactly once")
check([r["loss"] for r in rows6] == [r["loss"] for r in ref_rows],
      "a one-worker torchrun run is the same computation as section 4's reference: every loss should be equal")
print(f"the worker was killed after step {rows_at_kill}, restarted by torchrun, resumed from step {restart_from}, "
      f"and finished all {RESUME_STEPS} steps with the reference's losses")

# %% [markdown]
# **What you should see:** torchrun logs the worker's failure (`exitcode: -9`, SIGKILL) and
# starts the group again ("attempts left; will restart worker group": torchrun logs that at INFO
# level, so the cell sets `LOGLEVEL=INFO`; without it you see only the failure); the new worker
# prints "resumed from" the last checkpoint, and the run
# ends with exit code 0, every step logged once, and the same losses as the run that was never
# killed. On a cluster, `--max-restarts` (with an elastic rendezvous across nodes) plus
# `--resume auto` is the whole recovery procedure: nobody has to wake up.
#
# ## 7. Leaving the kit: from a sharded run to a file a server loads
#
# A run trained with FSDP ends as a folder of DCP shards: every rank wrote its own slice of every
# weight and of AdamW's two moments. A server wants one file of full weights in names it knows.
# `course ckpt` turns one into the other with the libraries that define these formats (torch DCP
# stitches the shards, `safetensors` writes the file, `transformers`' own config class writes
# `config.json`):
#
# ```
# course ckpt list RUN                                   # every checkpoint, and what --resume auto takes
# course ckpt consolidate RUN --out model.safetensors    # full weights, any world size, any layout
# course ckpt export-hf RUN --out hf/                    # a folder from_pretrained loads
# ```
#
# First the sharded run: FSDP on 2 ranks under torchrun, saving at its last step (the tiny config,
# made 4 layers of width 256 so that the files are megabytes, not kilobytes).

# %%
from course_lib import cli

run7 = fresh(RUNS / "fsdp")
cmd7 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "course_lib.train", "--config", str(CONFIG), "--max-steps", str(EXPORT_STEPS),
        "--save-every", str(EXPORT_STEPS), "--no-progress", "--set", "train.peak_flops=1e12",
        "--set", "schedule.warmup_steps=1", "--set", "train.strategy=fsdp", "--out", str(run7),
        "--set", "model.d_model=256", "--set", "model.n_layers=4"]  # 3.2 M parameters: files big enough to time
fsdp_run = subprocess.run(cmd7, capture_output=True, text=True, env=ENV, timeout=600)
check(fsdp_run.returncode == 0, f"the 2-rank FSDP run failed:\n{fsdp_run.stdout[-1500:]}{fsdp_run.stderr[-1500:]}")
print("$ course ckpt list", run7.name)
check(cli.main(["ckpt", "list", str(run7)]) == 0, "every checkpoint of the run should verify")

# %% [markdown]
# One checkpoint, written by 2 ranks in the sharded format. Now the two exports, and a check that
# they hold the same weights as the shards: the same model, three containers.

# %%
from safetensors.torch import load_file as load_safetensors
from course_lib.checkpoint.dcp import consolidate_sharded
import transformers

transformers.utils.logging.disable_progress_bar()  # one bar per load would bury the table
single_file, hf_dir = fresh(RUNS / "model.safetensors"), fresh(RUNS / "hf")
print("$ course ckpt consolidate fsdp --out model.safetensors")
check(cli.main(["ckpt", "consolidate", str(run7), "--out", str(single_file)]) == 0, "consolidate failed")
print("$ course ckpt export-hf fsdp --out hf")
check(cli.main(["ckpt", "export-hf", str(run7), "--out", str(hf_dir)]) == 0, "export-hf failed")
sharded_dir = next((run7 / "checkpoints").glob("step_*"))
from_shards = consolidate_sharded(sharded_dir)
from_file = load_safetensors(single_file)
check(all(torch.equal(from_shards[k], v) for k, v in from_file.items()),
      "the consolidated file should hold exactly the weights stitched from the shards")
hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
import json
ours = TinyGPT(train_config.build_model_config(json.loads((run7 / "config.json").read_text()))).eval()
ours.load_state_dict({**from_file, "lm_head.weight": from_file["tok_emb.weight"]} if "lm_head.weight" not in from_file
                     else from_file)
tokens = torch.randint(0, ours.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(SEED))
with torch.no_grad():
    logit_gap = (ours(tokens)[0] - hf_model(input_ids=tokens).logits).abs().max().item()
check(logit_gap < 1e-4, f"transformers' {type(hf_model).__name__} should give our model's logits; "
                        f"they differ by {logit_gap:.2e}: a weight went to the wrong name")
print(f"transformers loaded a {type(hf_model).__name__}; its logits equal ours within {logit_gap:.1e}")

# %% [markdown]
# What each format costs: bytes on disk, and the time for one process to get full weights out of
# it (the median of `LOAD_REPEATS` loads; the first one also warms the page cache).
#
# Predict first. The model has 3.2 M parameters (4 blocks of width 256; the output layer shares
# the token table), trained in fp32 with AdamW. How many MB is the one-file export (weights only),
# and how many times the weights' bytes do the training shards take?

# %%
my_file_mb = None  # your prediction: MB of model.safetensors
my_shards_x = None  # your prediction: the shards' bytes / the weights' bytes

# %%
def folder_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def median_load_s(load):
    times = []
    for _ in range(LOAD_REPEATS + 1):
        t0 = time.perf_counter()
        load()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


formats = [
    ("sharded (DCP), as trained", sharded_dir, lambda: consolidate_sharded(sharded_dir)),
    ("one safetensors file", single_file, lambda: load_safetensors(single_file)),
    ("Hugging Face folder", hf_dir, lambda: transformers.AutoModelForCausalLM.from_pretrained(hf_dir)),
]
costs = {name: (folder_bytes(path) if Path(path).is_dir() else Path(path).stat().st_size, median_load_s(load))
         for name, path, load in formats}
weight_bytes = sum(v.numel() * v.element_size() for v in from_file.values())
print(f"{'format':28} {'on disk':>10} {'x weights':>10} {'load (ms)':>10}")
for name, (size, secs) in costs.items():
    print(f"{name:28} {size / 1e6:>8.2f} MB {size / weight_bytes:>10.2f} {secs * 1e3:>10.1f}")
shard_bytes = sum(f.stat().st_size for f in sharded_dir.glob("*.distcp"))
other_bytes = costs["sharded (DCP), as trained"][0] - shard_bytes
print(f"inside the sharded checkpoint: {shard_bytes / 1e6:.2f} MB of shards ({shard_bytes / weight_bytes:.2f}x the "
      f"weights), {other_bytes / 1e3:.0f} kB of index, per-rank state (RNG, data position) and manifest")
shards_x = shard_bytes / weight_bytes
file_x = costs["one safetensors file"][0] / weight_bytes
check(2.8 <= shards_x <= 3.3,
      f"the shards should be about 3x the weights (weights + AdamW's two fp32 moments), got {shards_x:.2f}x")
check(file_x < 1.05, f"the consolidated file should be the weights and little else, got {file_x:.2f}x")
check(other_bytes < 1e6, f"the index and per-rank files should be small next to the shards, got {other_bytes / 1e6:.1f} MB")
check(all(secs < 2.0 for _, secs in costs.values()), "each load should take well under a second at this size")
n_weights = sum(v.numel() for v in from_file.values())
print()
show_prediction("model.safetensors", my_file_mb, costs["one safetensors file"][0] / 1e6, unit="MB",
                why=f"{n_weights / 1e6:.2f} M parameters x 4 bytes = {4 * n_weights / 1e6:.2f} MB, and a small "
                    "header naming each tensor with its dtype and shape")
show_prediction("shards / weights", my_shards_x, shards_x,
                why="each fp32 weight has AdamW's two fp32 moments next to it: 3 x; the few percent above that "
                    "are bookkeeping stored in the same shard files")
check(abs(n_weights / 1e6 - 3.2) < 0.05 and abs(costs["one safetensors file"][0] / 1e6 - 12.8) < 0.1,
      f"the text says 3.2 M parameters and a 12.8 MB file; got {n_weights / 1e6:.2f} M and "
      f"{costs['one safetensors file'][0] / 1e6:.2f} MB")
one_file_s = costs["one safetensors file"][1]
check(all(secs > one_file_s for name, (_, secs) in costs.items() if name != "one safetensors file"),
      "stitching the shards and building the HF model should both take longer than reading the one file")
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3), layout="constrained")
ax1.barh(list(costs), [v[0] / 1e6 for v in costs.values()], color="tab:blue")
ax1.set(xlabel="MB on disk", title="size")
ax2.barh(list(costs), [v[1] * 1e3 for v in costs.values()], color="tab:orange")
ax2.set(xlabel="ms to full weights in one process", title="load time (median)")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3, axis="x")
ax2.set_yticklabels([])
plt.show()

# %% [markdown]
# **What you should see:** the shards alone are about three times the weights: they carry AdamW's
# two moments (fp32, one each per weight) so that training can resume exactly. On top come small
# files that do not grow with the model (DCP's index, each rank's RNG and data position: the kB in
# the line above). A server needs none of it: the consolidated file is the weights alone. Every load here takes milliseconds (under a second); stitching shards
# reads DCP's index and every rank's files, and `from_pretrained` also builds the model and checks
# its config, so on this machine both take longer than reading the one file. At 7B parameters the
# byte counts scale with the model, and a server that reads one file (safetensors can memory-map
# it) skips the stitching. To keep training somewhere else on one process,
# `course ckpt consolidate RUN --with-optimizer` also writes `FILE.optim.pt`: AdamW's state by
# parameter name, which torch's `set_optimizer_state_dict` loads. In the other direction,
# `model.init_from = "hf/"` starts a run from a Hugging Face folder (fine-tuning).
#
# ## Where next
#
# * **Exercise 07**: write the atomic save and a retention that never deletes first; the grader
#   kills it mid-save.
# * **Lab 05**: the rollback policy, which uses these checkpoints to undo a loss spike.
