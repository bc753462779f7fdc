"""Training stability: gradient monitor, clip controller and the :class:`Stabilizer` facade.

The trainer calls the stabilizer once per step, after ``backward`` (and after
``GradScaler.unscale_`` - clipping scaled gradients is a common tutorial bug)::

    loss = stab.on_loss(loss, step)                  # fault injection point (no-op without faults)
    loss.backward()                                  # or scaler.scale(loss).backward(); scaler.unscale_(opt)
    d = stab.after_backward(model, loss, step, optimizer=opt, scaler=scaler, batch=batch)
    if d.rollback:   ...load the last good checkpoint...
    elif not d.skip:
        with scaled_lr(opt, d.lr_factor):
            opt.step()                               # or scaler.step(opt)
    # with a scaler: scaler.update() in every case (unscale_ recorded the overflow check)
    opt.zero_grad(set_to_none=True)

One device synchronization per step: the loss and every parameter's gradient norm are stacked on
the device and copied to the host with a single ``tolist()``; everything else (global norm,
per-layer norms, the spike and NaN decisions, the clip coefficient) is host arithmetic on those
numbers, and clipping is an asynchronous ``_foreach_mul_``. A tutorial's ``.item()`` per
parameter stalls the GPU once per tensor. ``sync_count`` counts the transfers so tests can check.
Use ``decision.loss`` for logging instead of calling ``loss.item()`` again.
"""
from __future__ import annotations

import math
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from ..validate import check_choice, check_int

from .faults import FaultInjector
from .grad_monitor import GradientMonitor, GradStats
from .nonfinite import NonFiniteGuard
from .spikes import SpikeAction, SpikeDetector, SpikePolicy, decide

ROLLBACK_LIMITS = ("accept", "error")  # what the ROLLBACK policy does when a spike outlives max_rollbacks


class RollbackLimitError(RuntimeError):
    """A spike survived ``max_rollbacks`` consecutive roll-backs and ``rollback_limit="error"``."""



