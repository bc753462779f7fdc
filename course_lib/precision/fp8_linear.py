"""The kit's own FP8 Linear: all three GEMMs of a linear layer run on FP8 operands under a recipe.

A linear layer y = x W^T + b costs three GEMMs per step, each with two FP8 operands:

    forward      y  = x  @ W^T    input (E4M3) x weight (E4M3), contraction over in_features
    grad input   dx = dy @ W      grad_output (E5M2 or E4M3 per recipe) x weight, over out_features
    grad weight  dW = dy^T @ x    grad_output x input, contraction over the tokens

Every operand is quantized with its blocks laid along that GEMM's contraction dimension, so the
same tensor is quantized twice with different blocks (DeepSeek-V3's 1 x 128 activation tiles in
the forward become 128 x 1 for the weight gradient). Outputs accumulate in fp32. The bias and
everything outside the GEMMs stay in high precision.

Parallel layouts hold parts of these axes on other ranks: context parallelism the tokens,
tensor parallelism the ``out`` (column-parallel) or ``in`` (row-parallel) features. A scale whose
block spans a split axis takes its amax max-reduced over the ranks holding the parts
(:class:`Split`, :func:`_quantize_operand`), so every rank quantizes exactly as one process would;
:func:`fp8_linear` is the one entry point for :class:`Fp8Linear` and the tensor-parallel layers.

Where torch runs the scaled GEMM (``torch._scaled_mm``: tensorwise and rowwise scales, on CPU in
torch 2.13) it is called with the FP8 tensors and their scales; otherwise (blockwise, MX) the
operands are quantized, dequantized and multiplied in fp32 - the same rounding, *emulated*. This is
the readable path; torchao's Float8Linear (:mod:`course_lib.precision.fp8_model`) is the fast one.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

import torch.distributed as dist

from course_lib.precision.recipes import (AmaxHistory, Recipe, block_amax, dequantize, get_recipe, quantize,
                                          scale_from_amax)

ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Split:
    """One axis of a layer's GEMMs ("tokens", "in" or "out" features) held in parts by the ranks of
    ``group``. ``contiguous``: rank r holds the r-th of N equal, consecutive parts (tensor
    parallelism's feature shards), so a block's place in the whole axis is known on every rank;
    False: the parts are not consecutive (context parallelism's zig-zag token chunks)."""

    group: object
    contiguous: bool = False


# Which axis each dimension of each GEMM operand runs over (2-D, the contraction dimension last):
#   forward     x [tokens, in]  @ W [out, in]^T
#   grad input  dy [tokens, out] @ W^T [in, out]^T
#   grad weight dy^T [out, tokens] @ x^T [in, tokens]^T
FORWARD_AXES = (("tokens", "in"), ("out", "in"))
GRAD_INPUT_AXES = (("tokens", "out"), ("in", "out"))
GRAD_WEIGHT_AXES = (("out", "tokens"), ("in", "tokens"))


def _max_over(amax: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:  # max is associative: one group after the other gives the max over all
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _straddling_scale(t: torch.Tensor, dim: int, block: tuple[int, int], split: Split, groups, fmt: str,
                      scale_kind: str):
    """Scales for ``t`` (this rank's contiguous part of ``dim``) whose ``block[dim]``-long tiles of the
    *whole* axis straddle the rank boundaries: each tile's amax is max-reduced over the ranks that
    hold a piece of it, then every line along ``dim`` takes its tile's scale. Returns (block, scale)
    for :func:`quantize`: block 1 along ``dim`` and one scale per line, so the FP8 values are one
    process's, element for element."""
    lines = t if dim == 0 else t.t()
    other = (1, block[1 - dim])
    local = lines.shape[0]
    rank, n = dist.get_rank(split.group), dist.get_world_size(split.group)
    tile = (rank * local + torch.arange(local, device=t.device)) // block[dim]  # tile of the whole axis
    line_amax = block_amax(lines, other)                                        # (local lines, blocks)
    amax = torch.zeros((-(-n * local // block[dim]), line_amax.shape[1]), device=t.device)
    amax.scatter_reduce_(0, tile[:, None].expand_as(line_amax), line_amax, "amax")
    scale = scale_from_amax(_max_over(amax, groups), fmt, scale_kind=scale_kind)[tile]
    return ((1, other[1]), scale) if dim == 0 else ((other[1], 1), scale.t())


def _quantize_operand(t: torch.Tensor, role: str, recipe: Recipe, history: dict | None,
                      axes: tuple[str, str] = (None, None), splits: dict | None = None):
    """Quantize one GEMM operand (2-D, contraction along its last dimension) for ``role``.
    ``axes``: the axis each dimension runs over ("tokens", "in", "out"); ``splits``: axis ->
    :class:`Split` for the axes held in parts over ranks (None: this rank holds everything).

    Where a scale's block spans a split axis (tensorwise and delayed: every axis; rowwise: the
    contraction axis) its amax is max-reduced over that axis's group, so every rank scales with
    the amax one process sees. Blocks that fit inside a part are local. Tiles of a contiguous
    split (tensor-parallel features) that straddle two parts get their amax from the ranks
    holding their pieces (:func:`_straddling_scale`); tiles along a non-contiguous split (cp
    tokens) are local only when each part holds whole tiles (trainer.config checks it)."""
    fmt, block = recipe.fmt(role), recipe.block(role)
    splits = splits or {}
    spanning, straddling = [], None
    for dim, axis in enumerate(axes):
        split = splits.get(axis)
        if split is None:
            continue
        if block[dim] == -1:
            spanning.append(split.group)
        elif split.contiguous and t.shape[dim] % block[dim]:
            straddling = dim, split
    if straddling is not None:
        dim, split = straddling
        block, scale = _straddling_scale(t, dim, block, split, [split.group, *spanning], fmt, recipe.scale_kind)
        return quantize(t, fmt, block, scale_kind=recipe.scale_kind, scale=scale)
    scale = None
    if spanning:
        amax = _max_over(block_amax(t, block), spanning)
        if recipe.history and history is not None:  # delayed, from the global amaxes
            scale = torch.tensor(history[role].scale(fmt, float(amax.max())))
        else:
            scale = scale_from_amax(amax, fmt, scale_kind=recipe.scale_kind)
    elif recipe.history and history is not None:  # delayed: the scale comes from earlier steps
        scale = torch.tensor(history[role].scale(fmt, float(t.detach().abs().max())))
    return quantize(t, fmt, block, scale_kind=recipe.scale_kind, scale=scale)


def fp8_gemm(a: torch.Tensor, b_t: torch.Tensor, roles: tuple[str, str], recipe: Recipe,
             history: dict | None = None, *, axes=((None, None), (None, None)),
             splits: dict | None = None) -> torch.Tensor:
    """``a @ b_t.T`` in float32 with both operands through FP8. ``a``: (M, K), ``b_t``: (N, K) -
    both hold the contraction dimension K last, so every block lies along it. ``roles`` names the
    operands ("input", "weight" or "grad_output"), which picks their format and block.
    ``axes`` (one pair per operand, e.g. :data:`FORWARD_AXES`) with ``splits`` (axis ->
    :class:`Split`): which dimensions other ranks hold parts of (see :func:`_quantize_operand`;
    none by default: this rank holds both operands whole)."""
    qa = _quantize_operand(a, roles[0], recipe, history, axes[0], splits)
    qb = _quantize_operand(b_t, roles[1], recipe, history, axes[1], splits)
    whole_rows = qa.block[1] == a.shape[1] and qb.block[1] == b_t.shape[1]
    if whole_rows and qa.data.shape == a.shape and qb.data.shape == b_t.shape and a.device.type == "cpu":
        # one scale per row (or per tensor) factors out of every dot product: the FP8 GEMM itself
        return torch._scaled_mm(qa.data, qb.data.t(), scale_a=qa.scale.reshape(-1, 1) if qa.scale.numel() > 1
                                else qa.scale.reshape(()), scale_b=qb.scale.reshape(1, -1) if qb.scale.numel() > 1
                                else qb.scale.reshape(()), out_dtype=torch.float32)
    return dequantize(qa) @ dequantize(qb).t()  # emulated: same FP8 values, fp32 products and sums


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, history, out_dtype, splits):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.history, ctx.has_bias, ctx.splits = recipe, history, bias is not None, splits
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).float()
            y = fp8_gemm(x2, weight.float(), ("input", "weight"), recipe, history, axes=FORWARD_AXES,
                         splits=splits)
            if bias is not None:
                y = y + bias.float()
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe, history, splits = ctx.recipe, ctx.history, ctx.splits
        with torch.autocast(x.device.type, enabled=False):
            dy = grad_out.reshape(-1, weight.shape[0]).float()
            x2 = x.reshape(-1, x.shape[-1]).float()
            w = weight.float()
            dx = fp8_gemm(dy, w.t(), ("grad_output", "weight"), recipe, history,           # over out_features
                          axes=GRAD_INPUT_AXES, splits=splits)
            dw = fp8_gemm(dy.t(), x2.t(), ("grad_output", "input"), recipe, history,       # over the tokens
                          axes=GRAD_WEIGHT_AXES, splits=splits)
            db = dy.sum(0) if ctx.has_bias else None
        return (dx.reshape(x.shape).to(x.dtype), dw.to(weight.dtype),
                None if db is None else db.to(weight.dtype), None, None, None, None)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
               history: dict | None = None, splits: dict | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (like ``F.linear``) with the forward and both backward GEMMs in FP8
    under ``recipe``; ``history``: delayed scaling's {role: AmaxHistory}; ``splits``: axis
    ("tokens", "in", "out") -> :class:`Split` for what other ranks hold (a tensor-parallel shard
    of the weight, context-parallel chunks of the tokens). Returns the autocast dtype under
    autocast, otherwise the input's dtype. What :class:`Fp8Linear` and the tensor-parallel layers
    (course_lib.parallel.tensor_parallel.fp8_gemm) both call."""
    kind = x.device.type
    out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    return _Fp8LinearFunction.apply(x, weight, bias, recipe, history, out_dtype, splits or None)


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in FP8 under ``recipe`` (a name in
    :data:`course_lib.precision.recipes.RECIPES`). Same parameters and state_dict keys as the Linear
    it replaces, so checkpoints stay interchangeable. Under autocast it returns the autocast dtype,
    otherwise the input's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: str = "tensorwise",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = get_recipe(recipe)
        # delayed scaling: one amax history per operand, kept on the host (not in checkpoints)
        self.history = {role: AmaxHistory(self.recipe.history) for role in ROLES} if self.recipe.history else None
        # context parallelism: the ranks holding the other tokens of the same sequences (set_token_group)
        self.token_group = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "tensorwise") -> "Fp8Linear":
        """An Fp8Linear sharing ``linear``'s weight and bias Parameters (no copy)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        splits = {"tokens": Split(self.token_group)} if self.token_group is not None else None
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.history, splits)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def matches(name: str, patterns) -> bool:
    """Whether a module's qualified name is named by one of ``patterns``: the whole name, one of its
    dotted parts ("lm_head" matches "lm_head", "router" matches "blocks.0.moe.router"), or a
    shell-style pattern ("blocks.0.*")."""
    parts = name.split(".")
    return any(name == p or p in parts or fnmatch.fnmatchcase(name, p) for p in patterns)


def convert_to_fp8(model: nn.Module, recipe: str = "tensorwise", skip=("lm_head", "router")) -> dict:
    """Swap every ``nn.Linear`` of ``model`` (in place) for an :class:`Fp8Linear` running ``recipe``,
    except those named by ``skip`` (see :func:`matches`). Embeddings and norms are not Linear layers
    and stay as they are. Returns ``{"converted": [names], "kept": [names]}`` (the Linear layers
    left in high precision). Do it before an optimizer or a data-parallel wrapper is built: the
    Parameters are reused, the modules are new."""
    get_recipe(recipe)
    if isinstance(skip, str):
        raise TypeError("skip must be a list of names or patterns, e.g. ['lm_head', 'router'], not a string")
    converted, kept = [], []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear:
                continue
            if matches(full, skip):
                kept.append(full)
                continue
            setattr(module, child_name, Fp8Linear.from_linear(child, recipe))
            converted.append(full)
    return {"converted": converted, "kept": kept}


def is_fp8_layer(module: nn.Module) -> bool:
    """Whether ``module`` runs its GEMMs through :func:`fp8_linear`: an :class:`Fp8Linear`, or a
    tensor-parallel layer cut from one (it carries ``fp8_recipe``)."""
    return isinstance(module, Fp8Linear) or getattr(module, "fp8_recipe", None) is not None


def set_token_group(model: nn.Module, group) -> int:
    """Tell every FP8 layer of ``model`` (:func:`is_fp8_layer`) which ranks hold the other tokens
    of its input's sequences (context parallelism: the cp group; None: this rank holds them all).
    Scales whose blocks span the tokens then come from the amax over the group (an all-reduce with
    ``ReduceOp.MAX`` of a few floats per GEMM), so the FP8 values, and the loss, equal one
    process's. Call it on every rank of the group, in the same order. Returns how many layers
    were told."""
    layers = [m for m in model.modules() if is_fp8_layer(m)]
    for m in layers:
        m.token_group = group
    return len(layers)
