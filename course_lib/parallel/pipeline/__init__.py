"""Pipeline parallelism: from scratch (stages, GPipe / 1F1B schedules, the measured bubble), then torch's.

* :mod:`.stages` - cut a ``TinyGPT`` into ``pp`` stages by its blocks (even, balanced for the
  embedding/head cost, or an explicit ``balance``); each stage keeps the dense parameter names.
* :mod:`.schedules` - the per-stage op order of GPipe and 1F1B, and the runner that executes it
  micro-batch by micro-batch with ``isend``/``recv`` between neighbouring ranks; returns a
  timeline and the peak number of micro-batches in flight.
* :mod:`.timeline` - the measured bubble next to ``course_lib.estimate.pipeline.bubble_fraction``.
* :mod:`.torch_pipelining` - the same stages run by PyTorch's ``torch.distributed.pipelining``
  (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` with virtual stages):
  :func:`build_torch_stages`, :func:`torch_pipeline_step`, :func:`named_stage_parameters`.
  Exported lazily: importing torch's pipelining package takes seconds, so it is loaded on first
  use of one of these names.

Usage, on every rank (``run_ranks`` or torchrun; rank s runs stage s)::

    model = TinyGPT(cfg)                                   # same seed on every rank
    stage = build_stage(model, dist.get_rank(), pp, balance="balanced")
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    opt.zero_grad()
    result = pipeline_step(stage, idx, targets, schedule="1f1b", micro_batches=8)
    opt.step()                                             # result["loss"] on the last stage

With torch's schedules (``virtual_stages=2`` and ``schedule="interleaved"`` for interleaved 1F1B)::

    stages = build_torch_stages(model, dist.get_rank(), pp, virtual_stages=1)
    opt = torch.optim.AdamW(named_stage_parameters(stages).values(), lr=1e-3)
    opt.zero_grad()
    result = torch_pipeline_step(stages, idx, targets, schedule="1f1b", micro_batches=8)
    opt.step()

Tested equal to one process on the global batch (tests/test_pipeline_parallel.py), and torch's
runs bit-equal to ours (tests/test_torch_pipelining.py).
"""
from course_lib.parallel.pipeline.schedules import (SCHEDULES, compute_order, pipeline_step,
                                                    run_schedule, stage_actions, sync_tied_grads)
from course_lib.parallel.pipeline.stages import (PipelineStage, balanced_split, build_stage,
                                                 even_split, resolve_balance, split_model, stage_costs)
from course_lib.parallel.pipeline.timeline import measure_bubble, summarize_timeline

__all__ = ["SCHEDULES", "compute_order", "stage_actions", "run_schedule", "sync_tied_grads",
           "pipeline_step", "PipelineStage", "build_stage", "split_model", "even_split",
           "balanced_split", "resolve_balance", "stage_costs", "measure_bubble", "summarize_timeline",
           "TORCH_SCHEDULES", "build_torch_stages", "torch_pipeline_step", "named_stage_parameters"]

_LAZY = ("TORCH_SCHEDULES", "build_torch_stages", "torch_pipeline_step", "named_stage_parameters")


def __getattr__(name):
    """The torch-pipelining names, imported on first use (PEP 562)."""
    if name in _LAZY:
        from course_lib.parallel.pipeline import torch_pipelining

        return getattr(torch_pipelining, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
