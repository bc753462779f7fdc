"""Prediction cells: the learner writes down a number before the lab measures it, then sees both.

A lab's prediction cell holds a variable left ``None`` (``my_prediction = None``); the next cell
calls :func:`show_prediction` with it and the measured value. It never fails: a prediction is not
graded. Left ``None`` it says so and shows the measured value anyway, so Run All still works.
"""
from __future__ import annotations

import math
from numbers import Real


def _fmt(x, digits: int) -> str:
    if isinstance(x, bool) or not isinstance(x, Real):
        return str(x)
    x = float(x)
    if x.is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"  # counts (bytes, blocks) in full
    return f"{x:.{digits}g}"


def prediction_gap(mine, measured) -> float | None:
    """Relative gap (mine - measured) / |measured| for two numbers; 0.0 / 1.0 for equal / unequal
    other values (lists, strings); None when ``mine`` is None or the measured number is 0."""
    if mine is None:
        return None
    if isinstance(mine, Real) and isinstance(measured, Real) and not isinstance(mine, bool):
        if measured == 0:
            return None if mine != 0 else 0.0
        return (float(mine) - float(measured)) / abs(float(measured))
    return 0.0 if mine == measured else 1.0


def show_prediction(what: str, mine, measured, *, unit: str = "", why: str = "", digits: int = 4,
                    against: str = "measured") -> float | None:
    """Print the learner's prediction ``mine`` for ``what`` beside the ``measured`` value (both in
    ``unit``, e.g. "bytes" or "GB/s") and the relative gap; ``why`` explains where a gap comes from
    (printed either way, so a right guess is explained too). ``against`` names where the value comes
    from ("measured" by default; "the planner" where a model computed it). Returns the gap (see
    :func:`prediction_gap`) or None when ``mine`` is None, which only prints a reminder to fill it in."""
    u = f" {unit}" if unit else ""
    if mine is None:
        print(f"{what}: fill in your prediction above, then run this cell again. "
              f"{against[:1].upper() + against[1:]}: {_fmt(measured, digits)}{u}")
        if why:
            print(f"  {why}")
        return None
    gap = prediction_gap(mine, measured)
    if isinstance(mine, Real) and isinstance(measured, Real) and not isinstance(mine, bool):
        verdict = "spot on" if gap is not None and abs(gap) < 0.02 else (
            f"{gap:+.0%} from " + ("the measurement" if against == "measured" else against) if gap is not None and math.isfinite(gap) else "measured 0")
    else:
        verdict = "the same" if gap == 0.0 else "different"
    print(f"{what}: your prediction {_fmt(mine, digits)}{u}, {against} {_fmt(measured, digits)}{u} ({verdict})")
    if why:
        print(f"  {why}")
    return gap
