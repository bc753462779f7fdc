"""Kill a checkpoint writer with SIGKILL and report what it left on disk (lab 07, exercise 07).

A training process can die at any instant: ``kill -9``, the out-of-memory killer and a lost node
run no signal handler and no ``finally``. :func:`kill_while_saving` reproduces that for any save
function. A driver process forks one writer per cycle; the writer saves step 1, 2, 3, ... into a
folder of its own, as fast as it can; after two saves (the second one timed: the save period) the
driver sends SIGKILL, on even cycles at a random moment within one save period, on odd cycles as
soon as it sees a write in progress. Each cycle's folder is then listed: checkpoints (names that
match ``final``) and leftovers (anything else: what a kill mid-write left behind). The caller
checks the folders the way a restarted run would, e.g. with :func:`loaded_step`.

The writer saves :func:`make_state` ``(step, numel)``: every element equals the step, so a loaded
checkpoint shows both that it is complete and which step it holds.

Why a driver process: forking a process that has run torch compute can hang forever (an OpenMP
barrier), so a notebook kernel must never fork. The driver imports torch and the writer's module,
computes nothing, and forks. The writer is named ``"module:function"``, importable by the driver
(a ``course_lib`` module, or a file written with ``%%writefile`` whose folder is passed in
``path``): a function defined in a notebook cell cannot reach another process.

    reports = kill_while_saving("course_lib.labs.lab07_checkpoints:torch_save_in_place", tmp / "naive",
                                cycles=4, numel=2_000_000, final="latest.pt")
    [loaded_step(r.folder / "latest.pt") for r in reports]   # None: torn by the kill
"""
from __future__ import annotations

import fnmatch
import importlib
import itertools
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from course_lib.parallel.ranks.entry import _die_with_parent  # SIGKILL with the parent (Linux)
from course_lib.validate import check_int, check_number

_REPORT = "KILL-REPORT "  # prefix of the driver's result line on stdout
_POLL_S = 0.0002  # seconds between two looks at the folder while waiting for a write


class WriterFailed(RuntimeError):
    """The writer could not be imported, or raised, before it was killed; the message holds its
    traceback. A correct writer never stops by itself: it is only ever killed."""


@dataclass(frozen=True)
class KillReport:
    """One writer, killed once, and what it left in ``folder``.

    ``targeted``: this cycle waited for a write in progress before the kill (odd cycles); otherwise
    the kill came at a random moment within one save period. ``in_write``: a write was seen in
    progress just before the kill (checked within about a millisecond of it; on targeted cycles
    False only when none was seen within ``max_wait_s``). ``period_s``: seconds the cycle's second
    save took. ``saves``: saves that completed before the kill. ``final``: names in the folder
    matching the ``final`` pattern (checkpoints), sorted; ``leftovers``: every other name, sorted."""

    cycle: int
    folder: Path
    targeted: bool
    in_write: bool
    period_s: float
    saves: int
    final: tuple[str, ...]
    leftovers: tuple[str, ...]


# ----------------------------------------------------------------------------- the saved state
def make_state(step: int, numel: int) -> dict:
    """What the writer saves after ``step`` steps: ``{"step": step, "w": float32 tensor of
    numel elements (4 * numel bytes), every element equal to step}``."""
    import torch

    return {"step": step, "w": torch.full((numel,), float(step))}


def state_step(state: Any) -> int | None:
    """The step a loaded :func:`make_state` holds, or None when it is not one, or its tensor is
    not filled with its step throughout (a mix of two saves)."""
    import torch

    try:
        step, w = state["step"], state["w"]
    except (TypeError, KeyError):
        return None
    if not isinstance(w, torch.Tensor) or not bool((w == step).all()):
        return None
    return step


