"""torch ``DistributedDataParallel`` behind the strategy interface (``train.strategy = "ddp"``).

DDP all-reduces gradients in buckets while backward is still running, on the last micro-batch of
each step only (``no_sync`` on the others: accumulation without extra traffic). The loss every rank
acts on is the rank-mean, so spike and NaN decisions (skip, roll back) are identical everywhere and
the replicas never drift apart.
"""
from __future__ import annotations

from torch import nn

from course_lib.parallel.strategy import Distributed


class TorchDDP(Distributed):
    """torch DDP on the default process group; checkpoints: full state on rank 0."""

    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def no_sync(self):
        return self.module.no_sync()
