"""Probes: tests the grader runs itself, on the module a submission wrote, outside its kernel.

Some properties cannot be handed over as values. "A kill at any instant leaves a checkpoint that
loads" is one: whatever a kernel reports about its own kills, a student who silences the checks
can report the right thing. A probe therefore runs the student's module (the file a
``%%writefile`` answer cell left in the kernel's folder) in fresh, confined kernels of its own,
ends them itself - with SIGKILL, at moments it picks - and only then, when no process that ran
student code is left, looks at the files on disk from the grader's process.

A test cell asks for a probe with a jupytext tag next to its points:
``# %% tags=["points:3", "probe:checkpoint-kills"]``. The probe runs once per submission (and
once on the instructor's solution, whose verdicts are the reference); the cell earns its points
only when its recorded values *and* every probe it names equal the reference's verdicts.

Each probe returns plain data: a list of verdicts, ``"ok"`` or a sentence saying what the grader
found (that sentence is the feedback).
"""
from __future__ import annotations

import fnmatch
import os
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from course_lib.grading import sandbox

MAX_MODULE_BYTES = 2**20  # a written module larger than this is not probed (bytes)
MAX_CHECKPOINT_BYTES = 64 * 2**20  # a checkpoint larger than this is not loaded (bytes)
KILL_CYCLES = 4  # writers killed per submission: even ones at a random moment, odd ones mid-write
KILL_NUMEL = 500_000  # float32 elements per checkpoint (2 MB: a save takes milliseconds)
START_TIMEOUT_S = 60.0  # seconds for a writer to start and finish its first two saves
MAX_WAIT_S = 5.0  # seconds a targeted kill waits to see a write in progress
SCENARIO_TIMEOUT_S = 60.0  # seconds for a scenario run (kernel start included)
CHECKPOINT_NAME = re.compile(r"step_(\d{8})\.pt")
# The verdict of a check skipped because an earlier verdict of the same probe already failed: a
# probe's verdicts earn points only when all of them equal the reference's (all "ok"), and the
# feedback shows the first one that is not, so the checks after a failure cannot change either.
NOT_RUN = "not run: an earlier check of this probe already failed"


@dataclass(frozen=True)
class ProbeLimits:
    """The grading run's confinement, reused for the probe's kernels."""

    memory_bytes: int
    hide: tuple
    sandbox: bool | None


# ----------------------------------------------------------------------------- run in the kernels
class RefusesWeightsOnly:
    """A value ``torch.save`` pickles but ``torch.load(weights_only=True)`` refuses: a checkpoint
    that writes fine and cannot be loaded back safely."""


class FailsToPickle:
    """A value whose pickling fails halfway, as a full disk makes a write fail."""

    def __reduce__(self):
        raise OSError("No space left on device (simulated by the grader)")


def write_forever(module: str, function: str, folder: str, numel: int) -> None:
    """In a probe kernel: save step 1, 2, 3, ... until killed, with ``module.function``:
    ``save_checkpoint(state, folder, step, keep_last=2)`` or ``atomic_save(state, folder/model.pt)``
    (``state``: :func:`course_lib.labs.lab07_checkpoints.make_state`). After each finished save it creates
    ``progress/<step>``, outside ``folder``, so the grader knows how far it got."""
    import importlib

    from course_lib.labs.lab07_checkpoints import make_state

    save = getattr(importlib.import_module(module), function)
    step = 0
    while True:
        step += 1
        if function == "atomic_save":
            save(make_state(step, numel), Path(folder) / "model.pt")
        else:
            save(make_state(step, numel), Path(folder), step, keep_last=2)
        Path("progress", str(step)).touch()


def atomic_save_scenario(module: str) -> None:
    """In a probe kernel: two saves to ``a/model.pt``, then one whose pickling fails (its OSError
    is expected and swallowed), then a nested state saved to a path given as ``str``."""
    import importlib

    import torch

    from course_lib.labs.lab07_checkpoints import make_state

    mod = importlib.import_module(module)
    Path("a").mkdir()
    Path("b").mkdir()
    mod.atomic_save(make_state(1, 16), Path("a") / "model.pt")
    mod.atomic_save(make_state(2, 16), Path("a") / "model.pt")
    try:
        mod.atomic_save({"step": 3, "w": FailsToPickle()}, Path("a") / "model.pt")
    except OSError:
        pass
    mod.atomic_save({"step": 4, "w": {"nested": [torch.full((5,), 4.0)]}}, "b/x.pt")


