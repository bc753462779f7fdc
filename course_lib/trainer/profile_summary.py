"""Reading a profiler trace: where each step's time went (torch-free; :mod:`course_lib.trainer.profiling`
records the trace, this module only reads it).

A step's wall time ``wall_s`` is the length of its ``ProfilerStep#N`` annotation (from one
``profiler.step()`` call to the next). It is split into three parts that add up to it exactly:

* ``compute_s``: time when at least one computing operator ran. On a GPU run ("cuda" timeline):
  a kernel, memcpy or memset that is not a collective. On a CPU run ("cpu" timeline): a
  ``cpu_op`` event on any thread that is not a collective (nor inside one).
* ``comm_s``: *exposed* communication: time when a collective was in flight and nothing computed.
  Waiting for a slower rank inside a collective counts here: that is what the step pays for it.
* ``idle_s``: the rest, ``wall_s - compute_s - comm_s``: no operator and no collective. On a CPU:
  Python between operators, data loading, logging, the profiler's own bookkeeping; on a GPU:
  time the GPU had no work (the host was too slow to feed it, or waited).

``comm_total_s`` is the length of all collective time (overlapped or not) and
``comm_overlapped_s = comm_total_s - comm_s`` the part hidden behind computation.
Collectives are recognised by name (:data:`COMM_WORDS`): gloo's ``gloo:all_reduce``, torch's
``c10d::allreduce_``, NCCL kernels (``ncclDevKernel_AllReduce...``), ``record_param_comms``.
"""
from __future__ import annotations

import bisect
import json
import math
import re
from pathlib import Path
from typing import Iterable

# Patterns of collective names. "broadcast" alone would also match aten::broadcast_tensors (a
# compute-side shape op), so it is excluded by a look-ahead.
COMM_WORDS = (r"all_?reduce", r"all_?gather", r"reduce_?scatter", r"broadcast(?!_tensors|_to|_shapes|_in_dim)",
              r"(?<![a-z])i?send", r"(?<![a-z])i?recv", r"c10d", r"gloo", r"nccl", r"record_param_comms",
              r"all_?to_?all", r"barrier")
_COMM_RE = re.compile("|".join(COMM_WORDS), re.IGNORECASE)
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # work that occupies the GPU

DEFINITIONS = {
    "wall_s": "seconds from one profiler.step() to the next (the ProfilerStep#N annotation)",
    "compute_s": "seconds in which at least one non-collective operator (CPU timeline) or kernel "
                 "(CUDA timeline) ran",
    "comm_s": "exposed communication: seconds in which a collective was in flight and nothing computed "
              "(waiting for a slower rank included)",
    "idle_s": "wall_s - compute_s - comm_s: no operator and no collective (Python, data, logging; on a "
              "GPU: the GPU had nothing to do)",
    "comm_total_s": "all seconds with a collective in flight, overlapped with compute or not",
    "comm_overlapped_s": "comm_total_s - comm_s: communication hidden behind computation",
    "mfu": "the trainer's metrics row for that step: tokens/s x FLOPs/token / (peak FLOP/s x ranks)",
}


def is_comm(name: str) -> bool:
    """True when an event name is a collective or point-to-point communication."""
    return bool(_COMM_RE.search(name))


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of [start, end) intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merged(intervals))


def _clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _inside_comm(events: list[dict]) -> set[int]:
    """Indices of events that lie inside a collective on the same thread (its own copies and
    waits are communication, not compute)."""
    by_tid: dict = {}
    for e in events:
        if is_comm(e["name"]):
            by_tid.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"]))
    merged = {tid: _merged(iv) for tid, iv in by_tid.items()}
    starts = {tid: [a for a, _ in iv] for tid, iv in merged.items()}
    inside = set()
    for i, e in enumerate(events):
        iv = merged.get(e.get("tid"))
        if not iv or is_comm(e["name"]):
            continue
        k = bisect.bisect_right(starts[e.get("tid")], e["ts"]) - 1
        if k >= 0 and e["ts"] + e["dur"] <= iv[k][1]:
            inside.add(i)
    return inside


