"""Per-step metrics: JSON lines always (one object per optimizer step), TensorBoard and other
sinks (Weights & Biases: course_lib.trainer.wandb_log) when asked.

The JSONL file survives crashes. Rows reach the file as whole lines, in order, each exactly
once: a flush encodes every pending row to one line of strict JSON and hands them all to the
kernel in one ``os.write`` on an ``O_APPEND`` descriptor (retrying the rest of a partial write,
never rewriting what is already in the file). A process killed mid-write can leave a torn last
line; :func:`read_rows` skips it, and a resumed run first rewrites the file (atomically) keeping
only whole rows up to the step it resumes from, so a torn line, or rows the crashed run wrote
after its checkpoint, never reach a reader twice.

When rows reach the file (``flush_every_s``, seconds):

* ``0`` (the default): at every ``write``, one ``write(2)`` per row, as a line-buffered file.
* ``> 0``: buffered. Rows are flushed when ``flush_every_s`` seconds have passed since the last
  flush (checked at each ``write``), when ``flush_every_rows`` are pending, on :meth:`flush`,
  and on :meth:`close` / leaving a ``with`` block (exceptions included) / normal interpreter exit.
  A reader polling the file sees rows up to ``flush_every_s`` late.

The buffered mode loses nothing a resume needs **if the caller calls** :meth:`flush` **before
every checkpoint save**: a resume keeps exactly the rows with ``step <=`` the checkpoint's step,
so those rows must be in the file before the checkpoint can exist. A SIGKILL/SIGTERM then costs
at most the rows written since the last flush, which all belong to steps after the newest
checkpoint (the resumed run drops and rewrites them anyway). Without that call, a kill right
after a save can lose rows the resumed run keeps: a gap in the log. That is why buffering is
opt-in: the default is safe for a caller that never flushes.

Cost per row inside the trainer's loop (tiny CPU config, 2 cores, ``bench_trainer.py``): ~90 us
written at once (the JSON encoding and the ``write(2)`` both run with cold caches between two
training steps), ~20 us buffered (a copy of the row now; rows are encoded together at flush time).
Encoding rows together, not saving syscalls, is most of the difference.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

from course_lib.validate import check_int, check_number

_LIVE: "weakref.WeakSet[MetricsLog]" = weakref.WeakSet()  # open logs, flushed at interpreter exit
_SCALARS = frozenset({float, int, str, bool, type(None)})  # values json.dumps always encodes


def _clean(value: Any) -> Any:
    """Strict JSON has no NaN/Inf: non-finite floats become None (inside lists/dicts too)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _to_line(row: dict[str, Any]) -> str:
    """One row as one line of strict JSON (with its newline). The common all-finite row takes
    one ``json.dumps``; only a row holding NaN/Inf pays for a cleaned copy."""
    try:
        return json.dumps(row, allow_nan=False) + "\n"
    except ValueError:  # a non-finite float somewhere in the row
        return json.dumps(_clean(row), allow_nan=False) + "\n"


