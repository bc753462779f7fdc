"""Experts sharded over the EP group, and the gradient averaging that goes with it.

:func:`shard_experts` keeps, in every MoE layer, this rank's L = E / ep experts (a slice of the
stacked weights: nothing else changes) and sets the all-to-all dispatcher. :func:`sync_gradients`
averages gradients as one process with the global batch would have them: non-expert parameters
over the whole world (plain data parallelism), expert parameters over the expert-DP group. Both
divide by the world size: an expert's gradient already sums, through the combine's backward, the
contributions of every token of its EP group. :func:`reduce_expert_gradients` is the expert half
alone, for the trainer's layouts whose wrapper already synchronized the rest.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.model.moe import moe_layers
from course_lib.parallel.expert_parallel.dispatch import AllToAllDispatcher
from course_lib.parallel.expert_parallel.group import EPGroup


@torch.no_grad()
def shard_experts(model: nn.Module, ep: EPGroup, log: bool = True) -> list[AllToAllDispatcher]:
    """Keep this rank's experts in every MoE layer of ``model`` (which holds all of them, the same
    weights on every rank) and route through all-to-all. Returns the layers' dispatchers (with
    ``log``, their ``log`` records every exchange for the wire check; the trainer passes False: a
    record per exchange for a whole run would grow without bound). ValueError when E is not
    divisible by ep."""
    out = []
    for m in moe_layers(model):
        keep = ep.local_experts(m.n_experts)
        for name in ("gate", "up", "down"):
            full = getattr(m.experts, name)
            part = nn.Parameter(full[keep.start:keep.stop].clone(), requires_grad=full.requires_grad)
            part.is_expert = True  # read by sync_gradients and checkpoint gathering
            setattr(m.experts, name, part)
        m.dispatcher = AllToAllDispatcher(ep, log=log)
        out.append(m.dispatcher)
    return out


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is a sharded expert weight (set by :func:`shard_experts`)."""
    return getattr(p, "is_expert", False)


def sync_gradients(model: nn.Module, ep: EPGroup) -> None:
    """Average gradients over the world as a one-process run on the global batch (mean loss) has
    them: non-expert: all-reduce over every rank / world; expert: all-reduce over the expert-DP
    group / world."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        if is_expert(p):
            if ep.edp_group is not None:
                dist.all_reduce(p.grad, group=ep.edp_group)
        elif world > 1:
            dist.all_reduce(p.grad)
        p.grad.div_(world)


@torch.no_grad()
def reduce_expert_gradients(params: list[nn.Parameter], ep: EPGroup, divisor: int | None = None) -> None:
    """One process's gradient of the mean loss for expert slices whose ``.grad`` holds this rank's
    local sum (over its micro-batches, the combine's backward having summed the EP group's tokens):
    sum over the expert-DP group, divide by ``divisor`` - the number of data-parallel replicas of
    the loss: the world size (default) under pure data parallelism, dp under tp/pp
    (course_lib.parallel.composed.experts). One all-reduce of the slices flattened; a slice without
    a gradient counts as zeros, so every rank of the group hands over the same length. Used after
    the dense part's own synchronization by every trainer layout with experts but DeepSpeed's."""
    if not params:
        return
    divisor = dist.get_world_size() if divisor is None else divisor
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if ep.edp_group is not None:
        dist.all_reduce(flat, group=ep.edp_group)
    flat /= divisor
    for p, f in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = f.view_as(p).clone()
        else:
            p.grad.copy_(f.view_as(p))


def gather_experts(model: nn.Module, ep: EPGroup) -> dict[str, torch.Tensor]:
    """The full state dict (every expert) on every rank: the sharded stacks all-gathered over the
    EP group in expert order. A collective over the EP group."""
    state, params = {}, dict(model.named_parameters())
    for name, t in model.state_dict().items():
        param = params.get(name)
        if param is not None and is_expert(param) and ep.size > 1:
            parts = [torch.empty_like(t) for _ in range(ep.size)]
            dist.all_gather(parts, t.contiguous(), group=ep.group)
            t = torch.cat(parts)
        state[name] = t.detach().clone()
    return state
