"""One measured training step per data-parallel strategy: memory and wire bytes, next to the estimate.

Rank functions for :func:`course_lib.parallel.run_ranks` (lab 09 and tests/test_dp_measured.py)::

    rows = run_ranks(measure_strategies, 2, ["ddp", "zero2", "fsdp2"], threads_per_rank=1)
    rows[rank][i]   # a plain dict per strategy, see measure_step

Each measurement builds the same model on every rank (``spec``: ``layers`` bias-free
``nn.Linear(dim, dim)`` with ReLU between, optionally a replicated ``LayerNorm`` at the end), wraps
it for the strategy, and runs **one** real step (forward, mse loss, backward, gradient sync, AdamW
step) inside :func:`course_lib.parallel.wire.count_collectives`. The one-off construction traffic
(the broadcast of rank 0's weights) is counted apart (``wire_setup_bytes``). Then
:func:`course_lib.parallel.memory_census.model_state_bytes_on_rank` measures the model state.

Strategies and what they are compared with (Psi = parameters, N = ranks, fp32 = 4 B/element):

| strategy | engine | ZeRO stage | estimator comm |
| --- | --- | --- | --- |
| ddp | torch DistributedDataParallel (+ counting comm hook, gradient_as_bucket_view) | 0 | ddp |
| ddp-naive | course NaiveDDP | 0 | ddp |
| ddp-bucketed | course BucketedDDP | 0 | ddp |
| zero1 | ShardedOptimizer + ``reduce_gradients(free_unowned=False)`` | 1 | zero1 |
| zero2 | ShardedOptimizer(reduce_scatter_grads=True) | 2 | zero2 |
| zero3-scratch | course SimpleFSDP | 3 | zero3 |
| fsdp2 | torch ``fully_shard`` per Linear + root, reshard_after_forward=True | 3 | zero3 |

``wire_overhead_bytes`` is the bookkeeping the from-scratch engines send on top of the model
state, predicted in closed form by :func:`expected_overhead_bytes` (P = parameter tensors):
NaiveDDP and ShardedOptimizer all-reduce one int32 "has a gradient" flag per parameter
(2(N-1)/N x 4P bytes); BucketedDDP appends one fp32 flag per parameter to its bucket (the same
bytes); SimpleFSDP all-reduces the replicated parameters' gradients (2(N-1)/N x 4 Psi_rep) and
their flags. torch DDP and FSDP2 send nothing extra. So measured = estimated + overhead, exactly.

The input ``x`` requires grad (``spec["input_requires_grad"]``, default True): otherwise the first
layer's backward does not need its weight (only grad_W = g^T x is computed), so SimpleFSDP does not
re-gather it and sends (N-1)/N x Psi_first less than 3 Psi (N-1)/N (FSDP2 re-gathers anyway).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.memory_census import compare_with_estimate, model_state_bytes_on_rank
from course_lib.parallel.wire import attach_ddp_counter, count_collectives

STRATEGIES = ("ddp", "ddp-naive", "ddp-bucketed", "zero1", "zero2", "zero3-scratch", "fsdp2")
ZERO_STAGE = {"ddp": 0, "ddp-naive": 0, "ddp-bucketed": 0, "zero1": 1, "zero2": 2,
              "zero3-scratch": 3, "fsdp2": 3}
COMM_STRATEGY = {"ddp": "ddp", "ddp-naive": "ddp", "ddp-bucketed": "ddp", "zero1": "zero1",
                 "zero2": "zero2", "zero3-scratch": "zero3", "fsdp2": "zero3"}
DEFAULT_SPEC = {"layers": 4, "dim": 32, "batch_per_rank": 4, "norm": False, "input_requires_grad": True,
                "seed": 0}
BYTES_PER_ELEMENT = 4  # fp32 parameters and gradients


def full_spec(spec: dict | None = None) -> dict:
    """DEFAULT_SPEC updated with ``spec`` (unknown keys are an error)."""
    spec = dict(spec or {})
    unknown = set(spec) - set(DEFAULT_SPEC)
    if unknown:
        raise ValueError(f"unknown model spec keys {sorted(unknown)}; known: {sorted(DEFAULT_SPEC)}")
    return {**DEFAULT_SPEC, **spec}


def build_model(spec: dict | None = None) -> nn.Sequential:
    """``layers`` x (bias-free Linear(dim, dim), ReLU), then a LayerNorm if ``norm``; same on every rank."""
    s = full_spec(spec)
    torch.manual_seed(s["seed"])
    mods: list[nn.Module] = []
    for i in range(s["layers"]):
        mods.append(nn.Linear(s["dim"], s["dim"], bias=False))
        if i < s["layers"] - 1:
            mods.append(nn.ReLU())
    if s["norm"]:
        mods.append(nn.LayerNorm(s["dim"]))
    return nn.Sequential(*mods)


def replicated_params(spec: dict | None = None) -> tuple[int, int]:
    """(tensors, elements) of the parameters SimpleFSDP keeps replicated (the LayerNorm)."""
    s = full_spec(spec)
    return (2, 2 * s["dim"]) if s["norm"] else (0, 0)


def expected_overhead_bytes(strategy: str, world_size: int, spec: dict | None = None) -> float:
    """Bytes per rank each engine sends per step beyond the estimator's model-state traffic
    (see the module docstring): flags, and SimpleFSDP's replicated-parameter all-reduce."""
    model = build_model(spec)
    n_tensors = sum(1 for _ in model.parameters())
    ar = 2 * (world_size - 1) / world_size  # ring all-reduce factor
    if strategy in ("ddp-naive", "ddp-bucketed", "zero1", "zero2"):
        return ar * 4 * n_tensors
    if strategy == "zero3-scratch":
        rep_tensors, rep_elements = replicated_params(spec)
        if rep_tensors == 0:
            return 0.0
        # the replicated params get 2 (all-reduce) instead of the estimator's 3 passes, plus flags
        return ar * 4 * rep_tensors + ar * 4 * rep_elements - 3 * (world_size - 1) / world_size * 4 * rep_elements
    return 0.0