def read_rows(path: str | Path) -> list[dict]:
    """Every complete, valid row of a metrics.jsonl (a torn last line is left out). Rows still
    buffered in a writer's memory are not visible here until it flushes."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class MetricsLog:
    """Append-only ``metrics.jsonl`` (+ optional TensorBoard event files next to it).

    ``resume_step``: keep existing rows with ``step <= resume_step`` and drop the rest (0 or None:
    start a fresh file). ``enabled=False`` (ranks other than 0) writes nothing. ``sinks``: objects
    with ``open(resume_step)``, ``write(row)`` and ``close()``, opened once the kept rows are in the
    file, given every row as it is written (not when it is flushed) and closed with the log, e.g.
    :class:`course_lib.trainer.wandb_log.WandbLog`.

    ``flush_every_s`` (seconds, >= 0): 0 writes every row to the file at once (the default);
    > 0 buffers rows in memory and flushes when that long has passed since the last flush.
    ``flush_every_rows`` (rows, >= 1): flush when this many rows are pending, whatever the time.
    See the module docstring for the one call a buffered caller owes: :meth:`flush` before every
    checkpoint save. Not thread-safe: one writer thread per log.

    Usable as a context manager (``with MetricsLog(...) as log:``): leaving the block closes it,
    exceptions included."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None, tensorboard: bool = False,
                 enabled: bool = True, flush_every_s: float = 0.0, flush_every_rows: int = 1000,
                 sinks: Sequence[Any] = ()):
        check_number("flush_every_s", flush_every_s, 0)  # seconds
        check_int("flush_every_rows", flush_every_rows, 1)
        self.path = Path(path)
        self.enabled = enabled
        self.flush_every_s = float(flush_every_s)
        self.flush_every_rows = 1 if flush_every_s == 0 else flush_every_rows
        self._tb = None
        self._sinks = tuple(sinks)  # e.g. course_lib.trainer.wandb_log.WandbLog: open, write(row) at once, close
        self._fd: int | None = None
        # Rows not yet handed to the file: a dict (a copy of a row of plain scalars, encoded at
        # flush time) or a str (a row with anything else, encoded at write time).
        self._pending: list[dict | str] = []
        self._tail = b""  # bytes of a partially failed write still owed to the file
        self._last_flush = time.monotonic()
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_rows(self.path) if resume_step and r.get("step", 0) <= resume_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _LIVE.add(self)
        for sink in self._sinks:  # the kept rows are in the file: a sink may read them now
            sink.open(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))

    @property
    def pending(self) -> int:
        """Rows written but not yet in the file (lost if the process is killed now)."""
        return len(self._pending)

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (must hold ``step``); non-finite floats become null. The row is copied
        now, so later changes to the dict do not reach the log, and reaches the file per the flush
        policy. Numbers also go to TensorBoard under ``train/``.

        A row of str keys and plain ``float``/``int``/``str``/``bool``/``None`` values (the
        trainer's) is JSON-encoded at flush time, together with the other pending rows: in the
        trainer's loop that costs ~20 us per row, against ~60 for encoding each row on its own
        between two training steps (cold caches) and ~90 for writing it at once (tiny CPU config,
        ``benchmarks/bench_trainer.py``). Any other row (lists, numpy scalars, ...) is encoded at
        once, so a value JSON cannot hold raises ``TypeError`` here, not at a later flush."""
        if not self.enabled:
            return
        if self._fd is None:
            raise ValueError(f"write to a closed MetricsLog ({self.path})")
        if all(type(k) is str and type(v) in _SCALARS for k, v in row.items()):
            self._pending.append(dict(row))
        else:
            self._pending.append(_to_line(row))
        if (len(self._pending) >= self.flush_every_rows
                or time.monotonic() - self._last_flush >= self.flush_every_s):
            self.flush()
        for sink in self._sinks:
            sink.write(row)
        if self._tb is not None:
            row = {k: _clean(v) for k, v in row.items()}
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"train/{key}", value, row["step"])

    def flush(self, *, fsync: bool = False) -> None:
        """Hand every pending row to the file (one ``write(2)`` for all of them; a no-op when
        none is pending). After it returns the rows survive the death of this process (SIGKILL
        included); ``fsync=True`` also waits until they are on the disk (survive power loss;
        ~0.15 ms here). **Call it before every checkpoint save** when ``flush_every_s > 0``. On
        an ``OSError`` (disk full) the rows not yet written stay pending and the error is raised;
        a later flush continues where it stopped, so no row is written twice."""
        if not self.enabled or self._fd is None:
            return
        if self._pending:
            self._tail += "".join(r if isinstance(r, str) else _to_line(r) for r in self._pending).encode()
            self._pending.clear()
        while self._tail:
            written = os.write(self._fd, self._tail)
            self._tail = self._tail[written:]
        self._last_flush = time.monotonic()
        if fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Flush, fsync and close (TensorBoard included): after it returns every row is on the
        disk. Idempotent."""
        if not self.enabled or self._fd is None:
            return
        try:
            self.flush(fsync=True)
        finally:
            fd, self._fd = self._fd, None
            _LIVE.discard(self)
            os.close(fd)
            if self._tb is not None:
                self._tb.close()
            for sink in self._sinks:
                sink.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _flush_all_at_exit() -> None:
    """A log nobody closed still gets its rows out at a normal interpreter exit (an uncaught
    exception included); SIGKILL/os._exit skip this, which the flush-before-checkpoint rule covers."""
    for log in list(_LIVE):
        try:
            log.flush()
        except OSError:
            pass


def _forget_in_child() -> None:
    """A forked child inherits the parent's pending rows: drop them there, or both would write them."""
    for log in list(_LIVE):
        log._pending.clear()
        log._tail = b""


atexit.register(_flush_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
