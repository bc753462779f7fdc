"""Checkpoint cost: training stall of an async save vs a synchronous save, and save throughput vs
the disk's raw write speed, all measured in the same run on the same directory.

    python benchmarks/bench_checkpoint.py [--params-m 8] [--repeats 3] [--dir /path/on/the/disk]

* raw disk: write the checkpoint's byte count of random data to a new file + fsync (MB/s);
* sync save: ``CheckpointManager(async_save=False).save`` - snapshot, serialize, write with fsync
  (and sha256), rename, re-read + verify, prune: the whole time training would wait; its phases
  are printed, the write phase's throughput next to the raw disk's;
* async save: the time ``save()`` blocks the training thread (the CPU copy of the state), and the
  background write's duration; plus the slowdown of training steps that run while the background
  write is in progress (on 2 cores the writer competes with training for CPU).

Issue 5's target: async stall per save <= 10% of a synchronous save of the same state. Ratios are
printed, never asserted.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from course_lib.checkpoint import CheckpointManager
from course_lib.checkpoint.io import fsync_dir, write_durable


def build(params_m: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP of about ``params_m`` million parameters with AdamW state (12 bytes/param on disk:
    4 weights + 8 Adam moments)."""
    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> float:
    """Seconds per step for ``n`` small training steps."""
    x = torch.randn(16, 1024)
    t0 = time.perf_counter()
    for _ in range(n):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / n


def raw_write(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` random bytes to a new file with fsync (file + directory)."""
    data = os.urandom(nbytes)
    path = folder / "raw.bin"
    t0 = time.perf_counter()
    write_durable(path, data)
    fsync_dir(folder)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=float, default=8.0, help="model size, millions of parameters")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir); the disk under test")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for the training steps")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=a.dir))
    try:
        model, opt = build(a.params_m)
        n_params = sum(p.numel() for p in model.parameters())
        sync_mgr = CheckpointManager(root / "sync", async_save=False, keep_last=1)
        async_mgr = CheckpointManager(root / "async", async_save=True, keep_last=1)
        sync_s, stall_s, write_s, raw_s, slow, phases = [], [], [], [], [], []
        base_step = train_steps(model, opt, 3)
        for r in range(a.repeats):
            t0 = time.perf_counter()
            sync_mgr.save(2 * r + 1, model=model, optimizer=opt)
            sync_s.append(time.perf_counter() - t0)
            nbytes = sync_mgr.last_bytes
            raw_s.append(raw_write(root, nbytes))
            base_step = train_steps(model, opt, 3)
            t0 = time.perf_counter()
            async_mgr.save(2 * r + 2, model=model, optimizer=opt)
            stall_s.append(time.perf_counter() - t0)
            during = train_steps(model, opt, 3)  # steps that overlap the background write
            async_mgr.wait()
            write_s.append(async_mgr.last_write_s)
            phases.append(dict(sync_mgr.last_timings))
            slow.append(during / base_step)
        async_mgr.close()
        mb = nbytes / 1e6
        med, best = statistics.median, min
        sync, stall, write, raw = (med(v) for v in (sync_s, stall_s, write_s, raw_s))
        print(f"state: {n_params / 1e6:.1f} M params + AdamW = {mb:.1f} MB per checkpoint; "
              f"median (best) of {a.repeats} repeats; this disk's speed varies a lot between writes")
        print(f"raw disk write + fsync : {raw * 1e3:8.1f} ms ({best(raw_s) * 1e3:6.1f})  "
              f"{mb / raw:7.1f} MB/s ({mb / best(raw_s):6.1f})")
        print(f"sync save (all of it)  : {sync * 1e3:8.1f} ms ({best(sync_s) * 1e3:6.1f})  "
              f"{mb / sync:7.1f} MB/s ({mb / best(sync_s):6.1f}) = {raw / sync:.2f} "
              f"({best(raw_s) / best(sync_s):.2f}) x raw disk speed")
        for phase in phases[0]:
            vals = [ph[phase] for ph in phases]
            extra = (f"  {mb / med(vals):7.1f} MB/s ({mb / best(vals):6.1f}) = {raw / med(vals):.2f} "
                     f"({best(raw_s) / best(vals):.2f}) x raw disk speed" if phase == "write" else "")
            print(f"  of which {phase:<12}: {med(vals) * 1e3:8.1f} ms ({best(vals) * 1e3:6.1f}){extra}")
        print(f"async save, stall      : {stall * 1e3:8.1f} ms ({best(stall_s) * 1e3:6.1f})  "
              f"(the CPU copy on the training thread)")
        print(f"async save, background : {write * 1e3:8.1f} ms ({best(write_s) * 1e3:6.1f})  "
              f"(serialize, write, fsync, verify, prune)")
        print(f"stall / sync save      : {stall / sync:8.3f} ({best(stall_s) / best(sync_s):.3f})  target <= 0.10")
        print(f"training steps during the background write: {med(slow):.2f} x their normal time "
              f"({base_step * 1e3:.1f} ms/step normally; the writer thread competes for the cores)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
