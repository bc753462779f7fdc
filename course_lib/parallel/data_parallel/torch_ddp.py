"""torch ``DistributedDataParallel`` behind the strategy interface (``train.strategy = "ddp"``).

DDP all-reduces gradients in buckets while backward is still running, on the last micro-batch of
each step only (``no_sync`` on the others: accumulation without extra traffic). The loss every rank
acts on is the rank-mean, so spike and NaN decisions (skip, roll back) are identical everywhere and
the replicas never drift apart.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.launch import DistInfo
from course_lib.parallel.strategy import Strategy


class TorchDDP(Strategy):
    """torch DDP on the default process group; checkpoints: full state on rank 0."""

    name = "ddp"

    def __init__(self, info: DistInfo, device: torch.device, cfg: dict | None = None):
        if not dist.is_initialized():
            raise RuntimeError(f"strategy {self.name!r} needs a process group: start with torchrun (or "
                               "course_lib.parallel.run_ranks) and call init_distributed() first")
        super().__init__(info, device, cfg)

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def no_sync(self):
        return self.module.no_sync()

    def global_mean(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)  # on the device: no host read
        return out / dist.get_world_size()
