"""``torch.distributed.all_to_all_single`` with variable split sizes, differentiable, and logged.

Forward sends ``send_splits[q]`` rows to rank q and receives ``recv_splits[q]`` rows from it;
backward is the same exchange with the splits swapped (the gradient of a row goes back to where
the row came from). Every exchange, forward and backward, appends to the caller's ``log`` what was
actually handed to the collective, so the bytes on the wire can be checked against a formula.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, log: list | None,
             what: str) -> torch.Tensor:
    """One all-to-all of the rows of ``x`` [sum(send_splits), ...]; returns [sum(recv_splits), ...].
    ``log`` (a list or None) gets ``{"what", "send_rows", "recv_rows", "row_bytes"}``."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    if log is not None:
        log.append({"what": what, "send_rows": list(send_splits), "recv_rows": list(recv_splits),
                    "row_bytes": math.prod(x.shape[1:]) * x.element_size()})  # an empty x still has rows' width
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable :func:`exchange` (rows out, gradients back the same way)."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, log, what):
        ctx.splits, ctx.group, ctx.log, ctx.what = (send_splits, recv_splits), group, log, what
        return exchange(x, send_splits, recv_splits, group, log, what)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return exchange(grad, recv, send, ctx.group, ctx.log, ctx.what + " backward"), None, None, None, None, None
