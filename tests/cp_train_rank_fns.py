"""Rank functions for tests/test_train_context_parallel.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def host_reads(rank, world_size, cfg, out_dir, steps):
    """Host reads per optimizer step made by course_lib on this rank (runs of ``steps`` and
    ``2 * steps`` steps; see tests/host_reads.py)."""
    import os

    import course_lib.train as train_mod
    from host_reads import reads_per_step

    train_mod._peak_flops = lambda cfg, device: 1e12  # set-up only; keeps the count to the loop

    def run(n):
        train_mod.train({**cfg, "train": {**cfg["train"], "max_steps": n}}, os.path.join(out_dir, f"r{n}"))

    return reads_per_step(run, steps=steps)


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


def train_then_count_reads(rank, world_size, runs, reads_cfg, reads_dir, reads_steps, bytes_cfg, bytes_dir):
    """Every fresh run (model_parallel_rank_fns.train_many), then :func:`host_reads` of
    ``reads_cfg`` and :func:`ring_bytes` of ``bytes_cfg``, in one launch (starting 4 ranks is the
    slow part)."""
    import model_parallel_rank_fns as fns

    return {"runs": fns.train_many(rank, world_size, runs),
            "reads": host_reads(rank, world_size, reads_cfg, reads_dir, reads_steps),
            "bytes": ring_bytes(rank, world_size, bytes_cfg, bytes_dir)}
