"""Rank functions for tests/test_train_context_parallel.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def ring_bytes(rank, world_size, cfg, out_dir):
    """Bytes this rank's ring attention sent (``bytes_sent_forward`` / ``_backward``) over a run of
    ``cfg``, counted by ring_attention itself through ContextParallelCore.stats."""
    from course_lib.parallel.context_parallel import in_trainer
    from course_lib.train import train

    stats = {}
    in_trainer.ContextParallelCore.stats = stats  # every core of this process adds to it
    try:
        train(cfg, out_dir)
    finally:
        in_trainer.ContextParallelCore.stats = None
    return stats


def train_resume_and_count(rank, world_size, runs, count_reads, bytes_cfg, bytes_dir):
    """Every fresh run and every resume (model_parallel_rank_fns.train_then_resume; the resumes of
    ``count_reads`` also count host reads per step), then :func:`ring_bytes` of ``bytes_cfg``, in
    one launch (starting 4 ranks and each process's first train() are the slow part)."""
    import model_parallel_rank_fns as fns

    return {**fns.train_then_resume(rank, world_size, runs, count_reads),
            "bytes": ring_bytes(rank, world_size, bytes_cfg, bytes_dir)}
