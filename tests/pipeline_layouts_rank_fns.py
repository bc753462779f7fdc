"""Rank functions for tests/test_train_pipeline_layouts.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_layouts(rank, world_size, runs):
    """Several trainer runs in one launch (each ``(cfg, out_dir, resume)``): per run, the steps,
    where it resumed from, the split the strategy chose, the dense block ids this rank holds, the
    per-rank autocast dtype seen by a stage forward, and (rank 0) the dense weights gathered through
    the strategy."""
    from course_lib.train import train

    out = []
    for cfg, out_dir, resume in runs:
        result = train(cfg, out_dir, resume=resume)
        strategy = result.strategy
        full = strategy.full_weights()  # a collective: every rank calls it
        blocks = sorted(int(k) for k in strategy.model.blocks.keys())
        out.append({"steps": result.steps, "resumed_from": result.resumed_from,
                    "split": getattr(strategy, "split", None), "blocks": blocks,
                    "logits_dtype": _last_stage_logits_dtype(strategy),
                    "coords": strategy.mesh.coords,
                    "weights": {k: v.float().cpu().clone() for k, v in full.items()} if rank == 0 else None})
    return out


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


def layouts_then_host_reads(rank, world_size, runs, reads_cfg, reads_dir, reads_steps):
    """:func:`train_layouts`, then the host reads per optimizer step made by course_lib on this
    rank for ``reads_cfg`` (runs of ``reads_steps`` and twice that many steps; tests/host_reads.py),
    in one launch (starting 4 ranks is the slow part)."""
    import os

    from host_reads import reads_per_step

    from course_lib.train import train

    out = train_layouts(rank, world_size, runs)

    def run(steps):
        cfg = {**reads_cfg, "train": {**reads_cfg["train"], "max_steps": steps}}
        train(cfg, os.path.join(reads_dir, f"r{steps}"))

    return {"runs": out, "reads": reads_per_step(run, steps=reads_steps)}
