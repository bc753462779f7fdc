"""The course's GPU numbers, measured: MFU of the kit's trainer, CUDA memory next to the estimator,
and the memory-leak / fragmentation failure modes seen through the CUDA allocator.

    python benchmarks/gpu_check.py env                 # device, versions, matmul and copy ceilings
    python benchmarks/gpu_check.py mfu [--steps 60]    # GPT-2 small (124M, seq 1024) in the trainer
    python benchmarks/gpu_check.py profile             # where the MFU run's GPU time goes
    python benchmarks/gpu_check.py memory              # max_memory_allocated vs course_lib.estimate
    python benchmarks/gpu_check.py memory-accum        # the same under grad_accum 1/4/16, ZeRO 0-3, fp32/bf16
    python benchmarks/gpu_check.py leak                # lab 04's leak on the CUDA allocator
    python benchmarks/gpu_check.py fragmentation       # reserved vs allocated, with and without
                                                       # expandable segments
    python benchmarks/gpu_check.py layouts             # ddp/zero1/zero2/fsdp on a one-rank NCCL group = single
    python benchmarks/gpu_check.py save-stall          # async vs sync sharded save, FSDP2, one rank
    ... --json PATH                                    # every figure, with device and versions

Needs a CUDA GPU (it says so and exits 2 otherwise). Every table says which device, torch and CUDA
produced it; benchmarks/RESULTS-gpu.md records the runs. Nothing here is asserted: the tests in
tests/test_train_gpu.py assert what must hold; this script measures what is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 2**20
GiB = 2**30


# ----------------------------------------------------------------------------- environment
def environment() -> dict:
    """Device name, memory (bytes), torch / CUDA / driver versions: the header of every result."""
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return {"device": torch.cuda.get_device_name(0), "memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "driver": driver, "python": sys.version.split()[0]}


def _median_ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` timed with CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_peak(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Measured dense matmul FLOP/s (2 n^3 per product) on random data, median of 10."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = _median_ms(lambda: a @ b)
    return 2 * n**3 / (ms / 1e3)


def copy_bandwidth(n_bytes: int = 2 * GiB) -> float:
    """Device-to-device copy bandwidth, bytes/s counting bytes read plus bytes written."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms / 1e3)


