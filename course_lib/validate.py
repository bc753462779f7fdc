"""Argument validation shared by the whole library (torch-free: the estimators use it too).

Every public estimator validates its arguments *before* doing any arithmetic, so a wrong input
fails with a message that names the argument and the accepted range instead of producing a
plausible-looking but meaningless number. Booleans are rejected where a number is expected
(``True`` is an ``int`` in Python, and ``dp=True`` is always a bug).
"""

from __future__ import annotations

import math
from typing import Iterable


def check_int(name: str, value, lo: int | None = None, hi: int | None = None, hi_name: str | None = None) -> int:
    """Return `value` if it is an int in [lo, hi]; TypeError / ValueError naming `name` otherwise.

    `hi_name` names where the upper bound comes from ("n_heads"), so the message says why.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = hi if hi_name is None else f"{hi_name}={hi}"
        raise ValueError(f"{name} must be {_range_text(lo, bound)}, got {value}")
    return value


def check_number(name: str, value, lo: float | None = None, hi: float | None = None,
                 *, lo_open: bool = False) -> float:
    """Return `value` if it is a finite int/float in the range; TypeError / ValueError otherwise.

    `lo_open=True` makes the lower bound exclusive (e.g. a bandwidth must be > 0).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    if too_low or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {_range_text(lo, hi, lo_open)}, got {value}")
    return value


def check_count(name: str, value, lo: float = 0) -> float:
    """A count that may be written as a float (``7.5e9`` parameters) but must be whole and >= lo."""
    check_number(name, value, lo)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be a whole number (a count), got {value}")
    return value


def check_choice(name: str, value, choices: Iterable) -> None:
    """ValueError naming `name` and listing the accepted values when `value` is not one of them."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}; got {value!r}")


def check_bool(name: str, value) -> bool:
    """TypeError naming `name` unless `value` is exactly True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_divides(divisor_name: str, divisor: int, dividend_name: str, dividend: int) -> None:
    """ValueError unless `divisor` divides `dividend` (e.g. tp must divide n_heads)."""
    if dividend % divisor:
        raise ValueError(
            f"{divisor_name} ({divisor}) must divide {dividend_name} ({dividend}); "
            f"accepted {divisor_name} values are the divisors of {dividend}"
        )


def _range_text(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}"
