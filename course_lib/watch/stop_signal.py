"""Checkpoint on a signal: SIGUSR1 or SIGTERM asks the run to stop at the next step boundary.

The handler only sets a flag (a signal handler must not save a checkpoint: it runs between two
bytecodes of whatever the main thread was doing, maybe half-way through an optimizer step).
The ranks must then agree: a signal usually reaches one process (``kill`` on one worker) or
reaches them at slightly different moments, and a rank that stops while its peers enter the
next step's collectives hangs the job. So every step each rank contributes its flag to a
one-element ``all_reduce(MAX)`` issued at the start of the step and waited on just before the
stabilizer's single host read, which carries the result to the host with the loss and the
gradient norms (``extra=`` of :meth:`Stabilizer.after_backward`). Every rank thus learns, in the
same step and with no extra host read, whether *any* rank was signalled; they all finish that
step, save a checkpoint at that boundary, and exit with :data:`STOP_EXIT_CODE`.

The cost is one tiny extra collective per step, launched asynchronously so it overlaps the
forward and backward passes (NCCL: the wait is a stream dependency, not a host wait).

A second signal while the stop is pending restores the previous handler and re-sends the signal:
a user pressing Ctrl-\\ twice (or a scheduler's second SIGTERM) still gets the default action.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

STOP_EXIT_CODE = 75  # EX_TEMPFAIL in sysexits.h: "try again later" - resume with --resume auto
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignal:
    """Installs the handlers on :meth:`install` (main thread only; elsewhere nothing is installed
    and :attr:`installed` stays False), restores the previous ones on :meth:`restore`.
    :attr:`received` is the name of the first signal (e.g. ``"SIGTERM"``) or None;
    :attr:`received_at` its ``time.time()``."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: str | None = None
        self.received_at: float | None = None
        self.installed = False
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal only works in the main thread
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self.installed = True
        return self

    def restore(self) -> None:
        """Put the handlers back as they were before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # second signal: the user insists, give the default action
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received, self.received_at = name, time.time()
        print(f"course: {name} received: checkpoint at the next step boundary, then exit "
              f"{STOP_EXIT_CODE}", file=sys.stderr, flush=True)


class StopAgreement:
    """The per-step agreement: :meth:`launch` at the start of a step (async all-reduce of this
    rank's flag), :meth:`tensor` before the host read (the one-element float tensor to pass in
    ``extra``), :meth:`agreed` with the host value read back. Without a process group the
    flag is local and no collective runs."""

    def __init__(self, stop: StopSignal, device: Any, distributed: bool):
        self.stop, self.device, self.distributed = stop, device, distributed
        self._flag = None
        self._work = None

    def launch(self) -> None:
        import torch

        self._flag = torch.full((), 1.0 if self.stop.received else 0.0, device=self.device)
        if self.distributed:
            import torch.distributed as dist

            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def tensor(self):
        if self._work is not None:
            self._work.wait()  # NCCL: the current stream waits; gloo: done long before, during backward
            self._work = None
        return self._flag

    @staticmethod
    def agreed(value: float) -> bool:
        """True when the all-reduced flag says some rank was signalled."""
        return value > 0.5
