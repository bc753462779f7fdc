"""Rank functions for lab 08 (data parallelism): training runs, timelines and sync timings.

They live here, not in the notebook, because spawned ranks can only run importable code. Each has
the ``fn(rank, world_size, ...)`` signature :func:`course_lib.parallel.run_ranks` calls and returns
plain dicts and lists (tensors only where a lab compares weights). :func:`train_losses` also runs
as the single-process reference when called directly as ``train_losses(0, 1, "single", ...)``.

Every run uses the same data: example ``i`` of the synthetic Markov task, the global batch of
step ``s`` being examples ``s * G .. s * G + G - 1``; rank ``r`` of ``W`` takes the ``r``-th
contiguous slice of ``G / W`` examples, so the union over ranks is exactly the global batch.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from course_lib.data import make_dataset
from course_lib.model import ModelConfig, TinyGPT

KINDS = ("single", "naive", "bucketed", "torch-ddp")
SEQ_LEN, VOCAB = 32, 64  # tokens per example, vocabulary of the Markov task (and the model)


def model_config(d_model: int = 64, n_layers: int = 2) -> ModelConfig:
    """The ``tiny`` preset on the lab's task (vocabulary 64, 32-token context), resized."""
    return ModelConfig.preset("tiny", vocab_size=VOCAB, block_size=SEQ_LEN, d_model=d_model,
                              n_layers=n_layers, n_heads=4)


def global_batches(steps: int, global_batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches (x, y), int64 [global_batch, SEQ_LEN], identical in every process."""
    task = make_dataset("markov", seq_len=SEQ_LEN, seed=seed, vocab_size=VOCAB)
    return [task.get_batch(list(range(s * global_batch, (s + 1) * global_batch))) for s in range(steps)]


def _my_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = t.shape[0] // world_size
    return t[rank * per:(rank + 1) * per]


class _CountAllReduce:
    """Replaces ``torch.distributed.all_reduce`` in this process to count calls (not time them)
    while ``on`` is set; every wrapper here looks the function up at call time, so all go through."""

    def __init__(self):
        self.calls, self.on, self.original = 0, False, dist.all_reduce

    def __call__(self, *args, **kwargs):
        if self.on:
            self.calls += 1
        return self.original(*args, **kwargs)


def _wrap(kind: str, model: torch.nn.Module, bucket_mb: float | None, **kwargs):
    from course_lib.parallel.data_parallel.bucketed_ddp import BucketedDDP
    from course_lib.parallel.data_parallel.naive_ddp import NaiveDDP

    if kind == "naive":
        return NaiveDDP(model)
    if kind == "bucketed":
        return BucketedDDP(model, bucket_mb=bucket_mb, **kwargs)
    if kind == "torch-ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb or 25.0)
        # torch's own hook, the same math as the built-in path, but through dist.all_reduce in
        # Python, so _CountAllReduce sees every bucket
        ddp.register_comm_hook(None, allreduce_hook)
        return ddp
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def train_losses(rank: int, world_size: int, kind: str, steps: int, global_batch: int, *,
                 micro: int = 1, use_no_sync: bool = True, bucket_mb: float | None = 25.0,
                 d_model: int = 64, n_layers: int = 2, optimizer: str = "adamw", lr: float = 3e-3,
                 seed: int = 0) -> dict:
    """Train a TinyGPT (``optimizer``: ``"adamw"`` or ``"sgd"``, learning rate ``lr``) for ``steps`` steps on ``global_batch`` examples per step.

    ``kind``: ``"single"`` (one process, whole global batch, no process group), ``"naive"``
    (NaiveDDP), ``"bucketed"`` (BucketedDDP, ``bucket_mb`` MiB buckets) or ``"torch-ddp"``.
    ``micro``: micro-batches per step (gradient accumulation; the loss of each is divided by
    ``micro``); ``use_no_sync``: run all but the last micro-batch's backward inside ``no_sync()``
    (bucketed and torch-ddp; without it every micro-batch's gradients are synchronised).

    Returns ``losses`` (global-batch mean loss per step, nats/token), ``allreduce_calls`` (calls
    to ``dist.all_reduce`` per step made by the wrapper, the loss report excluded), ``params`` (one
    flat fp32 tensor of this rank's final weights) and ``buckets`` (BucketedDDP only, else None)."""
    torch.manual_seed(seed)
    model = TinyGPT(model_config(d_model, n_layers))
    counter = _CountAllReduce()
    if kind != "single":
        dist.all_reduce = counter
    try:
        ddp = model if kind == "single" else _wrap(kind, model, bucket_mb)
        opt = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1) if optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=lr))
        losses, calls = [], []
        for x, y in global_batches(steps, global_batch, seed):
            if kind != "single":
                x, y = _my_slice(x, rank, world_size), _my_slice(y, rank, world_size)
            opt.zero_grad(set_to_none=True)
            counter.calls, counter.on = 0, True
            total = torch.zeros(())
            for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                last = i == micro - 1
                quiet = use_no_sync and not last and kind != "single"
                with (ddp.no_sync() if quiet and kind != "naive" else _nothing()):
                    loss = ddp(xm, ym)[1] / micro
                    loss.backward()
                total += loss.detach()
                if kind in ("naive", "bucketed") and not quiet:  # NaiveDDP: accumulate, sync once
                    ddp.finish_gradient_synchronization()
            counter.on = False
            calls.append(counter.calls)
            if kind != "single":
                counter.original(total)  # the loss report: not counted
                total /= world_size
            losses.append(total.item())
            opt.step()
    finally:
        if kind != "single":
            dist.all_reduce = counter.original
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "allreduce_calls": calls, "params": flat,
            "buckets": getattr(ddp, "bucket_count", None)}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def compare_runs(rank: int, world_size: int, specs: list[dict], steps: int, global_batch: int,
                 **common) -> list[dict]:
    """Several :func:`train_losses` runs in one launch (starting ranks is the slow part): one
    result per spec, each spec a dict of keyword arguments (``kind`` included) over ``common``."""
    return [train_losses(rank, world_size, steps=steps, global_batch=global_batch,
                         **{**common, **spec}) for spec in specs]


