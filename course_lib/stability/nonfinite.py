"""Non-finite guard: a NaN/Inf loss or gradient never reaches the optimizer.

A common tutorial handler saved a diagnostic and *carried on*, applying the NaN update. Here a bad
step is skipped (the caller leaves ``optimizer.step()`` out), a diagnostic bundle is written so the
step can be replayed, and after ``max_consecutive`` bad steps in a row the run stops with a message
that says what to look at - a run that only produces NaNs is burning money.

fp16 with a ``GradScaler`` is the one place where Inf gradients are routine: the scaler starts with
a huge scale and halves it on each overflow. With an enabled scaler, a finite loss with non-finite
gradients counts as an *overflow*: skipped, no bundle, and it aborts only after
``max_consecutive_overflow`` in a row (each halves the scale, so 64 of them mean a real fault).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..validate import check_int


class NonFiniteError(RuntimeError):
    """Raised after too many consecutive non-finite steps; the message names the steps and the
    last diagnostic bundle."""


def _batch_tensors(batch: Any, prefix: str = "batch") -> dict[str, torch.Tensor]:
    """Flatten a tensor / dict / list / tuple batch into ``{name: tensor}`` (other leaves ignored)."""
    if isinstance(batch, torch.Tensor):
        return {prefix: batch}
    out: dict[str, torch.Tensor] = {}
    if isinstance(batch, dict):
        for key, value in batch.items():
            out.update(_batch_tensors(value, f"{prefix}.{key}"))
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            out.update(_batch_tensors(value, f"{prefix}.{i}"))
    return out


def _json_number(x: float) -> float | str:
    """JSON has no NaN/Inf; write them as strings so the bundle stays strict JSON."""
    return x if math.isfinite(x) else str(x)


def _without_partial(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient still holding partial sums (``Partial`` placement) made whole on those
    mesh dims (a collective; counting NaNs in a summand would count the wrong thing)."""
    placements = getattr(grad, "placements", ())
    if not any(p.is_partial() for p in placements):
        return grad
    from torch.distributed.tensor import Replicate

    return grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in placements])


def _local_stats(grad: torch.Tensor) -> torch.Tensor:
    """``[nan count, inf count, max |finite|]`` (fp32) of this rank's part of ``grad`` (its local
    shard for a DTensor). An empty part - FSDP2 gives some ranks no rows of a tensor smaller than
    the mesh - counts zeros: a DTensor ``max()`` would fail on that rank alone and hang the others."""
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    finite_abs = torch.nan_to_num(local.float().abs(), nan=0.0, posinf=0.0, neginf=0.0)
    peak = finite_abs.max() if local.numel() else finite_abs.new_zeros(())
    return torch.stack([torch.isnan(local).sum().float(), torch.isinf(local).sum().float(), peak])


def _complete_over_shards(grads: list[torch.Tensor], rows: list[torch.Tensor]) -> None:
    """Turn the local rows of DTensor gradients into whole-tensor rows, in place: counts summed
    and maxima taken over each mesh dim the tensor is sharded on (replicated dims hold copies).
    Tensors with the same mesh and placements share one pair of all-reduces; every rank holds
    the same DTensors in the same order, so every rank issues the same collectives."""
    import torch.distributed as dist

    sets: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        if hasattr(g, "device_mesh"):
            sets.setdefault((g.device_mesh, tuple(g.placements)), []).append(i)
    for (mesh, placements), index in sets.items():
        block = torch.stack([rows[i] for i in index])
        counts, peaks = block[:, :2].contiguous(), block[:, 2].contiguous()
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                group = mesh.get_group(dim)
                dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
        for j, i in enumerate(index):
            rows[i] = torch.cat([counts[j], peaks[j:j + 1]])


