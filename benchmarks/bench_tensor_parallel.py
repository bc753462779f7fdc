"""Tensor-parallel step time on 2 gloo ranks: the from-scratch Megatron TP against DTensor TP.

What is measured (2 ranks started by ``course_lib.parallel.run_ranks``, gloo, 1 thread per rank,
every rank feeding the same batch - TP splits the model, not the batch): the time of one training
step, forward + backward (+ the scratch model's ``finish_gradient_synchronization``) + torch AdamW
step + zero_grad, for four variants built from identical copies of one dense TinyGPT (default
GPT-2 style, 4 blocks, d_model 256, 8 heads, vocab 512, ~3.4 M parameters; ``--llama``: RMSNorm,
SwiGLU, RoPE, 8 query / 4 key-value heads):

1. ``scratch`` - ``course_lib.parallel.tensor_parallel.tp_tinygpt`` (hand-written f/g, vocab-parallel
   loss);
2. ``DTensor`` - ``parallelize_tinygpt`` (``parallelize_module`` with ``tinygpt_tp_plan``), forward
   and backward under ``loss_parallel()``;
3. and 4. the same two with sequence parallelism.

Method: all four live in the same two processes; after ``--warmup`` steps each (left out) they are
timed **interleaved**: every round runs one step of each variant, order rotated (and reversed every
other round), so load from other processes hits all alike. A barrier before every step (not timed)
lines the ranks up; a step's time is the slower rank's. Reported: median step ms and IQR, the ratio
DTensor / scratch of the medians (with and without SP), the median of the per-round ratios, and
per-phase medians (fwd, bwd, opt). The first step's losses of DTensor and scratch are compared too
(they must agree: same model, same batch). Absolute ms move with the machine's load; read the ratios.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--quick] [--rounds 20] [--warmup 3]
        [--llama] [--json out.json]

About 1 minute (55-65 s measured on 2 busy CPU cores; ``--quick``: a tiny model, 2 rounds, 5-25 s, its
numbers only show that everything runs). Measured on 2 busy cores (load 6-9), GPT-2 style: DTensor /
scratch 1.50 without SP, 1.71 with it; llama-style 1.31 and 1.77 - DTensor's per-op dispatch, most of
all in the AdamW step over DTensor parameters. Exit code 2 when a variant could not be measured, else 0 (no target:
this benchmark reports the price of the production path, it does not judge it).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

from course_lib.parallel import run_ranks

LR = 1e-4
FULL = {"model": dict(vocab_size=512, block_size=128, n_layers=4, n_heads=8, d_model=256),
        "batch": 4, "seq": 128}
QUICK = {"model": dict(vocab_size=64, block_size=32, n_layers=2, n_heads=4, d_model=32),
         "batch": 2, "seq": 16}
LLAMA = dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
VARIANTS = [("scratch", False), ("DTensor", False), ("scratch", True), ("DTensor", True)]


def variant_name(kind: str, sp: bool) -> str:
    return f"{kind}{' + SP' if sp else ''}"


# ---------------------------------------------------------------------------------------------
# inside the ranks (spawned ranks import this file as their main module; the __main__ guard below
# keeps them from running the driver)
# ---------------------------------------------------------------------------------------------

class _Variant:
    """One model + its AdamW; ``step()`` returns the seconds of fwd, bwd (incl. gradient sync), opt."""

    def __init__(self, kind: str, sp: bool, dense, mesh):
        import torch

        from course_lib.parallel.tensor_parallel import parallelize_tinygpt, tp_tinygpt

        self.kind, self.sp = kind, sp
        if kind == "scratch":
            self.model = tp_tinygpt(dense, sequence_parallel=sp)
        else:
            self.model = parallelize_tinygpt(copy.deepcopy(dense), mesh, sequence_parallel=sp)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.times: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.rounds: list[int] = []
        self.first_loss: float | None = None

    def step(self, x, y) -> dict[str, float]:
        import contextlib

        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        pc = time.perf_counter
        # DTensor: the loss runs vocab-parallel only under loss_parallel(), backward included.
        ctx = loss_parallel() if self.kind == "DTensor" else contextlib.nullcontext()
        with ctx:
            t0 = pc()
            _, loss = self.model(x, y)
            t1 = pc()
            loss.backward()
            if self.kind == "scratch":
                self.model.finish_gradient_synchronization()  # SP: norms' (etc.) partial gradients
            t2 = pc()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = pc()
        if self.first_loss is None:  # outside the timing; a DTensor loss is Replicate
            self.first_loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
        return {"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2}


def run_bench(rank: int, world_size: int, cfg: dict, batch: int, seq: int, warmup: int, rounds: int) -> dict:
    """Build the four variants on identical weights, warm each up, then time ``rounds`` interleaved
    rounds of one step per variant. Returns per-variant step seconds (warm-up excluded)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from course_lib.model import ModelConfig, TinyGPT

    torch.manual_seed(0)
    dense = TinyGPT(ModelConfig(**cfg))
    mesh = DeviceMesh("cpu", list(range(world_size)))  # explicit 1-D tensor-parallel mesh
    g = torch.Generator().manual_seed(1234)  # the same batch on every rank (TP shares the batch)
    tokens = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    variants = [_Variant(kind, sp, dense, mesh) for kind, sp in VARIANTS]
    for v in variants:  # allocator, thread pools, DTensor's sharding-propagation caches
        for _ in range(warmup):
            dist.barrier()
            v.step(x, y)
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in (order[::-1] if r % 2 else order):
            dist.barrier()
            ph = v.step(x, y)
            v.phases.append(ph)
            v.times.append(sum(ph.values()))
            v.rounds.append(r)
    dist.barrier()
    return {"variants": [{"kind": v.kind, "sp": v.sp, "times": v.times, "phases": v.phases, "rounds": v.rounds,
                          "first_loss": v.first_loss} for v in variants],
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def merge_ranks(results: list[dict]) -> list[dict]:
    """Per variant, the slower rank's time for every step (ranks ran the same steps in order)."""
    merged = []
    for per_rank in zip(*(r["variants"] for r in results)):
        v = dict(per_rank[0])
        v["times"] = [max(ts) for ts in zip(*(p["times"] for p in per_rank))]
        v["phases"] = [{k: max(ph[k] for ph in phs) for k in phs[0]} for phs in zip(*(p["phases"] for p in per_rank))]
        merged.append(v)
    return merged


def summarize(variants: list[dict]) -> list[dict]:
    """Median ms, IQR, phases; for DTensor rows the ratio to the scratch row of the same SP setting."""
    by = {(v["kind"], v["sp"]): v for v in variants}
    rows = []
    for v in variants:
        t = v["times"]
        med = statistics.median(t)
        q = statistics.quantiles(t, n=4) if len(t) >= 4 else [med, med, med]
        row = {"name": variant_name(v["kind"], v["sp"]), "kind": v["kind"], "sequence_parallel": v["sp"],
               "median_ms": med * 1e3, "iqr_ms": [q[0] * 1e3, q[2] * 1e3], "steps": len(t),
               "phases_ms": {k: statistics.median(p[k] for p in v["phases"]) * 1e3 for k in v["phases"][0]},
               "first_loss": v["first_loss"], "ratio": None, "pair_ratio_median": None}
        ref = by[("scratch", v["sp"])]
        row["ratio"] = med / statistics.median(ref["times"])
        ref_of = dict(zip(ref["rounds"], ref["times"]))
        pairs = [a / ref_of[r] for a, r in zip(t, v["rounds"]) if r in ref_of]
        row["pair_ratio_median"] = statistics.median(pairs) if pairs else None
        row["loss_diff_vs_scratch"] = abs(v["first_loss"] - ref["first_loss"])
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n  {'variant':14s} {'median ms':>9s} {'IQR ms':>15s} {'vs scratch':>10s} {'per-round':>9s} "
          f"{'fwd':>7s} {'bwd':>7s} {'opt':>7s}  {'|loss - scratch|':>16s}")
    for r in rows:
        iqr = f"{r['iqr_ms'][0]:.1f}-{r['iqr_ms'][1]:.1f}"
        p = r["phases_ms"]
        print(f"  {r['name']:14s} {r['median_ms']:9.1f} {iqr:>15s} {r['ratio']:10.2f} {r['pair_ratio_median']:9.2f} "
              f"{p['fwd']:7.1f} {p['bwd']:7.1f} {p['opt']:7.1f}  {r['loss_diff_vs_scratch']:16.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps per variant (default 20, quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 3, quick 1)")
    ap.add_argument("--llama", action="store_true", help="llama-style model (RMSNorm, SwiGLU, RoPE, GQA)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--verbose", action="store_true", help="relay the ranks' output")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    size = QUICK if args.quick else FULL
    model_cfg = dict(size["model"])
    if args.llama:
        model_cfg.update(LLAMA, n_kv_heads=model_cfg["n_heads"] // 2)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]

    from course_lib.model import ModelConfig, TinyGPT

    n_params = TinyGPT(ModelConfig(**model_cfg)).num_params()
    style = "llama-style" if args.llama else "GPT-2 style"
    print(f"TinyGPT ({style}) {model_cfg}: {n_params:,} parameters; batch {size['batch']}x{size['seq']} tokens "
          f"(the same on both ranks); 2 gloo ranks x 1 thread; {args.warmup} warm-up steps per variant, then "
          f"{args.rounds} interleaved rounds of one step per variant", flush=True)
    t0 = time.perf_counter()
    code, error = 0, None
    try:
        res = run_ranks(run_bench, 2, model_cfg, size["batch"], size["seq"], args.warmup, args.rounds,
                        timeout=1200, threads_per_rank=1, show_output=args.verbose)
        rows = summarize(merge_ranks(res))
    except Exception as exc:  # noqa: BLE001 - reported, exit code 2
        error, rows, code = f"{type(exc).__name__}: {str(exc).splitlines()[0]}", [], 2
        print(f"NOT MEASURED: {error}")
    wall_s = time.perf_counter() - t0
    headline = {}
    if rows:
        print(f"(one 2-rank launch, {wall_s:.0f} s including start-up; step = forward + backward + gradient "
              "sync + AdamW + zero_grad, slower rank; ratios: DTensor / scratch with the same SP setting)")
        print_table(rows)
        for sp in (False, True):
            r = next(r for r in rows if r["kind"] == "DTensor" and r["sequence_parallel"] == sp)
            headline["sp" if sp else "no_sp"] = {"ratio": r["ratio"], "pair_ratio_median": r["pair_ratio_median"]}
        print(f"\nDTensor / scratch median step: {headline['no_sp']['ratio']:.2f} without sequence parallelism, "
              f"{headline['sp']['ratio']:.2f} with it (per-round medians {headline['no_sp']['pair_ratio_median']:.2f}, "
              f"{headline['sp']['pair_ratio_median']:.2f})" + (" (--quick: too small to judge)" if args.quick else ""))
    print(f"({time.perf_counter() - t_start:.0f} s; 1-min load average {load_start:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} CPUs)")
    if args.json:
        out = {"model": model_cfg, "style": style, "params": n_params, "batch": size["batch"], "seq": size["seq"],
               "rounds": args.rounds, "warmup": args.warmup, "quick": args.quick, "ranks": 2,
               "rows": rows, "headline": headline, "error": error, "launch_seconds": wall_s,
               "load_average": [load_start, os.getloadavg()[0]]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
