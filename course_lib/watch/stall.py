"""The ``stall`` fault: make one rank stop responding, to see the watchdog at work.

Written like the stabilizer's faults, ``stall@STEP=SECONDS[:RANK]`` (trainer flag
``--inject-fault``): at the start of optimizer step ``STEP`` (0-based), rank ``RANK`` (default 0)
sleeps ``SECONDS`` before its forward pass. Its peers run ahead into the step's first collective
and wait there, as they would behind a rank stuck in a data loader or a filesystem call. If
``SECONDS`` is shorter than ``train.watchdog_s`` the run just continues (the pause costs time,
nothing else); if longer, the watchdog aborts the job.

The stall lives here and not in :mod:`course_lib.stability.faults` because it acts on one rank,
before the step, outside the numerics the stabilizer guards. The trainer splits ``stall@...`` items
off the fault list with :func:`split_stalls` before the stabilizer sees the rest.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

from course_lib.watch.heartbeat import key_prefix


@dataclass(frozen=True)
class Stall:
    """Rank ``rank`` sleeps ``seconds`` at the start of step ``step``."""

    step: int
    seconds: float
    rank: int = 0

    def __str__(self) -> str:
        return f"stall@{self.step}={self.seconds:g}:{self.rank}"


def parse_stall(text: str) -> Stall:
    """Parse ``stall@STEP=SECONDS[:RANK]`` (e.g. ``stall@3=60:1``); ValueError names what is wrong."""
    head, sep, value = text.strip().partition("=")
    kind, _, step_text = head.partition("@")
    if kind != "stall" or not sep or not step_text:
        raise ValueError(f"fault {text!r} is not stall@STEP=SECONDS[:RANK], e.g. stall@3=60:1")
    seconds_text, _, rank_text = value.partition(":")
    try:
        step, seconds = int(step_text), float(seconds_text)
        rank = int(rank_text) if rank_text else 0
    except ValueError:
        raise ValueError(f"fault {text!r}: STEP and RANK must be integers >= 0 and SECONDS a number > 0") from None
    if step < 0 or rank < 0 or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"fault {text!r}: STEP and RANK must be >= 0 and SECONDS finite and > 0")
    return Stall(step, seconds, rank)


def split_stalls(faults: str | Iterable[Any] | None) -> tuple[list[Any], list[Stall]]:
    """Separate ``stall@...`` items (parsed into :class:`Stall`) from the stabilizer's faults
    (returned unchanged). Accepts what ``--inject-fault`` gives: None, a comma-separated string
    or a list."""
    if faults is None:
        return [], []
    if isinstance(faults, str):
        faults = [part for part in faults.split(",") if part.strip()]
    others, stalls = [], []
    for item in faults:
        if isinstance(item, Stall):
            stalls.append(item)
        elif isinstance(item, str) and item.strip().startswith("stall@"):
            stalls.append(parse_stall(item))
        else:
            others.append(item)
    return others, stalls


def check_stalls(stalls: list[Stall], world_size: int, max_steps: int) -> None:
    """ValueError when a stall names a rank that does not exist or a step the run never reaches."""
    for s in stalls:
        if s.rank >= world_size:
            raise ValueError(f"{s}: rank {s.rank} does not exist ({world_size} ranks: 0 to {world_size - 1})")
        if s.step >= max_steps:
            raise ValueError(f"{s} is at or after train.max_steps ({max_steps}) and would never fire; "
                             f"steps count from 0")


def stall_if_due(stalls: list[Stall], step: int, rank: int, store: Any = None) -> None:
    """Sleep here when a stall is due for ``rank`` at ``step``. The start time (``time.time()``)
    goes to the store first, so the watchdog's report can say how long the abort took."""
    for s in stalls:
        if s.step == step and s.rank == rank:
            if store is not None:
                store.set(f"{key_prefix()}stall/{rank}", repr(time.time()))
            time.sleep(s.seconds)  # a watchdog dump of this rank shows this line
