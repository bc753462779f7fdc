"""Rank functions for lab 09 (ZeRO, FSDP and DeepSpeed): spawned ranks can only run importable code.

* :func:`measure_all` - every measured one-step case of
  :mod:`course_lib.parallel.data_parallel.measure_runs` in one launch (memory per rank, wire bytes).
* :func:`train_runs` - several trainer runs in one launch (``course_lib.train.train``), each inside
  a :func:`course_lib.parallel.wire.count_collectives` block, returning the loss curve, the bytes
  on the wire per step by collective and dtype, the model state held on this rank after training,
  the parameter bytes an FSDP2 model holds between forward and backward, and (rank 0) the full
  weights gathered through the strategy.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from course_lib.parallel.data_parallel import measure_runs
from course_lib.parallel.memory_census import model_state_bytes_on_rank
from course_lib.parallel.wire import count_collectives


def measure_all(rank: int, world_size: int, cases) -> list[dict]:
    """:func:`measure_runs.measure_cases` (``cases`` = [(strategy, spec or None), ...])."""
    return measure_runs.measure_cases(rank, world_size, cases)


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
    from course_lib import data as data_lib
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
