"""Spike detection on a training signal (loss, gradient norm) with robust rolling statistics.

Why median/MAD: one spike of 100x moves a rolling mean and standard deviation so far that the next
few spikes hide behind it; the median and the median absolute deviation (MAD) of the window barely
move. ``scale = 1.4826 * MAD`` estimates the standard deviation of Gaussian noise.

What enters the window (a common rolling mean/std detector stops updating after a spike; this one never does):

* a normal value enters as it is;
* a spike enters *winsorized*, clipped to the detection bound. The window still advances every step
  (old values age out, so the statistics follow the run), but a spike cannot inflate the MAD and
  mask the spikes after it, and it moves the median by at most one rank;
* a value that stays "spiking" for ``patience`` consecutive steps is not a spike but a new level
  (the data changed, the LR schedule moved): the window is re-based on those raw values and the
  detector says ``level_shift`` instead of raising the alarm forever - a detector that flags every
  step after a shift is as useless as one that never flags.

Non-finite values are not a spike detector's business: :class:`~course_lib.stability.NonFiniteGuard`
handles them before a detector sees the step, and :meth:`SpikeDetector.update` refuses them.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from enum import Enum

MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass(frozen=True)
class SpikeCheck:
    """What a detector saw for one value: ``is_spike``; ``median``/``scale`` of the window before
    this value (``scale`` in the signal's units, >= the floors); ``z`` robust z-score;
    ``bound`` the value above which it counts as a spike (``inf`` while warming up);
    ``level_shift`` True on the step where a persistent level was accepted as the new normal."""

    value: float
    is_spike: bool
    median: float
    scale: float
    z: float
    bound: float
    level_shift: bool = False


class SpikeDetector:
    """Flags upward spikes of a non-negative-ish signal against the median/MAD of the last
    ``window`` values (steps).

    A value ``x`` is a spike when ``x > median + threshold * scale`` and ``x > min_ratio * median``
    (the ratio guards against alarms on tiny absolute wiggles of a very flat curve), where
    ``scale = max(1.4826 * MAD, rel_floor * |median|, abs_floor)``. Nothing is flagged until the
    window holds ``min_samples`` values. See the module docstring for what enters the window.
    """

    def __init__(self, window: int = 64, threshold: float = 6.0, min_ratio: float = 1.0,
                 min_samples: int = 16, patience: int = 8, rel_floor: float = 1e-3,
                 abs_floor: float = 1e-12, name: str = "signal"):
        if not isinstance(window, int) or window < 3:
            raise ValueError(f"window must be an int >= 3 (steps), got {window!r}")
        if not isinstance(min_samples, int) or not 3 <= min_samples <= window:
            raise ValueError(f"min_samples must be an int in [3, window={window}], got {min_samples!r}")
        if not isinstance(patience, int) or patience < 2:
            raise ValueError(f"patience must be an int >= 2 (consecutive steps), got {patience!r}")
        for label, value in (("threshold", threshold), ("rel_floor", rel_floor), ("abs_floor", abs_floor)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0 (robust z-score), got {threshold!r}")
        if not isinstance(min_ratio, (int, float)) or not math.isfinite(min_ratio) or min_ratio < 0:
            raise ValueError(f"min_ratio must be a finite number >= 0, got {min_ratio!r}")
        self.name = name
        self.window_size, self.threshold, self.min_ratio = window, float(threshold), float(min_ratio)
        self.min_samples, self.patience = min_samples, patience
        self.rel_floor, self.abs_floor = float(rel_floor), float(abs_floor)
        self.window: deque[float] = deque(maxlen=window)
        self._run: list[float] = []  # raw values of the current run of consecutive spikes
        self.spikes = 0
        self.level_shifts = 0

    def stats(self) -> tuple[float, float]:
        """(median, scale) of the current window; ``(nan, nan)`` when it is empty."""
        if not self.window:
            return math.nan, math.nan
        med = statistics.median(self.window)
        mad = statistics.median(abs(v - med) for v in self.window)
        return med, max(MAD_TO_STD * mad, self.rel_floor * abs(med), self.abs_floor)

    def update(self, value: float) -> SpikeCheck:
        """Judge ``value`` against the window, then add it (winsorized if it is a spike)."""
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{self.name} detector got a non-finite value {value}; NonFiniteGuard handles those")
        med, scale = self.stats()
        if len(self.window) < self.min_samples:
            self.window.append(value)
            z = (value - med) / scale if self.window and not math.isnan(med) else 0.0
            return SpikeCheck(value, False, med, scale, z, math.inf)
        bound = med + self.threshold * scale
        if med > 0:
            bound = max(bound, self.min_ratio * med)
        z = (value - med) / scale
        if value <= bound:
            self._run.clear()
            self.window.append(value)
            return SpikeCheck(value, False, med, scale, z, bound)
        self._run.append(value)
        if len(self._run) >= self.patience:
            # A level that persisted `patience` steps is the new normal: re-base on the raw values.
            self.window.clear()
            self.window.extend(self._run)
            self._run.clear()
            self.level_shifts += 1
            return SpikeCheck(value, False, med, scale, z, bound, level_shift=True)
        self.spikes += 1
        self.window.append(bound)  # winsorized: the window advances, the spike cannot inflate the MAD
        return SpikeCheck(value, True, med, scale, z, bound)

    def restart(self, value: float) -> None:
        """Take ``value`` as the new normal: the window restarts from it alone, so the detector
        warms up again (``min_samples`` values) on the new level. Used when a spike outlived the
        roll-back bound (see :meth:`Stabilizer.note_rollback`)."""
        self.window.clear()
        self.window.append(float(value))
        self._run.clear()
        self.level_shifts += 1

    def state_dict(self) -> dict:
        """Plain-Python state (safe for ``torch.load(weights_only=True)``) for bit-exact resume."""
        return {"window": list(self.window), "run": list(self._run),
                "spikes": self.spikes, "level_shifts": self.level_shifts}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (the window is trimmed to this detector's size)."""
        self.window = deque((float(v) for v in state["window"]), maxlen=self.window_size)
        self._run = [float(v) for v in state["run"]]
        self.spikes, self.level_shifts = int(state["spikes"]), int(state["level_shifts"])


class SpikePolicy(str, Enum):
    """What to do about a spike. The decision is returned as a :class:`SpikeAction`; the trainer
    carries it out (it owns the optimizer, the LR and the checkpoints)."""

    WARN = "warn"          # record it, apply the step as usual (labs: watch what a spike does)
    SKIP = "skip"          # do not apply this optimizer step
    LOWER_LR = "lower_lr"  # apply this step and the next ``lr_steps`` with the LR times ``lr_factor``
    ROLLBACK = "rollback"  # do not apply; restore the last good checkpoint


@dataclass(frozen=True)
class SpikeAction:
    """A policy decision for one step. ``skip``: leave the optimizer step out; ``lr_factor``
    (0, 1]: multiply the LR for ``lr_steps`` steps starting with this one; ``rollback``: load the
    last good checkpoint; ``reason``: a sentence for logs."""

    policy: SpikePolicy
    skip: bool
    lr_factor: float
    lr_steps: int
    rollback: bool
    reason: str


def decide(policy: SpikePolicy | str, checks: dict[str, SpikeCheck], *, lr_factor: float = 0.1,
           lr_steps: int = 50) -> SpikeAction | None:
    """Turn this step's detector results (``{"loss": check, "grad_norm": check}``) into an action
    under ``policy``; None when no detector flagged a spike."""
    policy = SpikePolicy(policy)
    if not 0 < lr_factor <= 1:
        raise ValueError(f"lr_factor must be in (0, 1], got {lr_factor!r}")
    if not isinstance(lr_steps, int) or lr_steps < 1:
        raise ValueError(f"lr_steps must be an int >= 1 (steps), got {lr_steps!r}")
    flagged = {k: c for k, c in checks.items() if c.is_spike}
    if not flagged:
        return None
    reason = "; ".join(f"{k}={c.value:.4g} > bound {c.bound:.4g} (median {c.median:.4g}, z={c.z:.1f})"
                       for k, c in flagged.items())
    if policy is SpikePolicy.WARN:
        return SpikeAction(policy, False, 1.0, 0, False, "spike (warn only): " + reason)
    if policy is SpikePolicy.SKIP:
        return SpikeAction(policy, True, 1.0, 0, False, "spike, step skipped: " + reason)
    if policy is SpikePolicy.LOWER_LR:
        return SpikeAction(policy, False, lr_factor, lr_steps, False,
                           f"spike, LR x{lr_factor} for {lr_steps} steps: " + reason)
    return SpikeAction(policy, True, 1.0, 0, True, "spike, rolling back to the last good checkpoint: " + reason)
