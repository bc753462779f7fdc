"""Megatron-style tensor-parallel transformer blocks, cut out of TinyGPT's dense blocks.

Per block and micro-batch (Shoeybi et al. 2019, Fig. 3)::

    attention:  x -> f -> q, k, v (column-parallel: this rank's heads) -> causal attention on those
                heads -> out (row-parallel) -> g
    MLP:        x -> f -> up (and gate) (column) -> GELU / SiLU-gate -> down (row) -> g

so one all-reduce of the ``[B, T, C]`` activation per sub-layer forward (``g``) and one backward
(``f``): 2 + 2 per block, what ``course_lib.estimate.comm.tp_comm_bytes_per_layer`` counts. ``f`` is
applied once per sub-layer, not once per column layer (q, k, v read the same input), so the three
input gradients are added locally and cross the wire together.

Heads split evenly: rank r runs query heads ``[r*H/N, (r+1)*H/N)`` and key/value heads
``[r*Hkv/N, (r+1)*Hkv/N)``. With grouped-query attention (Hkv < H) query head h reads k/v head
``h // (H/Hkv)``; because N divides both counts, every query head of rank r finds its k/v head on
rank r, and attention needs no communication. (Megatron replicates k/v heads when N > Hkv; here
that is refused.)

``sequence_parallel=True`` (Korthikanti et al. 2022): between the sub-layers the activation is kept
split along the sequence, ``[B, T/N, C]`` per rank, so norms and residual adds run on 1/N of the
tokens; ``f`` becomes an all-gather and ``g`` a reduce-scatter (same bytes). Norm weights and
row-parallel biases then only see this rank's tokens: call :func:`sync_sequence_parallel_grads`
after backward (a trainer does it with the gradient all-reduce of data parallelism).

Dropout must be 0: dropout inside a tensor-parallel region needs a different random stream per rank
and outside it the same one on every rank (Megatron's RNG tracker), not built here.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.model.layers import MLP, Attention, Block, SwiGLU, apply_rope, sliding_window_mask
from course_lib.model.moe import MoE
from course_lib.parallel.tensor_parallel.comm_ops import copy_to_tp_region, gather_from_sequence_region
from course_lib.parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                        tp_size_and_rank)
from course_lib.validate import check_bool, check_divides


def _enter(x, group, sequence_parallel):
    """Where a replicated (or sequence-split) activation enters the tensor-parallel region."""
    return gather_from_sequence_region(x, group) if sequence_parallel else copy_to_tp_region(x, group)


def _no_dropout(module, p: float) -> None:
    if p:
        raise ValueError(f"tensor-parallel {type(module).__name__} supports dropout=0 only, got dropout={p}: "
                         "dropout inside a TP region needs a per-rank random stream (not built here)")


def _column(linear, group, sp):
    return ColumnParallelLinear.from_linear(linear, group, gather_output=False, sequence_parallel=sp,
                                            skip_input_comm=True)


def _row(linear, group, sp):
    return RowParallelLinear.from_linear(linear, group, input_is_parallel=True, sequence_parallel=sp)


class TPMLP(nn.Module):
    """The GPT-2 MLP (``up -> GELU -> down``) or Llama's SwiGLU (``down(silu(gate) * up)``), with the
    hidden width F split over the ranks: column-parallel up/gate, row-parallel down.
    Input/output ``[B, T, C]`` replicated (``[B, T/N, C]`` with sequence parallelism)."""

    def __init__(self, up, down, gate, group, sequence_parallel: bool):
        super().__init__()
        self.up, self.down, self.gate = up, down, gate
        self.group, self.sequence_parallel = group, sequence_parallel

    @classmethod
    def from_dense(cls, mlp: nn.Module, group=None, sequence_parallel: bool = False) -> "TPMLP":
        """This rank's shard of a dense ``course_lib.model.layers.MLP`` or ``SwiGLU``."""
        if not isinstance(mlp, (MLP, SwiGLU)):
            raise TypeError(f"mlp must be a course_lib.model.layers.MLP or SwiGLU, got {type(mlp).__name__}")
        check_bool("sequence_parallel", sequence_parallel)
        tp, _ = tp_size_and_rank(group, "TPMLP")
        _no_dropout(mlp, mlp.dropout)
        check_divides("tp", tp, "the MLP width ffn_dim", mlp.up.out_features)
        gate = _column(mlp.gate, group, sequence_parallel) if isinstance(mlp, SwiGLU) else None
        return cls(_column(mlp.up, group, sequence_parallel), _row(mlp.down, group, sequence_parallel),
                   gate, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter(x, self.group, self.sequence_parallel)  # f: all-reduce in backward
        if self.gate is None:
            h = F.gelu(self.up(x), approximate="tanh")  # [B, T, F/N]: elementwise, no communication
        else:
            h = F.silu(self.gate(x)) * self.up(x)
        return self.down(h)  # row-parallel: g (all-reduce) inside


class TPAttention(nn.Module):
    """Causal self-attention on this rank's heads: column-parallel q/k/v, row-parallel out.
    Input/output ``[B, T, C]`` replicated (``[B, T/N, C]`` with sequence parallelism); RoPE tables
    ``cos, sin`` are ``[T, D]`` for the whole sequence, as for the dense block. ``cp_core``: as
    the dense block's (context parallelism swaps in ring attention over these local heads)."""

    cp_core = None

    def __init__(self, q_proj, k_proj, v_proj, out_proj, head_dim: int, window, use_rope: bool,
                 group, sequence_parallel: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.head_dim, self.window, self.use_rope = head_dim, window, use_rope
        self.group, self.sequence_parallel = group, sequence_parallel
        # Set by TPTinyGPT.set_memory_strategy (selective recomputation): keep only q, k, v and
        # recompute the core in backward. The core has no collective, so nothing is re-sent.
        self.recompute_core = False

    @classmethod
    def from_dense(cls, attn: Attention, group=None, sequence_parallel: bool = False) -> "TPAttention":
        """This rank's heads of a dense ``course_lib.model.layers.Attention``."""
        if not isinstance(attn, Attention):
            raise TypeError(f"attn must be a course_lib.model.layers.Attention, got {type(attn).__name__}")
        check_bool("sequence_parallel", sequence_parallel)
        tp, _ = tp_size_and_rank(group, "TPAttention")
        _no_dropout(attn, attn.dropout)
        check_divides("tp", tp, "n_heads", attn.n_heads)
        check_divides("tp", tp, "n_kv_heads", attn.n_kv_heads)  # each rank needs its own k/v heads
        sp = sequence_parallel
        return cls(_column(attn.q_proj, group, sp), _column(attn.k_proj, group, sp),
                   _column(attn.v_proj, group, sp), _row(attn.out_proj, group, sp),
                   attn.head_dim, attn.window, attn.use_rope, group, sp)

    def core(self, q, k, v, cos, sin):
        """softmax(q k^T / sqrt(D) + causal mask) v on local heads: q [B, H/N, T, D], k/v [B, Hkv/N,
        T, D]. The same math as the dense ``Attention.core``; heads never interact, so no traffic."""
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]
        if group > 1:  # local query head j reads local k/v head j // group, as in the dense block
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = sliding_window_mask(q.shape[-2], self.window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        x = _enter(x, self.group, self.sequence_parallel)  # f (or all-gather of the sequence)
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, H/N, T, D]
        k = self.k_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, Hkv/N, T, D]
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        core = self.core if self.cp_core is None else self.cp_core  # cp: ring attention on local heads
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(core, q, k, v, cos, sin, use_reentrant=False)
        else:
            y = core(q, k, v, cos, sin)
        y = y.transpose(1, 2).reshape(B, T, -1)  # [B, T, C/N]
        return self.out_proj(y)  # row-parallel: g (or reduce-scatter) inside


