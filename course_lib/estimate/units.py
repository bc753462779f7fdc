"""Units: bytes as decimal GB (1e9) or binary GiB (2**30), always labelled, never ambiguous.

Why this module exists: the sources this kit reproduces mix the two. The ZeRO paper and the
Ultra-Scale Playbook use GB = 1e9 bytes; DeepSpeed's memory estimator divides by 2**30 but prints
"GB"; `nvidia-smi` and `torch.cuda.mem_get_info` report MiB / bytes. A 7B model's 112e9 bytes of
model state is "112 GB" or "104.3 GiB" - a 7% gap that looks like an estimator error when it is
only a unit. Every formatted number here therefore carries its unit symbol.
"""

from __future__ import annotations

from course_lib.validate import check_choice, check_int, check_number

#: Bytes per unit. Decimal units (SI) are powers of 1000, binary units (IEC) powers of 1024.
BYTE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}

_SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def bytes_to(n_bytes: float, unit: str) -> float:
    """Convert a byte count to `unit` ("GB" = 1e9 bytes, "GiB" = 2**30 bytes, ...). Returns a float."""
    check_number("n_bytes", n_bytes)
    check_choice("unit", unit, BYTE_UNITS)
    return n_bytes / BYTE_UNITS[unit]


def format_bytes(n_bytes: float, unit: str = "GiB", digits: int = 2) -> str:
    """Format a byte count with an explicit unit symbol, e.g. ``format_bytes(112e9, "GB") == "112.00 GB"``.

    `unit` is one of BYTE_UNITS; "GB" means 1e9 bytes and "GiB" means 2**30 bytes; "auto" picks the
    largest binary unit (B, KiB, MiB, GiB, TiB) in which the count is at least 1, so a job of a few
    KiB is not printed as "0.00 GiB". Negative counts are allowed (differences between an estimate
    and a measurement).
    """
    check_int("digits", digits, 0, 12)
    if unit == "auto":
        check_number("n_bytes", n_bytes)
        unit = next((u for u in ("TiB", "GiB", "MiB", "KiB") if abs(n_bytes) >= BYTE_UNITS[u]), "B")
    return f"{bytes_to(n_bytes, unit):,.{digits}f} {unit}"


def format_seconds(seconds: float, digits: int = 2) -> str:
    """A duration with its unit, in ms below a tenth of a second: ``format_seconds(0.0042) == "4.20 ms"``,
    ``format_seconds(3.5) == "3.50 s"`` (a planner reason for a tiny job should not read "0.00 s")."""
    check_number("seconds", seconds)
    check_int("digits", digits, 0, 12)
    return f"{seconds * 1e3:.{digits}f} ms" if abs(seconds) < 0.1 else f"{seconds:.{digits}f} s"


def format_si(value: float, unit: str, digits: int = 2) -> str:
    """Format with an SI prefix and an explicit unit symbol: ``format_si(3.28e12, "FLOP") == "3.28 TFLOP"``.

    For FLOPs, FLOP/s and tokens/s. Bytes go through `format_bytes` (decimal/binary explicit);
    parameter counts are printed whole with thousands separators (``f"{n:,}"``).
    """
    check_number("value", value)
    check_int("digits", digits, 0, 12)
    if not isinstance(unit, str) or not unit:
        raise TypeError(f"unit must be a non-empty str, got {unit!r}")
    for factor, prefix in _SI_PREFIXES:
        if abs(value) >= factor:
            return f"{value / factor:.{digits}f} {prefix}{unit}"
    return f"{value:.{digits}f} {unit}"
