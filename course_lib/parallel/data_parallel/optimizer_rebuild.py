"""Re-create the trainer's optimizer over other parameters or around a sharding wrapper.

The trainer builds its optimizer with ``make_optimizer(model)`` (AdamW over ``model.param_groups``:
decay on matrices, none on norms and biases). Sharding strategies need *the same* optimizer with a
twist: ZeRO wraps the class in :class:`~course_lib.parallel.ShardedOptimizer`; hand-made ZeRO-3
replaces every weight by a flat 1-D shard, so the grouping must be decided on the original
shapes and then moved to the shards by name. These helpers keep the grouping and the options
identical, which is what makes the loss curves equal to one process.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` limited to what its class's constructor accepts (lr, betas, ...)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}


def groups_by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's groups with parameter *names* of ``model`` in place of the tensors
    (``"params"`` becomes a list of names; every other option is kept)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameter(s) are not parameters of the model")
        out.append({**{k: v for k, v in group.items() if k != "params"},
                    "params": [names[id(p)] for p in group["params"]]})
    return out


def groups_for(named_groups: list[dict[str, Any]], model: nn.Module) -> list[dict[str, Any]]:
    """Inverse of :func:`groups_by_name` on a (re-wrapped) ``model``: names back to its current
    parameters (after sharding, the shards registered under the same names)."""
    params = dict(model.named_parameters())
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in g["params"]]}
            for g in named_groups]
