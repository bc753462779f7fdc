"""Rank functions for tests/test_train_expert_parallel.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def entry(rank, result) -> dict:
    """model_parallel_rank_fns.weights_entry (the gathered one-process weights on rank 0) plus every
    rank's expert biases (the bias update must leave them equal everywhere)."""
    from course_lib.model.moe import moe_layers
    from model_parallel_rank_fns import weights_entry

    return {**weights_entry(rank, result),
            "bias": [m.router.expert_bias.detach().clone() for m in moe_layers(result.model)]}


def train_and_cross_resume(rank, world_size, runs, crosses, resume=True):
    """Every fresh run of ``runs`` (each ``(cfg, out_dir)``, trained into ``out_dir/full``) and, with
    ``resume``, its resume in the same layout (model_parallel_rank_fns.train_then_resume), then each
    ``(cfg, src, dst)`` of ``crosses``: the run folder ``src`` copied to ``dst`` without its newest
    checkpoint and resumed there under ``cfg`` (another EP size), in one launch."""
    import model_parallel_rank_fns as fns
    from course_lib.train import train

    if resume:
        out = fns.train_then_resume(rank, world_size, runs, entry=entry)
    else:
        out = {"first": [entry(rank, train(cfg, o + "/full")) for cfg, o in runs]}
    out["cross"] = []
    for cfg, src, dst in crosses:
        fns.copy_without_newest(src, dst)
        out["cross"].append(entry(rank, train(cfg, dst, resume=True)))
    return out
