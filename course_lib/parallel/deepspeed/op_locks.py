"""Build locks of torch C++ extensions (DeepSpeed's JIT ops): find the stale ones, never wait forever.

torch builds a JIT op into ``TORCH_EXTENSIONS_DIR/<op>/`` (the kit keeps that folder in the venv,
see ``course_lib/__init__.py``) and lets one process at a time in with a ``FileBaton``: the first
creates ``<op>/lock`` (``O_CREAT | O_EXCL``), keeps it open while ninja runs, and deletes it when
done; every other process polls until the file is gone, with no time limit and no message. Each
*load* of a DeepSpeed JIT op takes that baton, even when the op is built (ninja checks it is up to
date, under a second). A build killed half-way (SIGKILL, out of memory, a CI timeout) never deletes
its lock, and from then on every DeepSpeed start waits forever in ``deepspeed.init_distributed``.

**Stale** here means: no process on this machine has the lock file open (the builder holds its
descriptor for the whole build; the holders are read from ``/proc/<pid>/fd``) *and* the file is
older than ``stale_after_s`` (:data:`STALE_AFTER_S`, or ``COURSE_OP_LOCK_STALE_S``). The age is for a
build on another machine that shares the folder (a venv on a network file system), whose process
this machine cannot see; where ``/proc`` cannot be read at all, nobody counts as a holder and the age
decides alone.

:func:`guard` makes a waiting load give up with :class:`OpLockError` (naming the lock and the
command that clears it) as soon as the lock it waits on is stale, and after ``timeout_s`` in any
case. The kit's DeepSpeed start, ``deepspeed_ops.build`` and ``course doctor --load-ops`` run under
it; ``course doctor`` lists the locks and ``course doctor --clear-stale-locks`` removes the stale ones.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

#: Seconds without a holder on this machine after which a lock counts as stale.
STALE_AFTER_S = 120.0
#: Seconds a load may wait on a lock that a live process holds (a build running) before giving up.
TIMEOUT_S = 1800.0
CHECK_EVERY_S = 1.0  # how often a waiting load looks at the holders (a /proc scan), seconds
CLEAR_COMMAND = "course doctor --clear-stale-locks"


class OpLockError(RuntimeError):
    """A JIT op load gave up waiting on a build lock; the message names the lock and the fix."""


@dataclass
class OpLock:
    """One ``lock`` file: ``path``; ``age_s`` (seconds since it was created); ``holders`` (pids of the
    processes on this machine that have it open); ``stale`` (see the module docstring)."""

    path: Path
    age_s: float
    holders: list[int] = field(default_factory=list)
    stale: bool = False
    stale_after_s: float = STALE_AFTER_S  # the threshold it was judged with

    @property
    def op(self) -> str:
        """The op's name: the lock's folder (``deepspeed_shm_comm``, ``cpu_adam``, ...)."""
        return self.path.parent.name

    def describe(self) -> str:
        """One line for a report."""
        if self.holders:
            return (f"{self.path}: a build of op '{self.op}' is running (held by pid "
                    f"{', '.join(map(str, self.holders))}, {self.age_s:.0f} s)")
        if self.stale:
            return (f"{self.path}: STALE - left by a build of op '{self.op}' that was killed half-way "
                    f"({self.age_s:.0f} s old, no process on this machine holds it)")
        return (f"{self.path}: no process on this machine holds it ({self.age_s:.0f} s old); stale at "
                f"{self.stale_after_s:.0f} s unless a build on another machine shares this folder")

    def to_dict(self) -> dict:
        return {"path": str(self.path), "op": self.op, "age_s": round(self.age_s, 1),
                "holders": list(self.holders), "stale": self.stale}


def _stale_after(value: float | None) -> float:
    return float(value if value is not None else os.environ.get("COURSE_OP_LOCK_STALE_S", STALE_AFTER_S))


def extensions_root() -> Path:
    """Where torch builds JIT ops: ``TORCH_EXTENSIONS_DIR``, else torch's default build root
    (``~/.cache/torch_extensions``, ops one folder further down, per Python/CUDA version)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def lock_holders(path: str | os.PathLike) -> list[int]:
    """Pids of the processes on this machine that have ``path`` open (read from ``/proc/*/fd``;
    processes whose descriptors cannot be read are skipped). Empty without ``/proc``."""
    target = os.path.realpath(path)
    found = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def inspect(path: str | os.PathLike, stale_after_s: float | None = None) -> OpLock | None:
    """The state of one lock file, or None when it does not exist (any more)."""
    path = Path(path)
    try:
        age = max(0.0, time.time() - path.stat().st_mtime)
    except FileNotFoundError:
        return None
    holders, after = lock_holders(path), _stale_after(stale_after_s)
    return OpLock(path, age, holders, stale=not holders and age >= after, stale_after_s=after)


