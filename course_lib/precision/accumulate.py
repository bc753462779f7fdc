"""What a GEMM accumulator with fewer bits does to a long dot product, emulated.

An FP8 GEMM multiplies FP8 values (the products are exact: two 4-bit significands make at most 8
bits) and adds them into an accumulator. DeepSeek-V3's report measured that the FP8 tensor cores
of the H800 keep only about 14 bits of the accumulator's significand, not fp32's 24: every partial
sum is cut back to 14 bits, and over a long contraction (K = 4096) the cut-offs add up. Their fix:
every 128 products (N_C = 128), copy the partial sum out to an fp32 register on the CUDA cores and
start the limited accumulator again from zero.

:func:`accumulate` emulates exactly that on any device: products in float64, added ``chunk`` at a
time into an accumulator cut to ``bits`` significand bits (truncated toward zero, as a narrow
adder drops the bits it has no room for), optionally promoted into an exact sum every
``promote_every`` products. How many products the hardware adds between cuts is not published;
with 4 (the default) this model gives about the 2% worst-case error at K = 4096 that DeepSeek-V3
reports, and with 32 about a tenth of it. It shows the size of the effect, not a chip's rounding.
"""
from __future__ import annotations

import torch

from course_lib.validate import check_int


def round_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` with only ``bits`` significant bits kept (the leading one included), the rest cut off
    toward zero: 24 is fp32's significand, 14 the accumulator DeepSeek-V3 measured."""
    check_int("bits", bits, 1, 52)
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    return torch.ldexp(torch.trunc(mantissa * 2.0**bits) / 2.0**bits, exponent)


def accumulate(a: torch.Tensor, b: torch.Tensor, *, bits: int = 14, chunk: int = 4,
               promote_every: int | None = None) -> torch.Tensor:
    """``a @ b`` (a: (M, K), b: (K, N)) with the sum over K kept in a ``bits``-bit accumulator,
    ``chunk`` products added per step; ``promote_every`` (a multiple of ``chunk``): every that many
    products the accumulator is added into an exact sum and restarts from zero (DeepSeek-V3: 128).
    Returns float64 (M, N). Compare with ``a.double() @ b.double()``."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"accumulate needs a (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    check_int("chunk", chunk, 1)
    if promote_every is not None:
        check_int("promote_every", promote_every, chunk)
        if promote_every % chunk:
            raise ValueError(f"promote_every ({promote_every}) must be a multiple of chunk ({chunk})")
    a, b = a.double(), b.double()
    total = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    acc = torch.zeros_like(total)
    for k in range(0, a.shape[1], chunk):
        acc = round_significand(acc + a[:, k:k + chunk] @ b[k:k + chunk], bits)
        if promote_every is not None and (k + chunk) % promote_every == 0:
            total, acc = total + acc, torch.zeros_like(acc)
    return total + acc


def accumulation_error(a: torch.Tensor, b: torch.Tensor, **kwargs) -> float:
    """Largest relative error of :func:`accumulate` against the exact product, over the outputs
    (each output's error over the sum of its products' magnitudes, so near-zero outputs do not blow
    it up)."""
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    return float(((accumulate(a, b, **kwargs) - exact).abs() / scale.clamp(min=1e-300)).max())
