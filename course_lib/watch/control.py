"""What the training loop calls: heartbeats, the watchdog, the stall fault and checkpoint-on-signal
behind four calls, so that :mod:`course_lib.train` stays readable::

    faults, stalls = trainer_faults(faults, world_size, max_steps)   # before any file is written
    control = RunControl.start(cfg, info, device, out_dir, stalls)    # just before the loop
    while ...:
        control.step_start(step)                   # beat, injected stall, launch the stop vote
        ... stabilizer.after_backward(..., extra=control.extra(scale)) ...   # the one host read
        if control.should_stop(decision.extra[-1], step): break    # after the step is complete
    finally: control.close()                       # watchdog off, handlers restored
    control.finish()                               # signalled: wait for every rank's checkpoint

Config: ``train.watchdog_s`` (seconds of heartbeat silence before the abort; 0 = no watchdog) and
``train.checkpoint_on_signal`` (SIGUSR1/SIGTERM -> checkpoint and exit 75).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from course_lib.watch.heartbeat import default_store
from course_lib.watch.stall import Stall, check_stalls, split_stalls, stall_if_due
from course_lib.watch.stop_signal import STOP_EXIT_CODE, StopAgreement, StopSignal
from course_lib.watch.watchdog import HANG_EXIT_CODE, Watchdog

__all__ = ["HANG_EXIT_CODE", "STOP_EXIT_CODE", "RunControl", "split_stalls", "trainer_faults"]


def trainer_faults(faults: Any, world_size: int, max_steps: int) -> tuple[list, list[Stall]]:
    """Split ``--inject-fault`` items into the stabilizer's and the stalls, and check the stalls
    against the job (ConfigError naming the flag)."""
    from course_lib.validate import ConfigError

    try:
        others, stalls = split_stalls(faults)
        check_stalls(stalls, world_size, max_steps)
    except ValueError as exc:
        raise ConfigError(f"--inject-fault: {exc}") from None
    return others, stalls


class RunControl:
    """One per rank per ``train()`` call. ``stopped_by``: the name of the signal that stopped the
    run early (None when it ran to the end); ``stopped_at``: the step it stopped after."""

    def __init__(self, rank: int, world_size: int, device: Any, store: Any, stalls: list[Stall],
                 watchdog: Watchdog | None, stop: StopSignal | None, max_steps: int):
        self.rank, self.world_size, self.store, self.stalls = rank, world_size, store, stalls
        self.max_steps = max_steps
        self.watchdog, self.stop = watchdog, stop
        # checkpoint_on_signal off (on every rank: one config): no flag can be set, no vote to hold
        self.vote = StopAgreement(stop or StopSignal(()), device, distributed=world_size > 1 and stop is not None)
        self.stopped_by: str | None = None
        self.stopped_at: int | None = None

    @classmethod
    def start(cls, cfg: dict, info: Any, device: Any, out_dir: str | Path, stalls: list[Stall] = ()) -> "RunControl":
        """Start the watchdog (``train.watchdog_s`` > 0) and install the signal handlers
        (``train.checkpoint_on_signal``). One process without a group watches itself through an
        in-memory store, so a stalled single-process run is dumped and aborted too."""
        t = cfg["train"]
        store = default_store()
        if store is None:
            import torch.distributed as dist

            store = dist.HashStore()
        watchdog = None
        if t["watchdog_s"] > 0:
            watchdog = Watchdog(store, info.rank, info.world_size, out_dir, t["watchdog_s"]).start()
        stop = StopSignal().install() if t["checkpoint_on_signal"] else None
        return cls(info.rank, info.world_size, device, store, list(stalls), watchdog, stop,
                   max_steps=t["max_steps"])

    def step_start(self, step: int) -> None:
        """At the top of each step: beat, sleep if a stall is due, launch the stop vote."""
        if self.watchdog is not None:
            self.watchdog.heartbeat.beat(step)
        if self.stalls:
            stall_if_due(self.stalls, step, self.rank, self.store)
        self.vote.launch()

    def extra(self, scale: Any) -> list:
        """The ``extra`` tensors of the step's one host read: the fp16 loss scale (when there is
        one) first, then the all-reduced stop flag last (read back as ``decision.extra[-1]``)."""
        return ([scale] if scale is not None else []) + [self.vote.tensor()]

    def should_stop(self, flag: float, step: int) -> bool:
        """After step ``step`` (steps done) is complete: True when the ranks agreed to stop before
        the last step (a signal during the last step changes nothing: the run is complete)."""
        if not StopAgreement.agreed(flag) or step >= self.max_steps:
            return False
        self.stopped_at = step
        self.stopped_by = (self.stop.received if self.stop and self.stop.received else "a peer rank's signal")
        return True

    def close(self) -> None:
        """Stop the watchdog (this rank no longer beats) and restore the signal handlers."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.stop is not None:
            self.stop.restore()

    def finish(self) -> None:
        """After a signalled stop, wait until every rank has written its checkpoint: under
        torchrun the first worker to exit makes the agent SIGTERM the others."""
        if self.stopped_by is not None and self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
