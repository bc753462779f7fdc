"""The trainer's overhead, where it goes, and whether the throughput it reports is true.

1. Ratio: trainer step (stabilizer, scheduler, metrics, checkpoint policy; progress bar off) vs a
   bare loop (data, forward, backward, AdamW, zero_grad) on the same model, data and optimizer.
   The two are interleaved **step by step**: each time the trainer writes a metrics row, one bare
   step runs (its time is taken out of the trainer's next step), so both see the same machine
   load to within ~10 ms. Ratio of median step times (target <= 1.05). An A/A control (a bare
   loop interleaved with another bare loop the same way) shows the method's noise floor, and a
   bare loop with ``clip_grad_norm_`` what the clipping the config asks for costs by itself.
   (Alternating whole runs instead is not precise enough here: on 2 shared vCPUs the medians of
   two identical bare runs back to back differ by up to 25%.)
2. Budget: the same interleaved runs with a timer around every part (progress bar on, drawn to
   /dev/null): microseconds per step of each part, bare vs trainer, and what the trainer adds. A
   part's time is its own (exclusive of the timed parts it calls); "inline code" is the step time
   minus every timed part (loop lines, the row dict, timers). Means over steps, leaving out steps
   slower than 1.5x the median (another process took the CPU). The metrics write is measured per
   row (the trainer's default) and buffered (``MetricsLog(flush_every_s=1)``) in the same round.
3. Honesty: tokens/s and MFU the trainer logs (from its ``step_seconds``) vs a stopwatch outside
   it (the moments its rows reach ``MetricsLog.write``) over the same steps of one run that saves
   checkpoints on the way: any time the trainer leaves out of its rows (a save, a flush, the bar)
   shows up as a ratio above 1. (Comparing whole runs of N and 2N steps instead drowns in the
   run-to-run noise described above.)

    .venv/bin/python benchmarks/bench_trainer.py [--steps 200] [--repeats 3] [--no-budget]

About 1.5 minutes on 2 idle CPU cores. Prints numbers measured in this run; nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from course_lib.trainer import metrics as metrics_mod
from course_lib.trainer import config as train_config
from course_lib.data import BatchStream, make_dataset
from course_lib.trainer.metrics import read_rows
from course_lib.model import TinyGPT
from course_lib.train import train

ROOT = Path(__file__).resolve().parent.parent
WARM = 10  # first steps of every run left out (allocator and thread-pool warm-up)

PEAK: list[float] = []  # this CPU's matmul peak, measured once so every run divides by the same


def load_cfg(steps: int, progress: bool = False, *extra: str) -> dict:
    return train_config.load(ROOT / "labs" / "configs" / "tiny-cpu.toml",
                             [f"train.max_steps={steps}", f"train.progress={str(progress).lower()}",
                              "train.device=cpu", "checkpoint.async_save=false",
                              f"train.peak_flops={PEAK[0]}", *extra])  # CPU, like the bare loop, anywhere


class BareLoop:
    """The plainest correct loop, one step per :meth:`step` call: forward, backward, AdamW,
    zero_grad. ``timer``: time its parts under the same labels as the trainer's. ``clip``: also
    ``clip_grad_norm_`` to the config's ``stability.max_grad_norm`` (what clipping alone costs)."""

    def __init__(self, cfg: dict, timer: "PartTimer | None" = None, clip: bool = False):
        t, d, o = cfg["train"], cfg["data"], cfg["optim"]
        torch.manual_seed(t["seed"])
        self.model = TinyGPT(train_config.build_model_config(cfg))
        self.stream = BatchStream(make_dataset(d["task"], seq_len=d["seq_len"], seed=t["seed"],
                                               vocab_size=d["vocab_size"]), t["micro_batch"], seed=t["seed"])
        self.opt = torch.optim.AdamW(self.model.param_groups(o["weight_decay"]), lr=o["lr"],
                                     betas=(o["beta1"], o["beta2"]), eps=o["eps"])
        self.backward = lambda loss: loss.backward()
        self.opt_step = self.opt.step
        if timer is not None:
            self.backward = timer.timed(self.backward, "backward")
            self.opt_step = timer.timed(self.opt_step, "optimizer step")
        self.times: list[float] = []
        self.clip = cfg["stability"]["max_grad_norm"] if clip else None
        self.params = list(self.model.parameters())

    def step(self) -> float:
        t0 = time.perf_counter()
        x, y = next(self.stream)
        _, loss = self.model(x, y)
        self.backward(loss)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt_step()
        self.opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        self.times.append(seconds)
        return seconds


