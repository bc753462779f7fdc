"""Tensor-parallel layers: column- and row-parallel Linear, a vocab-parallel embedding and loss.

A Linear ``y = x W^T + b`` with ``W`` of shape ``[out, in]`` splits two ways over N ranks:

* **column-parallel** (:class:`ColumnParallelLinear`): rank r keeps rows ``r*out/N ... `` of W (and
  of b), i.e. ``out/N`` output channels; it needs the whole input and produces a slice of the
  output. The input enters through ``f`` (:func:`.copy_to_tp_region`, all-reduce in backward).
* **row-parallel** (:class:`RowParallelLinear`): rank r keeps columns ``r*in/N ...`` of W, i.e.
  reads ``in/N`` input channels and produces a *partial sum* of the whole output; ``g``
  (:func:`.reduce_from_tp_region`) adds the partial sums. The bias is replicated and added once,
  after the sum.

Column then row (an MLP, attention's q/k/v then out) needs no communication in between: the
column layer's output slice is exactly the row layer's input slice.

The vocabulary splits like a column-parallel layer: :class:`VocabParallelEmbedding` keeps
``vocab/N`` rows of the table (a token owned elsewhere looks up zeros, then ``g`` sums), and
:func:`.cross_entropy.vocab_parallel_cross_entropy` computes the loss from the ``[..., vocab/N]``
logit slices without ever assembling the full ``[..., vocab]`` logits.

Every layer has a ``from_*`` classmethod that cuts this rank's shard out of a dense layer, so a test
can compare with the dense layer; sharded parameters carry ``tp_partition_dim`` (0 or 1: the dim of
the dense tensor they were cut along), replicated ones do not. Parameters whose gradient covers only
this rank's tokens under sequence parallelism carry ``sequence_parallel = True``
(see :func:`course_lib.parallel.tensor_parallel.blocks.sync_sequence_parallel_grads`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.data_parallel.naive_ddp import require_group
from course_lib.parallel.tensor_parallel.comm_ops import (copy_to_tp_region, gather_from_sequence_region,
                                                          gather_from_tp_region, reduce_from_tp_region,
                                                          reduce_scatter_to_sequence_region,
                                                          scatter_to_tp_region)
from course_lib.parallel.tensor_parallel.fp8_gemm import ShardGemm
from course_lib.validate import check_bool, check_divides, check_int


def tp_size_and_rank(group, who: str) -> tuple[int, int]:
    """(N, this rank's index in ``group``); RuntimeError naming ``who`` without a process group."""
    require_group(group, who)
    return dist.get_world_size(group), dist.get_rank(group)


def _shard_param(full: torch.Tensor, dim: int, tp: int, rank: int) -> nn.Parameter:
    p = nn.Parameter(full.detach().chunk(tp, dim=dim)[rank].clone(memory_format=torch.contiguous_format))
    p.tp_partition_dim = dim
    return p


def _uniform_(t: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), with the *dense* fan_in: a
    row shard only sees in/N inputs, but the layer it is part of sees all of them."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        t.uniform_(-bound, bound)


class ColumnParallelLinear(ShardGemm, nn.Module):
    """``y = x W^T + b`` with W's output channels split over the ranks of ``group``.

    Input ``[..., in_features]`` (replicated; with ``sequence_parallel`` this rank's tokens
    ``[B, T/N, in]``). Output ``[..., out_features / N]``, this rank's channels, or all
    ``out_features`` when ``gather_output=True`` (default: a lone layer then equals ``nn.Linear``).

    ``skip_input_comm=True``: the caller already applied ``f`` (or the sequence all-gather) once for
    several column layers reading the same input (attention's q, k, v; SwiGLU's gate and up), so
    their input gradients add up locally and cross the wire in *one* all-reduce, not one per layer.
    Initialised like ``nn.Linear`` (fan_in = in_features); use :meth:`from_linear` to match a dense one
    (cut from the kit's Fp8Linear, its GEMMs run in FP8: :mod:`.fp8_gemm`).
    """

    split_axis = "out"  # FP8: the axis whose scales are reduced over the group (fp8_gemm)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 gather_output: bool = True, sequence_parallel: bool = False,
                 skip_input_comm: bool = False, device=None, dtype=None):
        super().__init__()
        check_int("in_features", in_features, 1)
        check_int("out_features", out_features, 1)
        for name, value in (("bias", bias), ("gather_output", gather_output),
                            ("sequence_parallel", sequence_parallel), ("skip_input_comm", skip_input_comm)):
            check_bool(name, value)
        tp, self.rank = tp_size_and_rank(group, "ColumnParallelLinear")
        check_divides("tp", tp, "out_features", out_features)
        self.group, self.tp = group, tp
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.skip_input_comm = skip_input_comm
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **kw))
        self.weight.tp_partition_dim = 0
        _uniform_(self.weight, in_features)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // tp, **kw))
            self.bias.tp_partition_dim = 0
            _uniform_(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **flags) -> "ColumnParallelLinear":
        """This rank's output channels of a dense ``nn.Linear`` (weight rows, bias entries); an
        Fp8Linear's recipe comes along (:meth:`.ShardGemm.take_fp8_from`)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **flags)
        layer.weight = _shard_param(linear.weight, 0, layer.tp, layer.rank)
        if linear.bias is not None:
            layer.bias = _shard_param(linear.bias, 0, layer.tp, layer.rank)
        layer.take_fp8_from(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.skip_input_comm:
            x = (gather_from_sequence_region(x, self.group) if self.sequence_parallel
                 else copy_to_tp_region(x, self.group))
        y = self.gemm(x, self.weight, self.bias)  # [..., out/N]: no communication needed
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), tp={self.tp}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(ShardGemm, nn.Module):
    """``y = x W^T + b`` with W's input channels split over the ranks of ``group``.

    Input ``[..., in_features / N]`` (this rank's channels, ``input_is_parallel=True``: what a
    column-parallel layer hands over) or ``[..., in_features]`` (default; this rank keeps its slice,
    so a lone layer equals ``nn.Linear``). Output ``[..., out_features]``, the all-reduced sum of the
    partial products, replicated; with ``sequence_parallel`` reduce-scattered to this rank's tokens
    ``[B, T/N, out]`` instead. The bias is replicated and added after the reduction, once. Cut from
    the kit's Fp8Linear (:meth:`from_linear`), its GEMMs run in FP8 (:mod:`.fp8_gemm`).
    """

    split_axis = "in"  # FP8: the axis whose scales are reduced over the group (fp8_gemm)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_is_parallel: bool = False, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        check_int("in_features", in_features, 1)
        check_int("out_features", out_features, 1)
        for name, value in (("bias", bias), ("input_is_parallel", input_is_parallel),
                            ("sequence_parallel", sequence_parallel)):
            check_bool(name, value)
        tp, self.rank = tp_size_and_rank(group, "RowParallelLinear")
        check_divides("tp", tp, "in_features", in_features)
        self.group, self.tp = group, tp
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **kw))
        self.weight.tp_partition_dim = 1
        _uniform_(self.weight, in_features)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw))
            _uniform_(self.bias, in_features)
            self.bias.sequence_parallel = sequence_parallel  # added to this rank's tokens only

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **flags) -> "RowParallelLinear":
        """This rank's input channels of a dense ``nn.Linear`` (weight columns; the whole bias)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **flags)
        layer.weight = _shard_param(linear.weight, 1, layer.tp, layer.rank)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        layer.take_fp8_from(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        partial = self.gemm(x, self.weight, None)  # this rank's share of the sum over input channels
        y = (reduce_scatter_to_sequence_region(partial, self.group) if self.sequence_parallel
             else reduce_from_tp_region(partial, self.group))
        return y if self.bias is None else y + self.bias  # after the sum: added once, not N times

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, tp={self.tp}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Token table ``[num_embeddings, embedding_dim]`` split by rows: rank r owns token ids
    ``[r*V/N, (r+1)*V/N)``. Input: int ids ``[B, T]`` (the same on every rank). Each rank looks up
    the ids it owns and writes zeros for the others; ``g`` sums, so every rank gets the full
    ``[B, T, C]`` output (with ``sequence_parallel``: a reduce-scatter, this rank's ``[B, T/N, C]``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        check_int("num_embeddings", num_embeddings, 1)
        check_int("embedding_dim", embedding_dim, 1)
        check_bool("sequence_parallel", sequence_parallel)
        tp, self.rank = tp_size_and_rank(group, "VocabParallelEmbedding")
        # Megatron pads the vocabulary to a multiple of tp; here it must divide (say so clearly).
        check_divides("tp", tp, "num_embeddings (the vocabulary size)", num_embeddings)
        self.group, self.tp, self.sequence_parallel = group, tp, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = num_embeddings // tp
        self.vocab_start, self.vocab_end = self.rank * per, (self.rank + 1) * per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, device=device, dtype=dtype))
        self.weight.tp_partition_dim = 0
        nn.init.normal_(self.weight)  # nn.Embedding's default, N(0, 1)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, **flags) -> "VocabParallelEmbedding":
        """This rank's rows of a dense ``nn.Embedding`` (plain lookups only)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"embedding must be a torch.nn.Embedding, got {type(embedding).__name__}")
        for name in ("padding_idx", "max_norm"):
            if getattr(embedding, name) is not None:
                raise ValueError(f"VocabParallelEmbedding supports no {name} (got "
                                 f"{getattr(embedding, name)}); build the embedding without it")
        if embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports no sparse=True gradients")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group,
                    device=embedding.weight.device, dtype=embedding.weight.dtype, **flags)
        layer.weight = _shard_param(embedding.weight, 0, layer.tp, layer.rank)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        elsewhere = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(elsewhere, 0)  # any valid row; zeroed below
        out = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group)
        return reduce_from_tp_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.tp}, sequence_parallel={self.sequence_parallel}")
