"""Rank functions for tests/test_torch_pipelining.py (torch.distributed.pipelining on gloo).

One launch per world size runs every scenario (starting ranks is the slow part). The model,
batches, optimizer and single-process reference are pp_rank_fns' (the from-scratch pipeline's
tests), so both runners are held to the same reference: GPT-2-style TinyGPT, 4 blocks, tied
embeddings, global batch 8 x 16 tokens, 3 AdamW steps.
"""
import torch.distributed as dist

import pp_rank_fns as base

STEPS = base.STEPS
GPT, LLAMA = base.GPT, base.LLAMA
# 2 ranks: every schedule at m = 2 and 4 (interleaved with 2 virtual stages = 4 stages of 1 block;
# also m = 1 < pp, which torch's interleaved schedule accepts and its 1F1B does not)
CASES_2 = [("gpipe", 2, 1), ("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1),
           ("interleaved", 1, 2), ("interleaved", 2, 2), ("interleaved", 4, 2)]
# 4 ranks: one step of each single-stage schedule (a 4-block model has no room for 8 stages)
CASES_4 = [("gpipe", 4, 1), ("1f1b", 4, 1)]


def train_torch(rank, world_size, cfg, schedule, m, virtual_stages=1, steps=STEPS, sync_tied=True,
                balance=None):
    """``steps`` AdamW steps through torch's schedule: first-step grads, final weights, losses."""
    from course_lib.parallel.pipeline.torch_pipelining import (build_torch_stages, named_stage_parameters,
                                                               torch_pipeline_step)

    stages = build_torch_stages(base.make_model(cfg), rank, world_size, virtual_stages, balance)
    params = named_stage_parameters(stages)
    opt = base.make_opt(params.values())
    grads, losses = None, []
    for x, y in base.batches(steps, vocab=cfg.vocab_size):
        opt.zero_grad(set_to_none=True)
        out = torch_pipeline_step(stages, x, y, schedule=schedule, micro_batches=m, sync_tied=sync_tied)
        losses.append(out["loss"])
        if grads is None:
            grads = {n: p.grad.clone() for n, p in params.items()}
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in params.items()}, "losses": losses,
            "stages": [s.stage_index for s in stages],
            "blocks": [s.submod.block_ids for s in stages]}


def torch_arithmetic(rank, world_size, m, *, divide_loss: bool, scale_grads: bool):
    """One GPipe step (m micro-batches) through a hand-made torch schedule with a chosen loss
    arithmetic - the mean loss per micro-batch, divided by m or not, and torch's ``scale_grads`` -
    then the usual tied-gradient sum. Returns this rank's gradients by dense name."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import ScheduleGPipe

    from course_lib.parallel.pipeline import sync_tied_grads
    from course_lib.parallel.pipeline.torch_pipelining import build_torch_stages, named_stage_parameters

    (stage,) = build_torch_stages(base.make_model(GPT), rank, world_size)

    def loss_fn(logits, y):
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        return loss / m if divide_loss else loss

    sched = ScheduleGPipe(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=scale_grads)
    x, y = base.batches(1)[0]
    sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None, return_outputs=False)
    sync_tied_grads(stage.submod)
    return {n: p.grad.clone() for n, p in named_stage_parameters(stage).items()}


def bad_inputs(rank, world_size):
    """Each bad call's error text (ValueError expected), made while a process group exists; a
    barrier afterwards proves no rank was left waiting on a message."""
    from course_lib.parallel.pipeline.torch_pipelining import build_torch_stages, torch_pipeline_step

    model = base.make_model(GPT)
    x, y = base.batches(1)[0]  # 8 sequences
    (one,) = build_torch_stages(model, rank, world_size)
    two = build_torch_stages(model, rank, world_size, virtual_stages=2)
    calls = {
        "schedule": lambda: torch_pipeline_step(one, x, y, schedule="zero-bubble", micro_batches=2),
        "micro_batches_1f1b": lambda: torch_pipeline_step(one, x, y, schedule="1f1b", micro_batches=world_size - 1),
        "micro_batches_zero": lambda: torch_pipeline_step(one, x, y, schedule="gpipe", micro_batches=0),
        "divisible": lambda: torch_pipeline_step(one, x, y, schedule="gpipe", micro_batches=3),
        "virtual_gpipe": lambda: torch_pipeline_step(two, x, y, schedule="gpipe", micro_batches=2),
        "virtual_1f1b": lambda: torch_pipeline_step(two, x, y, schedule="1f1b", micro_batches=2),
        "interleaved_rounds": lambda: torch_pipeline_step(two, x[:5], y[:5], schedule="interleaved",
                                                          micro_batches=5),
        "too_many_stages": lambda: build_torch_stages(model, rank, world_size, virtual_stages=3),
        "rank": lambda: build_torch_stages(model, (rank + 1) % world_size, world_size),
        "pp": lambda: build_torch_stages(model, rank, 1),
        "balance": lambda: build_torch_stages(model, rank, world_size, balance=[1, 1, 2]),
        "targets": lambda: torch_pipeline_step(one, x, y[:, :4], schedule="gpipe", micro_batches=2),
        "wrong_stages": lambda: torch_pipeline_step(two[::-1], x, y, schedule="interleaved", micro_batches=2),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the test reads type and text
            out[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return out


def everything(rank, world_size):
    out = {}
    if world_size == 2:
        for schedule, m, v in CASES_2:
            out[("torch", schedule, m)] = train_torch(rank, world_size, GPT, schedule, m, v)
        for m in (1, 2, 4):
            for schedule in ("gpipe", "1f1b") if m > 1 else ("1f1b",):
                out[("scratch", schedule, m)] = base.train(rank, world_size, GPT, schedule, m)
        out["llama_interleaved"] = train_torch(rank, world_size, LLAMA, "interleaved", 4, 2, steps=1)
        out["balanced_interleaved"] = train_torch(rank, world_size, GPT, "interleaved", 2, 2, steps=1,
                                                  balance=[1, 1, 1, 1])
        out["no_tied_sync"] = train_torch(rank, world_size, GPT, "1f1b", 2, steps=1, sync_tied=False)
        out["sum_loss"] = torch_arithmetic(rank, world_size, 4, divide_loss=False, scale_grads=False)
        out["torch_default"] = torch_arithmetic(rank, world_size, 4, divide_loss=False, scale_grads=True)
        out["bad"] = bad_inputs(rank, world_size)
    else:
        for schedule, m, v in CASES_4:
            out[("torch", schedule, m)] = train_torch(rank, world_size, GPT, schedule, m, v, steps=1)
            out[("scratch", schedule, m)] = base.train(rank, world_size, GPT, schedule, m, steps=1)
    dist.barrier()
    return out
