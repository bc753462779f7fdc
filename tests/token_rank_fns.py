"""Rank functions for tests/test_token_data.py (spawned ranks import them from here)."""
import shutil
from pathlib import Path

import torch.distributed as dist


def copy_checkpoint(src_run: str, step: int, dst_run: str) -> None:
    """Put ``src_run``'s checkpoint of ``step`` (and nothing newer) into ``dst_run/checkpoints``: a
    run folder whose newest checkpoint is that one, as a job killed right after it leaves."""
    src = next(p for p in (Path(src_run) / "checkpoints").iterdir()
               if p.name.startswith("step_") and int(p.name.split("_")[1]) == step)
    shutil.copytree(src, Path(dst_run) / "checkpoints" / src.name)


def tokens_runs(rank, world_size, cfg, scratch_cfg, tmp, step):
    """On 2 ranks: the tokens task from scratch (``tmp/ddp``, with ``scratch_cfg``), resumed from the
    one-process run's checkpoint (``tmp/up``, 1 -> 2 ranks) and from the 2-rank run's own
    (``tmp/same``, 2 -> 2). Returns the scratch run's validation loss (None on rank 1)."""
    from course_lib.train import train

    val_loss = train(scratch_cfg, f"{tmp}/ddp").val_loss
    train(cfg, f"{tmp}/up", resume=True)  # the test copied the checkpoint in before the launch
    if rank == 0:
        copy_checkpoint(f"{tmp}/ddp", step, f"{tmp}/same")
    dist.barrier()
    train(cfg, f"{tmp}/same", resume=True)
    return val_loss