def run_env(args) -> dict:
    env = environment()
    env["matmul_bf16_flops"] = matmul_peak(dtype=torch.bfloat16)
    env["matmul_tf32_flops"] = _tf32_peak()
    env["copy_bytes_per_s"] = copy_bandwidth()
    print(f"{env['device']}: torch {env['torch']}, CUDA {env['cuda']}, driver {env['driver']}")
    print(f"  bf16 matmul 8192^3: {env['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s; "
          f"tf32: {env['matmul_tf32_flops'] / 1e12:.0f} TFLOP/s; "
          f"d2d copy: {env['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    return env


def _tf32_peak() -> float:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return matmul_peak(dtype=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


# ----------------------------------------------------------------------------- MFU in the trainer
MFU_CASES = {
    # name: trainer overrides on top of the GPT-2-small base below
    "bf16 + compile + fused AdamW": [],
    "  + micro-batch 32": ["train.micro_batch=32"],
    "  + no clipping or spike checks": ["stability.max_grad_norm=0", "stability.detect_spikes=false"],
    "bf16, no compile": ["train.compile=false"],
    "bf16 + compile, foreach AdamW": ["optim.fused=false"],
    "fp32 (tf32) + compile": ["train.precision='fp32'"],
    # An experiment, not a trainer option: torch.compile(mode="reduce-overhead") replays CUDA graphs,
    # so the kernels of a step start without per-kernel launches after the step's host read.
    "  + CUDA graphs (experiment)": ["compile_mode=reduce-overhead"],
    # FP8 through torchao's float8 training (the production path): nn.Linear layers but the output
    # head become Float8Linear before the trainer compiles the model, as torchtitan's float8
    # converter does; autocast stays bf16 for everything else. Tokens/s against bf16 in one run.
    "fp8 tensorwise (torchao) mb 32": ["train.micro_batch=32", "fp8=tensorwise"],
    "fp8 rowwise (torchao) mb 32": ["train.micro_batch=32", "fp8=rowwise"],
}

PSEUDO = ("compile_mode=", "fp8=")  # gpu_check's own switches, not trainer overrides


def convert_fp8(module, recipe: str) -> int:
    """Swap ``module``'s nn.Linear layers (not the output head, which torchtitan also keeps in
    bf16) for torchao Float8Linear with ``recipe`` ("tensorwise" or "rowwise"); returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    before = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)
    after = sum(type(m) is torch.nn.Linear for m in module.modules())
    return before - after


def gpt2_small_overrides(micro_batch: int, steps: int) -> list[str]:
    """Trainer overrides for GPT-2 small (124M, seq 1024, vocabulary padded to 50304 as nanoGPT
    does: a multiple of 64 keeps the output matmul on fast tile sizes) on uniform random tokens."""
    return ["model.preset='gpt2-small'", "model.vocab_size=50304", "data.task='random'",
            "data.vocab_size=50257", "data.seq_len=1024", f"train.micro_batch={micro_batch}",
            "train.grad_accum=1", f"train.max_steps={steps}", "schedule.warmup_steps=5",
            "train.precision='bf16'", "train.compile=true", "optim.fused=true", "optim.lr=6e-4",
            "optim.min_lr=6e-5", "train.progress=false", "train.device='cuda'",
            "checkpoint.save_every=0", "checkpoint.async_save=false", "stability.spike_policy='warn'"]


def run_trainer_case(overrides: list[str], skip: int) -> dict:
    """Train with the kit's own trainer; tokens/s and MFU are the medians of the logged steps
    after the first ``skip`` (compilation and allocator warm-up)."""
    from course_lib.trainer import config as train_config
    from course_lib.train import train

    modes = [o.split("=", 1)[1] for o in overrides if o.startswith("compile_mode=")]
    fp8 = [o.split("=", 1)[1] for o in overrides if o.startswith("fp8=")]
    cfg = train_config.load(None, [o for o in overrides if not o.startswith(PSEUDO)])
    compile_fn = torch.compile
    converted = []

    def compile_hook(module, **kw):
        if fp8:
            converted.append(convert_fp8(module, fp8[0]))
        return compile_fn(module, **({"mode": modes[0]} if modes else {}), **kw)

    if modes or fp8:
        torch.compile = compile_hook
    try:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            result = train(cfg, out)
            wall = time.perf_counter() - t0
            rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    finally:
        torch.compile = compile_fn
    steady = rows[skip:]
    tok_s = statistics.median(r["tokens_per_s"] for r in steady)
    mfu = statistics.median(r["mfu"] for r in steady) if steady[0]["mfu"] is not None else None
    return {"tokens_per_s": tok_s, "mfu_datasheet": mfu, "step_ms": 1e3 * statistics.median(r["step_seconds"] for r in steady),
            "final_loss": result.final_loss, "wall_s": wall, "steps": len(rows),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            **({"fp8_recipe": fp8[0], "fp8_linears": converted[0] if converted else 0} if fp8 else {})}


def run_mfu(args) -> dict:
    from course_lib.estimate.flops import palm_flops_per_token
    from course_lib.estimate.hardware import ACCELERATORS
    from course_lib.model import ModelConfig

    env = environment()
    measured_peak = matmul_peak()
    sheet = next((a for k, a in ACCELERATORS.items() if k.split("-")[0] in env["device"].lower()), None)
    mcfg = ModelConfig.preset("gpt2-small", vocab_size=50304)
    from course_lib.model import TinyGPT
    with torch.device("meta"):
        n_params = TinyGPT(mcfg).num_params()
    fpt = palm_flops_per_token(n_params, n_layers=mcfg.n_layers, n_heads=mcfg.n_heads,
                               head_dim=mcfg.head_dim, seq_len=1024)
    wanted = None if not args.cases else [c.strip() for c in args.cases.split(",")]
    cases = {name: extra for name, extra in MFU_CASES.items()
             if (wanted is None or name.strip() in wanted) and (not args.quick or not extra)}
    results = {}
    print(f"GPT-2 small ({n_params / 1e6:.1f}M params, {fpt / 1e9:.3f} GFLOP/token), seq 1024, "
          f"micro-batch {args.micro_batch}, on {env['device']}")
    print(f"  datasheet bf16 peak {sheet.peak_flops('bf16') / 1e12:.0f} TFLOP/s; measured matmul "
          f"peak {measured_peak / 1e12:.0f} TFLOP/s" if sheet else "  (GPU not in the datasheet table)")
    for name, extra in cases.items():
        torch.cuda.reset_peak_memory_stats()
        try:
            r = run_trainer_case(gpt2_small_overrides(args.micro_batch, args.steps) + extra, skip=args.skip)
        except Exception as exc:  # one case's failure (e.g. torchao missing) must not lose the others
            print(f"  {name:36s} FAILED: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            torch.cuda.empty_cache()
            continue
        r["mfu_measured_peak"] = r["tokens_per_s"] * fpt / measured_peak
        results[name] = r
        if "fp8_recipe" in r:
            print(f"    ({r['fp8_linears']} nn.Linear layers converted to torchao Float8Linear, {r['fp8_recipe']})")
        print(f"  {name:36s} {r['tokens_per_s']:>10,.0f} tok/s  step {r['step_ms']:6.1f} ms  "
              f"MFU {100 * (r['mfu_datasheet'] or 0):5.1f}% of datasheet, "
              f"{100 * r['mfu_measured_peak']:5.1f}% of measured matmul  "
              f"(loss {r['final_loss']:.3f}, peak {r['peak_allocated_bytes'] / GiB:.1f} GiB)", flush=True)
        torch.cuda.empty_cache()
    return {"env": env, "matmul_bf16_flops": measured_peak, "flops_per_token": fpt, "n_params": n_params,
            "micro_batch": args.micro_batch, "steps": args.steps, "skip": args.skip, "cases": results}


def run_profile(args) -> dict:
    """Profile steady steps of the MFU run (the first case) with torch.profiler: GPU busy time
    over wall time, and the kernels that take the time. The profiler steps once per logged
    metrics row, i.e. once per optimizer step, without touching the trainer."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from course_lib.trainer import metrics

    active = 5
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=args.skip, warmup=2, active=active))
    original = metrics.MetricsLog.write

    def write(self, row):
        original(self, row)
        prof.step()

    metrics.MetricsLog.write = write
    try:
        with prof:
            r = run_trainer_case(gpt2_small_overrides(args.micro_batch, args.skip + 2 + active + 1), skip=args.skip)
    finally:
        metrics.MetricsLog.write = original
    # Device-side events, without the profiler's own step marks and user annotations
    # ("ProfilerStep#N", "Optimizer.step#AdamW.step") that span kernels rather than being one.
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("ProfilerStep") and "#" not in e.name]
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    span_us = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels))
    by_name: dict[str, float] = {}
    for e in kernels:
        key = e.name[:90]
        by_name[key] = by_name.get(key, 0.0) + e.time_range.elapsed_us()
    total = sum(by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]
    groups = {"matmul (gemm)": ("gemm", "sm90", "cutlass", "nvjet", "cublas", "xmma"),
              "attention (flash/efficient)": ("flash", "fmha", "attention", "efficient"),
              "optimizer (fused adam)": ("adam", "fused_adam", "multi_tensor"),
              "triton (compiled elementwise/norm/softmax)": ("triton",)}
    grouped = {g: sum(t for n, t in by_name.items() if any(k in n.lower() for k in keys))
               for g, keys in groups.items()}
    grouped["other"] = total - sum(grouped.values())
    print(f"  {active} steps: GPU busy {busy_us / span_us:.1%} of the span between first and last kernel "
          f"({busy_us / 1e3 / active:.1f} ms busy per step, step {r['step_ms']:.1f} ms)")
    for g, t in grouped.items():
        print(f"    {g:44s} {t / 1e3 / active:7.2f} ms/step  {t / total:6.1%}")
    print("  top kernels (ms per step):")
    for name, t in top:
        print(f"    {t / 1e3 / active:7.2f}  {name}")
    cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                 key=lambda e: -e.self_cpu_time_total)[:args.top]
    print("  host (CPU) time by operator, ms per step (self time):")
    for e in cpu:
        print(f"    {e.self_cpu_time_total / 1e3 / active:7.2f}  {e.key[:90]}")
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return {"run": r, "busy_fraction": busy_us / span_us, "busy_ms_per_step": busy_us / 1e3 / active,
            "groups_ms_per_step": {g: t / 1e3 / active for g, t in grouped.items()},
            "top_kernels_ms_per_step": {n: t / 1e3 / active for n, t in top},
            "top_host_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / active for e in cpu}}


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    busy, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if start > end_so_far:
            busy += end - start
            end_so_far = end
        elif end > end_so_far:
            busy += end - end_so_far
            end_so_far = end
    return busy


# ----------------------------------------------------------------------------- memory vs estimator
def memory_configs(quick: bool) -> list[tuple[str, dict, int, str]]:
    """(label, ModelConfig preset overrides, micro-batch, recompute) for the memory sweep."""
    gpt2 = dict(preset="gpt2-small", vocab_size=50304)
    llama = dict(preset="llama-tiny", vocab_size=32000, block_size=2048, n_layers=12, d_model=1024,
                 n_heads=16, n_kv_heads=4, d_ff=2816)
    out = []
    for mb in ((1, 8) if quick else (1, 4, 8, 16)):
        for rc in ("none", "selective", "full"):
            out.append((f"gpt2-small mb={mb} recompute={rc}", gpt2, mb, rc))
    for mb in ((1,) if quick else (1, 4)):
        for rc in ("none", "full"):
            out.append((f"llama-style 0.3B mb={mb} recompute={rc}", llama, mb, rc))
    # The optimizer step sets the peak here: does fused AdamW allocate the foreach temporaries?
    out.append(("gpt2-small mb=1 recompute=full, fused AdamW", {**gpt2, "fused_adamw": True}, 1, "full"))
    return out


def memory_row(label: str, spec: dict, micro_batch: int, recompute: str) -> dict:
    """One fp32 training step (AdamW after a warm-up step, so its moments exist), twice: with the
    loop keeping the logits through backward (``logits, loss = model(x, y)``) and dropping them.
    The allocator's peak (bytes above what was allocated before the model existed) next to the
    estimator: model states + saved activations, and + the output layer's backward transients.
    The saved activations are also measured exactly (saved-tensor hooks)."""
    import gc

    from course_lib import estimate
    from course_lib.measure import saved_activation_bytes, tinygpt_activation_kwargs
    from course_lib.model import ModelConfig, TinyGPT

    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    spec = dict(spec)
    fused = spec.pop("fused_adamw", False)
    cfg = ModelConfig.preset(spec.pop("preset"), checkpointing=recompute, **spec)
    seq = cfg.block_size
    torch.manual_seed(0)
    model = TinyGPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq), device="cuda")

    def step(keep_logits: bool):
        if keep_logits:
            logits, loss = model(idx, idx)  # noqa: F841 - alive until the function returns
        else:
            loss = model(idx, idx)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(False)  # AdamW moments, cuBLAS workspaces and kernels exist from here on
    peaks = {}
    for keep in (True, False):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(keep)
        torch.cuda.synchronize()
        peaks[keep] = torch.cuda.max_memory_allocated() - base
    saved = saved_activation_bytes(model, idx, idx).total_bytes
    n = model.num_params()
    kwargs = tinygpt_activation_kwargs(cfg, seq_len=seq, micro_batch=micro_batch)
    act = estimate.activation_bytes_first_stage(n_layers=cfg.n_layers, vocab_size=cfg.vocab_size, **kwargs)
    act += 8 * seq * micro_batch * 2  # int64 token ids and targets (not in Korthikanti's accounting)
    states = estimate.model_state_bytes(n, recipe="fp32-adam")
    est = {keep: estimate.training_step_peak_bytes(
        states, act,
        transient_bytes=estimate.output_backward_transient_bytes(
            seq_len=seq, micro_batch=micro_batch, vocab_size=cfg.vocab_size, bytes_per_element=4,
            logits_kept=keep)) for keep in (True, False)}
    del model, opt, idx, step
    gc.collect()
    torch.cuda.empty_cache()
    return {"config": label, "params": n, "micro_batch": micro_batch, "recompute": recompute,
            "measured_peak_logits_kept": peaks[True], "measured_peak": peaks[False],
            "measured_saved_activations": saved, "est_model_states": states.total, "est_activations": act,
            "est_states_plus_activations": states.total + act,
            "est_peak_logits_kept": est[True].peak, "est_peak": est[False].peak, "est_where": est[False].where,
            "ratio_without_transients": peaks[False] / (states.total + act),
            "ratio": peaks[False] / est[False].peak,
            "ratio_logits_kept": peaks[True] / est[True].peak,
            "logits_bytes": 4 * seq * micro_batch * cfg.vocab_size}


