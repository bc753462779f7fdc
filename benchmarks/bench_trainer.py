"""The trainer's overhead, and whether the throughput it reports is true.

1. Trainer step (stabilizer, scheduler, metrics, progress off) vs a bare loop on the same model,
   data and optimizer: ratio of median step times (target <= 1.05).
2. Tokens/s and MFU the trainer logs vs an external wall-clock timing of the same runs
   (runs of N and N+K steps: the difference is K steps, set-up and the final save cancel out).

    .venv/bin/python benchmarks/bench_trainer.py [--steps 200] [--repeats 3]

Prints ratios measured in this run; nothing is asserted. Run it on a quiet machine: other
processes inflate both sides, but not equally.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from course_lib import train_config
from course_lib.data import BatchStream, make_dataset
from course_lib.metrics import read_rows
from course_lib.model import TinyGPT
from course_lib.train import train

ROOT = Path(__file__).resolve().parent.parent


PEAK: list[float] = []  # this CPU's matmul peak, measured once so every run divides by the same


def load_cfg(steps: int) -> dict:
    return train_config.load(ROOT / "labs" / "configs" / "tiny-cpu.toml",
                             [f"train.max_steps={steps}", "train.progress=false",
                              "checkpoint.async_save=false", f"train.peak_flops={PEAK[0]}"])


def bare_loop(cfg: dict, steps: int) -> list[float]:
    """Seconds per step of the plainest correct loop: forward, backward, AdamW, zero_grad."""
    t, d, o = cfg["train"], cfg["data"], cfg["optim"]
    torch.manual_seed(t["seed"])
    model = TinyGPT(train_config.build_model_config(cfg))
    stream = BatchStream(make_dataset(d["task"], seq_len=d["seq_len"], seed=t["seed"],
                                      vocab_size=d["vocab_size"]), t["micro_batch"], seed=t["seed"])
    opt = torch.optim.AdamW(model.param_groups(o["weight_decay"]), lr=o["lr"],
                            betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = next(stream)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def trainer_steps(cfg: dict, out: Path) -> tuple[list[float], float]:
    """Per-step seconds the trainer logged, and the wall time of the whole call."""
    t0 = time.perf_counter()
    train(cfg, out)
    wall = time.perf_counter() - t0
    return [r["step_seconds"] for r in read_rows(out / "metrics.jsonl")], wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.steps < 20 or args.repeats < 1:
        ap.error("--steps must be >= 20 and --repeats >= 1")
    from course_lib.measure import cpu_matmul_peak_flops

    PEAK.append(cpu_matmul_peak_flops(1024).flops_per_second)
    warm = 10
    bare, logged = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):  # interleaved, so drift in machine load hits both sides
            bare += bare_loop(load_cfg(args.steps), args.steps)[warm:]
            steps, _ = trainer_steps(load_cfg(args.steps), Path(tmp) / f"t{r}")
            logged += steps[warm:]
        # External stopwatch: whole runs of N and 2N steps; the difference is N steps with
        # set-up and the final save cancelled. Best of `repeats` on each side (noise only adds).
        wall_short = wall_long = float("inf")
        for r in range(args.repeats):
            wall_short = min(wall_short, trainer_steps(load_cfg(args.steps), Path(tmp) / f"s{r}")[1])
            long_steps, wall = trainer_steps(load_cfg(2 * args.steps), Path(tmp) / f"l{r}")
            if wall < wall_long:
                wall_long, rows = wall, read_rows(Path(tmp) / f"l{r}" / "metrics.jsonl")
    b, t = statistics.median(bare), statistics.median(logged)
    print(f"median step: bare loop {b * 1e3:.2f} ms, trainer {t * 1e3:.2f} ms "
          f"-> ratio {t / b:.3f} (target <= 1.05)")
    c = load_cfg(args.steps)["train"]
    tokens_per_step = c["micro_batch"] * c["grad_accum"] * load_cfg(args.steps)["data"]["seq_len"]
    external = (wall_long - wall_short) / args.steps  # seconds per step, set-up cancelled
    # tokens over time, not a mean of per-step rates (that would overweight fast steps)
    reported = tokens_per_step * args.steps / sum(r["step_seconds"] for r in rows[args.steps:])
    print(f"tokens/s: trainer reports {reported:,.0f} (over its last {args.steps} steps), "
          f"external timing {tokens_per_step / external:,.0f} -> ratio "
          f"{reported / (tokens_per_step / external):.3f}")
    mfu = statistics.mean(r["mfu"] for r in rows[args.steps:])
    print(f"MFU reported {mfu:.1%} against this CPU's measured matmul peak "
          f"({PEAK[0] / 1e9:.1f} GFLOP/s); with the external timing {mfu * (tokens_per_step / external) / reported:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