def trainer_steps(cfg: dict, out: Path) -> tuple[list[float], float]:
    """Per-step seconds the trainer logged, and the wall time of the whole call."""
    t0 = time.perf_counter()
    train(cfg, out)
    wall = time.perf_counter() - t0
    return [r["step_seconds"] for r in read_rows(out / "metrics.jsonl")], wall


@contextlib.contextmanager
def _patch(cls: type, name: str, value):
    """Set ``cls.name`` for the block (deleting it after if ``cls`` only inherited it)."""
    had, old = name in cls.__dict__, cls.__dict__.get(name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if had:
            setattr(cls, name, old)
        else:
            delattr(cls, name)


def interleaved(cfg: dict, out: Path, bare: BareLoop, *, timer: "PartTimer | None" = None,
                bare_timer: "PartTimer | None" = None) -> tuple[list[float], list[float]]:
    """Run the trainer with one ``bare`` step after each metrics row it writes. Returns (trainer
    step seconds, bare step seconds), index-aligned, warm-up left out. The bare step's time
    (measured around it) is taken out of the trainer's next ``step_seconds``, which runs from one
    row to the next. With timers: parts per step of each (``timer.steps``, ``bare_timer.steps``)."""
    injected: list[float] = []
    write = metrics_mod.MetricsLog.write  # train() builds its log from this module at call time

    def write_then_bare(log, row):
        if timer is not None:
            timer.end_step()
        write(log, row)
        t0 = time.perf_counter()
        if timer is not None:
            timer.acc = bare_timer.acc  # the bare step's parts go to its own account
        try:
            bare.step()
        finally:
            if timer is not None:
                timer.acc = timer.own
                bare_timer.end_step()
        injected.append(time.perf_counter() - t0)

    with _patch(metrics_mod.MetricsLog, "write", write_then_bare):
        secs, _ = trainer_steps(cfg, out)
    n = min(len(secs) - 1, len(injected))
    trainer = [secs[i + 1] - injected[i] for i in range(n)]
    return trainer[WARM:], bare.times[WARM:n]


def honesty_run(steps: int, out: Path) -> tuple[list[dict], list[float], float]:
    """One trainer run saving a checkpoint every steps/4 steps, with a stopwatch outside it: the
    time each metrics row is handed to MetricsLog.write. Returns (rows, stamps, call seconds)."""
    stamps: list[float] = []
    write = metrics_mod.MetricsLog.write

    def stamped(log, row):
        stamps.append(time.perf_counter())
        write(log, row)

    cfg = load_cfg(steps, False, f"checkpoint.save_every={max(1, steps // 4)}")
    with _patch(metrics_mod.MetricsLog, "write", stamped):
        t0 = time.perf_counter()
        train(cfg, out)
        wall = time.perf_counter() - t0
    return read_rows(out / "metrics.jsonl"), stamps, wall


def ratio_round(steps: int, tmp: Path, r: int) -> tuple[list[float], list[float], float, float]:
    """One interleaved trainer/bare run, then three bare loops interleaved the same way: two
    alike (the A/A control) and one that also clips gradients. Returns (trainer seconds, bare
    seconds, A/A ratio, clipping/bare ratio)."""
    trainer, bare = interleaved(load_cfg(steps), tmp / f"r{r}", BareLoop(load_cfg(steps)))
    a, b, c = BareLoop(load_cfg(steps)), BareLoop(load_cfg(steps)), BareLoop(load_cfg(steps), clip=True)
    for _ in range(steps):
        a.step()
        b.step()
        c.step()
    med = statistics.median(a.times[WARM:])
    return trainer, bare, statistics.median(b.times[WARM:]) / med, statistics.median(c.times[WARM:]) / med


# --------------------------------------------------------------------------------------------
# part timers
# --------------------------------------------------------------------------------------------

# (module, class, method, label): every method found is timed; ones the code no longer has are
# skipped, so the budget keeps working while the trainer is refactored. Same label = same part.
PARTS = [
    ("course_lib.data", "BatchStream", "__next__", "data"),
    ("course_lib.model", "TinyGPT", "__call__", "forward"),  # hooks included, as model(x, y) runs
    ("course_lib.precision", "PrecisionPolicy", "backward", "backward"),
    ("course_lib.precision", "PrecisionPolicy", "step", "optimizer step"),
    ("torch.optim.optimizer", "Optimizer", "zero_grad", "zero_grad"),
    ("course_lib.stability.stabilizer", "Stabilizer", "after_backward", "stabilizer: decisions, glue"),
    ("course_lib.stability.grad_monitor", "GradientMonitor", "measure", "stabilizer: grad norms + host read"),
    ("course_lib.stability.spikes", "SpikeDetector", "update", "stabilizer: spike detectors"),
    ("course_lib.stability.stabilizer", "ClipController", "clip_", "stabilizer: clip multiply"),
    ("course_lib.stability.stabilizer", "Stabilizer", "on_loss", "stabilizer: fault hook"),
    ("course_lib.stability.stabilizer", "StepDecision", "log_row", "metrics: row fields (log_row)"),
    ("course_lib.trainer.metrics", "MetricsLog", "write", "metrics: write"),
    ("course_lib.trainer.metrics", "MetricsLog", "flush", "metrics: write"),
    ("course_lib.schedules", "ScheduleLR", "step", "LR scheduler step"),
    ("course_lib.checkpoint.manager", "CheckpointManager", "maybe_save", "checkpoint policy"),
    ("course_lib.checkpoint.manager", "CheckpointManager", "should_save", "checkpoint policy"),
    ("course_lib.parallel.checkpointing", "FullCheckpoints", "should_save", "checkpoint policy"),
    ("course_lib.parallel.strategy", "Strategy", "forward_backward", "strategy glue (loss sum, /k, lr cut)"),
    ("course_lib.parallel.strategy", "Strategy", "global_mean", "strategy glue (loss sum, /k, lr cut)"),
    ("course_lib.parallel.strategy", "Strategy", "optimizer_step", "strategy glue (loss sum, /k, lr cut)"),
    ("course_lib.parallel.strategy", "Strategy", "zero_grad", "strategy glue (loss sum, /k, lr cut)"),
    ("tqdm.std", "tqdm", "update", "progress bar"),
    ("tqdm.std", "tqdm", "set_postfix", "progress bar"),
]
CORE = ["data", "forward", "backward", "optimizer step", "zero_grad"]
INLINE = "inline code (the loop's own lines)"


class _Account(defaultdict):
    """Seconds per label, and how many timed calls were charged to it."""

    def __init__(self):
        super().__init__(float)
        self.calls = 0


class PartTimer:
    """Exclusive time per label (a part's time minus the timed parts it calls), cut into steps
    by :meth:`end_step`. ``acc`` is the account being charged (switchable)."""

    def __init__(self):
        self.own = _Account()
        self.acc = self.own
        self._stack: list[float] = []
        self.steps: list[dict[str, float]] = []

    def timed(self, fn, label: str):
        stack, pc = self._stack, time.perf_counter

        def timed_call(*args, **kwargs):
            stack.append(0.0)
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = pc() - t0
                acc = self.acc
                acc[label] += dt - stack.pop()
                acc.calls += 1
                if stack:
                    stack[-1] += dt
        return timed_call

    def end_step(self) -> None:
        self.steps.append(dict(self.acc))
        self.acc.clear()

    @contextlib.contextmanager
    def patched(self):
        """Time every method of PARTS that exists (restored on exit)."""
        with contextlib.ExitStack() as stack:
            for module, cls_name, meth, label in PARTS:
                try:
                    cls = getattr(importlib.import_module(module), cls_name)
                except (ImportError, AttributeError):
                    continue
                if callable(getattr(cls, meth, None)):
                    stack.enter_context(_patch(cls, meth, self.timed(getattr(cls, meth), label)))
            yield self


def timer_cost_us() -> float:
    """Microseconds one timed call adds (the wrapper around a no-op)."""
    f = PartTimer().timed(lambda: None, "x")
    t0 = time.perf_counter()
    for _ in range(20000):
        f()
    return (time.perf_counter() - t0) / 20000 * 1e6


def per_step_budget(step_seconds: list[float], parts: list[dict[str, float]]) -> tuple[dict[str, float], int]:
    """Mean microseconds per step of each part (and of the untimed rest, INLINE), leaving out
    steps slower than 1.5x the median. Returns (budget, steps kept)."""
    med = statistics.median(step_seconds)
    kept = [(s, p) for s, p in zip(step_seconds, parts) if s <= 1.5 * med]
    labels = {k for _, p in kept for k in p}
    out = {k: statistics.mean(p.get(k, 0.0) for _, p in kept) * 1e6 for k in labels}
    out[INLINE] = statistics.mean(s - sum(p.values()) for s, p in kept) * 1e6
    out["step"] = statistics.mean(s for s, _ in kept) * 1e6
    return out, len(kept)


class _Buffered(metrics_mod.MetricsLog):
    """The trainer's MetricsLog with buffered rows (what train.py gets by passing flush_every_s)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("flush_every_s", 1.0)
        super().__init__(*args, **kwargs)


def budget_round(steps: int, repeats: int, tmp: Path) -> tuple[dict, dict, float, dict]:
    """Instrumented interleaved runs: trainer with per-row metrics, trainer with buffered ones."""
    got: dict[str, list] = {k: [[], []] for k in ("bare", "trainer", "buffered")}
    calls = {"bare": 0, "trainer": 0}
    for r in range(repeats):
        for kind in ("trainer", "buffered"):
            timer, bare_timer = PartTimer(), PartTimer()
            bare = BareLoop(load_cfg(steps), bare_timer)
            saved = metrics_mod.MetricsLog
            if kind == "buffered":
                metrics_mod.MetricsLog = _Buffered  # train() imports it from the module at call time
            try:
                with timer.patched(), open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
                    trainer, bare_s = interleaved(load_cfg(steps, progress=True), tmp / f"b{r}{kind}", bare,
                                                  timer=timer, bare_timer=bare_timer)
            finally:
                metrics_mod.MetricsLog = saved
            # timer.steps[k] ends where row k+1 is written, like that row's step_seconds (which
            # run from the previous row): they line up, the write and what follows it
            # (checkpoint policy, progress bar) counting into the next step in both.
            got[kind][0] += trainer
            got[kind][1] += timer.steps[WARM + 1:WARM + 1 + len(trainer)]
            got["bare"][0] += bare_s
            got["bare"][1] += bare_timer.steps[WARM:WARM + len(bare_s)]
            if kind == "trainer":
                calls["trainer"] += timer.own.calls / (steps * repeats)
                calls["bare"] += bare_timer.own.calls / (steps * repeats)
    bare, _ = per_step_budget(*got["bare"])
    trainer, kept = per_step_budget(*got["trainer"])
    buffered, _ = per_step_budget(*got["buffered"])
    per_call = timer_cost_us()
    return bare, trainer, buffered.get("metrics: write", float("nan")), {
        "kept": kept, "of": len(got["trainer"][0]), "timer_us": {k: v * per_call for k, v in calls.items()}}


def print_budget(bare: dict, trainer: dict, buffered_write: float, info: dict) -> None:
    print(f"\nwhere a step's time goes (us/step, interleaved; progress bar on, drawn to /dev/null; "
          f"{info['kept']}/{info['of']} trainer steps kept)")
    print(f"  {'part':44s} {'bare':>9s} {'trainer':>9s} {'extra':>9s}")
    for label in CORE:
        b, t = bare.get(label, 0.0), trainer.get(label, 0.0)
        print(f"  {label:44s} {b:9.1f} {t:9.1f} {t - b:+9.1f}")
    print("  (the same work in both: a difference here is two model instances differing, not overhead)")
    extra_parts = sorted((k for k in trainer if k not in CORE and k not in (INLINE, "step")),
                         key=lambda k: -trainer[k])
    b, t = bare[INLINE], trainer[INLINE]
    added = t - b + sum(trainer[k] for k in extra_parts)
    print(f"  {INLINE:44s} {b:9.1f} {t:9.1f} {t - b:+9.1f}")
    for label in extra_parts:
        print(f"  {label:44s} {'':9s} {trainer[label]:9.1f} {trainer[label]:+9.1f}")
    print(f"  {'trainer-only work, total':44s} {'':9s} {'':9s} {added:+9.1f}"
          f"   = {added / bare['step']:.1%} of the bare step ({bare['step'] / 1e3:.2f} ms)")
    bar = trainer.get("progress bar", 0.0)
    print(f"  {'  of which the progress bar (off in the ratio)':44s} {'':9s} {'':9s} {bar:+9.1f}")
    print(f"  {'metrics: write if buffered (flush_every_s=1)':44s} {'':9s} {buffered_write:9.1f}"
          f"   ({buffered_write - trainer.get('metrics: write', 0.0):+.1f} vs per row)")
    print(f"  budget at 1.05x: {0.05 * bare['step']:.0f} us/step. The timers add ~{info['timer_us']['trainer']:.0f} "
          f"us/step to the trainer and ~{info['timer_us']['bare']:.0f} to the bare loop (inside the times above).")


# --------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-budget", action="store_true", help="skip part 2 (the per-part budget)")
    args = ap.parse_args()
    if args.steps < 20 or args.repeats < 1:
        ap.error("--steps must be >= 20 and --repeats >= 1")
    from course_lib.measure import cpu_matmul_peak_flops

    PEAK.append(cpu_matmul_peak_flops(1024).flops_per_second)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    bare, logged, ratios, aa, clip = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            trainer, bare_s, aa_r, clip_r = ratio_round(args.steps, Path(tmp), r)
            logged += trainer
            bare += bare_s
            ratios.append(statistics.median(trainer) / statistics.median(bare_s))
            aa.append(aa_r)
            clip.append(clip_r)
        b, t = statistics.median(bare), statistics.median(logged)
        print(f"median step, interleaved: bare loop {b * 1e3:.2f} ms, trainer {t * 1e3:.2f} ms "
              f"-> ratio {t / b:.3f} (target <= 1.05)")
        print(f"  per run: {', '.join(f'{x:.3f}' for x in ratios)}; A/A control (bare vs bare, same "
              f"method): {', '.join(f'{x:.3f}' for x in aa)}")
        print(f"  for scale: a bare loop that also calls clip_grad_norm_ (as the config's max_grad_norm "
              f"asks): {', '.join(f'{x:.3f}' for x in clip)} x the bare loop")
        if not args.no_budget:
            print_budget(*budget_round(args.steps, max(1, args.repeats - 1), Path(tmp)))
        rows, stamps, wall = honesty_run(args.steps, Path(tmp) / "honest")
    cfg = load_cfg(args.steps)
    tokens_per_step = cfg["train"]["micro_batch"] * cfg["train"]["grad_accum"] * cfg["data"]["seq_len"]
    window = rows[WARM + 1:]  # row j's step_seconds run from row j-1 to row j
    logged = sum(r["step_seconds"] for r in window)
    external = stamps[-1] - stamps[WARM]  # a stopwatch outside the trainer, same rows
    # tokens over time, not a mean of per-step rates (that would overweight fast steps)
    reported, actual = tokens_per_step * len(window) / logged, tokens_per_step * len(window) / external
    every = max(1, args.steps // 4)
    saves = sum(1 for k in range(every, args.steps, every) if k > WARM)  # in row k+1's time
    print(f"\ntokens/s over steps {WARM + 2}..{args.steps} ({saves} checkpoint saves inside): trainer "
          f"reports {reported:,.0f}, external stopwatch {actual:,.0f} -> ratio {reported / actual:.4f}")
    mfu = statistics.mean(r["mfu"] for r in window)
    print(f"MFU reported {mfu:.1%} against this CPU's measured matmul peak "
          f"({PEAK[0] / 1e9:.1f} GFLOP/s); with the external timing {mfu * actual / reported:.1%}. "
          f"Outside every row by design: start-up and the final save, "
          f"{wall - sum(r['step_seconds'] for r in rows):.2f} s of the {wall:.2f} s call")
    print(f"({time.perf_counter() - t_start:.0f} s; 1-min load average {load_start:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
