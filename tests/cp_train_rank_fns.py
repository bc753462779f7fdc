"""Rank functions for tests/test_train_context_parallel.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_then_count_reads(rank, world_size, runs, reads_cfg, reads_dir):
    """Every fresh run (model_parallel_rank_fns.train_many), then the host reads per optimizer
    step of ``reads_cfg`` on this rank, in one launch (starting 4 ranks is the slow part)."""
    import model_parallel_rank_fns as fns
    import rank_fns

    return {"runs": fns.train_many(rank, world_size, runs),
            "reads": rank_fns.host_reads_on_rank(rank, world_size, reads_cfg, reads_dir)}
