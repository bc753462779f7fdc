"""Number formats made visible: ranges, rounding, what a cast does to a set of values.

`dtype_ranges` / `format_dtype_table` (max, smallest normal, smallest subnormal, machine epsilon;
fp32, fp16, bf16 and the two FP8 formats), `cast_report` (what a cast to a low-precision dtype does
to a set of values: how many vanish, overflow, go subnormal), `loss_scaling_report` (the same with
and without a loss scale), `ulp`, `round_to`. The FP8-specific facts (saturation, the scale recipes)
are in :mod:`course_lib.precision.fp8` and :mod:`course_lib.precision.recipes`.
"""

from __future__ import annotations

import math

import torch

from course_lib.validate import check_int, check_number

_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def dtype_ranges(dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list[dict]:
    """One row per floating dtype: bits, exponent/mantissa bits, max, smallest normal, smallest
    subnormal, eps (spacing just above 1.0) and ~decimal digits. Values are plain Python floats,
    read from torch.finfo; the smallest subnormal is smallest_normal * eps (2^(emin - mantissa bits))."""
    rows = []
    for dt in dtypes:
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise TypeError(f"dtypes must be floating torch dtypes, got {dt!r}")
        fi = torch.finfo(dt)
        mantissa = -int(round(math.log2(fi.eps)))
        rows.append({
            "dtype": _NAMES.get(dt, str(dt).replace("torch.", "")),
            "bits": fi.bits,
            "exponent_bits": fi.bits - 1 - mantissa,
            "mantissa_bits": mantissa,
            "max": float(fi.max),
            "min_normal": float(fi.smallest_normal),
            "min_subnormal": float(fi.smallest_normal) * float(fi.eps),
            "eps": float(fi.eps),
            "decimal_digits": round(math.log10(2.0) * (mantissa + 1), 1),
        })
    return rows


def format_dtype_table(rows: list[dict] | None = None) -> str:
    """dtype_ranges() as a fixed-width text table (for notebooks and `course` output)."""
    rows = dtype_ranges() if rows is None else rows
    head = f"{'dtype':<6}{'bits':>5}{'exp':>5}{'mant':>6}{'max':>12}{'min normal':>12}{'min subnormal':>15}{'eps':>11}{'digits':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['dtype']:<6}{r['bits']:>5}{r['exponent_bits']:>5}{r['mantissa_bits']:>6}{r['max']:>12.4g}"
            f"{r['min_normal']:>12.4g}{r['min_subnormal']:>15.4g}{r['eps']:>11.4g}{r['decimal_digits']:>8}"
        )
    return "\n".join(lines)


def round_to(value: float, dtype: torch.dtype) -> float:
    """The value a float becomes when stored in `dtype` (round-to-nearest-even), as a Python float."""
    return float(torch.tensor(float(value), dtype=torch.float64).to(dtype).double())


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing between `value` and the next larger-magnitude number representable in `dtype`.

    This is the resolution of the format at that magnitude: adding less than half of it to
    `value` changes nothing (e.g. ulp(1.0, bf16) = 2^-7, so 1 + 1/256 rounds back to 1 in bf16).
    """
    fi = torch.finfo(dtype)
    mag = abs(float(value))
    if mag < fi.smallest_normal:  # subnormals are evenly spaced
        return float(fi.smallest_normal) * float(fi.eps)
    return 2.0 ** math.floor(math.log2(mag)) * float(fi.eps)


def log_uniform_values(n: int, low: float = 1e-12, high: float = 1e-1, seed: int = 0) -> torch.Tensor:
    """n float32 values with magnitudes log-uniform in [low, high] and random signs: a stand-in
    for a gradient tensor whose entries span many orders of magnitude."""
    check_int("n", n, 1)
    if not (0 < low < high):
        raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
    g = torch.Generator().manual_seed(seed)
    exps = torch.empty(n, dtype=torch.float64).uniform_(math.log10(low), math.log10(high), generator=g)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return (signs * 10.0**exps).float()


def cast_report(values: torch.Tensor, dtype: torch.dtype = torch.float16, scale: float = 1.0) -> dict:
    """What storing `values * scale` in `dtype`, then dividing by `scale` in float32, does to them.

    Counts (ints) over the nonzero finite inputs: `underflow` (became 0), `overflow` (became inf),
    `subnormal` (stored with reduced precision); `kept_fraction` = share that survived as nonzero
    finite numbers; `max_rel_error` / `median_rel_error` among the survivors. This is exactly what
    happens to fp16 gradients with and without a loss scale.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError("values must be a floating-point tensor")
    check_number("scale", scale, 0, lo_open=True)
    ref = values.detach().double().flatten()
    ref = ref[(ref != 0) & torch.isfinite(ref)]
    stored = (ref * scale).to(dtype)
    back = stored.double() / scale
    fi = torch.finfo(dtype)
    finite = torch.isfinite(back)
    underflow = finite & (back == 0)
    alive = finite & (back != 0)
    rel = ((back[alive] - ref[alive]).abs() / ref[alive].abs()).float()
    return {
        "dtype": _NAMES.get(dtype, str(dtype)),
        "scale": float(scale),
        "count": int(ref.numel()),
        "underflow": int(underflow.sum()),
        "overflow": int((~finite).sum()),
        "subnormal": int((alive & (stored.double().abs() < fi.smallest_normal)).sum()),
        "kept_fraction": float(alive.double().mean()) if ref.numel() else 1.0,
        "max_rel_error": float(rel.max()) if rel.numel() else 0.0,
        "median_rel_error": float(rel.median()) if rel.numel() else 0.0,
    }


def loss_scaling_report(grads: torch.Tensor, scales=(1.0, 2.0**8, 2.0**16, 2.0**24),
                        dtype: torch.dtype = torch.float16) -> list[dict]:
    """cast_report for each loss scale: too small a scale loses tiny gradients to underflow, too
    large a scale overflows the big ones; dynamic scaling searches between the two."""
    return [cast_report(grads, dtype, s) for s in scales]


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients of `model` concatenated into one float32 vector (a copy)."""
    grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
    if not grads:
        raise ValueError("model has no gradients: run a backward pass first")
    return torch.cat(grads)
