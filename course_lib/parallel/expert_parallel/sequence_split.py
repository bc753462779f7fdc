"""An MoE layer under sequence parallelism: each tensor-parallel rank routes its own slice of the
sequences, and the routing statistics are taken over the whole tp group.

With ``parallel.sequence_parallel`` the residual stream at an MoE layer's input is ``[B, T / tp, C]``
on each tp rank: the tokens are already split, so each rank routes its own (Megatron requires
sequence parallelism when expert and tensor parallelism are combined for this reason; without it
every tp rank would route the same tokens). The experts are not tensor-sharded (expert-tensor-
parallel size 1): the router and the shared experts are replicated over tp, like the norms, and
their gradients are the sums over the group (they are marked ``sequence_parallel``).

What one process decides over a whole micro-batch - which tokens an expert takes within its
capacity, and the balancing loss's f_i and P_i - is decided here over the tp group too
(:class:`TensorParallelSplit` gives :class:`course_lib.model.moe.SequenceSplit` its collectives),
so the layer equals one process, dropped tokens included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.model.moe import MoE, SequenceSplit


class TensorParallelSplit(SequenceSplit):
    """The sequence split of a tp ``group`` (this rank holds slice ``rank`` of ``size`` along T)."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    @torch.no_grad()
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[B, T / size, ...] on every rank -> [B, T, ...] (rank order along dim 1): one all-gather."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    @torch.no_grad()
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group, as a new tensor."""
        out = t.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


def split_moe_over_sequence(moe: MoE, group) -> None:
    """Make ``moe`` (a tensor-parallel model's copy) route this rank's slice of the sequences with
    the statistics of the whole ``group``, and mark its replicated weights (router, shared experts)
    as seeing only this rank's tokens. The routed experts are left to the caller (expert
    parallelism shards them and reduces their gradients over the expert-data-parallel group)."""
    moe.sequence_split = TensorParallelSplit(group)
    replicated = [moe.router] + ([moe.shared] if moe.shared is not None else [])
    for module in replicated:
        for p in module.parameters():
            p.sequence_parallel = True
