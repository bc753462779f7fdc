"""Model-state memory on this rank, measured: parameters, gradients, optimizer state, in bytes.

:func:`model_state_bytes_on_rank` walks a module's parameters, their ``.grad`` and an optimizer's
``state`` and adds up the bytes *allocated* for them on this rank: each tensor's
``untyped_storage().nbytes()``, every storage once (deduplicated by its ``data_ptr``, across all
components, so a gradient that is a view into a communication bucket counts the bucket once and
tied weights count once). A DTensor (FSDP2's sharded parameters, gradients and Adam moments)
counts its local tensor. Measuring storages rather than ``numel * element_size`` shows what is
really held: padding added to make shards even, and a bucket a gradient view lives in, both
count (``how="numel"`` gives the tensors' own sizes instead).

Optimizer state is split in two:

* ``optimizer_moments``: the state tensors with at least one element per parameter element
  (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``): what the estimator's
  8 B/param (``course_lib.estimate.memory``, recipe ``fp32-adam``) counts;
* ``optimizer_step``: AdamW's per-parameter ``step`` counter, a 0-d fp32 tensor (4 bytes) per
  parameter *tensor* (not per element), kept as a tensor so it can live on the device and be
  captured in graphs. It does not grow with the model size, so the estimator leaves it out; it is
  reported here so the totals still account for every byte.

What is *not* counted: activations, the temporary full weights ZeRO-3 gathers (freed after each
layer), communication buffers an engine keeps privately (torch DDP's reducer buckets when
``gradient_as_bucket_view=False``: use ``True`` so the gradients *are* the buckets; BucketedDDP's
flat buffers, which :mod:`course_lib.labs.lab09_zero_fsdp_deepspeed` reports separately).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


@dataclass(frozen=True)
class ModelStateCensus:
    """Bytes of model state allocated on **this rank** (ints). ``total`` = params + grads +
    optimizer_moments (the estimator's three parts); ``optimizer_step`` and ``optimizer_other``
    are extra, listed apart."""

    params: int
    grads: int
    optimizer_moments: int
    optimizer_step: int
    optimizer_other: int
    param_elements: int    # elements of the parameters held here (local shards)
    param_tensors: int
    step_tensors: int
    unit: str = "bytes on this rank"

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_moments

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor
    return t.to_local() if callable(to_local) else t


class _Counter:
    def __init__(self, how: str):
        self.how, self.seen = how, set()

    def __call__(self, t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = _local(t.detach())
        if self.how == "numel":
            return t.numel() * t.element_size()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in self.seen or storage.nbytes() == 0:
            return 0
        self.seen.add(key)
        return storage.nbytes()


def model_state_bytes_on_rank(module: nn.Module | None, optimizer: torch.optim.Optimizer | None = None, *,
                              params=None, how: str = "storage") -> ModelStateCensus:
    """Measure the parameters (of ``module``, or the iterable ``params``), their gradients and
    ``optimizer.state`` on this rank, in bytes. ``how``: ``"storage"`` (allocated storages, each
    once; default) or ``"numel"`` (numel x element size of each tensor). See the module docstring."""
    if how not in ("storage", "numel"):
        raise ValueError(f"how must be 'storage' or 'numel', got {how!r}")
    plist = list(params) if params is not None else list(module.parameters())
    count = _Counter(how)
    p_bytes = sum(count(p) for p in plist)
    g_bytes = sum(count(p.grad) for p in plist if p.grad is not None)
    moments = step = other = steps = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step":
                    step += count(value)
                    steps += 1
                elif key in MOMENT_KEYS:
                    moments += count(value)
                else:
                    other += count(value)
    elements = sum(_local(p).numel() for p in plist)
    return ModelStateCensus(p_bytes, g_bytes, moments, step, other, elements, len(plist), steps)


def compare_with_estimate(census: ModelStateCensus, num_params: int, *, zero_stage: int, dp: int,
                          recipe: str = "fp32-adam") -> dict:
    """Measured vs ``course_lib.estimate.memory.model_state_bytes(num_params, recipe=recipe,
    zero_stage=zero_stage, dp=dp)``, bytes on this rank. Returns ``{"measured": {...},
    "estimated": {...}, "difference": {...}, "equal": bool}`` over params, grads, optimizer
    (moments; the estimator's optimizer state) and total. ``num_params`` is the model's full
    (unsharded) parameter count."""
    from course_lib.estimate.memory import model_state_bytes

    est = model_state_bytes(num_params, recipe=recipe, zero_stage=zero_stage, dp=dp)
    measured = {"params": census.params, "grads": census.grads, "optimizer": census.optimizer_moments,
                "total": census.total}
    estimated = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer, "total": est.total}
    diff = {k: measured[k] - estimated[k] for k in measured}
    return {"unit": "bytes on this rank", "measured": measured, "estimated": estimated,
            "difference": diff, "equal": all(v == 0 for v in diff.values()),
            "optimizer_step_bytes": census.optimizer_step}
