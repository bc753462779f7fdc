"""Rank functions for benchmarks/bench_data_parallel.py (spawned ranks import them from here).

Kept apart from the script so that a spawned rank imports only this (light) module, not the
script's ``__main__``. Every function runs inside ``course_lib.parallel.run_ranks`` on gloo with
one thread per rank, builds all of its variants on identical copies of one TinyGPT (same seed),
then times them **interleaved**: round after round, each variant runs ``block`` steps in turn
(order rotated every round), so machine noise lands on all of them alike.

A step is forward + backward + gradient sync + AdamW step + zero_grad on a fixed batch (data
loading left out); a barrier before every step (outside the timing) lines the ranks up, and each
rank returns its per-step seconds, so the caller can take the slower rank per step.
"""
from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

LR = 1e-4


def _model(cfg: dict):
    from course_lib.model import ModelConfig, TinyGPT

    torch.manual_seed(0)
    return TinyGPT(ModelConfig(**cfg))


def _batch(cfg: dict, batch: int, seq: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own slice of the global batch
    x = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class Variant:
    """One way of training the same model. ``step()`` runs one full step and returns the seconds
    of its phases: fwd, bwd (torch DDP's all-reduce included), sync (an explicit
    finish_gradient_synchronization, if any) and opt (optimizer step + zero_grad)."""

    def __init__(self, name: str, group: str):
        self.name, self.group = name, group
        self.times: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.error: str | None = None
        self.note = ""

    def step(self, x, y) -> dict[str, float]:  # pragma: no cover - overridden
        raise NotImplementedError


class WrapperVariant(Variant):
    """A model wrapper (torch DDP, the kit's DDPs and FSDPs, FSDP2) + torch AdamW."""

    def __init__(self, name: str, group: str, model, opt, sync: Callable[[], None] | None):
        super().__init__(name, group)
        self.model, self.opt, self.sync = model, opt, sync

    def step(self, x, y) -> dict[str, float]:
        pc = time.perf_counter
        t0 = pc()
        _, loss = self.model(x, y)
        t1 = pc()
        loss.backward()
        t2 = pc()
        if self.sync is not None:
            self.sync()
        t3 = pc()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = pc()
        return {"fwd": t1 - t0, "bwd": t2 - t1, "sync": t3 - t2, "opt": t4 - t3}


class DeepSpeedVariant(Variant):
    def __init__(self, name: str, engine):
        super().__init__(name, "deepspeed")
        self.engine = engine

    def step(self, x, y) -> dict[str, float]:
        pc = time.perf_counter
        t0 = pc()
        _, loss = self.engine(x, y)
        t1 = pc()
        self.engine.backward(loss)
        t2 = pc()
        self.engine.step()  # optimizer step (+ ZeRO's gather/partition work) and zero_grad
        t3 = pc()
        return {"fwd": t1 - t0, "bwd": t2 - t1, "sync": 0.0, "opt": t3 - t2}


# ---------------------------------------------------------------------------------------------
# builders (each returns a Variant; a failure is recorded, never raised)
# ---------------------------------------------------------------------------------------------

def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def build_torch_ddp(cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(cfg))  # defaults: bucket_cap_mb=25, find_unused_parameters=False
    return WrapperVariant("torch DDP", "ddp", model, _adamw(model.parameters()), None)


def build_naive(cfg):
    from course_lib.parallel import NaiveDDP

    model = NaiveDDP(_model(cfg))
    return WrapperVariant("NaiveDDP", "ddp", model, _adamw(model.parameters()),
                          model.finish_gradient_synchronization)


def build_bucketed(cfg, bucket_mb: float | None = 25.0, find_unused: bool = False, label: str | None = None):
    from course_lib.parallel import BucketedDDP

    model = BucketedDDP(_model(cfg), bucket_mb=bucket_mb, find_unused_parameters=find_unused)
    name = label or f"BucketedDDP {'one bucket' if bucket_mb is None else f'{bucket_mb:g} MB'}"
    v = WrapperVariant(name, "bucket", model, _adamw(model.parameters()), model.finish_gradient_synchronization)
    v.note = f"{model.bucket_count} bucket{'' if model.bucket_count == 1 else 's'}"
    return v


def build_fsdp2(cfg, reshard: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return WrapperVariant(f"FSDP2 reshard_after_forward={reshard}", "fsdp", model, _adamw(model.parameters()), None)


def build_simple_fsdp(cfg):
    from course_lib.parallel import SimpleFSDP

    model = SimpleFSDP(_model(cfg))
    return WrapperVariant("SimpleFSDP (from scratch)", "fsdp", model, _adamw(model.parameters()),
                          model.finish_gradient_synchronization)


def build_deepspeed(cfg, stage: int, batch: int, bf16: bool):
    import deepspeed

    model = _model(cfg)
    ds_cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "wall_clock_breakdown": False, "bf16": {"enabled": bf16}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()), config=ds_cfg)
    v = DeepSpeedVariant(f"DeepSpeed ZeRO-{stage} {'bf16' if bf16 else 'fp32'}", engine)
    v.note = "torch AdamW (client optimizer)"
    return v


