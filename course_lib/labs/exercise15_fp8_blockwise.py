"""Exercise 15 (FP8 blockwise): the checks of the learner's ``quantize_blockwise(x, block)`` and
``dequantize_blockwise(q, scales, block)``, DeepSeek-V3's 1 x 128 tiles.

The reference is the library's block quantizer (:func:`course_lib.precision.recipes.quantize` with
blocks of ``(1, block)``, E4M3). Checks raise :class:`course_lib.kit.checks.CheckFailed` with a
sentence that says what came out and what was expected, in words (``NotImplementedError`` passes
through while the learner's code raises it), and otherwise return what the notebook prints and
records.
"""
from __future__ import annotations

import math

import torch

from course_lib.kit.checks import CheckFailed
from course_lib.precision.recipes import dequantize as _ref_dequantize
from course_lib.precision.recipes import quantize as _ref_quantize

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def reference(x: torch.Tensor, block: int = 128):
    """(values in E4M3 (rows, cols), scales float32 (rows, tiles)) as the library computes them."""
    q = _ref_quantize(x, "e4m3", (1, block))
    return q.data[:, : x.shape[1]], q.scale


def reference_roundtrip(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """x after a trip through 1 x ``block`` E4M3 tiles (float32)."""
    return _ref_dequantize(_ref_quantize(x, "e4m3", (1, block)))


def outlier_rows(rows: int = 4, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Activations with a hot channel in the first tile of each row (values ~1000x the rest)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, 3] *= 1000.0
    return x


# ============================================================= calling the learner's code
def call_quantize(quantize, x: torch.Tensor, block: int, what: str):
    """The learner's (values, scales) for ``x``, their types and shapes checked; ``x`` unchanged."""
    before = x.clone()
    out = quantize(x, block)
    if not torch.equal(x, before):
        raise CheckFailed(f"{what}: quantize_blockwise changed the tensor it was given; it must leave its input as it was")
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise CheckFailed(f"{what}: quantize_blockwise should return a pair (values, scales) of tensors, got {type(out).__name__}")
    values, scales = out
    tiles = math.ceil(x.shape[1] / block)
    if values.dtype != E4M3:
        raise CheckFailed(f"{what}: the values should be stored as torch.float8_e4m3fn (one byte each), got {values.dtype}")
    if tuple(values.shape) != tuple(x.shape):
        raise CheckFailed(f"{what}: the values should have the input's shape {tuple(x.shape)}, got {tuple(values.shape)}")
    if tuple(scales.shape) != (x.shape[0], tiles):
        raise CheckFailed(f"{what}: a {tuple(x.shape)} tensor in 1 x {block} tiles has {x.shape[0]} x {tiles} tiles, "
                          f"one scale each; the scales have shape {tuple(scales.shape)}")
    if not scales.is_floating_point() or scales.dtype.itemsize < 4:
        raise CheckFailed(f"{what}: the scales should be float32 (they are few, and their precision matters), got {scales.dtype}")
    return values, scales.float()


def call_dequantize(dequantize, values, scales, block: int, shape, what: str) -> torch.Tensor:
    out = dequantize(values, scales, block)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise CheckFailed(f"{what}: dequantize_blockwise should return a tensor of shape {tuple(shape)}, got {got}")
    if not out.is_floating_point() or out.dtype.itemsize < 4:
        raise CheckFailed(f"{what}: dequantize_blockwise should return float32 values, got {out.dtype}")
    return out.float()


def _first_bad(a: torch.Tensor, b: torch.Tensor, rtol: float) -> tuple | None:
    bad = ~torch.isclose(a, b, rtol=rtol, atol=0.0, equal_nan=False)
    if not bad.any():
        return None
    return tuple(bad.nonzero()[0].tolist())


def compare(quantize, dequantize, x: torch.Tensor, block: int, what: str) -> dict:
    """The learner's tiles against the reference: scales, stored values, the round trip. Returns
    the learner's (values as float32, scales, round trip) and the round trip's median error."""
    values, scales = call_quantize(quantize, x, block, what)
    want_values, want_scales = reference(x, block)
    if torch.isnan(scales).any() or (scales <= 0).any():
        r, t = (torch.isnan(scales) | (scales <= 0)).nonzero()[0].tolist()
        raise CheckFailed(f"{what}: tile ({r}, {t}) has scale {scales[r, t].item():g}; every scale must be a positive "
                          f"number, also for a tile of zeros (its values are 0 whatever the scale)")
    where = _first_bad(scales, want_scales, 1e-6)
    if where is not None:
        r, t = where
        tile = x[r, t * block:(t + 1) * block]
        ratio = scales[r, t].item() / want_scales[r, t].item()
        raise CheckFailed(f"{what}: tile ({r}, {t}) (row {r}, columns {t * block}-{min((t + 1) * block, x.shape[1]) - 1}, "
                          f"largest magnitude {tile.abs().max().item():g}) has scale {scales[r, t].item():g}; its largest "
                          f"value should land exactly on E4M3's largest, which needs {want_scales[r, t].item():g} "
                          f"({ratio:.3g} x yours)")
    stored, want_stored = values.float(), want_values.float()
    if stored.abs().max() > E4M3_MAX or not torch.isfinite(stored).all():
        raise CheckFailed(f"{what}: a stored value is {stored.abs().max().item():g}, past E4M3's range: nothing stored may "
                          f"exceed 448 in magnitude or be NaN")
    where = _first_bad(stored, want_stored, 0.0)
    if where is not None:
        r, c = where
        raise CheckFailed(f"{what}: value ({r}, {c}) = {x[r, c].item():g} was stored as {stored[r, c].item():g}; with its "
                          f"tile's scale it should be {want_stored[r, c].item():g} (the value divided by its tile's scale, "
                          f"rounded to the nearest E4M3 number)")
    back = call_dequantize(dequantize, values, scales, block, x.shape, what)
    want_back = reference_roundtrip(x, block)
    where = _first_bad(back, want_back, 1e-6)
    if where is not None:
        r, c = where
        raise CheckFailed(f"{what}: dequantized value ({r}, {c}) is {back[r, c].item():g}, expected "
                          f"{want_back[r, c].item():g}: the stored {stored[r, c].item():g} times its tile's scale "
                          f"{scales[r, c // block].item():g}")
    nonzero = x != 0
    err = ((back - x) / x.where(nonzero, torch.ones_like(x))).abs()[nonzero]
    return {"values": stored, "scales": scales, "back": back,
            "median_error": float(err.median()) if err.numel() else 0.0,
            "zeroed": float(((back == 0) & nonzero).sum() / max(int(nonzero.sum()), 1))}


def tensorwise_zeroed(x: torch.Tensor) -> float:
    """Share of x's nonzero values a single E4M3 scale for the whole tensor turns to zero."""
    back = _ref_dequantize(_ref_quantize(x, "e4m3", (-1, -1)))
    nonzero = x != 0
    return float(((back == 0) & nonzero).sum() / max(int(nonzero.sum()), 1))
