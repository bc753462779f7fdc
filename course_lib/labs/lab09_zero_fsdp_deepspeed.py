"""Lab 09 (ZeRO, FSDP and DeepSpeed): its rank functions (spawned ranks can only run importable code).

Two parts:

* **One measured training step per data-parallel strategy** (memory and wire bytes next to the
  estimate): :func:`measure_step`, :func:`measure_strategies`, :func:`measure_cases` and
  :func:`measure_all` (every case in one launch), also used by ``tests/test_dp_measured.py``.
* **Trainer runs counted on the wire** (:func:`train_runs`): several ``course_lib.train.train``
  runs in one launch, each inside a :func:`course_lib.parallel.wire.count_collectives` block,
  returning the loss curve, the bytes on the wire per step by collective and dtype, the model state
  held on this rank after training, the parameter bytes an FSDP2 model holds between forward and
  backward, and (rank 0) the full weights gathered through the strategy.

Measuring::

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

import json
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------
# Lab 09's launches: every measured case at once, and trainer runs counted on the wire
# ---------------------------------------------------------------------------------------------

def measure_all(rank: int, world_size: int, cases) -> list[dict]:
    """:func:`measure_cases` (``cases`` = [(strategy, spec or None), ...])."""
    return measure_cases(rank, world_size, cases)


def _losses(out_dir: Path) -> list[float]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def _wire_summary(wire, steps: int) -> dict:
    """Charged bytes per rank per optimizer step, by (kind, dtype), plus the total."""
    by = {}
    for call in wire.calls:
        key = f"{call.kind} {call.dtype.replace('torch.', '')}"
        entry = by.setdefault(key, {"count": 0, "charged_bytes": 0.0})
        entry["count"] += 1
        entry["charged_bytes"] += float(call.charged_bytes)
    per_step = {k: {"count": v["count"] / steps, "bytes": v["charged_bytes"] / steps} for k, v in by.items()}
    return {"per_step": per_step, "bytes_per_step": sum(v["bytes"] for v in per_step.values())}


def _held_between_forward_and_backward(strategy, cfg: dict) -> int | None:
    """FSDP2 only: bytes of parameter storage this rank holds after one forward, before backward
    (gathered full weights that were kept, plus the shards). None for other strategies."""
    if cfg["train"]["strategy"] != "fsdp":
        return None
    from course_lib.data import tasks as data_lib
    from course_lib.parallel.memory_census import _local

    t, d = cfg["train"], cfg["data"]
    ds = data_lib.make_dataset(d["task"], seq_len=d["seq_len"], seed=t["seed"], vocab_size=d["vocab_size"])
    x, y = next(data_lib.BatchStream(ds, t["micro_batch"], rank=dist.get_rank(),
                                     world_size=dist.get_world_size(), seed=t["seed"]))
    model = strategy.model
    _, loss = model(x, y)
    tensors = list(model.parameters())  # whatever is registered now: shards or gathered weights
    for module in model.modules():  # plus every shard (not registered while its group is gathered)
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        tensors += [fp.sharded_param for fp in (group.fsdp_params if group is not None else [])]
    seen, held = set(), 0
    for p in tensors:
        storage = _local(p.detach()).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    loss.backward()  # let FSDP2 finish the step's bookkeeping (reshard, reduce-scatter)
    for p in model.parameters():
        p.grad = None
    return held


def train_one(rank: int, world_size: int, cfg: dict, out_dir: str, resume: bool = False,
              want_weights: bool = False, probe_memory: bool = False) -> dict:
    """One trainer run on this rank, counted on the wire. Returns a plain dict: steps,
    resumed_from, final_loss, losses (rank 0's metrics.jsonl), wire (see ``_wire_summary``),
    state (bytes of params/grads/optimizer held here after training), held_fwd (FSDP2: parameter
    bytes held between forward and backward, when ``probe_memory``), ds_config (the generated
    DeepSpeed config, if the run wrote one) and weights (rank 0, when ``want_weights``)."""
    from course_lib.train import train

    out = Path(out_dir)
    with count_collectives() as wire:
        result = train(cfg, out, resume=resume)
    steps_run = max(1, result.steps - result.resumed_from)
    strategy = result.strategy
    report = {"steps": result.steps, "resumed_from": result.resumed_from, "final_loss": result.final_loss,
              "wire": _wire_summary(wire, steps_run), "state": None, "held_fwd": None}
    try:
        module = getattr(strategy, "model", None) or result.model
        census = model_state_bytes_on_rank(module, getattr(strategy, "optimizer", None))
        report["state"] = census.to_dict()
    except Exception as exc:  # noqa: BLE001 - a census is a nice-to-have, never a failure
        report["state"] = {"error": f"{type(exc).__name__}: {exc}"}
    if probe_memory:
        report["held_fwd"] = _held_between_forward_and_backward(strategy, cfg)
    full = strategy.full_weights() if want_weights else None  # a collective: every rank calls it
    if rank == 0:
        report["losses"] = _losses(out)
        ds = out / "ds_config.json"
        report["ds_config"] = json.loads(ds.read_text()) if ds.exists() else None
        if full is not None:
            report["weights"] = {k: v.detach().float().cpu().clone() for k, v in full.items()}
    dist.barrier()
    return report


def train_runs(rank: int, world_size: int, runs) -> list[dict]:
    """Several trainer runs in one launch: ``runs`` = [dict(cfg=..., out_dir=..., resume=False,
    want_weights=False, probe_memory=False), ...]; one :func:`train_one` report per run."""
    return [train_one(rank, world_size, **run) for run in runs]