def run_memory(args) -> dict:
    env = environment()
    rows = []
    print(f"fp32 + AdamW, one step after a warm-up step, on {env['device']} (torch {env['torch']}); GiB")
    print(f"  {'config':40s} {'saved act':>9s} {'est act':>8s} | {'measured':>8s} {'st+act':>7s} "
          f"{'estimate':>8s} {'ratio':>6s} {'peak at':>14s} | {'logits kept':>11s} {'estimate':>8s} {'ratio':>6s}")
    for label, spec, mb, rc in memory_configs(args.quick):
        r = memory_row(label, spec, mb, rc)
        rows.append(r)
        g = {k: v / GiB for k, v in r.items() if isinstance(v, (int, float))}
        print(f"  {label:40s} {g['measured_saved_activations']:9.2f} {g['est_activations']:8.2f} | "
              f"{g['measured_peak']:8.2f} {g['est_states_plus_activations']:7.2f} {g['est_peak']:8.2f} "
              f"{r['ratio']:6.3f} {r['est_where']:>14s} | {g['measured_peak_logits_kept']:11.2f} {g['est_peak_logits_kept']:8.2f} "
              f"{r['ratio_logits_kept']:6.3f}", flush=True)
    return {"env": env, "rows": rows}


# ----------------------------------------------------------------------------- memory under accumulation
ACCUM_STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}  # train.strategy -> ZeRO stage it is
# "ddp-bucket-view": the trainer's ddp with torch DDP's gradient_as_bucket_view=True (the gradients
# *are* the buckets), to isolate the bucket copy the default DDP keeps beside the gradients.
ACCUM_VARIANTS = {**ACCUM_STRATEGIES, "ddp-bucket-view": 0}