def _data(rank: int, spec: dict):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(spec["batch_per_rank"], spec["dim"], generator=g)
    y = torch.randn(spec["batch_per_rank"], spec["dim"], generator=g)
    return x.requires_grad_(spec["input_requires_grad"]), y


def _wrap(strategy: str, model: nn.Module, world_size: int):
    """(forward module, optimizer, sync callable or None, extras dict)."""
    from course_lib.parallel.data_parallel.zero import ShardedOptimizer

    adamw = {"lr": 1e-2, "weight_decay": 0.1}
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, gradient_as_bucket_view=True)
        attach_ddp_counter(ddp)
        return ddp, torch.optim.AdamW(ddp.parameters(), **adamw), None, {}
    if strategy in ("ddp-naive", "ddp-bucketed"):
        from course_lib.parallel.data_parallel.bucketed_ddp import BucketedDDP
        from course_lib.parallel.data_parallel.naive_ddp import NaiveDDP
        wrapped = NaiveDDP(model) if strategy == "ddp-naive" else BucketedDDP(model)
        extras = {}
        if strategy == "ddp-bucketed":
            extras["comm_buffer_bytes"] = sum(b.flat.numel() * b.flat.element_size() for b in wrapped._buckets)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), **adamw), \
            wrapped.finish_gradient_synchronization, extras
    if strategy in ("zero1", "zero2"):
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, reduce_scatter_grads=strategy == "zero2",
                               **adamw)
        if strategy == "zero2":
            return model, opt, None, {}
        if not hasattr(opt, "reduce_gradients"):
            raise NotImplementedError("zero1 needs ShardedOptimizer.reduce_gradients(free_unowned=False) "
                                      "(reduce-scatter, keep the zeroed full gradient buffers)")
        return model, opt, lambda: opt.reduce_gradients(free_unowned=False), {}
    if strategy == "zero3-scratch":
        from course_lib.parallel.data_parallel.simple_fsdp import SimpleFSDP
        fsdp = SimpleFSDP(model)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), **adamw), fsdp.finish_gradient_synchronization, {}
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        for m in model:
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                fully_shard(m, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        return model, torch.optim.AdamW(model.parameters(), **adamw), None, {}
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")


def measure_step(rank: int, world_size: int, strategy: str, spec: dict | None = None) -> dict:
    """One measured training step of ``strategy`` on this rank; returns a plain dict (bytes):

    strategy, world_size, rank, num_params (Psi, unsharded), zero_stage, memory_measured /
    memory_estimated ({params, grads, optimizer, total}, bytes on this rank), memory_equal,
    optimizer_step_bytes (AdamW's step counters, not in the estimate), wire_measured_bytes (ring
    charged, per rank), wire_estimated_bytes (comm_elements_per_step x 4), wire_overhead_bytes
    (expected bookkeeping), wire_model_state_bytes (measured - overhead), wire_by_kind, wire_calls,
    wire_setup_bytes (construction broadcast), loss."""
    from course_lib.estimate.comm import comm_elements_per_step

    spec = full_spec(spec)
    model = build_model(spec)
    num_params = sum(p.numel() for p in model.parameters())
    with count_collectives() as setup:
        fwd, opt, sync, extras = _wrap(strategy, model, world_size)
    x, y = _data(rank, spec)
    with count_collectives() as wire:
        loss = F.mse_loss(fwd(x), y)
        loss.backward()
        if sync is not None:
            sync()
        opt.step()
    census = model_state_bytes_on_rank(fwd, opt)
    cmp = compare_with_estimate(census, num_params, zero_stage=ZERO_STAGE[strategy], dp=world_size)
    est_wire = comm_elements_per_step(num_params, COMM_STRATEGY[strategy], world_size=world_size) \
        .bytes_per_rank(BYTES_PER_ELEMENT)
    overhead = expected_overhead_bytes(strategy, world_size, spec)
    measured_wire = wire.bytes_per_rank()
    out = {
        "strategy": strategy, "world_size": world_size, "rank": rank, "num_params": num_params,
        "zero_stage": ZERO_STAGE[strategy], "unit": "bytes", "spec": spec,
        "memory_measured": cmp["measured"], "memory_estimated": cmp["estimated"],
        "memory_equal": cmp["equal"], "optimizer_step_bytes": census.optimizer_step,
        "census": census.to_dict(),
        "wire_measured_bytes": measured_wire, "wire_estimated_bytes": est_wire,
        "wire_overhead_bytes": overhead, "wire_model_state_bytes": measured_wire - overhead,
        "wire_by_kind": wire.by_kind(), "wire_calls": wire.breakdown(),
        "wire_setup_bytes": setup.bytes_per_rank(), "loss": float(loss.detach()),
    }
    out.update(extras)
    return out


def measure_strategies(rank: int, world_size: int, strategies=STRATEGIES, spec: dict | None = None) -> list[dict]:
    """:func:`measure_step` for each strategy in turn (one process start for all); a list of dicts."""
    results = []
    for strategy in strategies:
        results.append(measure_step(rank, world_size, strategy, spec))
        dist.barrier()
    return results


def measure_cases(rank: int, world_size: int, cases) -> list[dict]:
    """Several (strategy, spec) pairs in one launch: ``cases`` = [(strategy, spec or None), ...]."""
    out = []
    for strategy, spec in cases:
        out.append(measure_step(rank, world_size, strategy, spec))
        dist.barrier()
    return out
