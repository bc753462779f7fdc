"""How the training loop spreads over ranks. The loop calls the same four methods whatever the
strategy; ``single`` and ``ddp`` live here, FSDP and DeepSpeed plug in with the same interface.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


class Single:
    """One process, no communication."""

    name = "single"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the loop calls forward on (the model itself)."""
        return model

    def no_sync(self, wrapped: nn.Module):
        """Context for micro-batches that must not communicate gradients yet (none here)."""
        return contextlib.nullcontext()

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The rank-mean of a scalar tensor (itself here). Stays on the device: no sync."""
        return value


class DDP(Single):
    """torch DistributedDataParallel: gradients all-reduced (bucketed, overlapped with backward)
    on the last micro-batch of each step; earlier micro-batches skip the all-reduce."""

    name = "ddp"

    def __init__(self, device: torch.device):
        if not dist.is_initialized():
            raise RuntimeError("strategy 'ddp' needs a process group: start with torchrun, or "
                               "run_ranks, and call init_distributed() first")
        self.device = device

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, wrapped: nn.Module):
        return wrapped.no_sync()

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        # Every rank must see the same loss, or spike decisions (skip / roll back) would differ
        # between ranks and their weights would drift apart.
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out / dist.get_world_size()


def make_strategy(name: str, device: torch.device) -> Single:
    """``single`` or ``ddp`` (ValueError for anything else)."""
    if name == "single":
        return Single()
    if name == "ddp":
        return DDP(device)
    raise ValueError(f"strategy must be 'single' or 'ddp', got {name!r}")
