"""Profiling chosen steps of a training run with ``torch.profiler``, and a summary a learner reads.

In the trainer: ``--profile`` (or ``[profile] enabled = true``). After ``profile.wait`` steps the
profiler warms up for ``profile.warmup`` steps (recording, then discarding: the first recorded
step pays the profiler's start-up) and records ``profile.active`` steps; steps count from the
first step this process runs (a resumed run profiles its own first steps). Then it stops and
never runs again in that process. Disabled, nothing of the profiler is imported or called.

Files, under ``OUT/profile/``:

* ``trace_rank{R}.json``: the Chrome trace of rank R (chrome://tracing, https://ui.perfetto.dev);
  the same file as ``tensorboard/rank{R}.*.pt.trace.json`` (a hard link when the file system allows
  it), the layout of TensorBoard's profiler plugin ``torch-tb-profiler``: retired upstream and not
  installed by the kit, so plain ``tensorboard`` shows no dashboard for it; open the Chrome trace.
* ``summary_rank{R}.json`` / ``.md``: per rank, the top operators by self time (CPU, and CUDA on
  GPUs), each profiled step split into compute / exposed communication / idle (seconds, defined in
  :mod:`course_lib.trainer.profile_summary`), the step's MFU from the trainer's metrics row, and the
  profiler's overhead (profiled steps against the steps before the window).
* ``summary.json`` / ``summary.md``: every rank's summary gathered by rank 0 (``load_summary``).

The trainer calls three things (see :func:`start`): ``profiler.step(row)`` after each metrics row,
``profiler.close()`` in its ``finally``. On a GPU the same code records CUDA kernels
(``ProfilerActivity.CUDA``) and the split uses the GPU's timeline.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from course_lib.trainer import profile_summary

PROFILE_DIR = "profile"


class _Off:
    """What the trainer holds when profiling is off: every call is a no-op."""

    summary = None

    def step(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def start(cfg: dict, info: Any, device: Any, out_dir: str | Path):
    """A started :class:`StepProfiler` when ``profile.enabled``, else a no-op object with the
    same ``step(row)`` / ``close()`` (no profiler import, no recording: zero overhead)."""
    if not cfg["profile"]["enabled"]:
        return _Off()
    p = cfg["profile"]
    return StepProfiler(Path(out_dir), rank=info.rank, world_size=info.world_size,
                        cuda=getattr(device, "type", str(device)) == "cuda", wait=p["wait"],
                        warmup=p["warmup"], active=p["active"], top_ops=p["top_ops"])


class StepProfiler:
    """``torch.profiler`` over steps ``[wait + warmup, wait + warmup + active)`` (counted from 0 at
    construction). ``summary``: this rank's summary dict once the window has been recorded."""

    def __init__(self, out_dir: Path, *, rank: int = 0, world_size: int = 1, cuda: bool = False,
                 wait: int = 5, warmup: int = 1, active: int = 3, top_ops: int = 15):
        from course_lib.validate import check_int

        check_int("wait", wait, 0)
        check_int("warmup", warmup, 0)
        check_int("active", active, 1)
        check_int("top_ops", top_ops, 1)
        import torch.profiler as tp

        self.dir = Path(out_dir) / PROFILE_DIR
        self.rank, self.world_size, self.cuda = rank, world_size, cuda
        self.wait, self.warmup, self.active, self.top_ops = wait, warmup, active, top_ops
        self.summary: dict | None = None
        self._n = 0               # profiler steps completed (= rows seen)
        self._rows: dict[int, dict] = {}  # profiler step -> the trainer's metrics row
        self._gathered = False
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
        self.dir.mkdir(parents=True, exist_ok=True)
        self._tb_dir = self.dir / "tensorboard"
        self._handler = tp.tensorboard_trace_handler(str(self._tb_dir), worker_name=f"rank{rank}")
        self._prof = tp.profile(activities=activities, on_trace_ready=self._ready,
                                schedule=tp.schedule(wait=wait, warmup=warmup, active=active, repeat=1))
        self._prof.start()

    @property
    def window(self) -> range:
        """Profiler step numbers (0 = the first step of this process) that are recorded."""
        return range(self.wait + self.warmup, self.wait + self.warmup + self.active)

    def step(self, row: dict) -> None:
        """Call once per optimizer step, after its metrics ``row`` (host values: step, mfu,
        step_seconds, tokens_per_s) is complete. Ends the window when its last step is done and
        then gathers every rank's summary to rank 0 (all ranks reach that step together)."""
        if self._prof is None:
            return
        self._rows[self._n] = {k: row.get(k) for k in ("step", "mfu", "step_seconds", "tokens_per_s")}
        self._n += 1
        self._prof.step()  # at the window's end this runs _ready (trace export + summary)
        if self._n >= self.window.stop:
            self._stop()
            self._gather()

    def close(self) -> None:
        """Stop the profiler if the run ended inside the window (what was recorded is still
        written, per rank; nothing is gathered: a failing rank must not hang the others)."""
        if self._prof is not None:
            self._stop()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()

    # ---- the window is recorded: files and summary
    def _ready(self, prof) -> None:
        self._handler(prof)
        written = sorted(self._tb_dir.glob(f"rank{self.rank}.*.pt.trace.json"), key=os.path.getmtime)
        trace_path = self.dir / f"trace_rank{self.rank}.json"
        _link_or_copy(written[-1], trace_path)
        trace = json.loads(trace_path.read_text())
        steps = []
        for part in profile_summary.step_breakdown(trace):
            row = self._rows.get(part["profiler_step"])
            if row is not None and part["profiler_step"] in self.window:
                steps.append({"step": row["step"], **part, "mfu": row["mfu"], "step_seconds": row["step_seconds"],
                              "tokens_per_s": row["tokens_per_s"]})
        self.summary = {
            "rank": self.rank, "world_size": self.world_size, "device": "cuda" if self.cuda else "cpu",
            "timeline": steps[0]["timeline"] if steps else ("cuda" if self.cuda else "cpu"),
            "window": {"wait": self.wait, "warmup": self.warmup, "active": self.active},
            "steps": steps, "mean": profile_summary.mean_of(steps),
            "top_ops": _top_ops(prof, self.top_ops, self.cuda), "overhead": self._overhead(steps),
            "files": {"trace": str(trace_path), "tensorboard": str(self._tb_dir)},
        }
        profile_summary.write_json(self.dir / f"summary_rank{self.rank}.json", self.summary)
        (self.dir / f"summary_rank{self.rank}.md").write_text(
            profile_summary.render_markdown({"out_dir": str(self.dir.parent), "ranks": [self.summary]}))

    def _overhead(self, steps: list[dict]) -> dict:
        """Profiled steps' mean step time against the median of the steps before the warm-up
        (the process's first step left out: it pays one-time start-up)."""
        before = [r["step_seconds"] for n, r in self._rows.items() if 1 <= n < self.wait and r["step_seconds"]]
        during = [s["step_seconds"] for s in steps if s["step_seconds"]]
        if not before or not during:
            return {"unprofiled_step_seconds_median": None, "profiled_step_seconds_mean": None, "ratio": None}
        base, mean = statistics.median(before), statistics.fmean(during)
        return {"unprofiled_step_seconds_median": base, "profiled_step_seconds_mean": mean, "ratio": mean / base}

    def _gather(self) -> None:
        """Every rank's summary to rank 0, which writes summary.json / summary.md."""
        import torch.distributed as dist

        if self._gathered:
            return
        self._gathered = True
        mine = self.summary or {"rank": self.rank, "missing": True}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(mine, everyone, dst=0)
        else:
            everyone = [mine]
        if self.rank == 0:
            ranks = [s for s in everyone if s and not s.get("missing")]
            if ranks:
                combined = {"out_dir": str(self.dir.parent), "world_size": self.world_size, "ranks": ranks,
                            "definitions": profile_summary.DEFINITIONS}
                profile_summary.write_json(self.dir / "summary.json", combined)
                (self.dir / "summary.md").write_text(profile_summary.render_markdown(combined))


