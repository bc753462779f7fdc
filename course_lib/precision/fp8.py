"""The two FP8 formats, E4M3 and E5M2: their ranges, and what a cast past the range does.

    E4M3 (torch.float8_e4m3fn): 4 exponent bits, 3 mantissa bits, max 448, no infinity (the "fn"
         is "finite"): more precision, less range - the format for weights and activations.
    E5M2 (torch.float8_e5m2):   5 exponent bits, 2 mantissa bits, max 57344, has inf and NaN like
         IEEE: more range, less precision - the classic format for gradients.

A value past the largest finite number either *saturates* (becomes +-max) or *overflows* (becomes
inf or NaN). Which one torch's own cast does is measured by :func:`overflow_behaviour`, not assumed:
the recipes never rely on it, because they scale first and clamp to +-max themselves
(:func:`to_fp8`), the way FP8 training libraries do.
"""
from __future__ import annotations

import math

import torch

from course_lib.validate import check_choice

#: name -> torch dtype. "e4m3" is the finite-only variant every FP8 training recipe uses.
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def dtype_of(fmt: str) -> torch.dtype:
    """The torch dtype of an FP8 format name ("e4m3" or "e5m2")."""
    check_choice("fmt", fmt, tuple(FORMATS))
    return FORMATS[fmt]


def fp8_max(fmt: str) -> float:
    """Largest finite value of the format: 448.0 for e4m3, 57344.0 for e5m2."""
    return float(torch.finfo(dtype_of(fmt)).max)


def emax(fmt: str) -> int:
    """Exponent of the largest power of two the format holds (floor(log2(max))): 8 for e4m3
    (448 = 1.75 * 2^8), 15 for e5m2 (57344 = 1.75 * 2^15). The OCP MX spec's ``emax_elem``."""
    return math.floor(math.log2(fp8_max(fmt)))


def format_facts(fmt: str) -> dict:
    """One format's numbers, read from torch.finfo: exponent and mantissa bits, max, smallest
    normal, smallest subnormal (smallest normal * eps), eps (spacing above 1.0), emax."""
    fi = torch.finfo(dtype_of(fmt))
    mantissa = -int(round(math.log2(fi.eps)))
    return {"format": fmt, "exponent_bits": 7 - mantissa, "mantissa_bits": mantissa, "max": float(fi.max),
            "min_normal": float(fi.smallest_normal), "min_subnormal": float(fi.smallest_normal) * float(fi.eps),
            "eps": float(fi.eps), "emax": emax(fmt)}


def to_fp8(x: torch.Tensor, fmt: str, *, saturate: bool = True) -> torch.Tensor:
    """Cast an already-scaled tensor to FP8 (round to nearest even). ``saturate=True`` clamps to
    +-max first, so nothing past the range becomes inf/NaN (what the recipes use); ``False`` is
    torch's plain cast, whatever it does at the edge (see :func:`overflow_behaviour`)."""
    dt = dtype_of(fmt)
    if saturate:
        top = fp8_max(fmt)
        x = x.clamp(-top, top)
    return x.to(dt)


def overflow_behaviour(fmt: str) -> dict:
    """What torch's plain cast does just past the range, measured here: the value 2 * max and
    +inf, each cast to ``fmt`` and back to fp32 (``"saturates"`` when it came back as max,
    ``"overflows"`` when it came back inf or NaN)."""
    top = fp8_max(fmt)
    probes = torch.tensor([2 * top, float("inf")])
    back = probes.to(dtype_of(fmt)).float()
    verdict = ["saturates" if v == top else "overflows" if not math.isfinite(v) else f"becomes {v}"
               for v in back.tolist()]
    return {"format": fmt, "2*max": back[0].item(), "inf": back[1].item(),
            "2*max verdict": verdict[0], "inf verdict": verdict[1]}


def format_fp8_table() -> str:
    """The two formats as a fixed-width text table (for notebooks)."""
    head = f"{'format':<7}{'exp':>4}{'mant':>5}{'max':>10}{'min normal':>12}{'min subnormal':>15}{'eps':>7}"
    lines = [head, "-" * len(head)]
    for fmt in FORMATS:
        f = format_facts(fmt)
        lines.append(f"{fmt:<7}{f['exponent_bits']:>4}{f['mantissa_bits']:>5}{f['max']:>10g}{f['min_normal']:>12.4g}"
                     f"{f['min_subnormal']:>15.4g}{f['eps']:>7g}")
    return "\n".join(lines)
