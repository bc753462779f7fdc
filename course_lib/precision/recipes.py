"""FP8 scaling recipes: how a tensor is cut into blocks, one scale per block, before the cast.

FP8 holds 448 (E4M3) or 57344 (E5M2) at most and loses values below ~2^-9 / 2^-16, so a tensor is
first divided by a *scale* that maps its largest magnitude (its amax) onto the format's max. The
recipes differ in how many values share one scale - the fewer, the less one outlier costs the rest:

    tensorwise  one scale per tensor, from this step's amax ("current" scaling)
    delayed     one scale per tensor, from the max of the last N steps' amaxes (an amax history);
                the scale is ready before the tensor is, but a tensor that outgrows its history
                saturates until the history catches up
    rowwise     one scale per row along the GEMM's contraction dimension
    blockwise   DeepSeek-V3: 1 x 128 tiles for activations and gradients, 128 x 128 blocks for
                weights, every tensor E4M3
    mxfp8       OCP Microscaling: 32 consecutive values share a power-of-two scale stored as E8M0,
                scale = 2^(floor(log2(amax)) - emax_elem); values past 448 after it saturate

Convention: ``x ~ dequantize(quantize(x))`` where ``q = fp8(x / scale)`` and ``x ~ q * scale``
(the scale is the *dequantization* multiplier, as ``torch._scaled_mm``'s scale_a/scale_b are).
A block of ``-1`` spans the whole dimension: tensorwise is ``(-1, -1)``, rowwise ``(1, -1)``.
A dimension that is not a multiple of its block gets a last, shorter block (zero padding inside,
never seen outside).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.precision.fp8 import emax, fp8_max, to_fp8
from course_lib.validate import check_choice, check_int

SCALE_KINDS = ("float", "e8m0")


@dataclass
class Quantized:
    """An FP8 tensor with its scales. ``data``: FP8, the padded 2-D shape; ``scale``: float32, one per
    block, shape (row blocks, column blocks); ``block``: the block actually used (rows, cols);
    ``shape``: the original 2-D shape; ``fmt``: "e4m3" or "e5m2"; ``scale_kind``: "float" or "e8m0"."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    shape: tuple[int, int]
    fmt: str
    scale_kind: str = "float"

    @property
    def nbytes(self) -> int:
        """Bytes this tensor costs in FP8: one per value plus its scales (an E8M0 scale is one
        byte, a float32 scale four)."""
        return self.data.numel() + self.scale.numel() * (1 if self.scale_kind == "e8m0" else 4)


