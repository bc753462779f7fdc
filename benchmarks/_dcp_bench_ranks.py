"""Rank function for benchmarks/bench_async_dcp.py (spawned ranks import it from here, not the
script's ``__main__``).

Every rank builds the same MLP (seed 0), shards it with FSDP2 over all ranks, and times, in
turn: plain training steps, synchronous sharded saves (``dcp.save_sharded``) and async ones
(``AsyncShardedSaver``). A barrier before every timed section lines the ranks up; each rank
returns its own seconds, and the caller takes the slower rank of each measurement (training
waits for the slowest rank).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 1024


def _model(params_m: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _steps(model, opt, x, n: int) -> list[float]:
    """Seconds of each of ``n`` training steps (forward, backward, AdamW, zero_grad)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(time.perf_counter() - t0)
    return out


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(rank: int, world_size: int, root: str, params_m: float, repeats: int, gap: int) -> dict:
    """Per repeat: a sync save, ``gap`` steps, an async save, ``gap`` steps overlapping its
    background write, then the wait the next save would pay. Returns this rank's seconds:
    ``base`` (steps without a save nearby), ``sync`` (whole save calls), ``async_call`` (the
    save() calls), ``async_wait`` (the later waits), ``during`` (the steps that overlapped a
    background write), ``bytes`` (this rank's files in one checkpoint)."""
    from course_lib.checkpoint.dcp import save_sharded
    from course_lib.checkpoint.dcp_async import AsyncShardedSaver

    model, opt = _model(params_m)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
    _steps(model, opt, x, 2)  # warm-up; AdamW state exists from here on
    saver = AsyncShardedSaver()
    out = {"params": sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the global one
           "base": [], "sync": [], "async_call": [], "async_wait": [], "during": []}
    step = 0
    for r in range(repeats):
        dist.barrier()
        out["base"] += _steps(model, opt, x, gap)
        step += 1
        out["sync"].append(_timed(lambda: save_sharded(Path(root) / "sync", step, model, opt, keep_last=1)))
        out["base"] += _steps(model, opt, x, gap)
        step += 1
        out["async_call"].append(_timed(lambda: saver.save(Path(root) / "async", step, model, opt, keep_last=1)))
        out["during"] += _steps(model, opt, x, gap)
        t0 = time.perf_counter()
        saver.wait()
        out["async_wait"].append(time.perf_counter() - t0)
    saver.close()
    newest = sorted((Path(root) / "async").glob("step_*"))[-1]
    out["bytes"] = sum(f.stat().st_size for f in newest.iterdir()
                       if f.name in (f"__{rank}_0.distcp", f"rank{rank}.pt"))
    return out
