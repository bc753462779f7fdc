# %% [markdown]
# # Exercise 07 — An atomic checkpoint writer with safe retention
#
# Many tutorials save a checkpoint with `torch.save(state, path)` and keep the last few by
# deleting the oldest *before* saving the new one. Both are wrong:
#
# * `torch.save` truncates `path` and then writes; a process killed in between (`kill -9`, the
#   out-of-memory killer, a lost node) leaves a torn file, and the previous checkpoint is gone;
# * deleting first means a crash during the save leaves one checkpoint fewer than promised.
#
# You will write `atomic_save` (a crash at any instant leaves the old file or the new file, never
# a torn one) and `save_checkpoint` (atomic save, verify, and only then delete old ones). The
# checks break your code on purpose, and the grader kills it mid-save, many times.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
KILLS = 8  # SIGKILLs in the visible crash test

# %%
import importlib
import os
import tempfile
from pathlib import Path

import torch

import course_lib
from course_lib.labs.lab07_checkpoints import kill_while_saving, loaded_step
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    KILLS = 4
SCRATCH = Path(tempfile.mkdtemp(prefix="ex07-"))

# %% [markdown]
# ## Part 1: your checkpoint module
#
# The grader runs your code in another process and kills that process, so the next cell *writes
# your code to a file* (`ex07_checkpoint.py`, next to this notebook) rather than defining it here.
# Edit the functions inside the cell, run it, then run the checks below.
#
# **`atomic_save(state, path)`** must hold, whenever the process dies (`SIGKILL`, a power cut):
#
# 1. `path` holds either its old complete contents or its new complete contents, never a torn
#    file; a file that is still being written never carries a checkpoint's name
#    (`list_checkpoints` only counts `step_*.pt`);
# 2. after a power cut, a name that points at the new contents points at bytes that reached the
#    disk, and the new name itself survived;
# 3. a save that fails halfway raises, leaves the old `path` intact and leaves nothing else behind.
#
# Lab 07, section 1 shows how `CheckpointManager` gets there: which single operation is its
# commit point, where does the new data live until then, and what has to reach the disk before it?
#
# **`save_checkpoint(state, folder, step, keep_last)`**: `atomic_save` to
# `checkpoint_path(folder, step)`; load it back with `torch.load(..., weights_only=True)` (if that
# fails: delete the new file, leave every older checkpoint alone, raise `RuntimeError`); only then
# delete the oldest checkpoints so that the newest `keep_last` remain. Return the new path.

# %%
# %%writefile ex07_checkpoint.py
"""Atomic checkpoints with retention (exercise 07)."""
import os
from pathlib import Path

import torch


def checkpoint_path(folder, step: int) -> Path:
    """Where checkpoint `step` lives: folder/step_00000042.pt."""
    return Path(folder) / f"step_{step:08d}.pt"


def list_checkpoints(folder) -> list:
    """Checkpoint files in `folder`, oldest (smallest step) first. Names that do not match
    step_*.pt (your temporary files) are never counted."""
    return sorted(Path(folder).glob("step_*.pt"))


def atomic_save(state: dict, path) -> None:
    """torch.save `state` so that `path` always holds either its old or its new complete contents."""
    path = Path(path)
    ### BEGIN SOLUTION Which file-system operation makes a complete file appear under a name in one indivisible step, and why must the file start in the same folder? What has to be on disk before that step, and what after it? Lab 07, section 1
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    ### END SOLUTION


