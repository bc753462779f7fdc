"""Fault injection for labs and tests: break one training step on purpose, at a known point.

A fault is written ``KIND@STEP[=VALUE]`` (the trainer's ``--inject-fault`` flag):

=============  ==================================================  ===================================
kind           effect at step ``STEP``                             ``VALUE``
=============  ==================================================  ===================================
``grad_scale`` every gradient is multiplied by ``VALUE``           factor, finite and > 0 (default 10)
``nan_loss``   the loss is multiplied by NaN *before* backward,    none
               so the gradients become NaN too (as a real
               overflow in the forward pass would make them)
``inf_grad``   one element of one gradient is set to +Inf, on      parameter name (default: the first
               every rank that holds (part of) that gradient       gradient each rank holds)
``loss_shift`` from ``STEP`` on, *every* loss is multiplied by     factor, finite and > 0 (default 3)
               ``VALUE`` (a persistent level change, as a data
               switch makes: not a spike, and a roll-back
               does not make it go away)
=============  ==================================================  ===================================

The two injection points of a step are :meth:`FaultInjector.on_loss` (after the forward pass,
before ``backward``) and :meth:`FaultInjector.on_grads` (after ``backward`` and after
``GradScaler.unscale_``, before any gradient is inspected or clipped). :class:`~course_lib.stability.Stabilizer`
calls both for you when it is given the faults.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

KINDS = ("grad_scale", "nan_loss", "inf_grad", "loss_shift")
DEFAULT_GRAD_SCALE = 10.0  # the classic "gradients x10" explosion
DEFAULT_LOSS_SHIFT = 3.0


@dataclass(frozen=True)
class FaultSpec:
    """One planned fault: ``kind`` (one of :data:`KINDS`) at optimizer step ``step`` (0-based count
    of steps, the trainer's step number), with an optional ``value`` (float factor for
    ``grad_scale``, parameter name for ``inf_grad``)."""

    kind: str
    step: int
    value: float | str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"fault step must be an int >= 0, got {self.step!r}")
        if self.kind in ("grad_scale", "loss_shift"):
            if not isinstance(self.value, (int, float)) or not math.isfinite(self.value) or self.value <= 0:
                raise ValueError(f"{self.kind} value must be a finite float > 0, got {self.value!r}")
        elif self.kind == "nan_loss" and self.value is not None:
            raise ValueError(f"nan_loss takes no value, got {self.value!r}")
        elif self.kind == "inf_grad" and self.value is not None and (not isinstance(self.value, str) or not self.value):
            raise ValueError(f"inf_grad value must be a parameter name, got {self.value!r}")

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}" + ("" if self.value is None else f"={self.value}")


def parse_fault(text: str) -> FaultSpec:
    """Parse ``KIND@STEP[=VALUE]`` (e.g. ``grad_scale@500=10``, ``nan_loss@7``,
    ``inf_grad@3=0.weight``) into a :class:`FaultSpec`. Raises ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise TypeError(f"fault must be a str like 'grad_scale@500=10', got {type(text).__name__}")
    head, sep, value = text.strip().partition("=")
    kind, at, step_text = head.partition("@")
    if not at or not kind or not step_text:
        raise ValueError(f"fault {text!r} is not KIND@STEP[=VALUE] with KIND in {KINDS}")
    try:
        step = int(step_text)
    except ValueError:
        raise ValueError(f"fault {text!r}: STEP must be an integer >= 0, got {step_text!r}") from None
    parsed: float | str | None = None
    if kind in ("grad_scale", "loss_shift"):
        try:
            parsed = float(value) if sep else (DEFAULT_GRAD_SCALE if kind == "grad_scale" else DEFAULT_LOSS_SHIFT)
        except ValueError:
            raise ValueError(f"fault {text!r}: {kind} VALUE must be a number, got {value!r}") from None
    elif sep:
        parsed = value
    return FaultSpec(kind, step, parsed)


def parse_faults(items: str | FaultSpec | Iterable[str | FaultSpec] | None) -> list[FaultSpec]:
    """Accept None, one spec, a comma-separated string, or a list of strings/specs (a repeated CLI
    flag) and return the list of :class:`FaultSpec`."""
    if items is None:
        return []
    if isinstance(items, FaultSpec):
        return [items]
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    return [item if isinstance(item, FaultSpec) else parse_fault(item) for item in items]


def check_reachable(faults: Iterable[FaultSpec], strategy: str, *, grads_visible: bool) -> None:
    """ValueError for faults the training strategy cannot deliver: ``grad_scale`` and ``inf_grad``
    write into ``p.grad``, which an engine that keeps the gradients to itself (``grads_visible``
    False, e.g. DeepSpeed with ZeRO > 0) never exposes. ``strategy`` is the ``train.strategy`` name
    the message quotes."""
    if grads_visible:
        return
    bad = [str(f) for f in faults if f.kind in ("grad_scale", "inf_grad")]
    if bad:
        raise ValueError(f"{', '.join(bad)} writes into p.grad, but train.strategy = {strategy!r} keeps "
                         f"the gradients inside its engine here; use nan_loss or loss_shift (or, for "
                         f"deepspeed, parallel.zero_stage = 0 with fp32)")