def step_breakdown(trace: dict | list) -> list[dict]:
    """Per ``ProfilerStep#N`` of a Chrome trace (the dict ``torch.profiler`` exports, or its
    ``traceEvents`` list): ``profiler_step`` (N), ``wall_s``, ``compute_s``, ``comm_s``,
    ``idle_s``, ``comm_total_s``, ``comm_overlapped_s`` (seconds, this rank) and ``timeline``
    ("cuda" when the trace holds GPU kernels, else "cpu"). See the module docstring."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    steps = sorted((int(m.group(1)), e["ts"], e["ts"] + e["dur"]) for e in spans
                   if (m := _STEP_RE.match(e.get("name", ""))))
    on_gpu = any(e.get("cat") in DEVICE_CATS for e in spans)
    work = [e for e in spans if (e.get("cat") in DEVICE_CATS if on_gpu else e.get("cat") == "cpu_op")]
    nested = _inside_comm(work) if not on_gpu else set()
    compute = [(e["ts"], e["ts"] + e["dur"]) for i, e in enumerate(work)
               if i not in nested and not is_comm(e["name"])]
    # A collective is seen on the host (gloo's annotations, c10d ops) or on the GPU (NCCL kernels).
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in spans
            if is_comm(e.get("name", "")) and (e.get("cat") in DEVICE_CATS if on_gpu else True)
            and not _STEP_RE.match(e.get("name", ""))]
    rows = []
    for n, lo, hi in steps:
        c, m = _clip(compute, lo, hi), _clip(comm, lo, hi)
        wall, busy, comp, comm_total = (hi - lo), _length(c + m), _length(c), _length(m)
        exposed = busy - comp
        rows.append({"profiler_step": n, "timeline": "cuda" if on_gpu else "cpu",
                     "wall_s": wall / 1e6, "compute_s": comp / 1e6, "comm_s": exposed / 1e6,
                     "idle_s": (wall - busy) / 1e6, "comm_total_s": comm_total / 1e6,
                     "comm_overlapped_s": (comm_total - exposed) / 1e6})
    return rows


def mean_of(steps: list[dict]) -> dict:
    """Mean of every numeric per-step field over ``steps`` plus the shares of step time
    (``compute_share``, ``comm_share``, ``idle_share``: fractions of ``wall_s``, summing to 1)."""
    keys = ("wall_s", "compute_s", "comm_s", "idle_s", "comm_total_s", "comm_overlapped_s", "mfu",
            "step_seconds", "tokens_per_s")
    out = {}
    for k in keys:
        vals = [s[k] for s in steps if isinstance(s.get(k), (int, float)) and math.isfinite(s[k])]
        out[k] = sum(vals) / len(vals) if vals else None
    wall = out["wall_s"] or 0.0
    for part in ("compute", "comm", "idle"):
        out[f"{part}_share"] = out[f"{part}_s"] / wall if wall else None
    return out


def top_ops_table(ops: list[dict], title: str) -> list[str]:
    """Markdown lines of a top-operators list (``name``, ``calls``, ``self_s``, ``share``)."""
    lines = [f"### {title}", "", "| operator | calls | self time (ms) | share of self time |",
             "| --- | ---: | ---: | ---: |"]
    for op in ops:
        lines.append(f"| `{op['name']}` | {op['calls']} | {op['self_s'] * 1e3:.2f} | {op['share']:.1%} |")
    return lines + [""]


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def render_markdown(summary: dict) -> str:
    """The combined summary (``{"ranks": [...], ...}``) as a page a learner reads."""
    ranks = summary["ranks"]
    first = ranks[0]
    steps = [s["step"] for s in first["steps"]]
    lines = [f"# Profile: {summary.get('out_dir', '')}", "",
             f"{len(ranks)} rank(s), {first['timeline']} timeline, trainer steps {steps} profiled "
             f"(after {first['window']['wait']} waiting and {first['window']['warmup']} warm-up steps).", "",
             "## Time per step (mean over the profiled steps)", "",
             "| rank | step wall (ms) | compute | communication (exposed) | idle | comm hidden by overlap (ms) | MFU |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ranks:
        m = r["mean"]
        mfu = "n/a" if m["mfu"] is None else f"{m['mfu']:.2%}"
        lines.append(f"| {r['rank']} | {m['wall_s'] * 1e3:.1f} | {_pct(m['compute_share'])} | {_pct(m['comm_share'])} "
                     f"| {_pct(m['idle_share'])} | {m['comm_overlapped_s'] * 1e3:.1f} | {mfu} |")
    lines.append("")
    for key, title in (("cpu", "self CPU time"), ("cuda", "self CUDA time")):
        if first["top_ops"].get(key):
            lines += top_ops_table(first["top_ops"][key], f"Top operators by {title} (rank {first['rank']})")
    over = first.get("overhead") or {}
    if over.get("ratio") is not None:
        lines += ["## Profiler overhead", "",
                  f"Profiled steps took {over['profiled_step_seconds_mean'] * 1e3:.1f} ms on average against "
                  f"{over['unprofiled_step_seconds_median'] * 1e3:.1f} ms (median) before the window: "
                  f"x{over['ratio']:.2f}.", ""]
    lines += ["## Definitions", ""] + [f"* `{k}`: {v}" for k, v in DEFINITIONS.items()]
    files = [f"`{r['files']['trace']}`" for r in ranks if r.get("files")]
    lines += ["", "Chrome traces (open in https://ui.perfetto.dev or chrome://tracing): " + ", ".join(files),
              f"`{first['files']['tensorboard']}` holds the same traces in the layout of TensorBoard's profiler "
              "plugin (torch-tb-profiler), which the kit does not install: plain `tensorboard` shows no profile "
              "for them. Use the Chrome traces.", ""]
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON (NaN/inf become null: strict JSON)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    Path(path).write_text(json.dumps(clean(data), indent=1))
