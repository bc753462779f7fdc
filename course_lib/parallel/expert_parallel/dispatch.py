"""The expert step across ranks: counts first, then tokens out, experts, tokens back.

Set as ``MoE.dispatcher`` (course_lib/model/moe.py) by :func:`course_lib.parallel.expert_parallel.shard_experts`.
The MoE layer has already routed, dropped over capacity and permuted its N tokens into rows grouped
by global expert (``counts[e]`` rows for expert e); expert e lives on EP rank e // L.

1. counts: one all-to-all of the E int64 counts; rank r receives, from every source q, how many
   rows q sends to each of r's L experts ([ep, L]). Now every rank knows every split size.
2. dispatch: all-to-all of the rows, ``sum(counts[q*L:(q+1)*L])`` to rank q (variable splits).
3. permute the received rows by local expert, run the local experts, permute back.
4. combine: the all-to-all of step 2 in reverse; rows return to the rank and place they came from,
   where the MoE layer weighs them and sums them into their tokens (``unpermute``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.expert_parallel.all_to_all import AllToAll, exchange
from course_lib.parallel.expert_parallel.group import EPGroup
from course_lib.parallel.expert_parallel.permute import group_by_local_expert, ungroup


class AllToAllDispatcher:
    """``dispatcher(rows, counts, experts)`` for an MoE layer whose experts are sharded over ``ep``.
    ``log``: every exchange this layer made (see all_to_all.exchange), for the wire check; cleared
    by the caller (None when built with ``log=False``: nothing recorded). ``idle_experts``: local experts that received no rows, summed over every call
    (they still run, on zero rows: a zero gradient), so a test can tell that case was exercised."""

    def __init__(self, ep: EPGroup, log: bool = True) -> None:
        self.ep = ep
        self.log: list[dict] | None = [] if log else None
        self.idle_experts = 0

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        ep, L = self.ep.size, experts.n_local
        if counts.numel() != ep * L:
            raise ValueError(f"{counts.numel()} expert counts for ep = {ep} ranks x {L} local experts")
        recv_counts = exchange(counts, [L] * ep, [L] * ep, self.ep.group, self.log, "counts").view(ep, L)
        send = counts.view(ep, L).sum(1).tolist()  # rows to each rank (one host read of 2*ep ints)
        recv = recv_counts.sum(1).tolist()
        arrived = AllToAll.apply(rows, send, recv, self.ep.group, self.log, "dispatch")
        grouped, local_counts, index = group_by_local_expert(arrived, recv_counts)
        sizes = local_counts.tolist()  # the host read Experts would make of a tensor, made here once
        self.idle_experts += sizes.count(0)
        out = ungroup(experts(grouped, sizes), index)
        return AllToAll.apply(out, recv, send, self.ep.group, self.log, "combine")


def all_reduce_load(load: torch.Tensor) -> None:
    """Sum a layer's expert loads over every rank (the bias update's global count), in place."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(load)