class FaultInjector:
    """Applies planned :class:`FaultSpec` faults at their step, each at most once per injector:
    a transient fault, so a rollback past the step inside the same run does not meet it again
    (a new process resumed from before the step does, as an uninterrupted run did). The exception
    is ``loss_shift``, a persistent change that applies at every step from its step on.
    ``fired`` lists ``(step, str(spec))`` of what was applied."""

    def __init__(self, faults: str | FaultSpec | Iterable[str | FaultSpec] | None = None):
        self.faults = parse_faults(faults)
        self.fired: list[tuple[int, str]] = []

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _at(self, step: int, kinds: tuple[str, ...]) -> list[FaultSpec]:
        done = {spec for _, spec in self.fired}
        return [f for f in self.faults if f.step == step and f.kind in kinds and str(f) not in done]

    def validate(self, model: nn.Module) -> None:
        """Check before training that every ``inf_grad`` names a trainable parameter of ``model``
        (a typo should fail at step 0, not at step 500). Raises ValueError listing valid names."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for fault in self.faults:
            if fault.kind == "inf_grad" and fault.value is not None and fault.value not in names:
                raise ValueError(f"fault {fault}: no trainable parameter named {fault.value!r}; "
                                 f"names: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")

    def on_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Injection point 1, between forward and backward: returns the loss, multiplied by NaN
        when a ``nan_loss`` fault is due (kept in the graph so the gradients turn NaN too)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        for fault in self._at(step, ("nan_loss",)):
            loss = loss * float("nan")
            self.fired.append((step, str(fault)))
        for fault in self.faults:  # persistent: every step from fault.step on, fired or not
            if fault.kind == "loss_shift" and step >= fault.step:
                loss = loss * float(fault.value)
                if str(fault) not in {spec for _, spec in self.fired}:
                    self.fired.append((step, str(fault)))
        return loss

    def on_grads(self, model: nn.Module, step: int) -> None:
        """Injection point 2, after backward (and after ``GradScaler.unscale_``): scales all
        gradients for ``grad_scale``; writes +Inf into one gradient element for ``inf_grad``.

        Sharded gradients: ``model`` is what this rank measures (the stabilizer's module), so a
        named ``inf_grad`` reaches the gradient *this rank holds* of that parameter - its DTensor
        shard (FSDP2, TP), its ZeRO range (a piece named ``name[a:b]``), its pipeline stage's copy.
        A rank of a process group that holds none of it (ZeRO-2 frees the gradients it does not
        own; another stage has the parameter) writes nothing: the owner's Inf reaches every rank
        through the gradient norm's all-reduce, so all ranks still skip the step together. That some
        rank did write is checked (one all-reduce on the fault's step): otherwise every rank raises
        ValueError, never a run that silently goes on as if the fault had fired."""
        due = self._at(step, ("grad_scale", "inf_grad"))
        if not due:
            return
        named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        elsewhere = _in_process_group()  # another rank may hold what this one lacks
        if not named and not elsewhere:
            raise ValueError(f"fault at step {step}: the model has no gradients; call on_grads after backward")
        for fault in due:
            if fault.kind == "grad_scale":
                if named:
                    with torch.no_grad():
                        torch._foreach_mul_([p.grad for _, p in named], float(fault.value))
            else:
                grads = _gradients_named(named, fault.value)
                if not (_on_any_rank(bool(grads), named) if elsewhere else grads):
                    some = ", ".join(n for n, _ in named[:8])
                    raise ValueError(f"inf_grad: {'no rank holds' if elsewhere else 'no'} gradient of a parameter "
                                     f"named {fault.value!r}; some names here: {some}")
                for grad in grads:
                    _write_inf(grad)
            self.fired.append((step, str(fault)))


def _in_process_group() -> bool:
    """True inside a process group of 2+ ranks (gradients may live on other ranks)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _on_any_rank(flag: bool, named: list[tuple[str, nn.Parameter]]) -> bool:
    """``flag`` OR-ed over all ranks: one all-reduce and one host read, on a fault's step only, so
    a fault that no rank can inject fails on every rank instead of silently doing nothing."""
    import torch.distributed as dist

    if named:
        device = named[0][1].grad.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t)
    return bool(t.item())


def _gradients_named(named: list[tuple[str, nn.Parameter]], name: str | None) -> list[torch.Tensor]:
    """This rank's gradients of parameter ``name`` (None: the first gradient it holds): the whole
    gradient, or the pieces of it a ZeRO range holds (``name[a:b]``, one per piece)."""
    if name is None:
        return [named[0][1].grad] if named else []
    return [p.grad for n, p in named if n == name or (n.startswith(name + "[") and n.endswith("]"))]


def _write_inf(grad: torch.Tensor) -> None:
    """+Inf into the first element of this rank's part of ``grad``. A DTensor (FSDP2, TP): item
    assignment on it does not reach the local shard (measured, torch 2.13: the gradient stayed
    finite), so write into the local shard; an empty shard (a tensor smaller than the mesh) holds
    nothing to write."""
    if hasattr(grad, "to_local"):
        grad = grad.to_local()
    if grad.numel():
        with torch.no_grad():  # index the first element of any shape, contiguous or not
            grad[(0,) * grad.dim()] = float("inf")