def _block_of(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return tuple(dim if b == -1 else b for dim, b in zip(shape, block))


def _tiles(x: torch.Tensor, block: tuple[int, int]):
    rows, cols = x.shape
    br, bc = _block_of((rows, cols), block)
    nr, nc = -(-rows // br), -(-cols // bc)
    xf = x.detach().float()
    if (nr * br, nc * bc) != (rows, cols):  # zeros do not change a block's amax
        xf = torch.nn.functional.pad(xf, (0, nc * bc - cols, 0, nr * br - rows))
    return br, bc, nr, nc, xf.reshape(nr, br, nc, bc)


def block_amax(x: torch.Tensor, block: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """Largest magnitude of each ``block`` of a 2-D tensor (same units as ``x``): float32, shape
    (row blocks, column blocks), the amax :func:`quantize` derives its scales from. A layout that
    splits a block over ranks max-reduces these over the ranks first (an all-reduce with
    ``ReduceOp.MAX``), so every rank scales with the whole block's amax, as one process would."""
    if x.dim() != 2:
        raise ValueError(f"block_amax takes a 2-D tensor, got shape {tuple(x.shape)}")
    return _tiles(x, block)[4].abs().amax(dim=(1, 3))


def scale_from_amax(amax: torch.Tensor, fmt: str = "e4m3", *, scale_kind: str = "float") -> torch.Tensor:
    """The dequantization scale of blocks whose largest magnitude is ``amax`` (float32, any shape):
    ``amax / fp8_max(fmt)`` for ``scale_kind="float"`` (the amax lands on the format's max),
    ``2^(floor(log2(amax)) - emax(fmt))`` for ``"e8m0"`` (a power of two, OCP MX); 1 where amax is 0."""
    check_choice("scale_kind", scale_kind, SCALE_KINDS)
    amax = amax.float()
    if scale_kind == "float":
        return torch.where(amax > 0, amax / fp8_max(fmt), torch.ones_like(amax))
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - emax(fmt)
    return torch.where(amax > 0, torch.exp2(exponent.clamp(-127, 127)), torch.ones_like(amax))


def quantize(x: torch.Tensor, fmt: str = "e4m3", block: tuple[int, int] = (-1, -1), *,
             scale_kind: str = "float", scale: torch.Tensor | None = None) -> Quantized:
    """Quantize a 2-D tensor to FP8 with one scale per ``block`` (rows, cols; -1 = whole dimension).

    ``scale_kind="float"``: scale = amax / fmt max (the block's largest magnitude lands on max).
    ``"e8m0"``: scale = 2^(floor(log2(amax)) - emax(fmt)), a power of two (OCP MX); values that
    land past max after it are clamped. ``scale``: use this one instead (delayed scaling passes the
    scale its history chose; shape (row blocks, col blocks) or a single value). Values past +-max
    after scaling saturate; an all-zero block gets scale 1."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor (flatten the leading dimensions first), got shape {tuple(x.shape)}")
    check_choice("scale_kind", scale_kind, SCALE_KINDS)
    for b in block:
        if b != -1:
            check_int("block", b, 1)
    br, bc, nr, nc, tiles = _tiles(x, block)
    if scale is None:
        scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), fmt, scale_kind=scale_kind)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).expand(nr, nc)
    data = to_fp8(tiles / scale[:, None, :, None], fmt).reshape(nr * br, nc * bc)
    return Quantized(data, scale.contiguous(), (br, bc), tuple(x.shape), fmt, scale_kind)


def dequantize(q: Quantized) -> torch.Tensor:
    """The float32 tensor a :class:`Quantized` stands for (original shape): each value times its
    block's scale."""
    br, bc = q.block
    nr, nc = q.scale.shape
    tiles = q.data.float().reshape(nr, br, nc, bc) * q.scale[:, None, :, None]
    return tiles.reshape(nr * br, nc * bc)[: q.shape[0], : q.shape[1]]


def fake_quantize(x: torch.Tensor, fmt: str = "e4m3", block: tuple[int, int] = (-1, -1), *,
                  scale_kind: str = "float") -> torch.Tensor:
    """dequantize(quantize(x)): what a tensor looks like after a trip through FP8 (float32)."""
    return dequantize(quantize(x, fmt, block, scale_kind=scale_kind))


# --------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    """Which format and which blocks each GEMM operand gets.

    ``activation_block`` applies to the operands whose rows are tokens or features (input, output
    gradient), ``weight_block`` to the weight; blocks are laid along the GEMM's contraction
    dimension (the one the scales must stay constant over for the scale to factor out of a sum).
    ``forward_fmt`` for input and weight, ``grad_fmt`` for the output gradient. ``history`` > 0:
    delayed scaling over that many steps (tensorwise only)."""

    name: str
    forward_fmt: str
    grad_fmt: str
    activation_block: tuple[int, int]
    weight_block: tuple[int, int]
    scale_kind: str = "float"
    history: int = 0

    def block(self, role: str) -> tuple[int, int]:
        """The block for ``role``: "input", "weight" or "grad_output"."""
        check_choice("role", role, ("input", "weight", "grad_output"))
        return self.weight_block if role == "weight" else self.activation_block

    def fmt(self, role: str) -> str:
        """The FP8 format for ``role``: "input", "weight" or "grad_output"."""
        check_choice("role", role, ("input", "weight", "grad_output"))
        return self.grad_fmt if role == "grad_output" else self.forward_fmt


RECIPES = {
    # E4M3 forward, E5M2 gradients: the classic "hybrid" split (gradients need range more than digits)
    "tensorwise": Recipe("tensorwise", "e4m3", "e5m2", (-1, -1), (-1, -1)),
    "delayed": Recipe("delayed", "e4m3", "e5m2", (-1, -1), (-1, -1), history=16),
    # finer scales give the gradients enough range in E4M3 (torchao's rowwise recipe does the same)
    "rowwise": Recipe("rowwise", "e4m3", "e4m3", (1, -1), (1, -1)),
    "blockwise": Recipe("blockwise", "e4m3", "e4m3", (1, 128), (128, 128)),
    "mxfp8": Recipe("mxfp8", "e4m3", "e4m3", (1, 32), (1, 32), scale_kind="e8m0"),
}


def get_recipe(name: str) -> Recipe:
    """The :class:`Recipe` called ``name`` (one of RECIPES)."""
    check_choice("recipe", name, tuple(RECIPES))
    return RECIPES[name]


class AmaxHistory:
    """Delayed scaling's memory: the amaxes of the last ``length`` steps of one tensor. The scale
    for this step comes from the history *before* this step's amax is known (max over the window /
    fmt max); this step's amax is recorded afterwards. An empty history uses the current amax."""

    def __init__(self, length: int = 16):
        check_int("length", length, 1)
        self.length = length
        self.values: list[float] = []

    def scale(self, fmt: str, current_amax: float) -> float:
        """The scale to quantize this step's tensor with, then record ``current_amax``."""
        window = max(self.values) if self.values else current_amax
        self.values = (self.values + [float(current_amax)])[-self.length:]
        return window / fp8_max(fmt) if window > 0 else 1.0


def quantization_error(x: torch.Tensor, recipe: str | Recipe, role: str = "input") -> dict:
    """How far a trip through ``recipe``'s FP8 moves ``x`` (2-D, float32 math): relative error
    ``||x - q(x)|| / ||x||`` (dominated by the largest values), the median of each nonzero value's
    own relative error (what the typical, small values suffer), the share of nonzero values that
    became zero (underflow), and the share that hit +-max (saturated)."""
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    q = quantize(x, r.fmt(role), r.block(role), scale_kind=r.scale_kind)
    back = dequantize(q)
    xf = x.detach().float()
    nonzero = xf != 0
    top = fp8_max(r.fmt(role))
    return {"recipe": r.name, "role": role, "format": r.fmt(role),
            "rel_error": float((back - xf).norm() / xf.norm().clamp(min=1e-30)),
            "median_rel_error": float(((back - xf)[nonzero] / xf[nonzero]).abs().median()) if nonzero.any() else 0.0,
            "underflow": float(((back == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)),
            "saturated": float((q.data.float().abs() == top).sum() / max(xf.numel(), 1))}
