"""The expert-parallel group: which ranks share one set of experts, and which hold the same slice.

World = ep x expert-dp (or, under pipeline parallelism, each stage's ranks = ep x expert-dp: the
``block`` of :func:`make_ep_group`). Ranks [k*ep, (k+1)*ep) form EP group k: together they hold all E experts,
E / ep each (rank i of the group holds experts [i*L, (i+1)*L), L = E / ep), and tokens travel
between them (all-to-all). Ranks with the same index in different EP groups hold the same experts:
their expert gradients are averaged over that expert-data-parallel group, as plain data
parallelism does for everything else (Megatron's expert-data-parallel; torchtitan's dp_shard_in_ep).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class EPGroup:
    """This rank's place in the expert layout. ``group``/``edp_group``: process groups (None when
    of size 1); ``rank``/``size``: index in and size of the EP group; ``edp_size``: replicas of
    each expert slice."""

    group: object
    rank: int
    size: int
    edp_group: object
    edp_size: int

    def local_experts(self, n_experts: int) -> range:
        """Global ids of the experts this rank holds (a contiguous block of n_experts / size)."""
        if n_experts % self.size:
            raise ValueError(f"n_experts ({n_experts}) must be divisible by the expert-parallel size ({self.size})")
        per = n_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


def make_ep_group(ep: int, block: int | None = None) -> EPGroup:
    """Build every EP and expert-DP group of the world (a collective: every rank calls it, same
    arguments) and return this rank's. ``block`` (default: the world size): the ranks are cut into
    blocks of that many consecutive ranks, and experts are laid out inside each block alone - a
    pipeline stage's ranks under pipeline parallelism (pp outermost: a stage is a block), whose
    MoE layers are not the other stages'. ``ep`` must divide ``block``, and ``block`` the world."""
    world, me = dist.get_world_size(), dist.get_rank()
    block = world if block is None else block
    if not isinstance(block, int) or block < 1 or world % block:
        raise ValueError(f"block must be a positive divisor of the world size {world}, got {block!r}")
    if not isinstance(ep, int) or ep < 1 or block % ep:
        raise ValueError(f"ep must be a positive divisor of the {block} ranks it spreads over, got {ep!r}")
    mine = mine_edp = None
    for k in range(world // ep):  # every rank creates every group, in the same order
        ranks = list(range(k * ep, (k + 1) * ep))
        g = dist.new_group(ranks) if ep > 1 else None
        if me in ranks:
            mine = g
    for start in range(0, world, block):
        for i in range(ep):
            ranks = list(range(start + i, start + block, ep))
            g = dist.new_group(ranks) if block // ep > 1 else None
            if me in ranks:
                mine_edp = g
    return EPGroup(mine, me % ep, ep, mine_edp, block // ep)