def mark_sequence_parallel(module: nn.Module, on: bool) -> None:
    """Tag a replicated module's parameters: under SP their gradients cover this rank's tokens only."""
    for p in module.parameters():
        p.sequence_parallel = on


class TPBlock(nn.Module):
    """Pre-norm block ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``: norms replicated, attention
    and MLP tensor-parallel (an MoE MLP, under sequence parallelism only, is copied whole and
    routes this rank's tokens: expert_parallel.sequence_split).
    ``forward(x, cos=None, sin=None)``, x ``[B, T, C]`` (``[B, T/N, C]``,
    this rank's tokens, with sequence parallelism)."""

    def __init__(self, norm1, attn, norm2, mlp):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    @classmethod
    def from_dense(cls, block: Block, group=None, sequence_parallel: bool = False) -> "TPBlock":
        """This rank's shard of a dense ``course_lib.model.layers.Block`` (norms copied)."""
        if not isinstance(block, Block):
            raise TypeError(f"block must be a course_lib.model.layers.Block, got {type(block).__name__}")
        norm1, norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        for norm in (norm1, norm2):  # under SP a norm sees only this rank's tokens
            mark_sequence_parallel(norm, sequence_parallel)
        return cls(norm1, TPAttention.from_dense(block.attn, group, sequence_parallel), norm2,
                   _mlp(block.mlp, group, sequence_parallel))

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def _mlp(mlp: nn.Module, group, sequence_parallel: bool) -> nn.Module:
    """The block's MLP under TP: a dense MLP split by columns/rows (:class:`TPMLP`); an MoE layer
    copied whole, routing this rank's tokens (expert-tensor-parallel size 1: only under sequence
    parallelism, where each rank holds its own tokens; see expert_parallel.sequence_split)."""
    if not isinstance(mlp, MoE):
        return TPMLP.from_dense(mlp, group, sequence_parallel)
    if not sequence_parallel:
        raise ValueError("an MoE layer under tensor parallelism needs sequence_parallel=True: each rank then routes "
                         "its own slice of the tokens (experts are not tensor-sharded; without sequence "
                         "parallelism every rank would route the same tokens)")
    from course_lib.parallel.expert_parallel.sequence_split import split_moe_over_sequence

    moe = copy.deepcopy(mlp)
    split_moe_over_sequence(moe, group)
    return moe


@torch.no_grad()
def sync_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """Sum over ``group`` the gradients of parameters marked ``sequence_parallel`` (replicated, but
    each rank saw only its own tokens: norms, row-parallel biases, position embeddings), so every
    rank holds the full gradient. Call after backward, before the optimizer step. One all-reduce
    per such parameter (a real trainer would flatten them into one); returns how many were synced."""
    partial = [p for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    for p in partial:
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
    return len(partial)
