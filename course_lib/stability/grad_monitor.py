"""Gradient monitor: per-parameter and per-layer gradient norms with one device synchronization.

A common tutorial loop calls ``.item()`` per parameter, which stalls a GPU once per tensor (hundreds of
times a step). Here every norm is computed on the device with ``torch._foreach_norm`` (one fused
kernel per device and dtype), the norms and the loss are stacked, and a single ``tolist()`` brings
them to the host; the global norm and the per-layer norms are then host arithmetic.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..validate import check_int


@dataclass
class GradStats:
    """One step's numbers, on the host: ``loss`` (None if not given), ``total_norm`` (global L2 norm
    of all gradients, before clipping), ``param_norms`` and ``layer_norms`` (L2, by name),
    ``finite`` (loss and every gradient finite)."""

    loss: float | None
    total_norm: float | None  # None: no gradients measured (loss-only stats)
    param_norms: dict[str, float]
    layer_norms: dict[str, float]
    finite: bool
    grads: list[torch.Tensor] = field(default_factory=list, repr=False)  # the measured gradients
    extra: list[float] = field(default_factory=list)  # host values of measure(extra=...), in order


class GradientMonitor:
    """Per-parameter and per-layer gradient L2 norms with exactly one device-to-host transfer.

    ``layer_depth``: None groups each parameter under its owning module (``blocks.0.attn.qkv``);
    an int keeps that many leading name components (``2`` -> ``blocks.0``).

    The (name, parameter, layer) list of a model is built once and reused: walking
    ``named_parameters()`` every step costs as much as the norms on a small model. Call
    :meth:`refresh` after replacing parameters of the same model object (re-tying, re-wrapping)."""

    def __init__(self, layer_depth: int | None = None):
        if layer_depth is not None:
            check_int("layer_depth", layer_depth, 1)  # name components
        self.layer_depth = layer_depth
        self.sync_count = 0
        self._cache: tuple[weakref.ref, list[tuple[str, nn.Parameter, str]]] | None = None
        self._plain = True

    def refresh(self) -> None:
        """Forget the cached parameter list (rebuilt at the next :meth:`measure`)."""
        self._cache = None

    def _params(self, model: nn.Module) -> list[tuple[str, nn.Parameter, str]]:
        if self._cache is None or self._cache[0]() is not model:
            named = [(n, p, self.layer_of(n)) for n, p in model.named_parameters()]
            # Plain: ordinary tensors on one device, so the per-step path can skip the DTensor and
            # device checks (about 1 us per tensor per step, a few percent of a tiny model's step).
            devices = {p.device for _, p, _ in named}
            self._plain = len(devices) <= 1 and not any(hasattr(p, "full_tensor") for _, p, _ in named)
            self._cache = (weakref.ref(model), named)
        return self._cache[1]

    def layer_of(self, name: str) -> str:
        """The layer a parameter name belongs to under this monitor's grouping."""
        parts = name.split(".")
        if self.layer_depth is None:
            return ".".join(parts[:-1]) or name
        return ".".join(parts[: self.layer_depth])

    def measure(self, model: nn.Module, loss: torch.Tensor | None = None, *,
                extra: list[torch.Tensor] | None = None,
                reduce_sq: Callable[[torch.Tensor], torch.Tensor] | None = None) -> GradStats:
        """Norms of the current gradients of ``model`` (and the value of ``loss``), one sync.

        ``extra``: other one-element device tensors the caller needs on the host this step (the
        fp16 loss scale); they ride along in the same transfer and come back as ``GradStats.extra``
        (floats, same order). ``reduce_sq``: for gradients sharded by hand (ZeRO-1/2/3 from
        scratch), a function that takes the stacked per-tensor *squared* norms of this rank's
        gradients and completes them over the shard group on the device (a collective, not a host
        read). It returns either the per-tensor vector (same length; the global norm is its sum),
        or a pair ``(per_tensor, total_sq)`` when ranks hold different tensors (ZeRO-2 keeps only
        the gradients a rank owns: per-tensor norms are already whole, only the total needs every
        rank). DTensor gradients (FSDP2, TP) need no hook: their norms are completed here; given a
        ``reduce_sq`` anyway, it gets the norms of their *local* shards (fsdp x tp completes all
        of them in one all-reduce)."""
        named = [(n, p.grad, layer) for n, p, layer in self._params(model) if p.grad is not None]
        if not named:
            raise ValueError("the model has no gradients; call after backward()")
        grads = [g for _, g, _ in named]
        if any(g.is_sparse for g in grads):
            raise TypeError("sparse gradients are not supported by GradientMonitor")
        extra = list(extra or [])
        with torch.no_grad():
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # fp32 so fp16 norms cannot overflow
            if not self._plain:
                # FSDP2/DTensor gradients: the norm of a shard is partial; full_tensor() all-reduces
                # on the device (a collective, not a host sync) - one or more per tensor. A strategy
                # that passes reduce_sq completes the local norms itself, all tensors in one collective.
                norms = [(n.to_local() if reduce_sq is not None else n.full_tensor())
                         if hasattr(n, "full_tensor") else n for n in norms]
            device = norms[0].device
            head = [t.detach().float().reshape(()) for t in ([loss] if loss is not None else []) + extra]
            if not self._plain or any(t.device != device for t in head):
                norms = [n if n.device == device else n.to(device) for n in norms]
                head = [t if t.device == device else t.to(device) for t in head]
            total_sq = None
            if reduce_sq is not None:
                out = reduce_sq(torch.stack(norms).square())
                per_sq, total_sq = out if isinstance(out, tuple) else (out, None)
                if per_sq.numel() != len(norms):
                    raise ValueError(f"reduce_sq returned {per_sq.numel()} per-tensor values for "
                                     f"{len(norms)} gradients")
                norms = list(per_sq.sqrt())
                if total_sq is not None:
                    head.append(total_sq.reshape(()).float())
            values = torch.stack([*head, *norms]).tolist()  # one kernel, one transfer
        self.sync_count += 1  # the one device synchronization of the step (tolist above)
        loss_value = values.pop(0) if loss is not None else None
        extra_values = [values.pop(0) for _ in extra]
        reduced_total = math.sqrt(max(values.pop(0), 0.0)) if total_sq is not None else None
        param_norms = {}
        sq: dict[str, float] = {}
        for (name, _, layer), v in zip(named, values):
            param_norms[name] = v
            sq[layer] = sq.get(layer, 0.0) + v * v
        layer_norms = {k: math.sqrt(v) for k, v in sq.items()}
        # A reduced total already carries any rank's NaN/inf: every rank decides alike.
        total = reduced_total if reduced_total is not None else math.sqrt(sum(v * v for v in values))
        finite = math.isfinite(total) and (loss_value is None or math.isfinite(loss_value))
        return GradStats(loss_value, total, param_norms, layer_norms, finite, grads, extra_values)
