"""Pipeline schedules on gloo ranks: torch.distributed.pipelining against the kit's from-scratch runner.

What is measured (``--ranks`` 2 or 4 processes started by ``course_lib.parallel.run_ranks``, gloo,
1 thread per rank, the same TinyGPT for every variant - default 8 blocks, d_model 128, tied
embeddings - and the same global batch, default 16 x 64 tokens) for each micro-batch count m in
``--micro`` (default 4 and 8):

1. torch ``ScheduleGPipe``, ``Schedule1F1B`` (one stage per rank) and ``ScheduleInterleaved1F1B``
   (2 virtual stages per rank, rank r holding stages r and r + pp), run through
   ``course_lib.parallel.pipeline.torch_pipelining``;
2. the kit's from-scratch GPipe and 1F1B (``pipeline_step``), on the same stage split.

Per variant: the step time (forward + backward over the global batch + the tied-gradient sum;
no optimizer, it is the same for all) - median ms of the slower rank, its IQR, and the ratio to
torch GPipe at the same m - and the activation memory: the peak bytes autograd holds for
backward on the busiest rank (each storage once, parameters excluded; see ``_pp_bench_ranks``
for how each runner is measured), its ratio to torch GPipe at the same m, and the per-rank
peaks. Torch's stages also keep one receive buffer per micro-batch for activations and for
gradients between steps; those bytes are listed separately. The estimated bubble
(``course_lib.estimate.pipeline.bubble_fraction``, relative to the ideal time) is printed next to
each row: interleaving divides it by the number of virtual stages.

Method: one launch runs every variant in the same processes; each is warmed up (``--warmup``
steps, torch's first step also runs its shape inference), measured for memory in one untimed
step, then all are timed **interleaved** for ``--rounds`` rounds (one step each per round, order
rotated and reversed every other round). Absolute ms move with the machine's load; the ratios,
measured in the same run, are what to read. On a tiny CPU model the step is dominated by Python
and message overhead, so schedules that do more, smaller sends (interleaved) can be slower here
even though they have the smaller bubble.

    .venv/bin/python benchmarks/bench_pipeline.py [--quick] [--ranks 2|4] [--micro 4,8]
        [--rounds 10] [--warmup 2] [--json out.json]

About 1 minute with 2 ranks on 2 quiet CPU cores (``--quick``: a 4-block d_model 32 model,
m = 4, 2 rounds, ~10-15 s; its numbers only show that everything runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the rank module, for the spawned ranks too

import _pp_bench_ranks as ranks  # noqa: E402

from course_lib.parallel import run_ranks  # noqa: E402

REF = "torch GPipe"
FULL = {"model": dict(vocab_size=256, block_size=64, n_layers=8, n_heads=4, d_model=128),
        "batch": 16, "seq": 64, "micro": [4, 8]}
QUICK = {"model": dict(vocab_size=64, block_size=16, n_layers=4, n_heads=4, d_model=32),
         "batch": 8, "seq": 16, "micro": [4]}


def specs(micro: list[int], pp: int) -> list[tuple]:
    """(name, runner, schedule, m, virtual_stages) of every variant."""
    out = []
    for m in micro:
        out += [(REF, "torch", "gpipe", m, 1), ("torch 1F1B", "torch", "1f1b", m, 1),
                ("torch interleaved v=2", "torch", "interleaved", m, 2),
                ("scratch GPipe", "scratch", "gpipe", m, 1), ("scratch 1F1B", "scratch", "1f1b", m, 1)]
    return out


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def summarize(results: list[dict], spec_list: list[tuple], pp: int) -> list[dict]:
    """One row per variant: slower-rank median step, memory peaks per rank, ratios vs torch GPipe."""
    from course_lib.estimate.pipeline import bubble_fraction

    rows = []
    for i, (name, runner, schedule, m, v) in enumerate(spec_list):
        per_rank = [r["variants"][i] for r in results]
        row = {"name": name, "runner": runner, "schedule": schedule, "micro_batches": m, "virtual_stages": v,
               "error": next((p["error"] for p in per_rank if p["error"]), None),
               "bubble_estimate": bubble_fraction(pp, m, schedule=schedule, virtual_stages=v)}
        if row["error"] is None:
            times = [max(ts) for ts in zip(*(p["times"] for p in per_rank))]
            q = statistics.quantiles(times, n=4) if len(times) >= 4 else [min(times), 0, max(times)]
            peaks = [p["memory"]["peak_saved_bytes"] for p in per_rank]
            row.update({"median_ms": statistics.median(times) * 1e3, "iqr_ms": [q[0] * 1e3, q[2] * 1e3],
                        "steps": len(times), "peak_saved_bytes": peaks, "peak_saved_max": max(peaks),
                        "recv_buffer_bytes": [p["memory"]["recv_buffer_bytes"] for p in per_rank],
                        "peak_in_flight": [p["memory"]["peak_in_flight"] for p in per_rank],
                        "left_after_step": [p["memory"]["left_after_step"] for p in per_rank]})
        rows.append(row)
    for row in rows:  # ratios against torch GPipe at the same m
        ref = next((r for r in rows if r["name"] == REF and r["micro_batches"] == row["micro_batches"]), None)
        ok = ref is not None and ref["error"] is None and row["error"] is None
        row["time_ratio"] = row["median_ms"] / ref["median_ms"] if ok else None
        row["memory_ratio"] = row["peak_saved_max"] / ref["peak_saved_max"] if ok else None
    return rows


def print_table(rows: list[dict], pp: int) -> None:
    print(f"\n  {'variant':24s} {'m':>3s} {'median ms':>9s} {'IQR ms':>13s} {'vs GPipe':>8s} "
          f"{'act. peak':>10s} {'vs GPipe':>8s} {'bubble est':>10s}  per-rank peaks; torch recv buffers")
    for m in sorted({r["micro_batches"] for r in rows}):
        for r in (r for r in rows if r["micro_batches"] == m):
            if r["error"]:
                print(f"  {r['name']:24s} {m:3d} {'-':>9s}  NOT MEASURED: {r['error']}")
                continue
            iqr = f"{r['iqr_ms'][0]:.1f}-{r['iqr_ms'][1]:.1f}"
            extra = ", ".join(fmt_bytes(b) for b in r["peak_saved_bytes"])
            if r["runner"] == "torch":
                extra += "; " + ", ".join(fmt_bytes(b) for b in r["recv_buffer_bytes"])
            else:
                extra += f" (in flight {r['peak_in_flight']})"
            print(f"  {r['name']:24s} {m:3d} {r['median_ms']:9.1f} {iqr:>13s} {r['time_ratio']:8.2f} "
                  f"{fmt_bytes(r['peak_saved_max']):>10s} {r['memory_ratio']:8.2f} "
                  f"{r['bubble_estimate']:10.3f}  {extra}")
        print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, m = 4, 2 rounds")
    ap.add_argument("--ranks", type=int, default=2, choices=(2, 4), help="pipeline ranks (default 2)")
    ap.add_argument("--micro", default=None, help="micro-batch counts, comma-separated (default 4,8; quick 4)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10, quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 2, quick 1)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--verbose", action="store_true", help="relay the ranks' output")
    args = ap.parse_args()
    size = dict(QUICK if args.quick else FULL)
    size["model"] = dict(size["model"])
    # interleaved needs 2 blocks per rank
    size["model"]["n_layers"] = max(size["model"]["n_layers"], 2 * args.ranks)
    try:
        micro = [int(s) for s in args.micro.split(",")] if args.micro else size["micro"]
    except ValueError:
        ap.error(f"--micro must be comma-separated integers, got {args.micro!r}")
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if rounds < 1 or warmup < 1:
        ap.error("--rounds and --warmup must be >= 1 (the first step runs torch's shape inference)")
    for m in micro:
        if m < args.ranks or size["batch"] % m:
            ap.error(f"every --micro value must be >= --ranks ({args.ranks}, torch's 1F1B) and divide the "
                     f"batch ({size['batch']}); got {m}")
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]

    from course_lib.model import ModelConfig, TinyGPT

    n_params = TinyGPT(ModelConfig(**size["model"])).num_params()
    spec_list = specs(micro, args.ranks)
    print(f"TinyGPT {size['model']}: {n_params:,} parameters; global batch {size['batch']}x{size['seq']} "
          f"tokens; {args.ranks} gloo ranks x 1 thread; m in {micro}; {warmup} warm-up step(s) per variant, "
          f"then {rounds} interleaved rounds", flush=True)
    t0 = time.perf_counter()
    results = run_ranks(ranks.run, args.ranks, size["model"], size["batch"], size["seq"], spec_list, warmup,
                        rounds, timeout=900, threads_per_rank=1, show_output=args.verbose)
    wall_s = time.perf_counter() - t0
    rows = summarize(results, spec_list, args.ranks)
    print(f"(one {args.ranks}-rank launch, {wall_s:.0f} s including start-up; set-up + warm-up + memory "
          f"steps {results[0]['setup_s']:.0f} s)")
    print("step = forward + backward of the global batch + tied-gradient sum, slower rank; act. peak = "
          "bytes saved for backward on the busiest rank (fp32, parameters excluded); bubble est = "
          "(pp - 1) / (v m)")
    print_table(rows, args.ranks)
    for m in micro:
        by = {r["name"]: r for r in rows if r["micro_batches"] == m and r["error"] is None}
        if {"torch GPipe", "torch 1F1B", "scratch GPipe", "scratch 1F1B"} <= set(by):
            def per_rank(a, b):
                return "[" + ", ".join(f"{x / y:.2f}" for x, y in zip(by[a]["peak_saved_bytes"],
                                                                      by[b]["peak_saved_bytes"])) + "]"
            want = "[" + ", ".join(f"{min(m, args.ranks - s) / m:.2f}" for s in range(args.ranks)) + "]"
            print(f"m={m}: 1F1B / GPipe activation peak per rank: torch {per_rank('torch 1F1B', 'torch GPipe')}, "
                  f"scratch {per_rank('scratch 1F1B', 'scratch GPipe')} (micro-batches in flight, "
                  f"min(m, pp - rank) / m = {want}); torch / scratch step time: GPipe "
                  f"{by['torch GPipe']['median_ms'] / by['scratch GPipe']['median_ms']:.2f}, 1F1B "
                  f"{by['torch 1F1B']['median_ms'] / by['scratch 1F1B']['median_ms']:.2f}")
    print(f"({time.perf_counter() - t_start:.0f} s; 1-min load average {load_start:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} CPUs)")
    if args.json:
        out = {"model": size["model"], "params": n_params, "batch": size["batch"], "seq": size["seq"],
               "ranks": args.ranks, "micro": micro, "rounds": rounds, "warmup": warmup, "quick": args.quick,
               "launch_seconds": wall_s, "rows": rows, "load_average": [load_start, os.getloadavg()[0]]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
