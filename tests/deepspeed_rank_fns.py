"""Rank functions for tests/test_deepspeed_strategy.py (spawned ranks import them from here)."""
import os

import torch


def train_digest(rank, world_size, cfg, out_dir, faults=(), resume=False):
    """One rank of a training run: what it did and a digest of its weights."""
    from rank_fns import param_digest
    from course_lib.train import train

    result = train(cfg, out_dir, faults=list(faults), resume=resume)
    return {"steps": result.steps, "resumed_from": result.resumed_from, "final_loss": result.final_loss,
            "skipped": result.skipped_steps, "digest": param_digest(result.model)}


def train_many(rank, world_size, runs):
    """Several training runs one after another in the same ranks (one process start for all):
    ``runs`` is a list of ``(cfg, out_dir, faults, resume)``; returns :func:`train_digest` of each."""
    return [train_digest(rank, world_size, cfg, out_dir, faults, resume) for cfg, out_dir, faults, resume in runs]