class _BucketView:
    """Context: torch's DistributedDataParallel built with gradient_as_bucket_view=True."""

    def __enter__(self):
        self.original = torch.nn.parallel.DistributedDataParallel
        original = self.original

        class DDPBucketView(original):
            def __init__(self, *a, **kw):
                kw.setdefault("gradient_as_bucket_view", True)
                super().__init__(*a, **kw)

        torch.nn.parallel.DistributedDataParallel = DDPBucketView
        return self

    def __exit__(self, *exc):
        torch.nn.parallel.DistributedDataParallel = self.original


def _nccl_group_of_one() -> None:
    """A one-rank NCCL process group, so the trainer builds its data-parallel strategies (DDP,
    ZeRO-1/2, FSDP2) on the GPU as a torchrun rank would; the group is reused by every case."""
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)


def accum_row(variant: str, precision: str, grad_accum: int, micro_batch: int) -> dict:
    """One trainer run (GPT-2 small, seq 1024, 3 optimizer steps of ``grad_accum`` micro-batches
    of ``micro_batch`` sequences, AdamW) under ``strategy`` on the one-rank NCCL group: the CUDA
    allocator's peak (bytes above what was allocated before) next to the estimator's step peak -
    today's (no gradients at the start of backward) and with the gradients that accumulation keeps
    alive from the second micro-batch on. Activations: the saved-tensor census of one micro-batch
    of the same model under the same autocast (exact), so the columns differ by model state and
    transients only."""
    import gc

    from course_lib import estimate
    from course_lib.trainer import config as train_config
    from course_lib.measure import saved_activation_bytes
    from course_lib.model import TinyGPT
    from course_lib.train import train

    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    overrides = [o for o in gpt2_small_overrides(micro_batch, 3) if not o.startswith(("train.precision", "train.compile",
                                                                                        "optim.fused", "train.grad_accum"))]
    strategy = variant.split("-")[0]
    overrides += [f"train.precision='{precision}'", "train.compile=false", "optim.fused=false",
                  f"train.grad_accum={grad_accum}", f"train.strategy='{strategy}'", "schedule.warmup_steps=1"]
    cfg = train_config.load(None, overrides)
    with tempfile.TemporaryDirectory() as out:
        if variant == "ddp-bucket-view":
            with _BucketView():
                train(cfg, out)
        else:
            train(cfg, out)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    gc.collect()
    torch.cuda.empty_cache()
    mcfg = train_config.build_model_config(cfg)
    torch.manual_seed(0)
    model = TinyGPT(mcfg).cuda()
    idx = torch.randint(0, mcfg.vocab_size, (micro_batch, 1024), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        saved = saved_activation_bytes(lambda: model(idx, idx)[1],
                                       skip=tuple(model.parameters()) + tuple(model.buffers())).total_bytes
    n = model.num_params()
    del model, idx
    gc.collect()
    torch.cuda.empty_cache()
    stage = ACCUM_VARIANTS[variant]
    states = estimate.model_state_bytes(n, recipe="fp32-adam", zero_stage=stage, dp=1)  # autocast keeps fp32 states
    transient = estimate.output_backward_transient_bytes(seq_len=1024, micro_batch=micro_batch, vocab_size=mcfg.vocab_size,
                                                         bytes_per_element=2 if precision == "bf16" else 4)
    # The estimator's own accumulation term (gradients live from the second micro-batch on), and
    # for default DDP its buckets: a second gradient-sized buffer the all-reduce reads from.
    buckets = states.grads if variant == "ddp" else 0.0
    est = estimate.training_step_peak_bytes(states, saved, transient_bytes=transient, grad_accum=grad_accum,
                                            accumulation="local")
    est_buckets = estimate.training_step_peak_bytes(states, saved, transient_bytes=transient, grad_accum=grad_accum,
                                                    accumulation="local", reduce_bucket_bytes=buckets)
    return {"strategy": variant, "zero_stage": stage, "precision": precision, "grad_accum": grad_accum,
            "micro_batch": micro_batch, "params": n, "measured_peak": measured, "saved_activations": saved,
            "est_states": states.total, "est_grads": states.grads, "est_transient": transient,
            "est_peak": est.peak, "est_where": est.where, "est_peak_with_buckets": est_buckets.peak,
            "ratio": measured / est.peak, "ratio_with_buckets": measured / est_buckets.peak}


def run_memory_accum(args) -> dict:
    env = environment()
    _nccl_group_of_one()
    rows = []
    mb = min(args.micro_batch, 4)
    print(f"GPT-2 small, seq 1024, micro-batch {mb}, AdamW, the kit's trainer on a one-rank NCCL group, "
          f"on {env['device']} (torch {env['torch']}); GiB")
    print(f"  {'strategy':15s} {'prec':5s} {'accum':>5s} | {'measured':>8s} {'saved act':>9s} {'estimate':>9s} "
          f"{'ratio':>6s} | {'+ buckets':>9s} {'ratio':>6s}")
    variants = [v.strip() for v in args.accum_strategies.split(",")]
    for v in variants:
        if v not in ACCUM_VARIANTS:
            raise SystemExit(f"--accum-strategies: {v!r} is not one of {', '.join(ACCUM_VARIANTS)}")
    for precision in ("fp32", "bf16"):
        for variant in variants:
            for k in (int(x) for x in args.accum.split(",")):
                r = accum_row(variant, precision, k, mb)
                rows.append(r)
                print(f"  {variant:15s} {precision:5s} {k:5d} | {r['measured_peak'] / GiB:8.2f} "
                      f"{r['saved_activations'] / GiB:9.2f} {r['est_peak'] / GiB:9.2f} {r['ratio']:6.3f} | "
                      f"{r['est_peak_with_buckets'] / GiB:9.2f} {r['ratio_with_buckets']:6.3f}", flush=True)
    return {"env": env, "rows": rows}


# ----------------------------------------------------------------------------- leak and fragmentation
LEAK_LOOPS = ("train: losses.append(loss)", "train: losses.append(loss.detach())",
              "eval, grad on: losses.append(loss)", "eval, no_grad: losses.append(loss.item())")


def run_leak(args) -> dict:
    """Lab 04's loops on the GPU: allocated and reserved bytes after each step, next to the bytes
    one forward saves (the lab's CPU stand-in counts exactly those)."""
    from course_lib.measure import saved_activation_bytes
    from course_lib.model import ModelConfig, TinyGPT

    env = environment()
    cfg = ModelConfig.preset("gpt2-small", n_layers=4, vocab_size=8192, block_size=512)
    steps, mb = 6, 4
    out = {"env": env, "steps": steps, "loops": {}}
    idx = torch.randint(0, cfg.vocab_size, (mb, cfg.block_size), device="cuda")
    torch.manual_seed(0)
    probe = TinyGPT(cfg).cuda()
    per_forward = saved_activation_bytes(probe, idx, idx).total_bytes
    del probe
    torch.cuda.empty_cache()
    out["saved_bytes_per_forward"] = per_forward
    print(f"one forward saves {per_forward / MiB:.1f} MiB (the CPU stand-in's count); {env['device']}")
    for kind in LEAK_LOOPS:
        torch.manual_seed(0)
        model = TinyGPT(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses, alloc, reserved = [], [], []
        for _ in range(steps):
            if kind.startswith("train"):
                _, loss = model(idx, idx)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach() if "detach" in kind else loss)
            elif "no_grad" in kind:
                with torch.no_grad():
                    losses.append(model(idx, idx)[1].item())
            else:
                losses.append(model(idx, idx)[1])
            torch.cuda.synchronize()
            alloc.append(torch.cuda.memory_allocated())
            reserved.append(torch.cuda.memory_reserved())
        growth = (alloc[-1] - alloc[1]) / (steps - 2)  # per step, after the first (AdamW moments)
        out["loops"][kind] = {"allocated": alloc, "reserved": reserved, "growth_per_step": growth,
                              "growth_over_saved": growth / per_forward}
        print(f"  {kind:44s} allocated +{growth / MiB:8.2f} MiB/step ({growth / per_forward:5.3f} x one "
              f"forward's saved bytes); reserved {reserved[-1] / MiB:,.0f} MiB", flush=True)
        del model, opt, losses
        torch.cuda.empty_cache()
    return out


FRAG_CHILD = r"""
import json, random, torch
torch.manual_seed(0); random.seed(0)
peak_alloc = peak_res = 0
keep = []
for step in range(200):
    n = random.randint(1, 64) * 2**20   # a batch whose size changes every step (variable lengths)
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    keep.append(torch.empty(random.randint(1, 8) * 2**19, dtype=torch.uint8, device="cuda"))
    if len(keep) > 20:
        keep.pop(random.randrange(len(keep)))   # long-lived tensors freed out of order
    peak_alloc = max(peak_alloc, torch.cuda.memory_allocated())
    peak_res = max(peak_res, torch.cuda.memory_reserved())
    del a
stats = torch.cuda.memory_stats()
print(json.dumps({"peak_allocated": peak_alloc, "peak_reserved": peak_res,
                  "num_alloc_retries": stats.get("num_alloc_retries", 0),
                  "inactive_split_bytes": stats.get("inactive_split_bytes.all.current", 0)}))
"""


def run_fragmentation(args) -> dict:
    """Variable-size allocations with long-lived tensors freed out of order: the caching allocator's
    reserved bytes vs allocated bytes, in default mode and with expandable segments (each in a
    fresh process: the allocator's settings are read once, at CUDA start-up)."""
    env = environment()
    out = {"env": env, "modes": {}}
    for mode, conf in (("default", ""), ("expandable_segments", "expandable_segments:True")):
        child_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf} if conf else dict(os.environ)
        child_env.pop("PYTORCH_CUDA_ALLOC_CONF", None) if not conf else None
        done = subprocess.run([sys.executable, "-c", FRAG_CHILD], capture_output=True, text=True,
                              env=child_env, timeout=300)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        r = json.loads(done.stdout.strip().splitlines()[-1])
        r["reserved_over_allocated"] = r["peak_reserved"] / r["peak_allocated"]
        out["modes"][mode] = r
        print(f"  {mode:22s} peak allocated {r['peak_allocated'] / MiB:7.0f} MiB, peak reserved "
              f"{r['peak_reserved'] / MiB:7.0f} MiB ({r['reserved_over_allocated']:.2f} x), "
              f"inactive split {r['inactive_split_bytes'] / MiB:.0f} MiB", flush=True)
    return out