def _timed_step(kind: str, model, ddp, opt, x, y) -> dict:
    """One SGD step after a barrier; stamps relative to its forward start (see timeline_run)."""
    opt.zero_grad(set_to_none=True)
    if kind == "bucketed":
        ddp.timeline.clear()
    dist.barrier()
    t0 = time.perf_counter()
    loss = ddp(x, y)[1]
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    ddp.finish_gradient_synchronization()
    t3 = time.perf_counter()
    opt.step()
    if kind == "bucketed":
        events = [{**e, "t": e["t"] - t0} for e in ddp.timeline]
    else:
        grad_bytes = sum(p.numel() * 4 for p in model.parameters())
        events = [{"event": "launch", "t": t2 - t0, "bucket": 0, "bytes": grad_bytes, "in_backward": False},
                  {"event": "complete", "t": t3 - t0, "bucket": 0, "bytes": grad_bytes, "how": "wait"}]
    return {"forward_end": t1 - t0, "backward_end": t2 - t0, "sync_end": t3 - t0, "events": events}


def timeline_runs(rank: int, world_size: int, specs: list[dict], steps: int, global_batch: int, *,
                  d_model: int = 128, n_layers: int = 4, seed: int = 0) -> list[dict]:
    """Time ``steps`` SGD steps of each spec: ``{"kind": "naive"}`` (NaiveDDP) or
    ``{"kind": "bucketed", "bucket_mb": ...}`` (BucketedDDP with its timeline on).

    The specs take turns, one step each per round (a burst of load from elsewhere on the machine
    hits them all alike); every step starts after a barrier. Per spec: ``steps``, a list of dicts
    with, in seconds from ``time.perf_counter()`` relative to that step's forward start,
    ``forward_end``, ``backward_end`` (``loss.backward()`` returned), ``sync_end``
    (``finish_gradient_synchronization()`` returned) and ``events``: BucketedDDP's timeline
    (ready/launch/complete per bucket, see :mod:`.bucketed_ddp`); for NaiveDDP one ``"launch"`` and
    one ``"complete"`` event around its whole sync (it all-reduces tensor after tensor, blocking).
    Also ``grad_bytes`` (fp32 gradient bytes) and ``buckets`` (NaiveDDP: its tensors)."""
    runs = []
    for spec in specs:
        kind = spec["kind"]
        torch.manual_seed(seed)
        model = TinyGPT(model_config(d_model, n_layers))  # one per spec: hooks must not pile up
        ddp = (_wrap(kind, model, spec.get("bucket_mb", 25.0), record_timeline=True) if kind == "bucketed"
               else _wrap(kind, model, None))
        runs.append((kind, model, ddp, torch.optim.SGD(model.parameters(), lr=0.01), []))
    for x, y in global_batches(steps, global_batch, seed):
        x, y = _my_slice(x, rank, world_size), _my_slice(y, rank, world_size)
        for kind, model, ddp, opt, out in runs:
            out.append(_timed_step(kind, model, ddp, opt, x, y))
    return [{"steps": out, "grad_bytes": sum(p.numel() * 4 for p in model.parameters()),
             "buckets": getattr(ddp, "bucket_count", sum(1 for _ in model.parameters()))}
            for kind, model, ddp, opt, out in runs]


