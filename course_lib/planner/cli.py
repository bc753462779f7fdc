"""``course plan``: the best parallel layout for a model, a cluster and a token budget.

    course plan --model llama2-70b --gpu a100-80gb --gpus 64 --gpus-per-node 8 --tokens 2e12 --out runs/plan-70b

Prints the comparison table (best and runners-up with why they lost) and writes the plan's files to
``--out`` (see ``course_lib.planner.output.PLAN_FILES``). Bad input: exit code 2, nothing written.
No layout fits: the table of closest misses and what would fit, exit code 1. ``--layout tp8,pp16,dp128``
scores that layout instead (breakdown, fits or not, rank against the best; exit 1 if it does not fit).
"""
from __future__ import annotations

import argparse
import sys

from course_lib.estimate import format_bytes
from course_lib.planner.launch_budget import gpus_for_days
from course_lib.planner.output import write_plan
from course_lib.planner.report import table
from course_lib.planner.search import search
from course_lib.planner.spec import PlanError, make_spec

_SHAPE = ("n_layers", "d_model", "n_heads", "n_kv_heads", "vocab_size", "d_ff")


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``subparsers``; returns its parser."""
    p = subparsers.add_parser("plan", help="choose tp/pp/dp/ZeRO/recompute for a model and a cluster; "
                                           "write configs, launch scripts, checkpoint plan and budget")
    p.add_argument("--model", help="preset (llama2-7b, llama2-70b, ...; mixture-of-experts: deepseek-v3, mixtral-8x7b, "
                                   "mixtral-8x22b, qwen3-30b-a3b, qwen3-235b-a22b; see `course estimate --help`)")
    for name in _SHAPE:
        p.add_argument("--" + name.replace("_", "-"), type=int, help="custom shape (Llama-style) or override")
    p.add_argument("--gpu", required=True, help="a100-80gb, a100-40gb, h100-80gb, h200, v100, ... or a full key")
    p.add_argument("--gpu-memory-gib", type=float, help="device memory for a GPU not in the table (GiB)")
    p.add_argument("--gpu-tflops", type=float, help="dense bf16 peak for a GPU not in the table (TFLOP/s)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job (a multiple of --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--tokens", required=True, help="training tokens: 2e12, 2T, 300B")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's context)")
    p.add_argument("--global-batch-tokens", default="4Mi",
                   help="tokens per optimizer step (default 4Mi = 4,194,304; M = 1e6, Mi = 2**20)")
    p.add_argument("--interconnect", help="link preset: a100-nvlink-hdr, h100-nvlink-ndr, pcie-100gbe "
                                          "(default: by GPU)")
    p.add_argument("--intra-node-gbps", type=float, help="per-GPU NVLink/PCIe GB/s per direction (overrides preset)")
    p.add_argument("--inter-node-gbps", type=float, help="per-GPU network GB/s per direction (overrides preset)")
    p.add_argument("--mfu", type=float, default=0.5, help="fraction of peak the matmuls sustain (default 0.5)")
    p.add_argument("--overlap", type=float, default=0.5,
                   help="fraction of compute time that hides DP/ZeRO traffic (default 0.5)")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of device memory kept free (default 0.10)")
    p.add_argument("--mtbf-hours", type=float, default=5000.0, help="mean time between failures of one node (h)")
    p.add_argument("--storage-gbps", type=float, default=10.0, help="aggregate checkpoint write GB/s (default 10)")
    p.add_argument("--recipe", default="mixed-adam", help="bytes per parameter recipe (default mixed-adam, 16 B)")
    p.add_argument("--attention", default="eager", help="eager (keeps s x s scores, default) or flash")
    p.add_argument("--precision", default="bf16", help="bf16 (default) or fp8: FP8 linears in the engine files")
    p.add_argument("--fp8-recipe", default="tensorwise",
                   help="FP8 scaling: tensorwise (default), rowwise (torchtitan), blockwise, mxfp8, delayed (Megatron)")
    p.add_argument("--fp8-param-gather", action="store_true",
                   help="keep the weights in FP8 and all-gather them in FP8 (1 byte per parameter)")
    p.add_argument("--moe-node-limit", type=int,
                   help="MoE: a token's experts on at most this many nodes (DeepSeek-V3: 4)")
    p.add_argument("--mirror", default="", help="second checkpoint tier URL for checkpoint.mirror (optional)")
    p.add_argument("--top", type=int, default=6, help="rows in the comparison table (default 6)")
    p.add_argument("--layout", help="score this layout instead of writing a plan: tp8,pp16,dp128[,cp2,v4,zero1,"
                                    "recompute=full,mb1,split=7:8*14:7]; fields left out are chosen (fastest fitting)")
    p.add_argument("--round-batch", action="store_true",
                   help="allow rounding --global-batch-tokens to the nearest batch a layout divides (default: refuse)")
    p.add_argument("--out", help="folder for the plan's files (default: print only)")
    p.set_defaults(func=run_plan)
    return p


def spec_from_args(args: argparse.Namespace):
    """make_spec with the parsed flags (PlanError names the flag)."""
    return make_spec(model=args.model, gpu=args.gpu, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                     tokens=args.tokens, seq=args.seq, global_batch_tokens=args.global_batch_tokens,
                     interconnect=args.interconnect, intra_node_gbps=args.intra_node_gbps,
                     inter_node_gbps=args.inter_node_gbps, gpu_memory_gib=args.gpu_memory_gib,
                     gpu_tflops=args.gpu_tflops, mfu=args.mfu, overlap=args.overlap, headroom=args.headroom,
                     mtbf_hours=args.mtbf_hours, storage_gbps=args.storage_gbps, recipe=args.recipe,
                     attention=args.attention, shape_overrides={k: getattr(args, k) for k in _SHAPE},
                     allow_batch_rounding=getattr(args, "round_batch", False),
                     precision=getattr(args, "precision", "bf16"), fp8_recipe=getattr(args, "fp8_recipe", "tensorwise"),
                     fp8_param_gather=getattr(args, "fp8_param_gather", False),
                     moe_node_limit=getattr(args, "moe_node_limit", None))


def run_plan(args: argparse.Namespace) -> int:
    """Run ``course plan``: 0 = a plan, 1 = nothing fits, 2 = bad input (nothing written)."""
    try:
        if args.top < 1:
            raise PlanError(f"--top: must be >= 1, got {args.top}")
        spec = spec_from_args(args)
        if args.layout is not None:
            if args.out:
                raise PlanError("--layout: scores a layout and writes nothing; leave out --out (plan without "
                                "--layout to write files)")
            from course_lib.planner.layout_score import score_layout

            score = score_layout(spec, args.layout)
    except PlanError as exc:
        print(f"course plan: {exc}", file=sys.stderr)
        return 2
    if args.layout is not None:
        print(f"course plan --layout: {spec.model_name} on {spec.gpus} x {spec.gpu_name} ({spec.nodes} node(s)), "
              f"seq {spec.seq}, batch {spec.global_batch} sequences")
        if spec.batch_note:
            print(f"note: {spec.batch_note}")
        print(score)
        return 0 if score.candidate.fits else 1
    plan = search(spec)
    print(f"course plan: {spec.model_name} on {spec.gpus} x {spec.gpu_name} ({spec.nodes} node(s)), "
          f"{spec.tokens:.3g} tokens, seq {spec.seq}, batch {spec.global_batch} sequences; "
          f"{plan.n_layouts} layouts, {len(plan.ranked)} fit in {format_bytes(spec.usable_bytes)} per GPU")
    if spec.batch_note:
        print(f"note: {spec.batch_note}")
    print(table(plan, args.top))
    if plan.best is None:
        print("\nnothing fits. What would:")
        for line in plan.advice:
            print(f"  - {line}")
    else:
        b = plan.best
        days = spec.tokens / b.tokens_per_s / 86400
        print(f"\nbest: {b.layout.label()}: {format_bytes(b.memory_total)} per GPU, {b.tokens_per_s:,.0f} tokens/s, "
              f"{days:.1f} days ({days * 24 * spec.gpus:,.0f} GPU-hours)")
        if days > 30:
            print(f"note: to finish in 30 days at the same tokens/s per GPU you would need about "
                  f"{gpus_for_days(spec, b, 30):,} GPUs (linear scaling; plan again with that --gpus)")
    if args.out:
        paths = write_plan(plan, args.out, mirror=args.mirror)
        print(f"wrote {len(paths)} file(s) to {args.out}: {', '.join(p.name for p in paths)}")
    return 0 if plan.best is not None else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.planner.cli [flags]``: the same as ``course plan [flags]``."""
    parser = argparse.ArgumentParser(prog="course")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
