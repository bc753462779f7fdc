"""Per-rank heartbeats through the process group's key-value store.

Every rank writes ``hb/RANK`` = ``STEP:SEQ``: the step it is working on and how many collectives
it has issued on the default process group (the group's sequence number). A rank stuck in a
collective, a sleep or a dead-locked data loader stops changing its value. When a job hangs, every
rank soon stops (the others wait for the culprit inside a collective), so silence alone does not
name the culprit; progress does: the rank whose ``(STEP, SEQ)`` is behind the others' never issued
the collective they are waiting in (the idea of NCCL's flight recorder, on any backend).

Why a step counter and not a timestamp: ranks on different nodes do not share a clock. A watcher
records *its own* monotonic time whenever a rank's value changes, so staleness is measured on one
clock only. The loop's beat is an attribute write; the rank's watchdog thread publishes it (one
small TCP message to the store that torchrun or :func:`course_lib.parallel.ranks.launch.run_ranks`
already runs) once per poll, only when it changed: no device work, no host read of a tensor, and
no network round trip inside a step however short the steps are.

Keys live under ``course/watch/ATTEMPT/`` where ATTEMPT is torchrun's restart count: a restarted
job shares the store with its previous attempt and must not read that attempt's beats.
"""
from __future__ import annotations

import os
from typing import Any

from course_lib.validate import check_int

DONE = "done"  # a rank that finished training: no longer expected to beat


def key_prefix() -> str:
    """The store prefix of this job attempt (``TORCHELASTIC_RESTART_COUNT``, 0 outside torchrun)."""
    return f"course/watch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def beat_key(rank: int) -> str:
    """Store key of ``rank``'s heartbeat."""
    return f"{key_prefix()}hb/{rank}"


def default_store() -> Any:
    """The default process group's store (None without a process group). Both torchrun and
    ``run_ranks`` initialise the group from a TCPStore; this is that store (wrapped in prefixes)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def own_connection(store: Any) -> Any:
    """A second client of the same store for a background thread, so that the thread's waits and
    the training loop's writes never share one socket. Falls back to ``store`` itself."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError):
        return store


def collective_count() -> int:
    """Collectives issued so far on the default process group (0 without one). Read from the
    watchdog thread: a plain counter, safe to read while the main thread waits in a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):  # a backend without sequence numbers: steps only
        return 0


def parse_beat(value: str) -> tuple[int, int]:
    """``"STEP:SEQ"`` -> ``(step, seq)``."""
    step, _, seq = value.partition(":")
    return int(step), int(seq or 0)


class Heartbeat:
    """This rank's heartbeat. The training loop calls ``beat(step)`` at each step: a plain
    attribute write, no I/O. The rank's watchdog thread calls :meth:`publish` at each poll, which
    writes the step to the store only when it changed. A main thread stuck anywhere stops changing
    the step, so the published value freezes although the thread that publishes is alive."""

    def __init__(self, rank: int, progress: Any = collective_count):
        check_int("rank", rank, 0)
        self.rank, self.key, self.progress = rank, beat_key(rank), progress
        self.step: int | None = None
        self._published: str | None = None

    def beat(self, step: int) -> None:
        """This rank is now working on optimizer step ``step`` (0-based)."""
        self.step = step

    def publish(self, store: Any, value: str | None = None) -> bool:
        """Write ``STEP:SEQ`` (or ``value``, e.g. :data:`DONE`) if it differs from the last
        write; returns whether a store write happened."""
        if value is None and self.step is not None:
            value = f"{self.step}:{self.progress()}"
        if value is None or value == self._published:
            return False
        store.set(self.key, value)
        self._published = value
        return True


def read_beats(store: Any, world_size: int) -> dict[int, str]:
    """Every rank's last heartbeat value (a step number as text, or ``DONE``); ranks that have not
    beaten yet are absent. One store round trip when all keys exist, else one per key."""
    keys = [beat_key(r) for r in range(world_size)]
    if store.check(keys):
        return {r: v.decode() for r, v in enumerate(store.multi_get(keys))}
    return {r: store.get(k).decode() for r, k in enumerate(keys) if store.check([k])}