def loaded_step(path: str | os.PathLike) -> int | None:
    """Load ``path`` as a restarted run would (``torch.load(weights_only=True)``) and return the
    step it holds; None when the file is missing, torn, or does not hold one complete step."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torn zip archive, empty file, missing file, refused object
        return None
    return state_step(state)


# ----------------------------------------------------------------------------- reference writers
def torch_save_in_place(state: dict, folder: Path, step: int) -> None:
    """The naive save: ``torch.save(state, folder / "latest.pt")``, truncating the previous
    checkpoint and writing over it (``final="latest.pt"``). ``step`` is unused."""
    import torch

    torch.save(state, Path(folder) / "latest.pt")


_managers: dict = {}  # folder -> CheckpointManager, one per writer process (each writer is a fork)


def save_with_manager(state: dict, folder: Path, step: int, keep_last: int = 2) -> None:
    """The atomic save: ``CheckpointManager(folder, keep_last=keep_last, async_save=False)``
    saves ``state["w"]`` as the parameter ``w`` of a ``ParameterDict`` (checkpoints ``step_*``;
    load one back into ``torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.empty(numel))})``)."""
    import torch

    from course_lib.checkpoint import CheckpointManager

    folder = Path(folder)
    if folder not in _managers:
        _managers[folder] = CheckpointManager(folder, keep_last=keep_last, async_save=False)
    model = torch.nn.ParameterDict({"w": torch.nn.Parameter(state["w"], requires_grad=False)})
    _managers[folder].save(step, model=model)


# ----------------------------------------------------------------------------- the harness
def kill_while_saving(writer: str, root: str | os.PathLike, *, cycles: int, seed: int = 0,
                      numel: int = 2_000_000, kwargs: dict | None = None,
                      path: Iterable[str | os.PathLike] = (), final: str = "step_*",
                      max_wait_s: float = 5.0, timeout_s: float = 600.0) -> list[KillReport]:
    """SIGKILL ``cycles`` writers, each in the middle of saving; one :class:`KillReport` per kill.

    ``writer``: ``"module:function"``, called as ``function(make_state(step, numel), folder, step,
    **kwargs)`` for step 1, 2, 3, ... (``kwargs``: JSON values); ``path``: folders put first on
    the driver's ``sys.path`` (where a written module lives). Cycle ``c`` writes into
    ``root/kill{c:03d}``, a new folder. ``final``: a glob for the names of complete checkpoints.
    A write is *in progress* when the folder holds a name that does not match ``final`` (a
    temporary file or directory), or a file matching it that is shorter than the largest one seen
    since the first two saves (a checkpoint being rewritten in place, or written under its final
    name). Even cycles are killed after a random delay, uniform in [0, period] seconds
    (``random.Random(seed)``); odd ones once a write is in progress, or after ``max_wait_s``
    seconds if none shows. ``timeout_s``: seconds for the whole run (``subprocess.TimeoutExpired``
    after that; no writer outlives it). Raises :class:`WriterFailed` when the writer cannot be
    imported, raises, or exits by itself.
    """
    if not isinstance(writer, str) or writer.count(":") != 1:
        raise ValueError(f"writer must be 'module:function', got {writer!r}")
    check_int("cycles", cycles, 1)
    check_int("seed", seed, 0)
    check_int("numel", numel, 1)
    check_number("max_wait_s", max_wait_s, 0, lo_open=True)
    check_number("timeout_s", timeout_s, 0, lo_open=True)
    spec = {"writer": writer, "root": str(Path(root).resolve()), "cycles": cycles, "seed": seed,
            "numel": numel, "kwargs": dict(kwargs or {}), "path": [str(Path(p).resolve()) for p in path],
            "final": final, "max_wait_s": max_wait_s, "timeout_s": timeout_s, "caller_pid": os.getpid()}
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread per writer, whatever the caller uses
    out = subprocess.run([sys.executable, "-m", __name__, json.dumps(spec)], capture_output=True,
                         text=True, timeout=timeout_s, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(_REPORT)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the kill driver failed (exit code {out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1][len(_REPORT):])
    if "error" in result:
        raise WriterFailed(f"the writer {writer} failed in cycle {result['cycle']} before it was "
                           f"killed:\n{result['error']}")
    return [KillReport(**{**r, "folder": Path(r["folder"]), "final": tuple(r["final"]),
                          "leftovers": tuple(r["leftovers"])}) for r in result["kills"]]


# ----------------------------------------------------------------------------- the driver process
class _Watch:
    """Whether a folder shows a write in progress: a name that does not match ``final``, or a file
    matching it that is shorter than the largest such file seen so far (one being rewritten)."""

    def __init__(self, folder: Path, final: str):
        self.folder, self.final, self.largest = folder, final, 0

    def writing(self) -> bool:
        busy = False
        for e in os.scandir(self.folder):
            if not fnmatch.fnmatch(e.name, self.final):
                busy = True
                continue
            try:
                if e.is_file(follow_symlinks=False):
                    size = e.stat(follow_symlinks=False).st_size
                    busy = busy or size < self.largest
                    self.largest = max(self.largest, size)
            except FileNotFoundError:  # pruned while we looked
                continue
        return busy


def _read_byte(fd: int, deadline: float) -> bytes:
    """One byte from the writer's pipe: b"." a save done, b"!" an error follows, b"" it died."""
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    return os.read(fd, 1) if ready else b"?"