class NonFiniteGuard:
    """Counts bad steps, writes diagnostic bundles into ``diag_dir`` (None: no bundles) and raises
    :class:`NonFiniteError` after ``max_consecutive`` consecutive bad steps (>= 1).
    ``max_batch_bytes``: batches up to this size (bytes) are saved as safetensors next to the JSON.
    ``rank``: this process's global rank; bundle files carry it (``..._rank1.json``) because every
    rank of a data-parallel run meets the same bad step and would otherwise write one file."""

    def __init__(self, max_consecutive: int = 3, diag_dir: str | os.PathLike | None = None,
                 max_consecutive_overflow: int = 64, max_batch_bytes: int = 64 << 20, rank: int = 0):
        check_int("max_consecutive", max_consecutive, 1)
        check_int("max_consecutive_overflow", max_consecutive_overflow, 1)
        check_int("max_batch_bytes", max_batch_bytes, 0)
        self.rank = check_int("rank", rank, 0)
        self.max_consecutive = max_consecutive
        self.max_consecutive_overflow = max_consecutive_overflow
        self.max_batch_bytes = max_batch_bytes
        self.diag_dir = Path(diag_dir) if diag_dir is not None else None
        self.consecutive = 0
        self.consecutive_overflow = 0
        self.total_bad = 0
        self.bad_steps: list[int] = []
        self.bundles: list[Path] = []
        self.diagnostic_syncs = 0  # host transfers made only on bad steps, to fill a bundle

    def record_good(self) -> None:
        """A finite step: the consecutive counters restart."""
        self.consecutive = 0
        self.consecutive_overflow = 0

    def record_bad(self, step: int, *, loss: float, param_norms: dict[str, float], model: nn.Module,
                   optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                   batch: Any = None) -> tuple[str, Path | None]:
        """Handle one non-finite step. Returns ``(kind, bundle_path)`` with kind ``"nonfinite"`` or
        ``"overflow"`` (scaler-managed). Raises :class:`NonFiniteError` past the limits."""
        self.total_bad += 1
        self.bad_steps.append(step)
        scaler_on = scaler is not None and getattr(scaler, "is_enabled", lambda: False)()
        if scaler_on and math.isfinite(loss):
            self.consecutive_overflow += 1
            if self.consecutive_overflow >= self.max_consecutive_overflow:
                raise NonFiniteError(
                    f"{self.consecutive_overflow} consecutive fp16 overflows up to step {step}: the loss "
                    f"scale keeps halving, so the gradients are non-finite at any scale. Look for an "
                    f"exploding layer in the gradient norms, or train in bf16.")
            return "overflow", None
        self.consecutive += 1
        bundle = self._write_bundle(step, loss, param_norms, model, optimizer, scaler, batch)
        if self.consecutive >= self.max_consecutive:
            first = self.bad_steps[-self.consecutive]
            bad = [n for n, v in param_norms.items() if not math.isfinite(v)]
            raise NonFiniteError(
                f"{self.consecutive} consecutive non-finite steps ({first}..{step}); loss={loss}, "
                f"non-finite gradients in {len(bad)} tensors (first: {bad[:3]}). Last diagnostic: "
                f"{bundle or 'none (no diag_dir given)'}. Usual causes: LR too high, missing warmup, "
                f"fp16 without a loss scaler, a bad batch (replay it from the bundle).")
        return "nonfinite", bundle

    def _write_bundle(self, step: int, loss: float, param_norms: dict[str, float], model: nn.Module,
                      optimizer: Any, scaler: Any, batch: Any) -> Path | None:
        if self.diag_dir is None:
            return None
        self.diag_dir.mkdir(parents=True, exist_ok=True)
        stem = f"nonfinite_step{step:09d}_rank{self.rank}"
        bundle = {
            "step": step, "time_unix": time.time(), "loss": _json_number(loss),
            "lr": [g.get("lr") for g in optimizer.param_groups] if optimizer is not None else None,
            "scaler": ({k: _json_number(float(v)) if isinstance(v, (int, float)) else str(v)
                        for k, v in scaler.state_dict().items()} if scaler is not None else None),
            "grads": self._grad_stats(model, param_norms),
            "batch": None,
        }
        tensors = {k: v.detach().cpu().contiguous() for k, v in _batch_tensors(batch).items()}
        if tensors:
            bundle["batch"] = {k: {"shape": list(t.shape), "dtype": str(t.dtype),
                                   "sha256": hashlib.sha256(
                                       t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()}
                               for k, t in tensors.items()}
            if sum(t.numel() * t.element_size() for t in tensors.values()) <= self.max_batch_bytes:
                from safetensors.torch import save_file
                tmp = self.diag_dir / f".{stem}.batch.safetensors.tmp"
                save_file(tensors, str(tmp))
                os.replace(tmp, self.diag_dir / f"{stem}.batch.safetensors")
                bundle["batch_file"] = f"{stem}.batch.safetensors"
        path = self.diag_dir / f"{stem}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(bundle, indent=1, allow_nan=False))
        os.replace(tmp, path)  # never a half-written bundle
        self.bundles.append(path)
        return path

    def _grad_stats(self, model: nn.Module, param_norms: dict[str, float]) -> dict[str, dict]:
        """Per-tensor NaN count, Inf count and max |finite value|, in one host transfer. DTensor
        gradients (FSDP2, TP) are counted over the whole tensor (every rank gets the same row);
        plain gradients are this rank's (under ZeRO-2, only the ones it owns are listed)."""
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None] \
            if model is not None else []  # None: an engine keeps the gradients (DeepSpeed)
        if not named:
            return {}
        with torch.no_grad():
            grads = [_without_partial(g.detach()) for _, g in named]
            rows = [_local_stats(g) for g in grads]
            _complete_over_shards(grads, rows)
            values = torch.stack([r.to(rows[0].device) for r in rows]).tolist()
        self.diagnostic_syncs += 1
        return {name: {"norm": _json_number(param_norms.get(name, math.nan)), "nan": int(v[0]),
                       "inf": int(v[1]), "max_abs_finite": v[2]}
                for (name, _), v in zip(named, values)}

    def state_dict(self) -> dict:
        """Counters, for resume (plain Python)."""
        return {"consecutive": self.consecutive, "consecutive_overflow": self.consecutive_overflow,
                "total_bad": self.total_bad, "bad_steps": list(self.bad_steps)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.consecutive = int(state["consecutive"])
        self.consecutive_overflow = int(state["consecutive_overflow"])
        self.total_bad = int(state["total_bad"])
        self.bad_steps = [int(s) for s in state["bad_steps"]]