def timeline_run(rank: int, world_size: int, kind: str, steps: int, global_batch: int, *,
                 bucket_mb: float | None = 1.0, **kwargs) -> dict:
    """:func:`timeline_runs` for one configuration (``kind``: ``"naive"`` or ``"bucketed"``)."""
    return timeline_runs(rank, world_size, [{"kind": kind, "bucket_mb": bucket_mb}], steps,
                         global_batch, **kwargs)[0]


def sync_cost(rank: int, world_size: int, configs: list[float | None | str], repeats: int = 10, *,
              d_model: int = 128, n_layers: int = 4, seed: int = 0) -> list[dict]:
    """Seconds to synchronise one step's gradients, with no compute to hide behind.

    Per entry of ``configs``: a BucketedDDP ``bucket_mb`` (``None``: one bucket) or ``"naive"``
    (NaiveDDP: a blocking all-reduce per tensor, after one small all-reduce of flags). Backward runs
    inside ``no_sync()`` (BucketedDDP) so nothing starts early, then after a barrier
    ``finish_gradient_synchronization()`` is timed: it launches every bucket back to back and waits.
    Returns per config: ``seconds`` (median over ``repeats``, slowest rank), ``bucket_bytes`` (bytes
    of each all-reduced message, in launch order). The configurations take turns, one sync each per
    round, so a burst of load from elsewhere on the machine hits them all alike."""
    runs = []
    x, y = global_batches(1, 2 * world_size, seed)[0]
    x, y = _my_slice(x, rank, world_size), _my_slice(y, rank, world_size)
    for config in configs:
        torch.manual_seed(seed)
        model = TinyGPT(model_config(d_model, n_layers))  # one per config: hooks must not pile up
        naive = config == "naive"
        ddp = _wrap("naive", model, None) if naive else _wrap("bucketed", model, config, record_timeline=True)
        sizes = ([4 * len(list(model.parameters()))] + [p.numel() * 4 for p in model.parameters()]
                 if naive else [])  # NaiveDDP: the flags, then one message per tensor
        runs.append({"config": config, "model": model, "ddp": ddp, "naive": naive, "times": [],
                     "sizes": sizes})
    for i in range(repeats + 2):  # 2 warm-up rounds
        for run in runs:
            run["model"].zero_grad(set_to_none=True)
            with (_nothing() if run["naive"] else run["ddp"].no_sync()):
                run["ddp"](x, y)[1].backward()
            if not run["naive"]:
                run["ddp"].timeline.clear()
            dist.barrier()
            t0 = time.perf_counter()
            run["ddp"].finish_gradient_synchronization()
            elapsed = time.perf_counter() - t0
            if i >= 2:
                run["times"].append(elapsed)
            if not run["naive"]:
                run["sizes"] = [e["bytes"] for e in run["ddp"].timeline if e["event"] == "launch"]
    results = []
    for run in runs:
        med = torch.tensor(statistics.median(run["times"]), dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        results.append({"config": run["config"], "seconds": med.item(), "bucket_bytes": run["sizes"]})
    return results


def bucket_sizes_bytes(param_numels: list[int], bucket_mb: float | None, bytes_per_elem: int = 4) -> list[int]:
    """The bucket sizes (bytes) BucketedDDP would form for parameters of these sizes (registration
    order, filled in reverse), without building anything: for predictions on models too big to run.
    Flags (4 bytes per parameter) are included, as in BucketedDDP's flat buffers."""
    cap = float("inf") if bucket_mb is None else bucket_mb * 2**20
    buckets, group = [], []
    for n in reversed(param_numels):
        if group and (sum(group) + n) * bytes_per_elem > cap:
            buckets.append(group)
            group = []
        group.append(n)
    if group:
        buckets.append(group)
    return [(sum(g) + len(g)) * bytes_per_elem for g in buckets]


__all__ = ["KINDS", "model_config", "global_batches", "train_losses", "compare_runs", "timeline_run",
           "sync_cost", "bucket_sizes_bytes"]
