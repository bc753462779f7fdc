"""Rank functions for tests/test_sharded_mirror.py (importable: run_ranks starts fresh processes)."""
from __future__ import annotations


def train_wipe_resume(rank, world_size, first_cfg, second_cfg, out_dir):
    """Train with ``first_cfg``, wipe the local checkpoint folder (a lost disk: only the mirror
    keeps the run), then ``--resume auto`` with ``second_cfg``. Returns, per run, the steps and
    where it resumed from; rank 0 also what the folder held just before the resume."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.train import train

    first = train(first_cfg, out_dir)
    dist.barrier()
    ckpts = Path(out_dir) / "checkpoints"
    if rank == 0:
        shutil.rmtree(ckpts)
    dist.barrier()
    left = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    second = train(second_cfg, out_dir, resume=True)
    return {"first": (first.steps, first.resumed_from), "second": (second.steps, second.resumed_from),
            "left_before_resume": left}


def resume_only(rank, world_size, cfg, out_dir):
    """``--resume auto`` into an empty folder: whatever it resumes from came from the mirror."""
    from course_lib.train import train

    result = train(cfg, out_dir, resume=True)
    return result.steps, result.resumed_from