def save_checkpoint(state: dict, folder, step: int, keep_last: int = 2) -> Path:
    """Save checkpoint `step` atomically, verify it loads, then keep only the newest `keep_last`."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    path = checkpoint_path(folder, step)
    ### BEGIN SOLUTION What could go wrong if anything older were deleted before the new checkpoint is known to load? list_checkpoints is sorted oldest first: which of its entries are the ones to keep? Lab 07, section 2
    atomic_save(state, path)
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        path.unlink(missing_ok=True)
        raise RuntimeError(f"checkpoint {path} does not load back ({exc}); older checkpoints kept") from exc
    for old in list_checkpoints(folder)[:-keep_last]:
        old.unlink()
    return path
    ### END SOLUTION

# %% [markdown]
# ## Part 2: `atomic_save`, checked
#
# The check watches the renames and the flushes to disk your function makes while it runs,
# saves twice to the same path, and makes one save fail halfway: a state holding an object that
# refuses to be pickled, as a full disk would make `write` fail.

# %% tags=["points:3", "probe:checkpoint-atomic"]
import ex07_checkpoint

importlib.reload(ex07_checkpoint)  # pick up your latest edit
from ex07_checkpoint import atomic_save, list_checkpoints, save_checkpoint  # noqa: E402


class Unpicklable:
    def __reduce__(self):
        raise OSError("No space left on device (simulated)")


def watched(fn, *args):
    """Run fn(*args) and record the renames and fsyncs it makes (the os module's functions)."""
    calls, saved = [], {n: getattr(os, n) for n in ("replace", "rename", "fsync")}

    def spy(name):
        def call(*a, **k):
            calls.append((name, a))
            return saved[name](*a, **k)
        return call
    for n in saved:
        setattr(os, n, spy(n))
    try:
        return fn(*args), calls
    finally:
        for n, f in saved.items():
            setattr(os, n, f)


folder = SCRATCH / "part2"
folder.mkdir()
target = folder / "model.pt"
_, calls = watched(atomic_save, {"step": 1, "w": torch.ones(3)}, target)
check(target.exists() and torch.load(target, weights_only=True)["step"] == 1,
      "after atomic_save the file should exist and load back with what was saved")
renames = [a for name, a in calls if name in ("replace", "rename")]
check(len(renames) == 1, "atomic_save renamed nothing: the target was written in place, so a kill mid-write "
      "tears it (lab 07, section 1)" if not renames else
      f"atomic_save made {len(renames)} renames; one is enough to swap the complete new file in")
src, dst = (Path(p) for p in renames[0][:2])
check(Path(dst).resolve() == target.resolve(), f"the rename should land on the target path, not {dst}")
check(src.parent.resolve() == target.parent.resolve(),
      f"the temporary file {src} must be in the target's folder: a rename across file systems is not atomic")
check(any(name == "fsync" for name, _ in calls), "nothing was flushed to disk: after a power cut the new name "
      "could point at data that never reached the disk")
atomic_save({"step": 2, "w": torch.full((3,), 2.0)}, target)
check(torch.load(target, weights_only=True)["step"] == 2, "a second save to the same path should replace the first")
try:
    atomic_save({"step": 3, "bad": Unpicklable()}, target)
    raised = False
except OSError:
    raised = True
check(raised, "a save that fails halfway must raise (here: the OSError from pickling), not swallow the error")
check(torch.load(target, weights_only=True)["step"] == 2,
      "after a failed save the old file must be intact: it is only replaced once the new one is complete")
check(sorted(p.name for p in folder.iterdir()) == ["model.pt"],
      f"a failed save should remove its temporary file; the folder holds {sorted(p.name for p in folder.iterdir())}")
record("part2.observations", [len(renames), Path(dst).resolve() == target.resolve(),
                                src.parent.resolve() == target.parent.resolve(), any(n == "fsync" for n, _ in calls),
                                raised, torch.load(target, weights_only=True)["step"],
                                sorted(p.name for p in folder.iterdir())])
print("atomic_save: temporary file in the same folder, fsync, one rename; a failed save changes nothing")

# %% [markdown]
# ## Part 3: retention that never deletes first
#
# Five saves with `keep_last=2` leave steps 4 and 5. Then a save whose file cannot be loaded back
# with `weights_only=True` (it holds a custom Python object: writing works, safe loading refuses),
# which must raise and leave both older checkpoints in place.

# %% tags=["points:3", "probe:checkpoint-retention"]
class Custom:  # torch.save pickles it; torch.load(weights_only=True) refuses to unpickle it
    pass


ckpts = SCRATCH / "part3"
ckpts.mkdir()
for step in range(1, 6):
    path = save_checkpoint({"step": step, "w": torch.full((4,), float(step))}, ckpts, step, keep_last=2)
    check(path.exists(), f"save_checkpoint should return the path it wrote, got {path}")
names = [p.name for p in list_checkpoints(ckpts)]
check(names == ["step_00000004.pt", "step_00000005.pt"], f"keep_last=2 after steps 1..5 should keep 4 and 5, got {names}")
try:
    save_checkpoint({"step": 6, "w": Custom()}, ckpts, 6, keep_last=2)
    raised = None
except RuntimeError as exc:
    raised = exc
check(raised is not None, "a checkpoint that does not load back with weights_only=True must raise RuntimeError")
left = sorted(p.name for p in ckpts.iterdir())
check(left == ["step_00000004.pt", "step_00000005.pt"],
      f"after a failed save the older checkpoints must all be there and the bad file gone; the folder holds {left}. "
      "Verify the new file *before* deleting anything")
save_checkpoint({"step": 7}, ckpts, 7, keep_last=1)
check([p.name for p in list_checkpoints(ckpts)] == ["step_00000007.pt"], "keep_last=1 keeps only the newest")
record("part3.observations", [names, raised is not None, left, [p.name for p in list_checkpoints(ckpts)]])
print("retention: verified before pruning; a bad save deletes nothing")

# %% [markdown]
# ## Part 4: kill it
#
# The real test, with the harness lab 07 uses (`course_lib.labs.lab07_checkpoints.kill_while_saving`). It
# starts a process that imports your module and forks a writer, which calls your `save_checkpoint`
# in a loop (`keep_last=2`, about 8 MB each, every tensor filled with its step number). The harness
# kills the writer with `SIGKILL` (no handler, no `finally`) at random moments, alternately while
# a write is certainly in progress, and lists what is left. After each kill, the newest checkpoint
# must load and hold its own step, exactly what a restarted training run would do.

# %% tags=["points:3", "probe:checkpoint-kills"]
def kill_test(kills, seed, numel, name):
    """Kill a writer running your save_checkpoint `kills` times; one row per kill: (newest checkpoint
    or None, it loads and holds its own step, how many checkpoints are on disk, leftover files)."""
    reports = kill_while_saving("ex07_checkpoint:save_checkpoint", SCRATCH / name, cycles=kills, seed=seed,
                                numel=numel, kwargs={"keep_last": 2}, final="step_*.pt",
                                path=[Path(ex07_checkpoint.__file__).parent])  # where your module is
    rows = []
    for r in reports:
        newest = r.final[-1] if r.final else None
        ok = newest is not None and loaded_step(r.folder / newest) == int(Path(newest).stem.split("_")[1])
        rows.append((newest, ok, len(r.final), list(r.leftovers)))
    return rows


rows = kill_test(KILLS, seed=0, numel=2_000_000, name="visible")
record("part4.kills_usable", [newest is not None and ok for newest, ok, _, _ in rows])
print(f"{'kill':>4} {'newest checkpoint':>20} {'loads':>6} {'on disk':>8}  leftovers (a kill mid-write)")
for i, (newest, ok, n, leftovers) in enumerate(rows):
    print(f"{i:>4} {str(newest):>20} {str(ok):>6} {n:>8}  {leftovers}")
for i, (newest, ok, n, leftovers) in enumerate(rows):
    check(newest is not None, f"kill {i}: no checkpoint left on disk at all")
    check(ok, f"kill {i}: the newest checkpoint {newest} does not load (or holds another step): it was given "
          "its final name before it was complete")

# %% [markdown]
# **What you should see:** every row's newest checkpoint loads. The odd rows were killed while a
# write was in progress: their leftover column shows your temporary file (a restarted run would
# delete it; it never has a checkpoint's name, so nothing ever loads it). With a plain
# `torch.save(state, path)` those rows would show a newest file that does not load.

# %% tags=["points:3", "probe:checkpoint-kills"]
### BEGIN HIDDEN TESTS
hidden = kill_test(10, seed=123, numel=3_000_000, name="hidden")
record("hidden.kills_usable", [newest is not None and ok and 1 <= n <= 3 for newest, ok, n, _ in hidden])
for i, (newest, ok, n, leftovers) in enumerate(hidden):
    check(newest is not None and ok, f"hidden kill {i}: newest checkpoint {newest} unusable")
    check(1 <= n <= 3, f"hidden kill {i}: {n} checkpoints on disk with keep_last=2 (at most one extra during a save)")
check(any(leftovers for *_, leftovers in hidden), "hidden: no kill landed mid-write")
# atomic_save into a folder given as a str, and a nested state
other = SCRATCH / "hidden-misc"
other.mkdir()
atomic_save({"a": {"b": [torch.arange(5)]}}, str(other / "x.pt"))
check(torch.equal(torch.load(other / "x.pt", weights_only=True)["a"]["b"][0], torch.arange(5)), "nested state")
check(sorted(p.name for p in other.iterdir()) == ["x.pt"], "no temporary file left after a good save")
# keep_last larger than the number of checkpoints keeps them all; steps sort numerically
(other / "k").mkdir()
for s in (9, 10, 11):
    save_checkpoint({"s": s}, other / "k", s, keep_last=5)
check([p.name for p in list_checkpoints(other / "k")] == ["step_00000009.pt", "step_00000010.pt", "step_00000011.pt"],
      "keep_last=5 with three checkpoints keeps all three")
save_checkpoint({"s": 12}, other / "k", 12, keep_last=2)
record("hidden.misc", [torch.load(other / "x.pt", weights_only=True), sorted(p.name for p in other.iterdir()),
                       [p.name for p in list_checkpoints(other / "k")]])
check([p.name for p in list_checkpoints(other / "k")] == ["step_00000011.pt", "step_00000012.pt"], "then prune to 2")
### END HIDDEN TESTS