class ClipController:
    """Clips the global gradient norm to ``max_norm`` (None: measure only, never clip) and tracks
    the clip rate over the last ``window`` applied steps; warns (``RuntimeWarning``, at most once per
    window) when the rate exceeds ``warn_rate`` - a run that clips most steps has an LR or init
    problem that clipping is hiding."""

    def __init__(self, max_norm: float | None = 1.0, window: int = 100, warn_rate: float = 0.5,
                 eps: float = 1e-6):
        if max_norm is not None and (not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm)
                                     or max_norm <= 0):
            raise ValueError(f"max_norm must be None or a finite float > 0, got {max_norm!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (steps), got {window!r}")
        if not isinstance(warn_rate, (int, float)) or not 0 <= warn_rate <= 1:
            raise ValueError(f"warn_rate must be in [0, 1], got {warn_rate!r}")
        self.max_norm, self.window, self.warn_rate, self.eps = max_norm, window, float(warn_rate), eps
        self.history: deque[bool] = deque(maxlen=window)
        self.total_clipped = 0
        self._since_warning = window  # allows a warning as soon as the window is full
        self.warnings: list[str] = []

    @property
    def clip_rate(self) -> float:
        """Fraction of the last ``window`` applied steps that were clipped (0 when none yet)."""
        return sum(self.history) / len(self.history) if self.history else 0.0

    def coefficient(self, total_norm: float) -> float:
        """Factor in (0, 1] the gradients get multiplied by (1: no clipping), as torch's
        ``clip_grad_norm_`` computes it: ``max_norm / (total_norm + eps)``."""
        if self.max_norm is None or total_norm <= self.max_norm:
            return 1.0
        return min(1.0, self.max_norm / (total_norm + self.eps))

    def clip_(self, grads: list[torch.Tensor], total_norm: float) -> tuple[bool, float]:
        """Clip ``grads`` in place for a step with global norm ``total_norm`` (host float, finite);
        record it. Returns ``(clipped, coefficient)``. No device synchronization."""
        coef = self.coefficient(total_norm)
        clipped = coef < 1.0
        if clipped:
            with torch.no_grad():
                torch._foreach_mul_(grads, coef)
        self.history.append(clipped)
        self.total_clipped += clipped
        self._since_warning += 1
        if (len(self.history) == self.window and self.clip_rate > self.warn_rate
                and self._since_warning >= self.window):
            msg = (f"gradient clipping fired on {self.clip_rate:.0%} of the last {self.window} steps "
                   f"(max_norm={self.max_norm}): the clip is steering training; check the LR and warmup")
            self.warnings.append(msg)
            self._since_warning = 0
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return clipped, coef

    def state_dict(self) -> dict:
        """Window and counters, plain Python."""
        return {"history": list(self.history), "total_clipped": self.total_clipped,
                "since_warning": self._since_warning}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.history = deque((bool(v) for v in state["history"]), maxlen=self.window)
        self.total_clipped = int(state["total_clipped"])
        self._since_warning = int(state["since_warning"])


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Multiply every param group's ``lr`` by ``factor`` (0, 1] inside the block, then restore it,
    so a scheduler that owns the LR is never confused by a temporary cut."""
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"factor must be in (0, 1], got {factor!r}")
    saved = [g["lr"] for g in optimizer.param_groups]
    if factor != 1.0:
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * factor
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


@dataclass
class StepDecision:
    """What the trainer should do with this step. ``skip``: leave the optimizer step out;
    ``rollback``: restore the last good checkpoint (implies skip); ``lr_factor``: multiply the LR for
    this step (see :func:`scaled_lr`); ``loss``/``grad_norm``: host floats (grad norm before
    clipping); ``clipped``/``clip_coef``: what clipping did; ``nonfinite``/``overflow``/``spike``:
    why a step was skipped; ``reason``: a sentence for logs; ``diagnostic``: bundle path or None."""

    step: int
    loss: float | None
    grad_norm: float | None  # None: the engine keeps the gradients (see Stabilizer._loss_only)
    skip: bool = False
    rollback: bool = False
    lr_factor: float = 1.0
    clipped: bool = False
    clip_coef: float = 1.0
    nonfinite: bool = False
    overflow: bool = False
    spike: bool = False
    level_shift: bool = False
    reason: str = ""
    action: SpikeAction | None = None
    diagnostic: str | None = None
    layer_norms: dict[str, float] = field(default_factory=dict)
    extra: list[float] = field(default_factory=list)  # host values of after_backward(extra=...)
    rollbacks_accepted: int = 0  # > 0: a spike that survived this many roll-backs was accepted

    def log_row(self) -> dict[str, Any]:
        """Flat fields for a metrics row (``skipped`` as the trainer's metrics.jsonl expects).
        Non-finite numbers become None: strict JSON has no NaN (``nonfinite`` says why)."""
        def num(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None
        return {"step": self.step, "loss": num(self.loss), "grad_norm": num(self.grad_norm), "skipped": self.skip,
                "clipped": self.clipped, "lr_factor": self.lr_factor, "spike": self.spike,
                "nonfinite": self.nonfinite, "rollback": self.rollback}


class Stabilizer:
    """Composes fault injection, :class:`GradientMonitor`, :class:`NonFiniteGuard`, two
    :class:`SpikeDetector` (loss, gradient norm), the :class:`SpikePolicy` decision and the
    :class:`ClipController` behind one call per step. See the module docstring for the loop.

    ``spike_policy``: a :class:`SpikePolicy`; ``detect_loss_spikes``/``detect_grad_spikes``: turn a
    detector off (False) or pass your own configured :class:`SpikeDetector`; ``lr_factor``/
    ``lr_steps``: the LOWER_LR cut; ``max_consecutive_bad``/``diag_dir``: the non-finite guard;
    ``faults``: ``KIND@STEP[=VALUE]`` strings or :class:`FaultSpec` (see :mod:`course_lib.stability.faults`).
    ``max_rollbacks``/``rollback_limit``: the ROLLBACK policy's bound (see :meth:`note_rollback`);
    ``rank``: this process's global rank (names its diagnostic bundles)."""

    def __init__(self, *, max_grad_norm: float | None = 1.0, spike_policy: SpikePolicy | str = SpikePolicy.SKIP,
                 detect_loss_spikes: bool | SpikeDetector = True, detect_grad_spikes: bool | SpikeDetector = True,
                 lr_factor: float = 0.1, lr_steps: int = 50, max_consecutive_bad: int = 3,
                 diag_dir: Any = None, faults: Any = None, clip_window: int = 100,
                 clip_warn_rate: float = 0.5, layer_depth: int | None = None,
                 max_rollbacks: int = 3, rollback_limit: str = "accept", rank: int = 0):
        check_int("max_rollbacks", max_rollbacks, 1)
        check_choice("rollback_limit", rollback_limit, ROLLBACK_LIMITS)
        self.max_rollbacks, self.rollback_limit = max_rollbacks, rollback_limit
        # Roll-back streak: process-local, never part of state_dict(), because the roll-back itself
        # restores state_dict() from the checkpoint and would otherwise erase the count.
        self.rollback_streak, self._rollback_trigger = 0, -1
        self.policy = SpikePolicy(spike_policy)
        decide(self.policy, {}, lr_factor=lr_factor, lr_steps=lr_steps)  # validates the LR cut early
        self.lr_factor_cut, self.lr_steps = lr_factor, lr_steps
        self.monitor = GradientMonitor(layer_depth)
        self.clip = ClipController(max_grad_norm, clip_window, clip_warn_rate)
        self.guard = NonFiniteGuard(max_consecutive_bad, diag_dir, rank=rank)
        self.faults = FaultInjector(faults)
        self.detectors: dict[str, SpikeDetector] = {}
        for key, option, defaults in (("loss", detect_loss_spikes, dict(min_ratio=1.05)),
                                      ("grad_norm", detect_grad_spikes, dict(min_ratio=2.0))):
            if isinstance(option, SpikeDetector):
                self.detectors[key] = option
            elif option is True:
                self.detectors[key] = SpikeDetector(name=key, **defaults)
            elif option is not False:
                raise TypeError(f"detect_{key}_spikes must be a bool or a SpikeDetector, got {option!r}")
        self._cut_factor, self._cut_left = 1.0, 0

    @property
    def sync_count(self) -> int:
        """Device-to-host transfers made so far: exactly one per healthy step. A non-finite step
        that writes a diagnostic bundle adds its own (gradient stats in one transfer, scaler
        state, the batch), counted as one in ``guard.diagnostic_syncs``: a rare, already-lost step."""
        return self.monitor.sync_count + self.guard.diagnostic_syncs

    def on_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Fault injection point between forward and backward (returns ``loss`` unchanged without
        a due ``nan_loss`` fault)."""
        return self.faults.on_loss(loss, step) if self.faults else loss

    def after_backward(self, model: nn.Module, loss: torch.Tensor, step: int, *,
                       optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                       batch: Any = None, extra: list[torch.Tensor] | None = None,
                       reduce_sq: Any = None) -> StepDecision:
        """Inspect (and clip) this step's gradients; return the :class:`StepDecision`. ``loss``: the
        unscaled loss tensor; ``optimizer``/``scaler``/``batch`` only feed the diagnostic bundle.
        ``extra``/``reduce_sq``: see :meth:`GradientMonitor.measure` (values come back as
        ``decision.extra``). Raises :class:`NonFiniteError` after too many consecutive non-finite
        steps, :class:`RollbackLimitError` when ``rollback_limit="error"`` and a spike survived
        ``max_rollbacks`` roll-backs."""
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss must be a one-element torch.Tensor")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if model is None:  # the engine owns the gradients (DeepSpeed ZeRO): judge the loss only
            stats = self._loss_only(loss, extra)
        else:
            if self.faults:
                self.faults.on_grads(model, step)
            stats = self.monitor.measure(model, loss, extra=extra, reduce_sq=reduce_sq)
        d = StepDecision(step, stats.loss, stats.total_norm, layer_norms=stats.layer_norms, extra=stats.extra)
        if not stats.finite:
            kind, bundle = self.guard.record_bad(step, loss=stats.loss, param_norms=stats.param_norms,
                                                 model=model, optimizer=optimizer, scaler=scaler, batch=batch)
            d.skip, d.nonfinite, d.overflow = True, kind == "nonfinite", kind == "overflow"
            d.diagnostic = str(bundle) if bundle else None
            d.reason = (f"non-finite loss/gradients at step {step}, step skipped"
                        if kind == "nonfinite" else f"fp16 overflow at step {step}, step skipped")
            return d
        self.guard.record_good()
        checks = {}
        if "loss" in self.detectors:
            checks["loss"] = self.detectors["loss"].update(stats.loss)
        if "grad_norm" in self.detectors and model is not None:
            checks["grad_norm"] = self.detectors["grad_norm"].update(stats.total_norm)
        d.level_shift = any(c.level_shift for c in checks.values())
        if d.level_shift:
            d.reason = "a persistent level change was accepted as the new normal by the spike detector"
        action = decide(self.policy, checks, lr_factor=self.lr_factor_cut, lr_steps=self.lr_steps)
        if step > self._rollback_trigger:
            self.rollback_streak = 0  # the run got past the step that caused the last roll-back
        if action is not None and action.rollback and self.rollback_streak >= self.max_rollbacks:
            d.rollbacks_accepted = self._rollback_limit_reached(step, checks)  # raises under "error"
            d.level_shift, action = True, None
            d.reason = (f"spike survived {d.rollbacks_accepted} consecutive roll-backs: accepted as the "
                        f"new level, step applied")
        if action is not None:
            d.action, d.spike, d.reason = action, True, action.reason
            d.skip, d.rollback = action.skip, action.rollback
            if action.lr_steps:
                self._cut_factor, self._cut_left = action.lr_factor, action.lr_steps
        if self._cut_left > 0 and not d.skip:
            d.lr_factor = self._cut_factor
            self._cut_left -= 1
        if not d.skip and model is not None:
            d.clipped, d.clip_coef = self.clip.clip_(stats.grads, stats.total_norm)
        return d

    def _loss_only(self, loss: torch.Tensor, extra: list[torch.Tensor] | None) -> GradStats:
        """Stats without gradients, for engines that keep them out of ``p.grad`` (DeepSpeed ZeRO
        partitions them inside its optimizer): the loss and ``extra`` in one host read; the
        gradient norm is unknown (``grad_norm`` None in the log), clipping is the
        engine's, and the gradient-norm spike detector does not run."""
        with torch.no_grad():
            values = torch.stack([t.detach().float().reshape(()).to(loss.device)
                                  for t in [loss, *(extra or [])]]).tolist()
        self.monitor.sync_count += 1
        value = values.pop(0)
        return GradStats(value, None, {}, {}, math.isfinite(value), [], values)

    def note_rollback(self, step: int) -> None:
        """The trainer rolled back because of a spike at ``step``. Roll-backs are *consecutive*
        while the run does not get past the step that triggered the previous one: a loss that moved
        to a new level (new data, a schedule change) spikes again right after every roll-back, and
        the checkpoint brings back the old detector window each time. After ``max_rollbacks`` of
        them, ``rollback_limit="accept"`` takes the new level as normal (the flagged detectors
        restart their warm-up from the current value, the step is applied) and ``"error"`` stops
        the run with :class:`RollbackLimitError`. Without this bound the policy loops forever."""
        check_int("step", step, 0)
        self.rollback_streak += 1
        self._rollback_trigger = max(self._rollback_trigger, step)

    def _rollback_limit_reached(self, step: int, checks: dict) -> int:
        """Apply ``rollback_limit``; returns how many roll-backs the accepted spike survived."""
        flagged = {k: c for k, c in checks.items() if c.is_spike}
        what = "; ".join(f"{k}={c.value:.4g} (median {c.median:.4g})" for k, c in flagged.items())
        if self.rollback_limit == "error":
            raise RollbackLimitError(
                f"step {step}: the spike survived {self.rollback_streak} consecutive roll-backs ({what}). "
                f"The loss has most likely moved to a new level (data or schedule change) rather than "
                f"spiked. Set stability.rollback_limit = 'accept' to continue at the new level, raise "
                f"stability.max_rollbacks, or inspect the data after step {step}.")
        for key in flagged:
            self.detectors[key].restart(checks[key].value)
        accepted, self.rollback_streak = self.rollback_streak, 0
        warnings.warn(f"step {step}: spike persisted through {accepted} roll-backs ({what}); accepted "
                      f"as the new level", RuntimeWarning, stacklevel=3)
        return accepted

    def state_dict(self) -> dict:
        """Everything that changes a later decision (detector windows, clip window, LR cut, guard
        counters), plain Python - save it with the checkpoint for bit-exact resume."""
        return {"detectors": {k: d.state_dict() for k, d in self.detectors.items()},
                "clip": self.clip.state_dict(), "guard": self.guard.state_dict(),
                "cut": [self._cut_factor, self._cut_left]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        for key, det_state in state["detectors"].items():
            if key in self.detectors:
                self.detectors[key].load_state_dict(det_state)
        self.clip.load_state_dict(state["clip"])
        self.guard.load_state_dict(state["guard"])
        self._cut_factor, self._cut_left = float(state["cut"][0]), int(state["cut"][1])