# ----------------------------------------------------------------------------- layouts on NCCL
LAYOUT_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def _losses(overrides: list[str]) -> list[float]:
    """Per-step losses of one trainer run (metrics.jsonl) with ``overrides``."""
    from course_lib.trainer import config as train_config
    from course_lib.train import train

    with tempfile.TemporaryDirectory() as out:
        train(train_config.load(None, overrides), out)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def run_layouts(args) -> dict:
    """The layouts that fit one GPU: every data-parallel strategy of the trainer on a one-rank NCCL
    group against the plain single-process loop, fp32, same seed and batches: per-step losses equal
    up to summation order. (Layouts of 2+ ranks - tp, pp, cp, dp - need as many GPUs: NCCL refuses
    two ranks on one device.)"""
    env = environment()
    _nccl_group_of_one()
    base = ["model.preset='gpt2-small'", "model.n_layers=4", "model.vocab_size=8192", "data.task='random'",
            "data.vocab_size=8192", "data.seq_len=512", "train.micro_batch=8", "train.grad_accum=2",
            "train.max_steps=8", "schedule.warmup_steps=2", "train.precision='fp32'", "train.compile=false",
            "train.progress=false", "train.device='cuda'", "checkpoint.save_every=0", "checkpoint.async_save=false"]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    single = _losses(base + ["train.strategy='single'"])
    out = {"env": env, "single": single, "layouts": {}}
    print(f"  single: losses {single[0]:.4f} -> {single[-1]:.4f} over {len(single)} steps")
    for strategy in LAYOUT_STRATEGIES:
        losses = _losses(base + [f"train.strategy='{strategy}'"])
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, single))
        out["layouts"][strategy] = {"losses": losses, "max_rel_diff": rel}
        print(f"  {strategy:6s} on a one-rank NCCL group: max relative loss difference vs single {rel:.2e} "
              f"({'equal' if rel < 1e-4 else 'DIFFERENT'})", flush=True)
    return out