def _read_all(fd: int) -> bytes:
    """Everything left in the pipe of a writer that is dead (so the read ends); closes ``fd``."""
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def _write_loop(fn, folder: Path, numel: int, kwargs: dict, fd: int, driver_pid: int) -> None:
    """The writer (a forked child): save step 1, 2, ... until killed; report each save on ``fd``."""
    import torch

    try:
        _die_with_parent(driver_pid)
        torch.set_num_threads(1)
        for step in itertools.count(1):
            fn(make_state(step, numel), folder, step, **kwargs)
            os.write(fd, b".")
    except BaseException:  # noqa: BLE001 - whatever it is, the driver reports it
        os.write(fd, b"!" + traceback.format_exc()[-6000:].encode())
    finally:
        os._exit(1)


def _drive(spec: dict) -> dict:
    """Run the cycles; return {"kills": [...]} or {"error": traceback, "cycle": n}."""
    _die_with_parent(spec["caller_pid"])
    sys.path[:0] = spec["path"]
    try:
        module, name = spec["writer"].split(":")
        fn = getattr(importlib.import_module(module), name)
        import torch  # noqa: F401 - imported once here, not in every forked writer (no compute)
    except BaseException:  # noqa: BLE001
        return {"error": traceback.format_exc()[-6000:], "cycle": 0}
    rng = random.Random(spec["seed"])
    final, kills = spec["final"], []
    for cycle in range(spec["cycles"]):
        folder = Path(spec["root"]) / f"kill{cycle:03d}"
        folder.mkdir(parents=True)
        r, w = os.pipe()
        sys.stdout.flush()
        driver_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _write_loop(fn, folder, spec["numel"], spec["kwargs"], w, driver_pid)
        os.close(w)
        deadline = time.monotonic() + spec["timeout_s"]
        first = _read_byte(r, deadline)
        t0 = time.monotonic()
        second = _read_byte(r, deadline) if first == b"." else first
        period = time.monotonic() - t0
        if second != b".":
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rest = _read_all(r).decode(errors="replace") if second == b"!" else ""
            why = rest or ("no save finished in time" if second == b"?" else "the writer exited by itself")
            return {"error": why, "cycle": cycle}
        watch = _Watch(folder, final)
        watch.writing()  # a first look: the sizes of complete checkpoint files
        targeted = cycle % 2 == 1
        if targeted:
            wait_until = time.monotonic() + spec["max_wait_s"]
            while not watch.writing() and time.monotonic() < wait_until:
                time.sleep(_POLL_S)
        else:
            time.sleep(rng.uniform(0, period))
        in_write = watch.writing()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        done = _read_all(r)
        if b"!" in done:
            return {"error": done[done.index(b"!") + 1:].decode(errors="replace"), "cycle": cycle}
        names = sorted(os.listdir(folder))
        kills.append({"cycle": cycle, "folder": str(folder), "targeted": targeted, "in_write": in_write,
                      "period_s": period, "saves": 2 + len(done),
                      "final": [n for n in names if fnmatch.fnmatch(n, final)],
                      "leftovers": [n for n in names if not fnmatch.fnmatch(n, final)]})
    return {"kills": kills}


if __name__ == "__main__":
    print(_REPORT + json.dumps(_drive(json.loads(sys.argv[1]))), flush=True)
