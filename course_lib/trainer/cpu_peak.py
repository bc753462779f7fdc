"""The CPU peak MFU divides by, measured once on a quiet machine and stamped into the venv.

A peak measured while something else holds the cores (JupyterLab, the other rank, a test run) is
too low, and every MFU divided by it is too high: lab 14 showed 83-99% on a CPU whose real figure
is a few percent. So the trainer does not trust a start-up measurement when it can avoid it:

* ``course doctor --measure-peak`` (and ``./kit setup``, the quietest moment a laptop has) times
  fp32 and bf16 matmuls on 1, 2, 4, ... threads up to the core count and writes the best rate of
  each into ``stamp_path()`` (``.venv/course-kit-cpu-peak.json``), keyed by CPU model, core count
  and torch version. Measuring again never lowers a stamped figure: a busy moment can only make a
  timing slower, so the fastest ever seen is the closest to the chip's peak.
* :func:`stamped_peak` reads it back for a dtype and thread count; a thread count that was not
  measured is scaled linearly from the nearest lower one, which can only raise the peak (and lower
  MFU), never the other way round.
* Half precision that the CPU only emulates runs on the fp32 units, so the ceiling of a bf16 run
  is the faster of the bf16 and fp32 peaks (:func:`cpu_peak_dtypes`): the chip could have done the
  run's FLOPs at that rate. Dividing by the emulated bf16 rate alone printed "MFU would be 223%".

The stamp is plain JSON; nothing here runs a matmul unless asked to measure.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

STAMP_ENV = "COURSE_CPU_PEAK_FILE"  # where the stamp lives, when not in the running venv
STAMP_NAME = "course-kit-cpu-peak.json"
MEASURE_HINT = "run `course doctor --measure-peak` on a quiet machine"
STAMP_PASSES = 5  # more passes than the trainer's start-up fallback: this runs once


@dataclass(frozen=True)
class Peak:
    """A peak in FLOP/s per device and where it came from, in words (logged by the trainer)."""

    flops: float
    source: str  # "config", "datasheet", "stamp", "start-up" or "caller"
    detail: str = ""

    @classmethod
    def of(cls, value: "Peak | float") -> "Peak":
        """``value`` as a Peak (a bare number came from the caller, e.g. a test's stand-in)."""
        return value if isinstance(value, Peak) else cls(float(value), "caller", "given by the caller")

    def describe(self) -> str:
        """One line for the run's log: the rate and its provenance."""
        rate = f"{self.flops / 1e9:,.1f} GFLOP/s" if self.flops else "unknown (MFU logged as n/a)"
        return f"MFU peak: {rate} per device, {self.detail or self.source}"


def stamp_path() -> Path:
    """The stamp file: ``$COURSE_CPU_PEAK_FILE``, else ``course-kit-cpu-peak.json`` in the running
    environment's prefix (the venv, so it goes when the venv goes)."""
    env = os.environ.get(STAMP_ENV)
    return Path(env) if env else Path(sys.prefix) / STAMP_NAME


def cpu_identity() -> dict:
    """What a stamp must match: the CPU model, the cores this process may use, torch's version."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"cpu": model, "cores": cores, "torch": torch.__version__}


def thread_counts(cores: int) -> list[int]:
    """The thread counts a stamp measures: 1, 2, 4, ... below ``cores``, and ``cores`` itself
    (what a single process, and each of several ranks, runs on)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    counts, t = [], 1
    while t < cores:
        counts.append(t)
        t *= 2
    return counts + [cores]


def cpu_peak_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes whose peak bounds a run in ``dtype``: fp32 alone, or bf16/fp16 and fp32 (the
    faster of the two is the ceiling: emulated half precision runs on the fp32 units)."""
    return (torch.float32,) if dtype == torch.float32 else (dtype, torch.float32)


def _key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), *, counts: list[int] | None = None,
            peak_fn: Callable[[torch.dtype], float] | None = None) -> dict[str, dict[str, float]]:
    """Measure the matmul peak of each dtype at each thread count (default :func:`thread_counts`
    of this machine's cores): ``{"float32": {"1": flops, "2": flops}, ...}``. ``peak_fn(dtype)``
    measures on torch's current thread count (default: ``mfu.robust_cpu_peak_flops`` with
    ``STAMP_PASSES`` passes). Restores torch's thread count afterwards."""
    if peak_fn is None:
        from course_lib.trainer.mfu import robust_cpu_peak_flops

        def peak_fn(dt):
            return robust_cpu_peak_flops(dt, passes=STAMP_PASSES)
    counts = counts or thread_counts(cpu_identity()["cores"])
    before = torch.get_num_threads()
    out: dict[str, dict[str, float]] = {}
    try:
        for dt in dtypes:
            for t in counts:
                torch.set_num_threads(t)
                out.setdefault(_key(dt), {})[str(t)] = float(peak_fn(dt))
    finally:
        torch.set_num_threads(before)
    return out


def read_stamp(path: Path | None = None) -> tuple[dict | None, str]:
    """``(stamp, "")`` when ``path`` (default :func:`stamp_path`) holds a stamp for this CPU, core
    count and torch; else ``(None, why not)``."""
    path = path or stamp_path()
    try:
        stamp = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no stamp at {path}"
    except (OSError, ValueError) as exc:
        return None, f"unreadable stamp {path}: {exc}"
    here = cpu_identity()
    for field in ("cpu", "cores", "torch"):
        if stamp.get(field) != here[field]:
            return None, (f"the stamp at {path} is for {field} {stamp.get(field)!r}, this machine has "
                          f"{here[field]!r}")
    if not isinstance(stamp.get("peaks"), dict):
        return None, f"the stamp at {path} holds no peaks"
    return stamp, ""


def write_stamp(peaks: dict[str, dict[str, float]], path: Path | None = None) -> dict:
    """Merge ``peaks`` (from :func:`measure`) into the stamp at ``path`` and write it (temp file +
    rename). A figure already stamped for this machine is only ever raised: the stamp keeps the
    fastest rate measured. Returns the stamp written."""
    path = path or stamp_path()
    old, _ = read_stamp(path)
    merged = {dt: dict(per) for dt, per in (old or {}).get("peaks", {}).items()}
    for dt, per in peaks.items():
        for t, flops in per.items():
            merged.setdefault(dt, {})[t] = max(float(flops), merged.get(dt, {}).get(t, 0.0))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    stamp = {**cpu_identity(), "peaks": merged, "measured_at": time.strftime("%Y-%m-%d %H:%M"),
             "load_1min": load}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return stamp


def peak_from_stamp(stamp: dict, dtype: torch.dtype, threads: int) -> float | None:
    """The stamped peak for ``dtype`` on ``threads`` threads (FLOP/s), or None when that dtype was
    not measured. Threads beyond the core count add nothing; a count between two measured ones is
    scaled linearly from the lower (an upper bound: MFU can come out low, never high)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    per = {int(t): f for t, f in stamp.get("peaks", {}).get(_key(dtype), {}).items() if f > 0}
    threads = min(threads, int(stamp.get("cores", threads)))
    lower = [t for t in per if t <= threads]
    if not lower:
        return None
    base = max(lower)
    return per[base] * threads / base


def stamped_peak(dtype: torch.dtype, threads: int, path: Path | None = None) -> tuple[float | None, str]:
    """``(FLOP/s, detail)`` for a run in ``dtype`` on ``threads`` threads from the stamp (the
    faster of :func:`cpu_peak_dtypes`), or ``(None, why not)``."""
    stamp, why = read_stamp(path)
    if stamp is None:
        return None, why
    rates = {dt: peak_from_stamp(stamp, dt, threads) for dt in cpu_peak_dtypes(dtype)}
    if any(r is None for r in rates.values()):
        missing = ", ".join(_key(dt) for dt, r in rates.items() if r is None)
        return None, f"the stamp at {path or stamp_path()} has no {missing} peak"
    best = max(rates, key=rates.get)
    note = "" if best == dtype else f" (the {_key(best)} units: {_key(dtype)} is emulated slower here)"
    return rates[best], (f"{_key(best)} on {threads} thread(s){note}, stamped by `course doctor "
                         f"--measure-peak` on {stamp.get('measured_at', '?')}")


def main() -> int:
    """``python -m course_lib.trainer.cpu_peak`` (``./kit setup``'s last step): measure, stamp, and
    print one line with the figures and where they went."""
    stamp = write_stamp(measure())
    figures = "; ".join(f"{dt} " + ", ".join(f"{f / 1e9:,.1f} GFLOP/s on {t}" for t, f in sorted(
        per.items(), key=lambda kv: int(kv[0]))) for dt, per in stamp["peaks"].items())
    print(f"CPU matmul peak ({figures} thread(s)) stamped into {stamp_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
