"""Rank functions for tests/test_ckpt_roundtrip.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def trainer_weights(result) -> dict:
    """The trainer's own full weights at its last step, as CPU fp32 copies (a collective where
    they are sharded: every rank calls it). DeepSpeed ZeRO-3 partitions the module's parameters,
    so they are gathered with DeepSpeed's own ``GatheredParameters`` first."""
    strategy = result.strategy
    if hasattr(strategy, "engine") and strategy.engine.zero_optimization_stage() == 3:
        import deepspeed

        module = strategy.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().float().cpu().clone() for k, v in strategy.full_weights().items()}


def train_many_weights(rank, world_size, runs):
    """Several trainer runs in one launch (each ``(cfg, out_dir)``); for each, rank 0 returns the
    trainer's weights at the last step (:func:`trainer_weights`), the other ranks None."""
    from course_lib.train import train

    out = []
    for cfg, out_dir in runs:
        weights = trainer_weights(train(cfg, out_dir))
        out.append(weights if rank == 0 else None)
    return out
