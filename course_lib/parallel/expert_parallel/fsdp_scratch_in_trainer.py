"""Expert parallelism with the kit's from-scratch ZeRO-3 (``parallel.ep > 1``, ``train.strategy =
"fsdp-scratch"``).

The layout is :mod:`.in_trainer`'s (world = ep x expert-dp, each rank holds E / ep experts of every
MoE layer, tokens through all-to-all). Around it, :class:`~course_lib.parallel.SimpleFSDP` shards
every Linear and Embedding weight over *every* rank, as plain ``fsdp-scratch`` does, and leaves the
expert slices alone (its ``ignored_params``): each stays whole on its rank, and after the step's last
micro-batch its gradient is all-reduced over the expert-DP group and divided by the world size
(:func:`.shard.reduce_expert_gradients`, as :class:`~.in_trainer.ExpertParallelDDP` does).

Why not shard the slices again over expert-DP (what FSDP2 does under ``fsdp``)? SimpleFSDP gathers a
weight in a Linear's forward pre-hook; the experts are stacked [L, F, C] tensors read inside the MoE
layer's own loop, so sharding them would need a second gather mechanism and a second process group
inside SimpleFSDP. The slice is already 1/ep of the experts; what a learner reads here is one hook
and the expert-DP reduction they already know.

Gradient norms: the trainer's stabilizer sums per-tensor squares over the world with one all-reduce
(FSDPScratch's): a shard's square on every rank, a replicated norm's on rank 0 only, and an expert
slice's on the ranks of the first EP group only (ranks 0..ep-1 hold every expert once; the other
expert-DP replicas hold the same reduced gradient).

Full checkpoints in the one-process layout, through both views in turn: FSDPScratch's gathers (and on
load slices) the SimpleFSDP shards over the world, :mod:`.in_trainer`'s gathers (slices) the experts
and their AdamW moments over the EP group, so a file resumes at another EP size, under plain
``fsdp-scratch``, or in one process.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from course_lib.parallel.data_parallel.fsdp_scratch_strategy import FSDPScratch
from course_lib.parallel.data_parallel.fsdp_scratch_strategy import _FullModelView as _ShardsView
from course_lib.parallel.expert_parallel.group import make_ep_group
from course_lib.parallel.expert_parallel.in_trainer import _FullModelView, _FullOptimizerView
from course_lib.parallel.expert_parallel.shard import (gather_experts, is_expert, reduce_expert_gradients,
                                                       shard_experts)


class ExpertParallelFSDPScratch(FSDPScratch):
    """SimpleFSDP over the dense weights (every rank), expert slices whole on their EP rank and
    reduced over expert-DP (see the module docstring). ``ep``: this rank's EPGroup after setup."""

    name = "fsdp-scratch"

    def setup(self, model: nn.Module, make_optimizer) -> None:
        self.ep = make_ep_group(self.cfg["parallel"]["ep"])
        self.dispatchers = shard_experts(model, self.ep, log=False)  # before SimpleFSDP: it must see the slices
        self._experts = [p for p in model.parameters() if is_expert(p)]
        super().setup(model, make_optimizer)  # the optimizer is regrouped by name: slices included

    def ignored_params(self) -> list[nn.Parameter]:
        """The expert slices (set by setup before SimpleFSDP wraps the model)."""
        return self._experts

    def forward_backward(self, batches, **step) -> torch.Tensor:
        loss = super().forward_backward(batches, **step)  # shards reduce-scattered, norms averaged
        reduce_expert_gradients(self._experts, self.ep)
        return loss

    def _counts_here(self, p: nn.Parameter, replicated: bool) -> bool:
        # An expert slice's square once per EP rank: on the first EP group (ranks 0..ep-1).
        return self.info.rank < self.ep.size if is_expert(p) else super()._counts_here(p, replicated)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The one-process state dict on every rank (SimpleFSDP shards gathered over the world, then
        experts over the EP group: collectives)."""
        return gather_experts(_ShardsView(self.module, gather=True), self.ep)

    def checkpoint_state(self, state, *, saving: bool):
        """One-process views: FSDPScratch's full views (the shards), wrapped by expert parallelism's
        (the experts and their moments; gathered when ``saving``: collectives)."""
        dense = super().checkpoint_state(state, saving=saving)
        return replace(dense, model=_FullModelView(dense.model, self.ep, gather=saving),
                       optimizer=_FullOptimizerView(self.model, dense.optimizer, self.ep, gather=saving))