# ----------------------------------------------------------------------------- async sharded save
def run_save_stall(args) -> dict:
    """FSDP2 with sharded (DCP) checkpoints on a one-rank NCCL group, GPT-2 small, bf16: the step
    after each save carries the save's stall (the trainer saves after writing a step's row), so the
    stall is that step's seconds minus the median step, for a synchronous and an async save."""
    env = environment()
    _nccl_group_of_one()
    from course_lib.trainer import config as train_config
    from course_lib.train import train

    steps, every = 31, 10
    out = {"env": env, "modes": {}}
    for mode in ("sync", "async"):
        overrides = [o for o in gpt2_small_overrides(8, steps) if not o.startswith(("train.compile", "checkpoint."))]
        overrides += ["train.compile=false", "train.strategy='fsdp'", "checkpoint.format='sharded'",
                      f"checkpoint.save_every={every}", f"checkpoint.async_save={'true' if mode == 'async' else 'false'}",
                      "checkpoint.keep_last=5"]
        with tempfile.TemporaryDirectory() as run_dir:
            train(train_config.load(None, overrides), run_dir)
            rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
            ckpt_bytes = sum(f.stat().st_size for f in (Path(run_dir) / "checkpoints").rglob("*") if f.is_file())
        secs = {r["step"]: r["step_seconds"] for r in rows}
        after = [s + 1 for s in range(every, steps, every) if s + 1 in secs]
        normal = statistics.median(v for k, v in secs.items() if k > 3 and k not in after)
        stalls = [secs[s] - normal for s in after]
        out["modes"][mode] = {"step_ms": 1e3 * normal, "stall_ms": [1e3 * x for x in stalls],
                              "checkpoint_bytes_on_disk": ckpt_bytes}
        print(f"  {mode:5s} sharded save of GPT-2 small + AdamW: stall {', '.join(f'{1e3 * x:.0f}' for x in stalls)} ms "
              f"(steps {1e3 * normal:.1f} ms; {ckpt_bytes / GiB:.2f} GiB on disk for all kept checkpoints)", flush=True)
    sync, asyn = (statistics.mean(out["modes"][m]["stall_ms"]) for m in ("sync", "async"))
    out["async_over_sync"] = asyn / sync if sync > 0 else None
    print(f"  async stall / sync stall = {asyn:.0f} / {sync:.0f} ms = {asyn / sync:.2f}")
    return out