def _top_ops(prof, n: int, cuda: bool) -> dict:
    """The ``n`` operators with the most self time (seconds, summed over the recorded steps),
    by CPU and, on a GPU, by CUDA time. User annotations (ProfilerStep#, Optimizer.step#...) are
    left out: they are not operators."""
    averages = [a for a in prof.key_averages() if not getattr(a, "is_user_annotation", False)
                and not a.key.startswith("ProfilerStep#")]
    out = {}
    for key, attr in (("cpu", "self_cpu_time_total"), ("cuda", "self_device_time_total")):
        if key == "cuda" and not cuda:
            continue
        total = sum(getattr(a, attr) for a in averages) or 1.0
        best = sorted(averages, key=lambda a: getattr(a, attr), reverse=True)[:n]
        out[key] = [{"name": a.key, "calls": a.count, "self_s": getattr(a, attr) / 1e6,
                     "share": getattr(a, attr) / total} for a in best if getattr(a, attr) > 0]
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes the same file as ``src`` (a hard link: no second copy on disk), or a copy."""
    import shutil

    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def load_summary(out_dir: str | Path) -> dict:
    """The profile summary of the run in ``out_dir`` (its ``profile/summary.json``): ``ranks`` is
    a list of per-rank dicts with ``steps`` (per profiled step: step, wall_s, compute_s, comm_s,
    idle_s, comm_total_s, comm_overlapped_s in seconds; mfu as a fraction), ``mean`` (the same
    averaged, plus compute/comm/idle shares of wall_s), ``top_ops`` ({"cpu": [...], "cuda": [...]},
    each {name, calls, self_s, share}), ``overhead`` and ``files``. Without a combined summary
    (the run ended before rank 0 gathered), the per-rank files found are combined here."""
    folder = Path(out_dir) / PROFILE_DIR
    combined = folder / "summary.json"
    if combined.exists():
        return json.loads(combined.read_text())
    ranks = sorted((json.loads(p.read_text()) for p in folder.glob("summary_rank*.json")), key=lambda s: s["rank"])
    if not ranks:
        raise FileNotFoundError(f"no profile summary under {folder}: run the trainer with --profile "
                                f"(or [profile] enabled = true) and at least wait + warmup + active steps")
    return {"out_dir": str(Path(out_dir)), "world_size": ranks[0]["world_size"], "ranks": ranks,
            "definitions": profile_summary.DEFINITIONS}
