"""Expert parallelism inside :class:`~.model_parallel.ModelParallel`: the MoE layers of a pipeline
stage (and of a tensor-parallel model, under sequence parallelism) with their experts sharded
over ``parallel.ep`` ranks of that stage.

Where the EP group sits (Megatron's "parallel folding"): the experts fold their own ep x
expert-dp grid over the ranks of one pipeline stage, i.e. its dp x tp ranks (cp is refused with
ep). Those ranks are consecutive (pp is the mesh's outermost dimension), and so are the ep ranks
of an EP group: ``make_ep_group(ep, block=ranks per stage)``. With tp = 1 the EP group is ep
data-parallel replicas; with tp > 1 (sequence parallelism: each tp rank routes its own slice of
the tokens) it takes tp peers first, then replicas. Expert-tensor-parallel size is 1: an expert
is never cut by tp; ETP = TP is not built (trainer.config refuses tp > 1 without sequence
parallelism, which would route every token tp times).

Gradients. A dense weight is averaged over dp as before (TP shards and SP sums unchanged). An
expert slice receives, through the combine's backward, the gradient of every token its EP group
routed to it; its expert-data-parallel group (the stage's other ranks holding the same slice)
holds the other tokens' parts. Every token of the stage's dp x tp ranks is counted once over the
EDP group, and each dp replica's loss is the mean over its micro-batches, so one process's
gradient of the mean loss is the EDP group's **sum divided by dp** (:meth:`StageExperts.reduce_gradients`;
with tp = 1 that is the world-size divisor of the data-parallel EP strategies).

Norms count each slice once: on the ranks of the stage's first EP group (expert-DP index 0),
whose slices together are every expert of the stage (:attr:`StageExperts.counts_in_norm`).
Expert loads for DeepSeek-V3's bias update are summed over the stage's ranks only
(:meth:`reduce_load`): another stage holds other layers.

ep = 1 (every rank of the stage holds every expert) is the same arithmetic with an EP group of
one rank: no all-to-all, the EDP group is the whole stage.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.model.moe import moe_layers
from course_lib.parallel.expert_parallel.group import make_ep_group
from course_lib.parallel.expert_parallel.shard import is_expert, reduce_expert_gradients, shard_experts


class StageExperts:
    """This rank's part of the experts of its pipeline stage (see the module docstring). Build it
    on every rank (collective: it creates the EP, expert-DP and stage groups) after the local
    module is cut, before the optimizer sees its parameters."""

    def __init__(self, mesh, local: nn.Module, ep: int):
        lay = mesh.layout
        self.stage_size = lay.world_size // lay.pp
        self.ep = make_ep_group(ep, block=self.stage_size)
        self.dp = lay.dp * lay.cp  # data-parallel replicas: the divisor of the mean loss
        self.stage_group = None  # one stage: the world
        if lay.pp > 1:
            for s in range(lay.pp):  # every rank creates every group, in the same order
                ranks = list(range(s * self.stage_size, (s + 1) * self.stage_size))
                g = dist.new_group(ranks)
                if mesh.rank in ranks:
                    self.stage_group = g
        if ep > 1:
            self.dispatchers = shard_experts(local, self.ep, log=False)
        else:  # every expert here: mark them, no dispatch
            self.dispatchers = []
            for m in moe_layers(local):
                for p in m.experts.parameters():
                    p.is_expert = True
        self.params = [p for p in local.parameters() if is_expert(p)]
        self.counts_in_norm = (mesh.rank % self.stage_size) // ep == 0

    def reduce_gradients(self) -> None:
        """Each expert slice's gradient -> one process's: sum over the expert-DP group, / dp."""
        reduce_expert_gradients(self.params, self.ep, divisor=self.dp)

    def reduce_load(self, load: torch.Tensor) -> None:
        """Sum a layer's expert loads (tokens per expert, [E]) over this stage's ranks, in place."""
        dist.all_reduce(load, group=self.stage_group)

    def whole_sq(self, expert_sq: torch.Tensor) -> torch.Tensor:
        """The squared norms of this rank's expert slices (every slice of its stage, in parameter
        order) -> those of the whole [E, ...] tensors, as one process logs them: summed over the EP
        group (whose ranks hold the same layers, so the vectors line up)."""
        if self.ep.group is None:
            return expert_sq
        out = expert_sq.clone()
        dist.all_reduce(out, group=self.ep.group)
        return out
