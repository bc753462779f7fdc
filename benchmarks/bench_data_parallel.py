"""Data-parallel step time on 2 gloo ranks: the kit's from-scratch DDP/FSDP against torch and DeepSpeed.

What is measured (2 ranks started by ``course_lib.parallel.run_ranks``, gloo, 1 thread per rank,
the same TinyGPT on every variant - default 4 blocks, d_model 192, ~1.8 M parameters = ~7 MB of
fp32 gradients to all-reduce per step - and a fixed batch per rank): the time of one training step,
forward + backward + gradient sync + torch AdamW step + zero_grad, for

1. the headline: ``BucketedDDP`` (25 MB buckets, ``find_unused_parameters=False`` like torch DDP's
   default and the trainer's) vs torch ``DistributedDataParallel`` (defaults) - **target <= 1.3**.
   Measured in a phase of its own (phase 0) where only the two alternate step by step, with a
   second torch DDP as an A/A control (its ratio shows the method's noise floor);
2. ``NaiveDDP`` (one all-reduce per gradient after backward) next to both;
3. ``BucketedDDP`` with the bucket size swept (0.25, 1, 5, 25 MB, one bucket; and 25 MB with
   ``find_unused_parameters=True``, the class's default, which reads the flags back per bucket);
4. torch FSDP2 (``fully_shard`` per block + root, ``reshard_after_forward`` True and False) and the
   from-scratch ``SimpleFSDP``;
5. DeepSpeed ``deepspeed.initialize`` with ZeRO 0, 1, 2, 3 (fp32; torch AdamW passed as the client
   optimizer, so every variant runs the same optimizer), as the last phase of the same launch with
   its own torch DDP reference (should that launch fail, phases 0-1 are re-run alone and the reason
   printed; a configuration DeepSpeed refuses is listed as NOT MEASURED with its error).

Method: one launch of 2 ranks runs the phases one after the other (phase 0 ``--pairs`` rounds, the
others ``--rounds``). All variants of a phase are built in the same two processes on identical
model copies, warmed up (``--warmup`` steps each, left out; a DeepSpeed JIT op build would happen
there and is reported), then timed **interleaved**: each round runs ``--block`` step(s) of every
variant, order rotated (and reversed every other round), so that load from other processes hits
all variants alike. A barrier before every step (not timed) lines the ranks up; a step's time is
the slower rank's. Reported: median step ms and its IQR, the ratio of medians vs the same phase's
torch DDP, and the min-max of that ratio over ``--repeats`` consecutive slices of the rounds (how
much it moves with the machine's load; the whole-run ratio can fall outside it, medians do not
compose). Per-phase medians (forward, backward, explicit sync, optimizer) follow the tables.
Absolute ms move with the load; the ratios are what to read.

    .venv/bin/python benchmarks/bench_data_parallel.py [--quick] [--pairs 40] [--rounds 20]
        [--no-deepspeed] [--json out.json]

About 1.5 minutes on 2 quiet CPU cores, 4-5 on busy ones (``--quick``: a smaller model, 2 rounds,
20-45 s; its numbers only show that everything runs). Exit code 1 when the headline ratio misses
1.3 (never in ``--quick`` mode, whose timings are too short to judge), 2 when the headline could not
be measured.
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

import _dp_bench_ranks as ranks  # noqa: E402

from course_lib.parallel import run_ranks  # noqa: E402

TARGET = 1.3
REF = "torch DDP"
HEADLINE = "BucketedDDP 25 MB"
AA = "torch DDP (A/A control)"

FULL = {"model": dict(vocab_size=256, block_size=64, n_layers=4, n_heads=4, d_model=192),
        "batch": 4, "seq": 64}
QUICK = {"model": dict(vocab_size=256, block_size=32, n_layers=2, n_heads=4, d_model=96),
         "batch": 2, "seq": 32}


def head_specs() -> list:
    """Phase 0: the headline pair plus an A/A control (a second torch DDP, same model)."""
    return [(REF, "head", "build_torch_ddp", {}),
            (HEADLINE, "head", "build_bucketed", {"bucket_mb": 25.0}),
            (AA, "head", "build_torch_ddp", {})]


def ddp_specs(quick: bool) -> list:
    """(name, group, builder, kwargs) of phase 1: the DDPs, the bucket sweep and the FSDPs."""
    sizes = [1.0, None] if quick else [0.25, 1.0, 5.0, None]
    specs = [(REF, "ddp", "build_torch_ddp", {}),
             ("NaiveDDP", "ddp", "build_naive", {}),
             (HEADLINE, "ddp", "build_bucketed", {"bucket_mb": 25.0})]
    for mb in sizes:
        name = "BucketedDDP one bucket" if mb is None else f"BucketedDDP {mb:g} MB"
        specs.append((name, "bucket sweep", "build_bucketed", {"bucket_mb": mb}))
    if not quick:
        specs.append(("BucketedDDP 25 MB find_unused=True", "bucket sweep", "build_bucketed",
                      {"bucket_mb": 25.0, "find_unused": True}))
    specs += [("FSDP2 reshard_after_forward=True", "fsdp", "build_fsdp2", {"reshard": True}),
              ("FSDP2 reshard_after_forward=False", "fsdp", "build_fsdp2", {"reshard": False}),
              ("SimpleFSDP (from scratch)", "fsdp", "build_simple_fsdp", {})]
    return specs


def ds_specs(quick: bool, batch: int) -> list:
    stages = [0, 3] if quick else [0, 1, 2, 3]
    return [(REF, "deepspeed", "build_torch_ddp", {})] + [
        (f"DeepSpeed ZeRO-{s} fp32", "deepspeed", "build_deepspeed", {"stage": s, "batch": batch, "bf16": False})
        for s in stages]


def merge_ranks(results: list[dict]) -> dict:
    """Per variant, the slower rank's time for every step (ranks ran the same steps in order)."""
    out = dict(results[0])
    merged = []
    for per_rank in zip(*(r["variants"] for r in results)):
        v = dict(per_rank[0])
        if all(p["error"] is None for p in per_rank):
            v["times"] = [max(ts) for ts in zip(*(p["times"] for p in per_rank))]
            v["phases"] = [{k: max(ph[k] for ph in phs) for k in phs[0]}
                           for phs in zip(*(p["phases"] for p in per_rank))]
        else:
            v["error"] = next(p["error"] for p in per_rank if p["error"])
        merged.append(v)
    out["variants"] = merged
    out["built_ops"] = sorted({o for r in results for o in r["built_ops"]})
    return out