def retention_scenario(module: str) -> None:
    """In a probe kernel: steps 1-5 with ``keep_last=2`` into ``r``, then a step 6 that does not
    load back (its RuntimeError is expected and swallowed); steps 9-11 with ``keep_last=5`` into
    ``k`` given as ``str``, then step 12 with ``keep_last=2``."""
    import importlib

    from course_lib.labs.lab07_checkpoints import make_state

    mod = importlib.import_module(module)
    Path("r").mkdir()
    Path("k").mkdir()
    for step in range(1, 6):
        mod.save_checkpoint(make_state(step, 16), Path("r"), step, keep_last=2)
    try:
        mod.save_checkpoint({"step": 6, "w": RefusesWeightsOnly()}, Path("r"), 6, keep_last=2)
    except RuntimeError:
        pass
    for step in (9, 10, 11):
        mod.save_checkpoint(make_state(step, 16), "k", step, keep_last=5)
    mod.save_checkpoint(make_state(12, 16), "k", 12, keep_last=2)


# ----------------------------------------------------------------------------- looked at by the grader
def _listing(folder: Path) -> list[os.DirEntry]:
    try:
        return sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []


def _loadable_file(path: Path) -> bool:
    """A regular file (not a link) small enough to load in the grader's process."""
    try:
        return not path.is_symlink() and path.is_file() and path.stat().st_size <= MAX_CHECKPOINT_BYTES
    except OSError:
        return False


def _loaded_step(path: Path) -> int | None:
    """:func:`course_lib.labs.lab07_checkpoints.loaded_step` (``weights_only=True``) of a loadable file."""
    from course_lib.labs.lab07_checkpoints import loaded_step

    return loaded_step(path) if _loadable_file(path) else None


def checkpoints_verdict(folder: Path, *, expect_steps: list[int] | None = None,
                        max_count: int | None = None) -> str:
    """"ok" when every ``step_*.pt`` in ``folder`` is a regular file that loads with
    ``weights_only=True`` and holds its own step, the steps are consecutive, and (when given)
    they are exactly ``expect_steps`` / at most ``max_count``; else what is wrong, in words."""
    finals = [e for e in _listing(folder) if fnmatch.fnmatch(e.name, "step_*.pt")]
    if not finals:
        return "no checkpoint (step_*.pt) on disk"
    steps = []
    for entry in finals:
        match = CHECKPOINT_NAME.fullmatch(entry.name)
        if not match or not entry.is_file(follow_symlinks=False):
            return f"{entry.name} is not a checkpoint file named step_NNNNNNNN.pt"
        if _loaded_step(folder / entry.name) != int(match.group(1)):
            return (f"{entry.name} does not load with weights_only=True or holds another step: a file "
                    "got its final name before it was complete")
        steps.append(int(match.group(1)))
    if expect_steps is not None and steps != expect_steps:
        return f"steps {steps} on disk, expected {expect_steps}"
    if max_count is not None and len(steps) > max_count:
        return f"{len(steps)} checkpoints on disk with keep_last=2 (at most one extra during a save)"
    if steps != list(range(steps[0], steps[0] + len(steps))):
        return f"the checkpoints on disk are not consecutive steps: {steps}"
    return "ok"


# ----------------------------------------------------------------------------- the probes
def _module_file(work: Path, module: str) -> bytes | None:
    path = Path(work) / f"{module}.py"
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_MODULE_BYTES:
            return None
        return path.read_bytes()
    except OSError:
        return None


def _fresh_folder(scratch: Path, name: str, module: str, code: bytes) -> Path:
    work = Path(scratch) / name / "work"
    shutil.rmtree(work.parent, ignore_errors=True)
    work.mkdir(parents=True)
    (work / f"{module}.py").write_bytes(code)
    return work


def _scenario(work: Path, scratch: Path, limits: ProbeLimits, module: str, scenario: str, tested: str,
              verdicts: int) -> tuple[Path, list[str]]:
    """Run ``scenario`` (a function of this module) on a copy of the written ``module`` in a fresh
    kernel; its folder, and ``verdicts`` copies of the reason when it could not run (else [])."""
    code = _module_file(work, module)
    if code is None:
        return Path(), [f"no {module}.py was written (run the %%writefile cell)"] * verdicts
    folder = _fresh_folder(scratch, f"probe-{scenario}", module, code)
    error = _run_scenario(folder, f"from course_lib.grading.probes import {scenario}; {scenario}({module!r})", limits)
    return folder, [f"the grader's run of {tested} failed: {error}"] * verdicts if error else []


