"""The learner's ZeRO-1 and ZeRO-2 in the trainer (``train.strategy = "zero1"`` / ``"zero2"``).

Weights stay replicated; the optimizer state is sharded by
:class:`~course_lib.parallel.ShardedOptimizer` (each rank owns whole parameters, ~1/N of them).
Per step, after the last micro-batch's backward (no communication before it, so gradient
accumulation is free):

* the local gradients are **reduce-scattered** (:meth:`ShardedOptimizer.reduce_gradients`): each
  owner gets the rank-mean gradient of its own parameters. ZeRO-1 keeps the full gradient buffers
  (the others are zeroed), ZeRO-2 frees every gradient it does not own;
* the stabilizer measures and clips those gradients; the global norm needs every rank
  (:attr:`reduce_grad_sq`), one small all-reduce on the device, no extra host read;
* each owner steps its shard and broadcasts the new values.

On the wire that is the ZeRO paper's 2 Psi (N-1)/N per rank per step for both stages: a
reduce-scatter and a gather of the parameters, the same volume as DDP's all-reduce.
Checkpoints are full (rank 0): the optimizer shards are consolidated on rank 0 before a save,
and every rank keeps its own shard of a loaded full state, whatever the world size was.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.data_parallel.naive_ddp import broadcast_from_first_rank
from course_lib.parallel.data_parallel.optimizer_rebuild import constructor_kwargs
from course_lib.parallel.data_parallel.zero import ShardedOptimizer
from course_lib.parallel.strategy import Distributed


class Zero1(Distributed):
    """ZeRO-1: optimizer state sharded, gradients reduce-scattered into full-size buffers."""

    name = "zero1"
    checkpoint_formats = ("full",)  # the optimizer shards are consolidated into a full file
    free_unowned_grads = False

    def setup(self, model, make_optimizer) -> None:
        broadcast_from_first_rank(model, None)  # identical replicas whatever each rank initialised
        self.model = self.module = model
        base = make_optimizer(model)  # the trainer's optimizer, only to copy its groups and options
        self.optimizer = ShardedOptimizer([dict(g) for g in base.param_groups], type(base),
                                          reduce_scatter_grads=self.free_unowned_grads,
                                          find_unused_parameters=False,  # TinyGPT uses every weight: no host read
                                          **constructor_kwargs(base))
        self.reduce_grad_sq = self._reduce_grad_sq

    def forward_backward(self, batches, **step) -> torch.Tensor:
        # Local gradients accumulate over the micro-batches; nothing is sent before the last one.
        loss = super().forward_backward(batches, **step)
        self.optimizer.reduce_gradients(free_unowned=self.free_unowned_grads)
        return loss

    def _reduce_grad_sq(self, sq: torch.Tensor):
        # Every rank holds the same set of gradient tensors (owned: averaged; others: zeros), so
        # an element-wise sum completes each tensor's norm on every rank.
        out = sq.clone()
        dist.all_reduce(out)
        return out

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def checkpoint_state(self, state, *, saving: bool):
        if saving:
            self.optimizer.consolidate_state_dict(to=0)  # collective: the full state on the writer
        return state


class Zero2(Zero1):
    """ZeRO-2: as ZeRO-1, and each rank frees the gradients it does not own."""

    name = "zero2"
    free_unowned_grads = True

    def _reduce_grad_sq(self, sq: torch.Tensor):
        # Ranks hold different tensors (their own, whole): per-tensor norms are already complete,
        # only the total needs every rank.
        total = sq.sum()
        dist.all_reduce(total)
        return sq, total