# ---------------------------------------------------------------------------------------------

def _extensions() -> dict[str, float]:
    """The built op libraries in TORCH_EXTENSIONS_DIR (path -> mtime): a new one means a JIT build."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    out = {}
    if root and os.path.isdir(root):
        for d, _, files in os.walk(root):
            for f in files:
                if f.endswith(".so"):
                    p = os.path.join(d, f)
                    out[p] = os.path.getmtime(p)
    return out


def _try(name: str, group: str, fn: Callable[[], Variant]) -> Variant:
    """Build a variant on every rank; if any rank failed, all drop it (no collective mismatch)."""
    variant, err = None, ""
    try:
        variant = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table, never crashes the run
        err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        traceback.print_exc()
    flag = torch.tensor([0.0 if err else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < 1.0:
        v = Variant(name, group)
        v.error = err or "failed on another rank"
        return v
    return variant


def _timed_step(v: Variant, x, y) -> None:
    try:
        ph = v.step(x, y)
        ok = 1.0
    except Exception as exc:  # noqa: BLE001
        ph, ok = None, 0.0
        v.error = f"step failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        traceback.print_exc()
    flag = torch.tensor([ok])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < 1.0:
        v.error = v.error or "step failed on another rank"
        raise _Dropped()
    v.phases.append(ph)
    v.times.append(sum(ph.values()))


class _Dropped(Exception):
    pass


def run_phases(rank: int, world_size: int, cfg: dict, batch: int, seq: int, phases: list[tuple[list, int]],
               warmup: int, block: int) -> list[dict[str, Any]]:
    """:func:`run_interleaved` for each ``(specs, rounds)`` in ``phases``, one after the other in the
    same processes (one start-up for all); each phase's models are freed before the next is built."""
    import gc

    out = []
    for specs, rounds in phases:
        out.append(run_interleaved(rank, world_size, cfg, batch, seq, specs, warmup, rounds, block))
        gc.collect()
    return out


def run_interleaved(rank: int, world_size: int, cfg: dict, batch: int, seq: int, specs: list,
                    warmup: int, rounds: int, block: int) -> dict[str, Any]:
    """Build every variant in ``specs`` (list of (name, group, builder name, kwargs)), warm each up
    ``warmup`` steps, then ``rounds`` rounds of ``block`` steps per variant (order rotated each
    round). Returns per-variant step seconds (warm-up excluded), phases, notes, errors."""
    before, t_build = _extensions(), time.perf_counter()  # before DeepSpeed's init (shm_comm build)
    ds_error = None
    if any(s[2] == "build_deepspeed" for s in specs):
        try:
            import logging

            import deepspeed
            from deepspeed.utils import logger as ds_logger

            ds_logger.setLevel(logging.WARNING)
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        except Exception as exc:  # noqa: BLE001 - every DeepSpeed variant then reports it
            ds_error = RuntimeError(f"deepspeed import/init_distributed failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    def build(builder: str, kwargs: dict) -> Variant:
        if builder == "build_deepspeed" and ds_error is not None:
            raise ds_error
        return globals()[builder](cfg, **kwargs)

    x, y = _batch(cfg, batch, seq, rank)
    variants: list[Variant] = []
    for name, group, builder, kwargs in specs:
        variants.append(_try(name, group, lambda b=builder, k=kwargs: build(b, k)))
        variants[-1].name = name
    # warm-up (allocator, thread pools, lazy init, any JIT op build)
    live = [v for v in variants if v.error is None]
    for v in live:
        with contextlib.suppress(_Dropped):
            for _ in range(warmup):
                dist.barrier()
                _timed_step(v, x, y)
        v.times.clear()
        v.phases.clear()
    setup_s = time.perf_counter() - t_build
    after = _extensions()
    built = sorted(os.path.basename(p) for p, m in after.items() if before.get(p) != m)
    live = [v for v in variants if v.error is None]
    round_of: dict[str, list[int]] = {v.name: [] for v in variants}
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        if r % 2:
            order = order[::-1]
        for v in order:
            if v.error is not None:
                continue
            try:
                for _ in range(block):
                    dist.barrier()
                    _timed_step(v, x, y)
                    round_of[v.name].append(r)
            except _Dropped:
                pass
    return {"variants": [{"name": v.name, "group": v.group, "times": v.times, "phases": v.phases,
                          "rounds": round_of[v.name], "error": v.error, "note": v.note} for v in variants],
            "built_ops": built, "setup_s": setup_s, "threads": torch.get_num_threads()}