def _run_scenario(work: Path, call: str, limits: ProbeLimits) -> str:
    """Run ``call`` (one line of Python) in a fresh confined kernel in ``work``; "" when it
    finished, else how it ended. The kernel is gone when this returns."""
    outcome = sandbox.run_cells([("probe", call)], work, cell_timeout=SCENARIO_TIMEOUT_S,
                                notebook_timeout=SCENARIO_TIMEOUT_S, memory_bytes=limits.memory_bytes,
                                hide=list(limits.hide), sandbox=limits.sandbox).cells["probe"]
    if outcome.status == "ok":
        return ""
    return f"{outcome.error_name}: {outcome.error}"[:200] if outcome.error_name else outcome.status


def probe_atomic_save(work: Path, scratch: Path, limits: ProbeLimits, module: str = "ex07_checkpoint") -> list[str]:
    """The submission's ``atomic_save``, run by the grader: after two saves and a failed one the
    folder holds exactly ``model.pt`` with the second state; a nested state saved to a ``str``
    path loads back; and ``model.pt`` still loads after each of two kills mid-save
    (:func:`kill_cycles`). Verdicts: [replace-and-failed-save, nested, kill, kill]; when one of the
    first two is not "ok", the kills are not run (:data:`NOT_RUN`)."""
    folder, failed = _scenario(work, scratch, limits, module, "atomic_save_scenario", "atomic_save", 4)
    if failed:
        return failed
    names = [e.name for e in _listing(folder / "a")]
    if names != ["model.pt"]:
        first = f"after two saves and a failed one the folder holds {names[:6]}, expected only model.pt"
    elif _loaded_step(folder / "a" / "model.pt") != 2:
        first = ("model.pt does not hold the second save after a save that failed halfway: the failed "
                 "save wrote over it instead of into a temporary file")
    else:
        first = "ok"
    try:
        import torch

        nested = torch.load(folder / "b" / "x.pt", weights_only=True) if _loadable_file(folder / "b" / "x.pt") else None
        good = nested["step"] == 4 and bool((nested["w"]["nested"][0] == 4.0).all())
    except Exception:  # noqa: BLE001 - a file the student wrote: any shape of wrong
        good = False
    second = "ok" if good and [e.name for e in _listing(folder / "b")] == ["x.pt"] else \
        "a nested state saved to a path given as str does not load back as saved (or left other files)"
    if first != "ok" or second != "ok":  # already wrong: the kills could not change the score or its message
        return [first, second, *[NOT_RUN] * 2]
    return [first, second, *kill_cycles(work, scratch, limits, module, "atomic_save", cycles=2, seed=1)]


def probe_retention(work: Path, scratch: Path, limits: ProbeLimits, module: str = "ex07_checkpoint") -> list[str]:
    """The submission's ``save_checkpoint``, run by the grader: steps 1-5 then an unloadable step 6
    with keep_last=2 leave exactly steps 4 and 5; keep_last=5 keeps 9-11, then keep_last=2 after
    step 12 leaves 11 and 12. Verdicts: [keep_last=2 and the bad save, keep_last=5 then 2]."""
    folder, failed = _scenario(work, scratch, limits, module, "retention_scenario", "save_checkpoint", 2)
    if failed:
        return failed
    leftovers = [e.name for e in _listing(folder / "r") if not fnmatch.fnmatch(e.name, "step_*.pt")]
    first = checkpoints_verdict(folder / "r", expect_steps=[4, 5])
    if first == "ok" and leftovers:
        first = f"after the failed save the folder also holds {leftovers[:4]}"
    return [first, checkpoints_verdict(folder / "k", expect_steps=[11, 12])]


def probe_kills(work: Path, scratch: Path, limits: ProbeLimits, module: str = "ex07_checkpoint",
                cycles: int | None = None, seed: int = 0) -> list[str]:
    """The submission's ``save_checkpoint`` in a loop (keep_last=2, 2 MB per save), killed by the
    grader ``cycles`` times (default: :data:`KILL_CYCLES`, read when called, so a test of the
    grader itself can set fewer; reference and submissions then get the same count)
    (:func:`kill_cycles`). After each kill the grader checks the folder:
    :func:`checkpoints_verdict`, at most 3 checkpoints. One verdict per kill."""
    cycles = KILL_CYCLES if cycles is None else cycles
    return kill_cycles(work, scratch, limits, module, "save_checkpoint", cycles=cycles, seed=seed)


