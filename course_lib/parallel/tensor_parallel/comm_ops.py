"""The communication of tensor parallelism, as autograd functions that come in conjugate pairs.

Megatron-LM (Shoeybi et al. 2019, Sec. 3) needs only two operators for a transformer layer:

* ``f`` = :func:`copy_to_tp_region`: identity in forward, all-reduce (sum) in backward. It sits
  where a replicated activation enters column-parallel layers: every rank reads the whole input,
  so the input's gradient is the *sum* of the partial gradients each rank's weight shard produced.
* ``g`` = :func:`reduce_from_tp_region`: all-reduce (sum) in forward, identity in backward. It sits
  after a row-parallel layer, whose ranks each hold a partial sum of the output.

Each is the other's transpose, so a layer ``g(row(act(col(f(x)))))`` costs one all-reduce forward
and one backward. Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) keeps the replicated
regions (norms, dropout, residual) split along the sequence instead, and swaps each all-reduce for
an all-gather + reduce-scatter pair of the same volume:

* :func:`gather_from_sequence_region`: all-gather along the sequence forward, reduce-scatter
  backward (replaces ``f``);
* :func:`reduce_scatter_to_sequence_region`: reduce-scatter forward, all-gather backward
  (replaces ``g``);
* :func:`scatter_to_sequence_region`: keep this rank's slice forward (no communication),
  all-gather backward: how a replicated tensor (an embedding output) enters the sequence region.

Two more, for a lone layer whose caller wants the full width (Megatron's ``gather_output`` and
``input_is_parallel=False``): :func:`gather_from_tp_region` (all-gather the last dim forward, keep
this rank's slice backward) and :func:`scatter_to_tp_region` (the transpose).

Every function takes ``group`` (``None`` = the default group of all ranks); "rank" below is the
rank *within* that group. Shapes: activations are batch-first ``[B, T, C]`` as in
:mod:`course_lib.model`, so the sequence dim defaults to 1 (Megatron is sequence-first and uses
dim 0, which makes its gathers contiguous; here a gathered tensor is re-assembled with one copy).
Collectives go through ``dist.<name>`` looked up at call time, so
:func:`course_lib.parallel.wire.count_collectives` sees them; gloo supports
``all_gather_single`` and ``reduce_scatter_single`` (torch 2.13 deprecates their old names,
``all_gather_into_tensor`` and ``reduce_scatter_tensor``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.validate import check_int


def _size(group) -> int:
    return dist.get_world_size(group)


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_split(x: torch.Tensor, dim: int, n: int, what: str) -> int:
    """The normalised dim, after checking that ``x.shape[dim]`` splits into n equal parts."""
    check_int("dim", dim, -x.dim(), x.dim() - 1)
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"{what} ({x.shape[dim]}, dim {dim} of shape {tuple(x.shape)}) must be "
                         f"divisible by the tensor-parallel size tp ({n})")
    return dim


# ---- the four primitives (no autograd): each returns a new tensor, the input is never written
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()  # all_reduce works in place; the input may be needed elsewhere
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/N slice of x along dim (a copy, so it owns its memory)."""
    return x.chunk(_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order."""
    n = _size(group)
    flat = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(flat, x.contiguous(), group=group)  # rank slices stacked on dim 0
    return flat if dim == 0 else torch.cat(flat.chunk(n, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum x over ranks and keep this rank's 1/N slice along dim."""
    n = _size(group)
    parts = x.chunk(n, dim=dim)
    stacked = torch.cat(parts, dim=0)  # slice r of dim becomes block r of dim 0, as the ring wants
    out = torch.empty_like(parts[0], memory_format=torch.contiguous_format)
    dist.reduce_scatter_single(out, stacked, op=dist.ReduceOp.SUM, group=group)
    return out


# ---- autograd functions ---------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather along dim forward; backward keeps this rank's slice of the gradient, or, when
    ``grad_is_partial`` (the gathered tensor feeds column-parallel layers, so each rank's gradient
    is a partial sum), reduce-scatters it."""

    @staticmethod
    def forward(ctx, x, dim, group, grad_is_partial):
        ctx.dim, ctx.group, ctx.partial = dim, group, grad_is_partial
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _Split(torch.autograd.Function):
    """Keep this rank's slice along dim forward (no communication); all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


# ---- public operators -------------------------------------------------------------------------
def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``f``: returns x unchanged; in backward all-reduces (sums) x's gradient over
    ``group``. Put it where a replicated activation enters column-parallel layers."""
    _check_tensor("x", x)
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``g``: returns the sum of every rank's x (all-reduce); the gradient passes
    through unchanged. Put it after a row-parallel layer (each rank holds a partial sum)."""
    _check_tensor("x", x)
    return _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the last dim (each rank holds C/N channels -> all C); backward keeps this rank's
    channels of the gradient, no communication. Column-parallel ``gather_output=True``."""
    _check_tensor("x", x)
    return _Gather.apply(x, x.dim() - 1, group, False)


def scatter_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's 1/N of the last dim (no communication); backward all-gathers the gradient.
    Row-parallel ``input_is_parallel=False``."""
    _check_tensor("x", x)
    dim = _check_split(x, -1, _size(group), "the last dimension")
    return _Split.apply(x, dim, group)


def gather_from_sequence_region(x: torch.Tensor, group=None, seq_dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's replacement for ``f``: [B, T/N, C] -> [B, T, C] by an all-gather along
    ``seq_dim``; backward reduce-scatters the gradient (sum over ranks, keep this rank's tokens)."""
    _check_tensor("x", x)
    check_int("seq_dim", seq_dim, -x.dim(), x.dim() - 1)
    return _Gather.apply(x, seq_dim % x.dim(), group, True)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group=None, seq_dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's replacement for ``g``: partial sums [B, T, C] -> this rank's tokens of
    the total, [B, T/N, C] (reduce-scatter along ``seq_dim``); backward all-gathers the gradient."""
    _check_tensor("x", x)
    dim = _check_split(x, seq_dim, _size(group), "sequence length")
    return _ReduceScatter.apply(x, dim, group)


def scatter_to_sequence_region(x: torch.Tensor, group=None, seq_dim: int = 1) -> torch.Tensor:
    """Replicated [B, T, C] -> this rank's tokens [B, T/N, C], no communication (every rank already
    has the whole tensor); backward all-gathers the gradient so every rank gets all of it."""
    _check_tensor("x", x)
    dim = _check_split(x, seq_dim, _size(group), "sequence length")
    return _Split.apply(x, dim, group)
