"""Learning-rate schedules: linear warmup, then linear / cosine / constant decay, or warmup-stable-decay.

    sched = Schedule(max_lr=3e-4, total_steps=1000, warmup_steps=100, kind="cosine", min_lr=3e-5)
    sched(0), sched(99), sched(100), sched(999)       # pure: the lr for an optimizer step index
    lr_at(500, max_lr=3e-4, total_steps=1000, warmup_steps=100)   # same, as a function
    scheduler = make_scheduler(optimizer, sched)      # a LambdaLR; call scheduler.step() after optimizer.step()

Step indexing: `step` is the 0-based index of the optimizer step the lr is used for. LambdaLR
applies factor(0) at construction and factor(s) after its s-th step() call, so
`make_scheduler` and `Schedule.__call__` agree step for step.

Phases, with W = warmup_steps and T = total_steps (both explicit: a tutorial schedule read an
undefined global `total_steps`; here a missing one is a TypeError, a bad one a ValueError):

- warmup, steps 0 .. W-1: lr = max_lr * w(step), from near 0 up to max_lr. `warmup_convention`:
  - "(it+1)/W" (default): w = (step+1)/W. Step 0 already learns (max_lr/W) and the last warmup step
    is exactly max_lr. A "it/W" warmup spends step 0 at lr 0: a forward/backward whose update is
    thrown away, while Adam's moment estimates still move.
  - "it/W": w = step/W; the continuous curve sampled at left end points (Hugging Face's
    get_*_schedule_with_warmup); peak reached at step W, the first decay step.
  - "(it+1)/(W+1)": w = (step+1)/(W+1); never reaches max_lr inside warmup (nanoGPT's current form).
- decay, steps W .. T: progress p = (step - W) / (T - W) from 0 to 1, and
  - "linear": lr = min_lr + (max_lr - min_lr) * (1 - p)
  - "cosine": lr = min_lr + (max_lr - min_lr) * (1 + cos(pi p)) / 2
  - "constant": lr = max_lr (no decay; min_lr unused)
  - "wsd": lr = max_lr until step T - decay_steps, then the decay shape ("linear", "cosine" or
    "sqrt" = 1 - sqrt(p), Hagele et al. 2024) over the last decay_steps steps.
  The floor is reached at step T. A run of T optimizer steps uses steps 0 .. T-1, so its last lr is
  one decrement above min_lr (as in Hugging Face); steps beyond T hold the final value instead of
  letting a cosine climb back up.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from dataclasses import dataclass

import torch

from course_lib.validate import check_choice, check_int, check_number

KINDS = ("linear", "cosine", "constant", "wsd")
WARMUP_CONVENTIONS = ("(it+1)/W", "it/W", "(it+1)/(W+1)")
DECAY_SHAPES = ("linear", "cosine", "sqrt")
WSD_DEFAULT_DECAY_FRACTION = 0.2  # of total_steps; ~20% cooldown matches cosine (Hagele et al. 2024)


def _as_int(name: str, value, lo: int | None = None, hi: int | None = None, hi_name: str | None = None) -> int:
    """:func:`check_int` that first turns numpy / torch integer scalars into an int (floats stay
    floats, and bools bools, so check_int refuses them)."""
    if not isinstance(value, bool):
        try:
            value = operator.index(value)
        except TypeError:
            pass
    return check_int(name, value, lo, hi, hi_name)


@dataclass(frozen=True)
class Schedule:
    """A validated learning-rate schedule; call it with a step index to get the lr (a float).

    All counts are optimizer steps (not micro-batches, not tokens). Arguments are checked at
    construction: max_lr > 0; 0 <= min_lr <= max_lr; total_steps >= 1; 0 <= warmup_steps <=
    total_steps; for "wsd", 0 <= decay_steps <= total_steps - warmup_steps.
    """

    max_lr: float
    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    min_lr: float = 0.0
    warmup_convention: str = "(it+1)/W"
    decay_steps: int | None = None  # wsd only; None: 20% of total_steps (capped to fit)
    decay_shape: str | None = None  # wsd only; None: "linear"

    def __post_init__(self) -> None:
        max_lr = float(check_number("max_lr", self.max_lr, 0, lo_open=True))
        min_lr = float(check_number("min_lr", self.min_lr))
        if not 0 <= min_lr <= max_lr:  # a range set by another argument: say which
            raise ValueError(f"min_lr must be in [0, max_lr={max_lr}], got {min_lr}")
        total = _as_int("total_steps", self.total_steps, 1)
        warmup = _as_int("warmup_steps", self.warmup_steps, 0, total, hi_name="total_steps")
        check_choice("kind", self.kind, KINDS)
        check_choice("warmup_convention", self.warmup_convention, WARMUP_CONVENTIONS)
        if self.kind != "wsd":
            for name in ("decay_steps", "decay_shape"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies only to kind='wsd', got kind={self.kind!r}")
            decay, shape = None, None
        else:
            if self.decay_steps is None:
                decay = min(total - warmup, round(WSD_DEFAULT_DECAY_FRACTION * total))
            else:
                decay = _as_int("decay_steps", self.decay_steps, 0, total - warmup,
                                hi_name="total_steps - warmup_steps")
            shape = "linear" if self.decay_shape is None else self.decay_shape
            check_choice("decay_shape", shape, DECAY_SHAPES)
        # Store normalised values (frozen dataclass: object.__setattr__ is the sanctioned way).
        for name, value in (("max_lr", max_lr), ("min_lr", min_lr), ("total_steps", total),
                            ("warmup_steps", warmup), ("decay_steps", decay), ("decay_shape", shape)):
            object.__setattr__(self, name, value)

    def __call__(self, step: int) -> float:
        """The learning rate for 0-based optimizer step `step` (>= 0; beyond total_steps it holds)."""
        step = _as_int("step", step, 0)
        W, T = self.warmup_steps, self.total_steps
        if step < W:
            num, den = {"(it+1)/W": (step + 1, W), "it/W": (step, W), "(it+1)/(W+1)": (step + 1, W + 1)}[
                self.warmup_convention]
            return self.max_lr * num / den
        if self.kind == "constant":
            return self.max_lr
        if self.kind == "wsd":
            start = T - self.decay_steps
            if step < start:
                return self.max_lr
            p = 1.0 if self.decay_steps == 0 else min(1.0, (step - start) / self.decay_steps)
            shape = {"linear": 1.0 - p, "cosine": 0.5 * (1.0 + math.cos(math.pi * p)), "sqrt": 1.0 - math.sqrt(p)}
            return self.min_lr + (self.max_lr - self.min_lr) * shape[self.decay_shape]
        p = 1.0 if T == W else min(1.0, (step - W) / (T - W))
        if self.kind == "linear":
            return self.min_lr + (self.max_lr - self.min_lr) * (1.0 - p)
        return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))

    def factor(self, step: int) -> float:
        """lr(step) / max_lr: the multiplier a LambdaLR applies to the optimizer's base lr."""
        return self(step) / self.max_lr

    def values(self, steps: int | None = None) -> list[float]:
        """[lr(0), ..., lr(steps-1)] (default: total_steps values), for plots and tables."""
        n = self.total_steps if steps is None else _as_int("steps", steps, 0)
        return [self(s) for s in range(n)]

    def to_dict(self) -> dict:
        """Plain dict of the (normalised) fields."""
        return dataclasses.asdict(self)


