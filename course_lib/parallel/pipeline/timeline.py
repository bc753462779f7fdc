"""The measured pipeline bubble, from the per-rank timelines :func:`.schedules.run_schedule` returns.

Definitions (seconds, one optimizer step):

* ``span``: from the earliest op start on any rank to the latest op end on any rank, on the one
  clock all processes of a machine share (``time.perf_counter()`` is CLOCK_MONOTONIC on Linux).
  Every stage "owns" the whole span: a stage that has nothing to do is idle, not absent.
* ``busy`` of a stage: the summed durations of its forward and backward ops (simulated compute
  included). Everything else is ``idle``: waiting in a receive (the bubble proper), posting
  sends, Python overhead between ops, and the time before its first op / after its last one.
* measured bubble, ``relative_to="ideal"``: sum over stages of idle / sum over stages of busy,
  i.e. idle time per unit of useful work. With equal stages each stage's busy time is the ideal
  m (t_f + t_b) and its idle time (pp - 1)(t_f + t_b), which gives Narayanan et al.'s
  (pp - 1) / m - what ``course_lib.estimate.pipeline.bubble_fraction(..., relative_to="ideal")``
  computes. ``relative_to="total"``: sum of idle / (pp x span), the share of all stage-time spent
  idle, Huang et al.'s (pp - 1) / (m + pp - 1).

Summing over stages (rather than taking one stage) is what makes uneven stages show up: the
busiest stage sets the span, and every other stage's shortfall is counted as idle, so an
unbalanced split measures a larger bubble than the estimate, which assumes equal stages.
"""
from __future__ import annotations

from course_lib.estimate.pipeline import RELATIVE_TO, bubble_fraction
from course_lib.validate import check_choice

__all__ = ["COMPUTE_OPS", "COMM_OPS", "summarize_timeline", "measure_bubble"]

COMPUTE_OPS = ("forward", "backward")
COMM_OPS = ("recv_activation", "send_activation", "recv_grad", "send_grad", "wait_sends")


def _check_result(result) -> dict:
    if not isinstance(result, dict) or "events" not in result or "origin" not in result:
        raise TypeError("expected the dict run_schedule returns (with 'events' and 'origin'), got "
                        f"{type(result).__name__}")
    return result


def summarize_timeline(result: dict) -> dict:
    """Seconds one rank spent per kind of op: ``forward_s``, ``backward_s``, ``compute_s`` (their
    sum), ``recv_s`` (waiting for data: where the bubble shows up), ``send_s`` (posting sends and
    the final wait), ``gaps_s`` (between stamps: Python overhead) and ``span_s`` (its own first
    op start to last op end)."""
    events = _check_result(result)["events"]
    total = {op: 0.0 for op in COMPUTE_OPS + COMM_OPS}
    for e in events:
        total[e["op"]] += e["end"] - e["start"]
    span = events[-1]["end"] - events[0]["start"] if events else 0.0
    compute = total["forward"] + total["backward"]
    recv = total["recv_activation"] + total["recv_grad"]
    send = total["send_activation"] + total["send_grad"] + total["wait_sends"]
    return {"stage": result["stage"], "forward_s": total["forward"], "backward_s": total["backward"],
            "compute_s": compute, "recv_s": recv, "send_s": send,
            "gaps_s": span - compute - recv - send, "span_s": span}


def measure_bubble(results: list[dict], relative_to: str = "ideal") -> dict:
    """Measured bubble of one step next to the closed-form estimate (see the module docstring).

    ``results``: the :func:`run_schedule` dicts of *all* stages of the same step (any order).
    Returns ``measured`` and ``estimated`` (both ratios, no unit), ``relative_to``, ``span_s``,
    and per stage (in stage order) ``busy_s``, ``idle_s`` and ``per_stage`` (idle / busy for
    "ideal", idle / span for "total").
    """
    check_choice("relative_to", relative_to, RELATIVE_TO)
    if not isinstance(results, (list, tuple)) or not results:
        raise ValueError("results must be a non-empty list of run_schedule dicts, one per stage")
    results = sorted((_check_result(r) for r in results), key=lambda r: r["stage"])
    pp, m, schedule = results[0]["pp"], results[0]["micro_batches"], results[0]["schedule"]
    if [r["stage"] for r in results] != list(range(pp)):
        raise ValueError(f"results must hold every stage 0..{pp - 1} once, got stages "
                         f"{[r['stage'] for r in results]}")
    if any((r["pp"], r["micro_batches"], r["schedule"]) != (pp, m, schedule) for r in results):
        raise ValueError("results must come from one step: pp, micro_batches and schedule differ")
    begin = min(r["origin"] + r["events"][0]["start"] for r in results)
    end = max(r["origin"] + r["events"][-1]["end"] for r in results)
    span = end - begin
    busy = [summarize_timeline(r)["compute_s"] for r in results]
    idle = [span - b for b in busy]
    if relative_to == "ideal":
        measured, per_stage = sum(idle) / sum(busy), [i / b for i, b in zip(idle, busy)]
    else:
        measured, per_stage = sum(idle) / (pp * span), [i / span for i in idle]
    return {"measured": measured, "estimated": bubble_fraction(pp, m, schedule=schedule, relative_to=relative_to),
            "relative_to": relative_to, "span_s": span, "busy_s": busy, "idle_s": idle,
            "per_stage": per_stage, "pp": pp, "micro_batches": m, "schedule": schedule}
