"""Training stability: keep a run alive through spikes, NaNs and bad batches.

One module per job:

* :mod:`.grad_monitor` - per-parameter and per-layer gradient norms with one device sync;
* :mod:`.spikes` - median/MAD spike detector and the policy that turns a spike into an action;
* :mod:`.nonfinite` - the non-finite guard (skip, diagnostic bundle, stop after N in a row);
* :mod:`.faults` - fault injection (``KIND@STEP[=VALUE]``) for labs and tests;
* :mod:`.stabilizer` - the :class:`Stabilizer` facade the trainer calls once per step, the clip
  controller and the bounded roll-back policy.

Everything users import comes from here: ``from course_lib.stability import Stabilizer``.
"""
from .faults import FaultInjector, FaultSpec, parse_fault, parse_faults
from .grad_monitor import GradientMonitor, GradStats
from .nonfinite import NonFiniteError, NonFiniteGuard
from .spikes import SpikeAction, SpikeCheck, SpikeDetector, SpikePolicy, decide
from .stabilizer import ClipController, RollbackLimitError, Stabilizer, StepDecision, scaled_lr

__all__ = [
    "Stabilizer", "StepDecision", "RollbackLimitError", "ClipController", "scaled_lr", "GradientMonitor", "GradStats",
    "NonFiniteGuard", "NonFiniteError", "SpikeDetector", "SpikeCheck", "SpikePolicy", "SpikeAction", "decide",
    "FaultInjector", "FaultSpec", "parse_fault", "parse_faults",
]
