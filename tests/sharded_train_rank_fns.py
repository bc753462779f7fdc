"""Rank functions for tests/test_train_sharded.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_and_report(rank, world_size, cfg, out_dir, resume=False):
    """One rank of a trainer run: steps, the final loss and (rank 0) the full weights, gathered
    through the strategy where they are sharded."""
    from course_lib.train import train

    result = train(cfg, out_dir, resume=resume)
    full = result.strategy.full_weights()  # a collective: every rank calls it
    return {"steps": result.steps, "resumed_from": result.resumed_from, "final_loss": result.final_loss,
            "weights": {k: v.float().cpu().clone() for k, v in full.items()} if rank == 0 else None}


def train_many(rank, world_size, runs):
    """Several trainer runs in one launch (each ``(cfg, out_dir, resume)``): the process start
    and the group set-up are paid once. Returns one report per run (see train_and_report)."""
    return [train_and_report(rank, world_size, cfg, out_dir, resume) for cfg, out_dir, resume in runs]
