"""Pipeline parallelism from scratch: stages, GPipe / 1F1B schedules, the measured bubble.

* :mod:`.stages` - cut a ``TinyGPT`` into ``pp`` stages by its blocks (even, balanced for the
  embedding/head cost, or an explicit ``balance``); each stage keeps the dense parameter names.
* :mod:`.schedules` - the per-stage op order of GPipe and 1F1B, and the runner that executes it
  micro-batch by micro-batch with ``isend``/``recv`` between neighbouring ranks; returns a
  timeline and the peak number of micro-batches in flight.
* :mod:`.timeline` - the measured bubble next to ``course_lib.estimate.pipeline.bubble_fraction``.

Usage, on every rank (``run_ranks`` or torchrun; rank s runs stage s)::

    model = TinyGPT(cfg)                                   # same seed on every rank
    stage = build_stage(model, dist.get_rank(), pp, balance="balanced")
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    opt.zero_grad()
    result = pipeline_step(stage, idx, targets, schedule="1f1b", micro_batches=8)
    opt.step()                                             # result["loss"] on the last stage

Tested equal to one process on the global batch (tests/test_pipeline_parallel.py).
"""
from course_lib.parallel.pipeline.schedules import (SCHEDULES, compute_order, pipeline_step,
                                                    run_schedule, stage_actions, sync_tied_grads)
from course_lib.parallel.pipeline.stages import (PipelineStage, balanced_split, build_stage,
                                                 even_split, resolve_balance, split_model, stage_costs)
from course_lib.parallel.pipeline.timeline import measure_bubble, summarize_timeline

__all__ = ["SCHEDULES", "compute_order", "stage_actions", "run_schedule", "sync_tied_grads",
           "pipeline_step", "PipelineStage", "build_stage", "split_model", "even_split",
           "balanced_split", "resolve_balance", "stage_costs", "measure_bubble", "summarize_timeline"]
