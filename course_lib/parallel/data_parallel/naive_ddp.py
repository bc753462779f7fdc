"""Data parallelism from scratch, the simplest correct form: one all-reduce per gradient, at the end.

Every rank holds a full replica and runs forward/backward on its own slice of the global batch.
If the replicas start equal (rank 0's parameters and buffers are broadcast at construction) and
every rank applies the *same* gradient (the mean over ranks) with the same optimizer, they stay
equal forever, and the update equals the one a single process would make on the whole global
batch (up to float rounding: the sum over ranks adds in another order).

Why "naive": communication waits until backward has finished, then sends one message per
parameter. Small messages are latency-bound and nothing overlaps compute; :mod:`.bucketed_ddp`
fixes both. This version is the reference the faster one must agree with.

Usage::

    model = NaiveDDP(model)
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()   # after backward, before optimizer.step()
    optimizer.step()
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def require_group(process_group, who: str):
    """The process group to use (``None`` = the default one); RuntimeError when none exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who} needs a process group: start the script with torchrun and call "
                           "course_lib.parallel.init_distributed(), or start ranks with "
                           "course_lib.parallel.run_ranks")
    return process_group


def broadcast_from_first_rank(module: nn.Module, process_group, skip=()) -> None:
    """Copy the first rank's parameters (frozen ones too) and buffers into every rank's module,
    so all replicas start bit-identical whatever seed each rank used. ``skip``: parameters that
    are not replicas (expert slices, different on every EP rank), left as they are."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    skipped = {id(p) for p in skip}
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):  # each tied tensor once
            if id(t) not in skipped:
                dist.broadcast(t.data, src=src, group=process_group)


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that get gradients, each Parameter object once (tied weights counted once:
    ``Module.parameters()`` already de-duplicates by identity), in registration order."""
    return [p for p in module.parameters() if p.requires_grad]


class NaiveDDP(nn.Module):
    """Wrap ``module``; after ``backward()`` call :meth:`finish_gradient_synchronization`.

    ``process_group``: the ranks that replicate the model (``None``: all ranks).

    A parameter whose ``.grad`` is ``None`` on a rank (not used in this rank's forward) counts as
    a zero gradient there, so every rank issues exactly the same collectives in the same order
    (a rank that skipped one would pair its next all-reduce with another rank's previous one, or
    hang). To tell "unused everywhere" from "used somewhere", one small all-reduce of per-parameter
    flags goes first: a parameter unused on *every* rank keeps ``.grad = None`` (so the optimizer
    skips it, exactly as in a single process); one used on some rank gets the rank-mean, with the
    missing ranks contributing zeros.
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.process_group = require_group(process_group, "NaiveDDP")
        self.module = module
        self.world_size = dist.get_world_size(process_group)
        broadcast_from_first_rank(module, process_group)
        self._params = trainable_params(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """All-reduce every gradient (sum), then divide by the world size: ``.grad`` becomes the
        mean over ranks, identical on every rank. Call after ``backward()``, before the step."""
        if not self._params:
            return
        pg = self.process_group
        has_grad = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32,
                                device=self._params[0].device)  # nccl reduces device tensors only
        dist.all_reduce(has_grad, group=pg)  # how many ranks have each gradient
        for p, n in zip(self._params, has_grad.tolist()):
            if n == 0:
                continue  # unused on every rank: every rank skips it, so sequences still agree
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=pg)
            p.grad.div_(self.world_size)
