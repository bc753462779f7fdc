"""The kit's own FP8 Linear: all three GEMMs of a linear layer run on FP8 operands under a recipe.

A linear layer y = x W^T + b costs three GEMMs per step, each with two FP8 operands:

    forward      y  = x  @ W^T    input (E4M3) x weight (E4M3), contraction over in_features
    grad input   dx = dy @ W      grad_output (E5M2 or E4M3 per recipe) x weight, over out_features
    grad weight  dW = dy^T @ x    grad_output x input, contraction over the tokens

Every operand is quantized with its blocks laid along that GEMM's contraction dimension, so the
same tensor is quantized twice with different blocks (DeepSeek-V3's 1 x 128 activation tiles in
the forward become 128 x 1 for the weight gradient). Outputs accumulate in fp32. The bias and
everything outside the GEMMs stay in high precision.

Where torch runs the scaled GEMM (``torch._scaled_mm``: tensorwise and rowwise scales, on CPU in
torch 2.13) it is called with the FP8 tensors and their scales; otherwise (blockwise, MX) the
operands are quantized, dequantized and multiplied in fp32 - the same rounding, *emulated*. This is
the readable path; torchao's Float8Linear (:mod:`course_lib.precision.fp8_model`) is the fast one.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

import torch.distributed as dist

from course_lib.precision.recipes import (AmaxHistory, Recipe, block_amax, dequantize, get_recipe, quantize,
                                          scale_from_amax)

ROLES = ("input", "weight", "grad_output")


def _quantize_operand(t: torch.Tensor, role: str, recipe: Recipe, history: dict | None,
                      token_dim: int | None = None, token_group=None):
    """Quantize one GEMM operand (2-D, contraction along its last dimension) for ``role``.
    ``token_dim``: which of its dimensions runs over the tokens (None: none does, a weight);
    ``token_group``: the ranks holding the other tokens of the same sequences (context
    parallelism). Where a scale's block spans the whole token dimension (tensorwise, delayed, and
    rowwise along the tokens of the weight-gradient GEMM) its amax is max-reduced over that group,
    so every rank scales with the amax one process would see; blocks of one token are local, and
    tiles of several tokens are local when the layout keeps them whole (trainer.config checks)."""
    fmt, block = recipe.fmt(role), recipe.block(role)
    scale = None
    if token_group is not None and token_dim is not None and block[token_dim] == -1:
        amax = block_amax(t, block)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=token_group)
        if recipe.history and history is not None:  # delayed, from the global amaxes
            scale = torch.tensor(history[role].scale(fmt, float(amax.max())))
        else:
            scale = scale_from_amax(amax, fmt, scale_kind=recipe.scale_kind)
    elif recipe.history and history is not None:  # delayed: the scale comes from earlier steps
        scale = torch.tensor(history[role].scale(fmt, float(t.detach().abs().max())))
    return quantize(t, fmt, block, scale_kind=recipe.scale_kind, scale=scale)


def fp8_gemm(a: torch.Tensor, b_t: torch.Tensor, roles: tuple[str, str], recipe: Recipe,
             history: dict | None = None, *, token_dims: tuple[int | None, int | None] = (None, None),
             token_group=None) -> torch.Tensor:
    """``a @ b_t.T`` in float32 with both operands through FP8. ``a``: (M, K), ``b_t``: (N, K) -
    both hold the contraction dimension K last, so every block lies along it. ``roles`` names the
    operands ("input", "weight" or "grad_output"), which picks their format and block.
    ``token_dims``: the dimension of each operand that runs over the tokens (None: none), read
    with ``token_group`` (context parallelism: see :func:`_quantize_operand`)."""
    qa = _quantize_operand(a, roles[0], recipe, history, token_dims[0], token_group)
    qb = _quantize_operand(b_t, roles[1], recipe, history, token_dims[1], token_group)
    whole_rows = qa.block[1] == a.shape[1] and qb.block[1] == b_t.shape[1]
    if whole_rows and qa.data.shape == a.shape and qb.data.shape == b_t.shape and a.device.type == "cpu":
        # one scale per row (or per tensor) factors out of every dot product: the FP8 GEMM itself
        return torch._scaled_mm(qa.data, qb.data.t(), scale_a=qa.scale.reshape(-1, 1) if qa.scale.numel() > 1
                                else qa.scale.reshape(()), scale_b=qb.scale.reshape(1, -1) if qb.scale.numel() > 1
                                else qb.scale.reshape(()), out_dtype=torch.float32)
    return dequantize(qa) @ dequantize(qb).t()  # emulated: same FP8 values, fp32 products and sums


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, history, out_dtype, token_group):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.history, ctx.has_bias = recipe, history, bias is not None
        ctx.token_group = token_group
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).float()
            y = fp8_gemm(x2, weight.float(), ("input", "weight"), recipe, history, token_dims=(0, None),
                         token_group=token_group)
            if bias is not None:
                y = y + bias.float()
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe, history, group = ctx.recipe, ctx.history, ctx.token_group
        with torch.autocast(x.device.type, enabled=False):
            dy = grad_out.reshape(-1, weight.shape[0]).float()
            x2 = x.reshape(-1, x.shape[-1]).float()
            w = weight.float()
            dx = fp8_gemm(dy, w.t(), ("grad_output", "weight"), recipe, history,           # over out_features
                          token_dims=(0, None), token_group=group)
            dw = fp8_gemm(dy.t(), x2.t(), ("grad_output", "input"), recipe, history,       # over the tokens
                          token_dims=(1, 1), token_group=group)
            db = dy.sum(0) if ctx.has_bias else None
        return (dx.reshape(x.shape).to(x.dtype), dw.to(weight.dtype),
                None if db is None else db.to(weight.dtype), None, None, None, None)


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
        kind = x.device.type
        out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self.recipe, self.history, out_dtype,
                                        self.token_group)

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


def set_token_group(model: nn.Module, group) -> int:
    """Tell every :class:`Fp8Linear` of ``model`` which ranks hold the other tokens of its input's
    sequences (context parallelism: the cp group; None: this rank holds them all). Scales whose
    blocks span the tokens then come from the amax over the group (an all-reduce with
    ``ReduceOp.MAX`` of a few floats per GEMM), so the FP8 values, and the loss, equal one
    process's. Call it on every rank of the group, in the same order. Returns how many layers
    were told."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.token_group = group
    return len(layers)