def lr_at(step: int, *, max_lr: float, total_steps: int, warmup_steps: int = 0, schedule: str = "cosine",
          min_lr: float = 0.0, warmup_convention: str = "(it+1)/W", decay_steps: int | None = None,
          decay_shape: str | None = None) -> float:
    """The learning rate for optimizer step `step` (pure function; see the module docstring)."""
    return Schedule(max_lr=max_lr, total_steps=total_steps, warmup_steps=warmup_steps, kind=schedule,
                    min_lr=min_lr, warmup_convention=warmup_convention, decay_steps=decay_steps,
                    decay_shape=decay_shape)(step)


class ScheduleLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR driven by a Schedule, with a resume that restores the optimizer's lr too.

    Plain LambdaLR.load_state_dict restores its own counter but leaves the optimizer's lr as it
    was until the next step(): a run resumed without also loading the optimizer state would take
    one step at the wrong lr. Here loading sets the lr of every group for the restored step, and
    warns if the saved schedule differs from this one (which can be intended: extending a WSD run).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule, last_epoch: int = -1):
        self.schedule = schedule
        # A closure, not the Schedule object: LambdaLR would pickle a callable object's __dict__
        # into its state and overwrite this schedule with the saved one on load.
        super().__init__(optimizer, lambda step: schedule.factor(step), last_epoch=last_epoch)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["schedule"] = self.schedule.to_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        saved = state.pop("schedule", None)
        if saved is not None and saved != self.schedule.to_dict():
            diff = {k: (saved.get(k), v) for k, v in self.schedule.to_dict().items() if saved.get(k) != v}
            warnings.warn(f"resuming with a different schedule (saved, now): {diff}", UserWarning, stacklevel=2)
        super().load_state_dict(state)
        step = max(self.last_epoch, 0)
        lrs = [base * self.schedule.factor(step) for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule, *, relative: bool = False) -> ScheduleLR:
    """A LambdaLR-based scheduler following `schedule`; call `.step()` once after each optimizer step.

    Every param group's lr becomes initial_lr * schedule(step) / max_lr. By default each group's
    lr must equal schedule.max_lr (so the absolute values, floor included, are what the schedule
    says); `relative=True` allows per-group lrs, each following the same shape scaled to its own.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    if not relative:
        for i, group in enumerate(optimizer.param_groups):
            lr = group.get("initial_lr", group["lr"])
            if not math.isclose(float(lr), schedule.max_lr, rel_tol=1e-12):
                raise ValueError(
                    f"optimizer param group {i} has lr={lr}, schedule.max_lr={schedule.max_lr}: create the "
                    "optimizer with lr=max_lr, or pass relative=True for per-group lrs"
                )
    return ScheduleLR(optimizer, schedule)


def schedule_from_config(cfg: dict) -> Schedule:
    """The trainer's Schedule (lr per optimizer step) from ``[optim]`` (peak and floor lr),
    ``[schedule]`` (kind, warmup, decay) and ``train.max_steps``; ``schedule.decay_steps`` counts
    for "wsd" only (0: the Schedule's default)."""
    o, s = cfg["optim"], cfg["schedule"]
    return Schedule(o["lr"], cfg["train"]["max_steps"], warmup_steps=s["warmup_steps"], kind=s["kind"],
                    min_lr=o["min_lr"], warmup_convention=s["warmup_convention"],
                    decay_steps=(s["decay_steps"] or None) if s["kind"] == "wsd" else None)
