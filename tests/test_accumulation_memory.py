"""Model-state memory under gradient accumulation, measured on 1, 2 and 4 ranks against the
estimator (course_lib.estimate.training_step_peak_bytes / accumulated_grad_bytes).

With one micro-batch per step and zero_grad(set_to_none=True) no gradient exists when backward
starts. With k > 1 the sum of the earlier micro-batches' gradients is live when micro-batch 2..k
starts its backward: the census taken right then must hold it, whole for DDP, ZeRO-1 and this
kit's ZeRO-2 (they communicate once, after the last micro-batch: "local" accumulation), while the
ZeRO-2 rank keeps only its own gradients after the step. TinyGPT (2 blocks), fp32 AdamW, the
trainer's strategies; one launch per world size."""
from __future__ import annotations

import functools

import pytest

import accum_census_rank_fns as fns
from course_lib.estimate import accumulated_grad_bytes, model_state_bytes, training_step_peak_bytes
from course_lib.parallel import run_ranks

STAGE = {"single": 0, "ddp": 0, "zero1": 1, "zero2": 2}
SHARDED = ("ddp", "zero1", "zero2")


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    if world == 1:
        return [fns.census_at_second_micro_batch(0, 1, ["single"])]
    return run_ranks(fns.census_at_second_micro_batch, world, list(SHARDED), threads_per_rank=1, timeout=300,
                     show_output=False)


@pytest.mark.parametrize("world, name", [(1, "single"), (2, "zero1"), (2, "zero2"), (2, "ddp"),
                                         (4, "zero1"), (4, "zero2"), (4, "ddp")])
def test_the_gradient_sum_is_live_when_the_second_micro_batch_starts_backward(world, name):
    rows = [r[name] for r in results(world)]
    n = rows[0]["num_params"]
    states = model_state_bytes(n, recipe="fp32-adam", zero_stage=STAGE[name], dp=world)
    live = accumulated_grad_bytes(states, "local")
    assert live == 4 * n  # whole fp32 gradients, whatever the stage keeps after the step
    for rank, r in enumerate(rows):
        during = r["during"]
        assert during["params"] == states.params, (rank, during)
        assert during["grads"] == live, f"{name} rank {rank}: {during['grads']} B of gradients live, expected {live}"
    # Moments: whole parameters are owned by one rank each, so ranks differ; together they hold the
    # estimator's dp x per-rank share, and the moment's model state adds up the same way.
    assert sum(r["during"]["optimizer_moments"] for r in rows) == states.optimizer * world
    peak = training_step_peak_bytes(states, 0.0, grad_accum=2, accumulation="local")
    assert sum(r["during"]["total"] for r in rows) == pytest.approx(peak.backward_start * world, rel=0, abs=0)
    if name == "zero2":  # after the step a ZeRO-2 rank keeps only the gradients it owns
        after = [r["after_step"]["grads"] for r in rows]
        assert sum(after) == 4 * n and all(a < 4 * n for a in after), after