def find_locks(root: str | os.PathLike | None = None, stale_after_s: float | None = None) -> list[OpLock]:
    """Every op build lock under ``root`` (default :func:`extensions_root`): ``<root>/<op>/lock``
    and, for torch's default root, ``<root>/<python-cuda>/<op>/lock``."""
    root = Path(root) if root is not None else extensions_root()
    paths = sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})
    return [lock for lock in (inspect(p, stale_after_s) for p in paths) if lock is not None]


def clear_stale(root: str | os.PathLike | None = None, stale_after_s: float | None = None) -> list[OpLock]:
    """Delete the stale locks under ``root`` (each judged again just before); returns them."""
    removed = []
    for lock in find_locks(root, stale_after_s):
        again = inspect(lock.path, stale_after_s) if lock.stale else None
        if again is not None and again.stale:
            with contextlib.suppress(FileNotFoundError):
                again.path.unlink()
            removed.append(again)
    return removed


def stale_message(lock: OpLock) -> str:
    """What a start that met a stale lock says: which file, why it is stale, how to clear it."""
    return (f"the build lock {lock.path} of DeepSpeed's op '{lock.op}' is stale: no process on this machine "
            f"holds it and it is {lock.age_s:.0f} s old (a build was killed half-way). Every run that loads "
            f"'{lock.op}' would wait on it forever. Remove it and start again (the op then builds or loads "
            f"as usual): rm {lock.path}   (or: {CLEAR_COMMAND})")


def _guarded_wait(baton, timeout_s: float, stale_after_s: float | None) -> None:
    """``FileBaton.wait`` with an end: poll as torch does; every CHECK_EVERY_S look at the lock."""
    path = Path(baton.lock_file_path)
    start = time.monotonic()
    next_check = start
    while path.exists():
        now = time.monotonic()
        if now >= next_check:
            lock = inspect(path, stale_after_s)
            if lock is None:
                return
            if lock.stale:
                raise OpLockError(stale_message(lock))
            if now - start > timeout_s:
                who = (f"held by pid {', '.join(map(str, lock.holders))} on this machine, a build still running"
                       if lock.holders else "no holder on this machine: a build on another machine?")
                raise OpLockError(
                    f"waited {now - start:.0f} s for the build lock {lock.path} of DeepSpeed's op '{lock.op}' "
                    f"({who}), longer than COURSE_OP_LOCK_TIMEOUT_S = {timeout_s:.0f} s. Let that build finish, "
                    f"or stop it and remove the lock: rm {lock.path}")
            next_check = now + CHECK_EVERY_S
        time.sleep(baton.wait_seconds)


@contextlib.contextmanager
def guard(timeout_s: float | None = None, stale_after_s: float | None = None) -> Iterator[None]:
    """Inside the block, a torch JIT op load that waits on another process's build lock raises
    :class:`OpLockError` once the lock is stale, or after ``timeout_s`` seconds of waiting
    (default ``COURSE_OP_LOCK_TIMEOUT_S`` or :data:`TIMEOUT_S`), instead of waiting forever.
    Replaces ``torch.utils.file_baton.FileBaton.wait`` for the block's duration (nested blocks
    keep the outer one's limits)."""
    from torch.utils.file_baton import FileBaton

    original = FileBaton.wait
    if getattr(original, "_course_guard", False):
        yield
        return
    limit = float(timeout_s if timeout_s is not None else os.environ.get("COURSE_OP_LOCK_TIMEOUT_S", TIMEOUT_S))

    def wait(self) -> None:
        _guarded_wait(self, limit, stale_after_s)

    wait._course_guard = True  # type: ignore[attr-defined]
    FileBaton.wait = wait
    try:
        yield
    finally:
        FileBaton.wait = original
