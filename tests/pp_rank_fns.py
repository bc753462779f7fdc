"""Rank functions (and the single-process reference) for tests/test_pipeline_parallel.py.

One launch per world size runs every scenario, because starting ranks is the slow part; the
timing-sensitive bubble runs have their own launch (slow tests).

The GPT-2-style config has ``bias=False``: the exact gradient of the key projection's bias is zero
(softmax ignores a shift that is the same for every key), so the computed one is rounding noise,
and AdamW turns noise of any size into steps of about +-lr - two correct runs that add in a
different order would then disagree by lr in that bias. ``tie_embeddings`` stays on: the tied
token table / LM head is the interesting case for a pipeline (first and last stage share it).

Weights after AdamW steps: Adam divides by the gradient's own running size, so rounding-level
differences (a micro-batched gradient adds in another order: ~1e-7 relative) grow into weight
differences far above fp32 allclose after a few steps - measured here, *one process* accumulating
4 micro-batches vs one pass over the global batch, 3 steps at lr 1e-2: up to 7.9e-5 (GPT config)
and 2.3e-4 (Llama config). So in fp32 the pipeline's weights are compared with one process that
accumulates the same micro-batches (the arithmetic the pipeline claims to do), and in float64 -
where that growth stays ~1e-13 - with one process on the global batch in a single pass.
"""

import torch
import torch.distributed as dist

from course_lib.model import ModelConfig, TinyGPT

GPT = ModelConfig(vocab_size=64, block_size=16, n_layers=4, n_heads=4, d_model=32, bias=False)
LLAMA = ModelConfig.preset("llama-tiny", vocab_size=64, block_size=16, n_layers=4, d_model=32)
# Its LM head costs exactly two blocks (2 s h V = 2 x 425,984 FLOPs per 16-token sequence): the
# even split of 6 blocks on 2 stages is [3, 3] (costs 3 : 5 blocks), the balanced one [4, 2] (4 : 4).
HEAVY_HEAD = ModelConfig(vocab_size=832, block_size=16, n_layers=6, n_heads=4, d_model=32, bias=False)
GLOBAL_BATCH, SEQ = 8, 16
STEPS = 3
MICRO = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")


def batches(steps=STEPS, seed=1234, vocab=GPT.vocab_size):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(steps)]


def make_model(cfg, dtype=torch.float32):
    torch.manual_seed(0)  # every rank and the reference build the same weights
    return TinyGPT(cfg).to(dtype)


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference(cfg=GPT, micro_batches=1, dtype=torch.float32):
    """One process: what every pipeline run must reproduce. ``micro_batches`` > 1 accumulates
    gradients over that many slices of each global batch (each loss divided by their number)."""
    model = make_model(cfg, dtype)
    opt = make_opt(model.parameters())
    grads, losses = None, []
    for x, y in batches(vocab=cfg.vocab_size):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xs, ys in zip(x.split(GLOBAL_BATCH // micro_batches), y.split(GLOBAL_BATCH // micro_batches)):
            _, loss = model(xs, ys)
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        losses.append(total)
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"grads": grads, "params": params, "losses": losses}


def _timing(result):
    """The parts of a run_schedule result the tests look at (no tensors)."""
    keys = ("stage", "pp", "schedule", "micro_batches", "ops", "events", "origin", "peak_in_flight",
            "peak_activation_bytes", "loss")
    return {k: result[k] for k in keys}


def train(rank, world_size, cfg, schedule, m, balance=None, steps=STEPS, sync_tied=True,
          dtype=torch.float32):
    """`steps` AdamW steps of stage `rank`; gradients of the first step, weights after the last."""
    from course_lib.parallel.pipeline import build_stage, pipeline_step, run_schedule

    stage = build_stage(make_model(cfg, dtype), rank, world_size, balance)
    opt = make_opt(stage.parameters())
    step_fn = pipeline_step if sync_tied else run_schedule
    grads, losses, first = None, [], None
    for x, y in batches(steps, vocab=cfg.vocab_size):
        opt.zero_grad(set_to_none=True)
        result = step_fn(stage, x, y, schedule=schedule, micro_batches=m)
        losses.append(result["loss"])
        if grads is None:
            grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
            first = _timing(result)
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in stage.named_parameters()},
            "losses": losses, "first": first, "balance": stage.balance, "block_ids": stage.block_ids}


def wrong_rank(rank, world_size):
    """Running stage (rank + 1) on this rank must be refused before any message is sent."""
    from course_lib.parallel.pipeline import build_stage, run_schedule

    x, y = batches(1)[0]
    try:
        run_schedule(build_stage(make_model(GPT), (rank + 1) % world_size, world_size), x, y)
    except ValueError as exc:
        return str(exc)
    return None


def everything(rank, world_size):
    out = {}
    for schedule in SCHEDULES:
        for m in MICRO:
            out[(schedule, m)] = train(rank, world_size, GPT, schedule, m)
            out[(schedule, m, "fp64")] = train(rank, world_size, GPT, schedule, m, dtype=torch.float64)
    out["llama"] = train(rank, world_size, LLAMA, "1f1b", 4)
    out["uneven"] = train(rank, world_size, GPT, "gpipe", 4,
                          balance=[1, 3] if world_size == 2 else [1, 1, 1, 1], steps=1)
    out["no_tied_sync"] = train(rank, world_size, GPT, "1f1b", 2, steps=1, sync_tied=False)
    out["wrong_rank"] = wrong_rank(rank, world_size)
    dist.barrier()
    return out


# ------------------------------------------------------------------------ timing (slow tests)
def _timed_step(stage, schedule, m, simulate_s):
    """One untimed warm-up step, then the timed one, started together on every rank."""
    from course_lib.parallel.pipeline import run_schedule

    x, y = batches(1)[0]
    run_schedule(stage, x, y, schedule=schedule, micro_batches=m)
    stage.zero_grad(set_to_none=True)
    dist.barrier()
    return _timing(run_schedule(stage, x, y, schedule=schedule, micro_batches=m, simulate_s=simulate_s))


def bubble_runs(rank, world_size, forward_s, backward_s):
    """Equal stages whose compute is a fixed sleep: every (schedule, m)."""
    from course_lib.parallel.pipeline import build_stage

    stage = build_stage(make_model(GPT), rank, world_size)
    return {(schedule, m): _timed_step(stage, schedule, m, (forward_s, backward_s))
            for schedule in SCHEDULES for m in MICRO}


def imbalance_runs(rank, world_size, cfg, seconds_per_flop, m):
    """Each stage sleeps in proportion to its stage_costs (backward = 2 x forward): the even
    split against the balanced one, on a config whose LM head costs as much as blocks."""
    from course_lib.parallel.pipeline import build_stage, stage_costs

    out = {}
    for name, balance in (("even", None), ("balanced", "balanced")):
        stage = build_stage(make_model(cfg), rank, world_size, balance)
        fwd = stage_costs(cfg, world_size, balance)[rank] * seconds_per_flop
        out[name] = _timed_step(stage, "1f1b", m, (fwd, 2 * fwd))
        out[name]["balance"] = stage.balance
    return out
