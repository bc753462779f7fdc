"""The learner's own data parallelism in the trainer (``train.strategy = "ddp-scratch"``).

:class:`~course_lib.parallel.data_parallel.bucketed_ddp.BucketedDDP` (buckets, async all-reduces
overlapped with backward, ``no_sync`` for accumulation) in place of torch's DDP, behind the same
strategy interface: everything else (rank-mean loss, checkpoints on rank 0, one host read per
step) is torch DDP's strategy, so the two runs must give the same numbers.
"""
from __future__ import annotations

import torch
from torch import nn

from course_lib.parallel.data_parallel.bucketed_ddp import BucketedDDP
from course_lib.parallel.data_parallel.torch_ddp import TorchDDP


class ScratchDDP(TorchDDP):
    """torch DDP's strategy with the from-scratch :class:`BucketedDDP` as the wrapper."""

    name = "ddp-scratch"

    def wrap(self, model: nn.Module) -> nn.Module:
        # No host read of "who has a gradient" flags: the trainer's step makes exactly one.
        mb = self.cfg["parallel"]["bucket_mb"]  # 0 = one bucket
        return BucketedDDP(model, bucket_mb=mb or None, find_unused_parameters=False,
                           ignored_params=self.ignored_params())

    def ignored_params(self) -> list[nn.Parameter]:
        """Parameters BucketedDDP leaves out (neither broadcast nor reduced over the world): none
        here; expert parallelism's slices (expert_parallel.in_trainer.ExpertParallelScratchDDP)."""
        return []

    def forward_backward(self, batches, **step) -> torch.Tensor:
        loss = super().forward_backward(batches, **step)
        self.module.finish_gradient_synchronization()  # torch DDP does this inside backward
        return loss