def kill_cycles(work: Path, scratch: Path, limits: ProbeLimits, module: str, function: str, *,
                cycles: int, seed: int) -> list[str]:
    """Run ``module.function`` in a loop in a fresh confined kernel and SIGKILL it - the kernel and
    every process it started, at once - ``cycles`` times, one new kernel and folder per kill:
    even cycles at a random moment within one save period (``random.Random(seed)``), odd ones as
    soon as a write shows in progress. ``function`` is ``save_checkpoint`` (checkpoints
    ``step_*.pt``, keep_last=2) or ``atomic_save`` (one file, ``model.pt``). Only after the kill
    does the grader look at the folder. One verdict per kill; after the first one that is not
    "ok" no further kernel is started and the remaining cycles read :data:`NOT_RUN`."""
    from course_lib.labs.lab07_checkpoints import _Watch

    code = _module_file(work, module)
    if code is None:
        return [f"no {module}.py was written (run the %%writefile cell)"] * cycles
    final = "step_*.pt" if function == "save_checkpoint" else "model.pt"
    rng = random.Random(seed)
    verdicts = []
    for cycle in range(cycles):
        folder = _fresh_folder(scratch, f"probe-{function}-kill{cycle}", module, code)
        (folder / "ckpt").mkdir()
        (folder / "progress").mkdir()
        kernel = sandbox.start_kernel(folder, memory_bytes=limits.memory_bytes, hide=list(limits.hide),
                                      sandbox=limits.sandbox)
        try:
            kernel.send("writer", "from course_lib.grading.probes import write_forever; "
                                  f"write_forever({module!r}, {function!r}, 'ckpt', {KILL_NUMEL})")
            problem = _kill_mid_save(kernel, folder / "progress", _Watch(folder / "ckpt", final),
                                     targeted=cycle % 2 == 1, delay=rng.random())
        finally:
            sandbox.stop_kernel(kernel)  # kills whatever is left, also when the writer never started
        if problem:
            verdicts.append(problem)
        elif function == "save_checkpoint":
            verdicts.append(checkpoints_verdict(folder / "ckpt", max_count=3))
        else:
            verdicts.append(_model_file_verdict(folder / "ckpt" / "model.pt"))
        if verdicts[-1] != "ok":
            return verdicts + [NOT_RUN] * (cycles - len(verdicts))
    return verdicts


def _model_file_verdict(path: Path) -> str:
    if not path.exists():
        return "model.pt was gone after the kill: the old file was removed before the new one was in place"
    if _loaded_step(path) is None:
        return ("model.pt does not load with weights_only=True after a kill mid-save: it was written in "
                "place (or renamed before it was complete)")
    return "ok"


def _kill_mid_save(kernel: sandbox.Kernel, progress: Path, watch, *, targeted: bool, delay: float) -> str:
    """Wait for the writer's first two saves (the second one timed; :func:`write_forever` marks
    each finished save in ``progress``), then SIGKILL its whole session: after ``delay`` (0-1)
    save periods, or, ``targeted``, once ``watch`` sees a write in progress. "" when killed as
    planned, else why the writer never got there."""
    deadline = time.monotonic() + START_TIMEOUT_S
    first = second = None
    while second is None:
        end = kernel.status.wait_for_end("writer", time.monotonic() + 0.0005)  # also reads the pipe
        if end is not None or kernel.status.eof:
            why = f"{end.get('error_name', '')}: {end.get('error', '')}"[:200] if end else "the kernel died"
            return f"the writer stopped by itself before its second save ({why})"
        if time.monotonic() > deadline:
            return f"the writer did not finish two saves within {START_TIMEOUT_S:g} s of its start"
        now = time.monotonic()
        if first is None and (progress / "1").exists():
            first = now
        if (progress / "2").exists():
            second = now
    period = max(second - (first or second), 0.001)
    watch.writing()  # remember the size of a complete checkpoint
    if targeted:
        until = time.monotonic() + MAX_WAIT_S
        while not watch.writing() and time.monotonic() < until:
            time.sleep(0.0002)
    else:
        time.sleep(delay * period)
    os.killpg(kernel.proc.pid, signal.SIGKILL)  # the writer and everything in its session, at once
    kernel.proc.wait()
    return ""


PROBES: dict[str, Callable[..., list[str]]] = {
    "checkpoint-atomic": probe_atomic_save,
    "checkpoint-retention": probe_retention,
    "checkpoint-kills": probe_kills,
}


def run_probes(names: set[str], work: Path, scratch: Path, limits: ProbeLimits) -> dict[str, list[str]]:
    """Every probe in ``names`` on the module(s) a finished run left in ``work``; its verdicts by
    name. Call only once the run's kernel is gone. A probe that crashes the grader's side is a bug
    of the kit and raises."""
    return {name: PROBES[name](Path(work), Path(scratch), limits) for name in sorted(names)}