# ----------------------------------------------------------------------------- command line
COMMANDS = {"env": run_env, "mfu": run_mfu, "profile": run_profile, "memory": run_memory, "leak": run_leak,
            "fragmentation": run_fragmentation, "memory-accum": run_memory_accum, "layouts": run_layouts,
            "save-stall": run_save_stall}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="+", choices=list(COMMANDS), help="which measurements, in order")
    parser.add_argument("--steps", type=int, default=60, help="mfu: optimizer steps per case")
    parser.add_argument("--skip", type=int, default=20, help="mfu: first steps left out (compilation)")
    parser.add_argument("--micro-batch", type=int, default=16, help="mfu: sequences per step")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--cases", help="mfu: comma-separated case names to run, e.g. \"bf16 + compile + fused AdamW,+ micro-batch 32\" (default: all)")
    parser.add_argument("--accum-strategies", default=",".join(ACCUM_VARIANTS),
                        help=f"memory-accum: which of {', '.join(ACCUM_VARIANTS)} (comma-separated)")
    parser.add_argument("--accum", default="1,4,16", help="memory-accum: grad_accum values (comma-separated)")
    parser.add_argument("--top", type=int, default=15, help="profile: kernels listed")
    parser.add_argument("--trace", type=Path, help="profile: write a Chrome trace here")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    if args.steps <= args.skip:
        parser.error(f"--steps ({args.steps}) must be > --skip ({args.skip})")
    if not torch.cuda.is_available():
        print(f"gpu_check needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    results = {}
    for what in args.what:
        print(f"== {what}", flush=True)
        results[what] = COMMANDS[what](args)
        if args.json:  # after every part: a later failure keeps what was measured
            args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
