"""Counting device-to-host reads made by our code (on a GPU each one is a synchronization).

Every way a tensor's value reaches Python is patched on ``torch.Tensor``; a call counts when the
frame that made it belongs to a file whose path contains one of ``where`` (default: course_lib).
Used in-process by the tests and inside spawned ranks (tests/rank_fns.py)."""
from __future__ import annotations

import contextlib
import sys

import torch

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def count_host_reads(where: tuple[str, ...] = ("course_lib",)):
    """Yields a dict whose ``"n"`` is the number of counted reads so far."""
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def make(original):
        def counting(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if any(w in caller for w in where):
                counts["n"] += 1
            return original(self, *a, **k)
        return counting

    for name, original in originals.items():
        setattr(torch.Tensor, name, make(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def reads_per_step(run, steps: int = 10, where: tuple[str, ...] = ("course_lib",)) -> float:
    """``run(n)`` trains ``n`` steps; runs of ``steps`` and ``2*steps`` differ by the per-step
    reads (set-up and the final save cancel out)."""
    with count_host_reads(where) as counts:
        run(steps)
        small = counts["n"]
        counts["n"] = 0
        run(2 * steps)
        big = counts["n"]
    return (big - small) / steps


def reads_between_rows(run, where: tuple[str, ...] = ("course_lib",)) -> dict[int, int]:
    """``run()`` trains once; returns ``{step: reads}``, the host reads counted between the
    metrics row of step ``step - 1`` and the row of ``step`` (every step after the first), i.e.
    the step itself plus whatever ran after the previous row (a checkpoint save, its async
    thread): a step with no save before it and none in flight counts its own reads only. Every
    rank calls ``MetricsLog.write`` each step (non-writers return at once), so every rank can
    count. One run, no extra steps: the fresh run a test needs anyway can be the counted one."""
    from course_lib.trainer.metrics import MetricsLog

    original = MetricsLog.write
    marks: list[tuple[int, int]] = []
    with count_host_reads(where) as counts:
        def marking(self, row):
            marks.append((row["step"], counts["n"]))
            return original(self, row)

        MetricsLog.write = marking
        try:
            run()
        finally:
            MetricsLog.write = original
    return {step: n - prev for (_, prev), (step, n) in zip(marks, marks[1:])}
