"""Rank functions for tests/test_train_pipeline_layouts.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_layouts(rank, world_size, runs):
    """Several trainer runs in one launch (each ``(cfg, out_dir, resume)``): per run, the steps,
    where it resumed from, the split the strategy chose, the dense block ids this rank holds, the
    per-rank autocast dtype seen by a stage forward, and (rank 0) the dense weights gathered through
    the strategy."""
    from course_lib.train import train

    return [layout_entry(rank, train(cfg, out_dir, resume=resume)) for cfg, out_dir, resume in runs]


def layout_entry(rank, result) -> dict:
    """:func:`train_layouts`' report of one run (a collective: every rank calls it)."""
    strategy = result.strategy
    full = strategy.full_weights()  # a collective: every rank calls it
    blocks = sorted(int(k) for k in strategy.model.blocks.keys())
    return {"steps": result.steps, "resumed_from": result.resumed_from,
            "split": getattr(strategy, "split", None), "blocks": blocks,
            "logits_dtype": _last_stage_logits_dtype(strategy),
            "coords": strategy.mesh.coords,
            "weights": {k: v.float().cpu().clone() for k, v in full.items()} if rank == 0 else None}


def _last_stage_logits_dtype(strategy):
    """Interleaved runs: the dtype of the logits the last virtual stage's torch-facing module
    returns, with the autocast the trainer handed it (str), on the ranks holding that stage (both
    tp ranks run it, so their collectives pair up); None elsewhere."""
    import torch

    for st in getattr(strategy.model, "torch_stages", []):
        wrapper = st.submod
        if wrapper.stage.is_last:
            h = torch.randn(1, 8, wrapper.stage.cfg.d_model)
            with torch.no_grad():
                return str(wrapper(h).dtype)
    return None


def layouts_then_resumes(rank, world_size, runs, count_reads):
    """Every fresh run, then every resume, with :func:`layout_entry`'s report of each, in one launch
    (model_parallel_rank_fns.train_then_resume: starting 4 ranks and each process's first train()
    are the slow part); the resumes of ``count_reads`` also count the host reads per step."""
    import model_parallel_rank_fns as fns

    return fns.train_then_resume(rank, world_size, runs, count_reads, entry=layout_entry)