def summarize(launch: dict, repeats: int) -> list[dict]:
    """Median ms, ratio vs the launch's torch DDP, and the ratio's min-max over round slices."""
    ref = next(v for v in launch["variants"] if v["name"] == REF)
    rounds = max((r for v in launch["variants"] for r in v.get("rounds", [])), default=-1) + 1
    cuts = [(i * rounds // repeats, (i + 1) * rounds // repeats) for i in range(repeats)]

    def in_slice(v, lo, hi):
        return [t for t, r in zip(v["times"], v["rounds"]) if lo <= r < hi]

    rows = []
    for v in launch["variants"]:
        row = {"name": v["name"], "group": v["group"], "note": v["note"], "error": v["error"]}
        if v["error"] is None and v["times"] and ref["error"] is None and ref["times"]:
            med, ref_med = statistics.median(v["times"]), statistics.median(ref["times"])
            slices = []
            for lo, hi in cuts:
                a, b = in_slice(v, lo, hi), in_slice(ref, lo, hi)
                if a and b:
                    slices.append(statistics.median(a) / statistics.median(b))
            phases = {k: statistics.median(p[k] for p in v["phases"]) * 1e3 for k in v["phases"][0]}
            q = statistics.quantiles(v["times"], n=4) if len(v["times"]) >= 4 else [med, med, med]
            row.update({"median_ms": med * 1e3, "iqr_ms": [q[0] * 1e3, q[2] * 1e3], "steps": len(v["times"]),
                        "ratio": med / ref_med, "ratio_slices": slices, "phases_ms": phases})
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"  {'variant':36s} {'median ms':>9s} {'IQR ms':>13s} {'vs DDP':>7s} {'slices min-max':>15s}  note")
    for r in rows:
        if r.get("error"):
            print(f"  {r['name']:36s} {'-':>9s} {'':>13s} {'-':>7s} {'':>15s}  NOT MEASURED: {r['error']}")
            continue
        if "median_ms" not in r:
            print(f"  {r['name']:36s} {'-':>9s}  (no reference)")
            continue
        s = r["ratio_slices"]
        spread = f"{min(s):.2f}-{max(s):.2f}" if s else ""
        iqr = f"{r['iqr_ms'][0]:.1f}-{r['iqr_ms'][1]:.1f}"
        print(f"  {r['name']:36s} {r['median_ms']:9.1f} {iqr:>13s} {r['ratio']:7.2f} {spread:>15s}  {r['note']}")


def print_phases(rows: list[dict]) -> None:
    print("\nmedian ms per phase (slower rank; torch DDP/FSDP2/DeepSpeed communicate inside bwd/opt, "
          "the kit's classes in 'sync')")
    print(f"  {'variant':36s} {'fwd':>7s} {'bwd':>7s} {'sync':>7s} {'opt':>7s}")
    seen = set()
    for r in rows:
        if "phases_ms" not in r or (r["name"], r["group"]) in seen:
            continue
        seen.add((r["name"], r["group"]))
        p = r["phases_ms"]
        print(f"  {r['name'] + (' [ds phase]' if r['group'] == 'deepspeed' and r['name'] == REF else ''):36s} "
              f"{p['fwd']:7.1f} {p['bwd']:7.1f} {p['sync']:7.1f} {p['opt']:7.1f}")


def launch(phases: list[tuple[list, int]], args, size: dict, timeout: float) -> list[dict]:
    """One run_ranks call running every phase ``(specs, rounds)`` in turn; merged results per phase."""
    res = run_ranks(ranks.run_phases, 2, size["model"], size["batch"], size["seq"], phases,
                    args.warmup, args.block, timeout=timeout, threads_per_rank=1, show_output=args.verbose)
    return [merge_ranks([r[i] for r in res]) for i in range(len(phases))]


def paired_ratios(launch: dict, name: str) -> list[float]:
    """Per round, ``name``'s step over the reference's step of the same round (steps ~1 apart)."""
    by = {v["name"]: v for v in launch["variants"]}
    a, b = by[name], by[REF]
    ref_of = {}
    for t, r in zip(b["times"], b["rounds"]):
        ref_of.setdefault(r, []).append(t)
    return [t / statistics.median(ref_of[r]) for t, r in zip(a["times"], a["rounds"]) if r in ref_of]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small model, few steps, no target")
    ap.add_argument("--pairs", type=int, default=None,
                    help="rounds of the headline phase (torch DDP, BucketedDDP, torch DDP again; default 40, quick 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the other phases (default 20, quick 2)")
    ap.add_argument("--block", type=int, default=None, help="steps per variant per round (default 1)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 3, quick 1)")
    ap.add_argument("--repeats", type=int, default=3, help="slices of the rounds the ratio spread is taken over")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed phase")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--verbose", action="store_true", help="relay the ranks' output")
    args = ap.parse_args()
    args.pairs = args.pairs or (2 if args.quick else 40)
    args.rounds = args.rounds or (2 if args.quick else 20)
    args.block = args.block or 1
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.pairs < 1 or args.rounds < 1 or args.block < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--pairs, --rounds, --block, --repeats must be >= 1 and --warmup >= 0")
    size = QUICK if args.quick else FULL
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]

    from course_lib.model import ModelConfig, TinyGPT

    n_params = TinyGPT(ModelConfig(**size["model"])).num_params()
    print(f"TinyGPT {size['model']}: {n_params:,} parameters ({n_params * 4 / 2**20:.1f} MiB fp32 gradients "
          f"per all-reduce); batch {size['batch']}x{size['seq']} tokens per rank; 2 gloo ranks x 1 thread; "
          f"{args.warmup} warm-up steps per variant, then {args.pairs} interleaved rounds (headline) / "
          f"{args.rounds} (other phases) x {args.block} step(s) per variant", flush=True)

    # One start-up for all phases (DeepSpeed last, its own torch DDP reference in every phase); if
    # that launch fails (DeepSpeed taking a rank down with it), the others are run again without it.
    phases = [(head_specs(), args.pairs), (ddp_specs(args.quick), args.rounds)]
    t0 = time.perf_counter()
    ds, ds_rows, ds_error = None, [], None
    if args.no_deepspeed:
        hd, dp = launch(phases, args, size, timeout=1200)
    else:
        try:
            hd, dp, ds = launch(phases + [(ds_specs(args.quick, size["batch"]), args.rounds)], args, size,
                                timeout=1200)
        except Exception as exc:  # noqa: BLE001 - a DeepSpeed launch that cannot run is reported
            ds_error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            print(f"launch with DeepSpeed failed ({ds_error}); measuring the other phases alone", flush=True)
            hd, dp = launch(phases, args, size, timeout=1200)
    wall_s = time.perf_counter() - t0
    hd_rows = summarize(hd, min(args.repeats, args.pairs))
    dp_rows = summarize(dp, min(args.repeats, args.rounds))
    if ds is not None:
        ds_rows = summarize(ds, min(args.repeats, args.rounds))

    print(f"(all phases ran in one 2-rank launch, {wall_s:.0f} s including start-up)")
    print_table(f"phase 0 (headline): torch DDP and BucketedDDP alternated step by step, {args.pairs} rounds; "
                f"a second torch DDP as A/A control", hd_rows)
    print_table(f"phase 1: DDP side by side, bucket sweep, FSDP ({args.rounds} rounds)", dp_rows)
    if ds_rows:
        built = ds["built_ops"]
        print_table(f"phase 2: DeepSpeed, fp32, torch AdamW as client optimizer ({args.rounds} rounds; "
                    f"init + warm-up {ds['setup_s']:.0f} s; JIT op build: "
                    f"{', '.join(built) if built else 'none, ops were cached'})", ds_rows)
    elif ds_error:
        print(f"\nphase 2: DeepSpeed NOT MEASURED: {ds_error}")
    print_phases(dp_rows + ds_rows)

    head = next((r for r in hd_rows if r["name"] == HEADLINE), None)
    ratio = head.get("ratio") if head else None
    print()
    pairs = aa = []
    if ratio is None:
        verdict, code = "NOT MEASURED", 2
        print(f"headline: {HEADLINE} / {REF} could not be measured")
    else:
        s = head["ratio_slices"]
        pairs = paired_ratios(hd, HEADLINE)
        aa_row = next((r for r in hd_rows if r["name"] == AA), {})
        aa = aa_row.get("ratio")
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        code = 0 if (verdict == "PASS" or args.quick) else 1
        p1 = next((r.get("ratio") for r in dp_rows if r["name"] == HEADLINE), None)
        print(f"headline: {HEADLINE} / {REF} median step = {ratio:.3f} (slices {min(s):.3f}-{max(s):.3f}; "
              f"median of per-round pairs {statistics.median(pairs):.3f}; A/A control "
              f"{aa if aa is None else f'{aa:.3f}'}; phase 1 gave {p1 if p1 is None else f'{p1:.3f}'}); "
              f"target <= {TARGET}: {verdict}" + (" (--quick: not judged)" if args.quick else ""))
    print(f"({time.perf_counter() - t_start:.0f} s; 1-min load average {load_start:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} CPUs)")
    if args.json:
        out = {"model": size["model"], "params": n_params, "batch": size["batch"], "seq": size["seq"],
               "pairs": args.pairs, "rounds": args.rounds, "block": args.block, "warmup": args.warmup,
               "quick": args.quick,
               "headline": {"name": HEADLINE, "reference": REF, "ratio": ratio, "target": TARGET,
                            "verdict": verdict, "pair_ratio_median": statistics.median(pairs) if pairs else None,
                            "aa_control": aa},
               "launch_seconds": wall_s, "headline_phase": {"rows": hd_rows}, "ddp_phase": {"rows": dp_rows},
               "deepspeed_phase": {"rows": ds_rows, "error": ds_error,
                                   "built_ops": ds["built_ops"] if ds else []},
               "load_average": [load_start, os.getloadavg()[0]]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
