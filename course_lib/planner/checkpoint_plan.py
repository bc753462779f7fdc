"""How often to checkpoint, in which format, how many to keep: Young/Daly from the failure rate.

Young (1974) / Daly (2006), first order: with C the seconds one checkpoint save blocks training and
M the job's mean time between failures, the interval that minimises the expected lost work is

    tau = sqrt(2 C M).

A job on N nodes fails whenever any node does, so M_job = M_node / N (failures independent, rate
adding up). Default per-node MTBF 5,000 h: the Llama 3 paper (Dubey et al. 2024, Sec. 3.3.4)
reports 419 unexpected interruptions in 54 days on 16,384 GPUs, ~6,300 h per 8-GPU node; 5,000 h
rounds that down (older nodes, smaller sites). Save cost C = checkpoint bytes / aggregate write
bandwidth (``--storage-gbps``). With asynchronous saves the *blocking* part is smaller (the copy to
host memory); the formula then errs on the side of saving more often, which is cheap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.estimate import resolve_recipe
from course_lib.planner.costs import Candidate
from course_lib.planner.spec import JobSpec
from course_lib.validate import check_number


def young_daly_interval_s(save_cost_s: float, mtbf_job_s: float) -> float:
    """sqrt(2 x save_cost x MTBF_job): seconds of training between checkpoints (both in seconds)."""
    check_number("save_cost_s", save_cost_s, 0, lo_open=True)
    check_number("mtbf_job_s", mtbf_job_s, 0, lo_open=True)
    return math.sqrt(2 * save_cost_s * mtbf_job_s)


@dataclass(frozen=True)
class CheckpointPlan:
    """The numbers behind ``[checkpoint]``: bytes, seconds, steps."""

    checkpoint_bytes: float   # whole training state (weights + master + optimizer), all ranks together
    save_cost_s: float        # seconds one save takes at the storage bandwidth
    mtbf_job_h: float         # hours between failures of the whole job
    interval_s: float         # Young/Daly interval, seconds of training
    save_every_steps: int     # the interval in optimizer steps (>= 1)
    overhead: float           # fraction of time spent saving: save_cost / interval
    expected_loss_h: float    # expected hours of recomputed work per failure (about interval / 2)
    keep_last: int
    sharded: bool             # each rank writes its own shard (DCP) instead of one consolidated file
    format_reason: str


def checkpoint_plan(spec: JobSpec, best: Candidate, keep_last: int = 3) -> CheckpointPlan:
    """The checkpoint plan for the chosen layout (see module docstring for the formulas)."""
    recipe = resolve_recipe(spec.recipe)
    # Saved state per parameter: the weights, the fp32 master copy and the optimizer moments
    # (gradients are not saved: they are recomputed from the next batch).
    per_param = recipe.param_bytes + recipe.master_bytes + recipe.optimizer_bytes
    # a MoE checkpoint holds every expert, not the dense stand-in that spec.shape is for MoE jobs
    ckpt = (spec.moe.num_params() if spec.moe is not None else spec.shape.num_params()) * per_param
    save = ckpt / spec.storage_bytes_per_s
    mtbf_job_h = spec.mtbf_hours / spec.nodes
    tau = young_daly_interval_s(save, mtbf_job_h * 3600)
    steps = max(1, int(round(tau / best.step_s)))
    lay = best.layout
    sharded = lay.zero_stage >= 1 or lay.tp * lay.pp * lay.cp > 1 or spec.gpus > 1
    reason = ("sharded (torch.distributed.checkpoint): every rank writes only its own shard in parallel, "
              "so a save costs bytes / aggregate bandwidth instead of funnelling all state through rank 0, "
              "and the shards can be re-loaded at a different world size; consolidate to one file only "
              "for export (e.g. to Hugging Face format) at the end" if sharded else
              "consolidated (one file): a single rank holds all the state anyway")
    return CheckpointPlan(ckpt, save, mtbf_job_h, tau, steps, save / (steps * best.step_s),
                          steps * best.step_s / 2 / 3600, keep_last, sharded, reason)
