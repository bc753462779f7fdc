"""Keeping a distributed job honest: heartbeats and a watchdog that turn a silent hang into stack
dumps and a prompt abort (exit 86), a ``stall`` fault to provoke one, and checkpoint-on-signal
(SIGUSR1/SIGTERM -> every rank stops at the same step, checkpoints, exits 75).

* :mod:`.heartbeat` - per-rank step counters in the process group's store;
* :mod:`.watchdog` - the thread that notices a silent rank, dumps stacks, aborts;
* :mod:`.stall` - ``stall@STEP=SECONDS[:RANK]``;
* :mod:`.stop_signal` - the signal flag and the per-step agreement between ranks;
* :mod:`.control` - what :mod:`course_lib.train` calls;
* :mod:`.demo` - :func:`run_stall_demo`, a 2-rank job with one stalled rank, for notebooks.
"""
from .demo import StallReport, run_stall_demo
from .heartbeat import Heartbeat, read_beats
from .stall import Stall, parse_stall, split_stalls
from .stop_signal import STOP_EXIT_CODE, StopSignal
from .watchdog import HANG_EXIT_CODE, StaleTracker, Watchdog, dump_stacks

__all__ = ["HANG_EXIT_CODE", "STOP_EXIT_CODE", "Heartbeat", "StaleTracker", "Stall", "StallReport", "StopSignal",
           "Watchdog", "dump_stacks", "parse_stall", "read_beats", "run_stall_demo", "split_stalls"]
