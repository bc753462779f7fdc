"""Rank functions for lab 15 (context parallelism: ring attention for long sequences).

They live here, not in the notebook, because spawned ranks can only run importable code. Each has
the ``fn(rank, world_size, ...)`` signature :func:`course_lib.parallel.run_ranks` calls and returns
plain dicts and lists (tensors only where the lab compares them with one process).

The lab starts ranks once (starting them is the slow part): :func:`cp_launch` runs, on every rank
of a 2-rank gloo group,

* :func:`ring_cases` - the library's ring attention on a sequence split between the ranks
  (contiguous and zig-zag), forward and backward: this rank's chunk of the output and gradients,
  the bytes it sent, counted twice (by ``ring_attention``'s own ``stats`` and on the wire);
* :func:`saved_bytes` - the bytes autograd saves for backward in one forward of a TinyGPT made
  context parallel (``apply_context_parallel``), for several sequence lengths;
* :func:`train_counted` - the trainer with ``parallel.cp`` = the world size, every collective
  counted on the wire and the ring's bytes counted by the attention cores.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist


def attention_inputs(batch: int, heads: int, seq_len: int, head_dim: int, seed: int = 0):
    """q, k, v, dout [batch, heads, seq_len, head_dim], fp32, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g) for _ in range(4)]


def ring_cases(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """Ring attention (causal) on every case ``(batch, heads, seq_len, head_dim, layout)``: this
    rank's chunk of out, dq, dk, dv, the ring's ``stats`` (bytes sent forward / backward, score
    elements) and the wire counter's view of the same run (``{kind: bytes}``)."""
    from course_lib.parallel.context_parallel import ring_attention, split_sequence
    from course_lib.parallel.wire import count_collectives

    out = []
    for b, h, s, d, layout in cases:
        q, k, v, dout = (split_sequence(t, world_size, rank, layout=layout) for t in attention_inputs(b, h, s, d))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        stats = {}
        with count_collectives() as wire:
            o = ring_attention(q, k, v, causal=True, layout=layout, stats=stats)
            o.backward(dout)
        out.append({"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "stats": stats,
                    "wire": {kind: row["charged_bytes"] for kind, row in wire.by_kind().items()}})
    return out


def saved_bytes(rank: int, world_size: int, cfg, seq_lens: list[int], seed: int = 0) -> list[int]:
    """Bytes autograd saves in one forward (loss included) of TinyGPT ``cfg`` made context parallel
    over all ranks, one sequence of each length in ``seq_lens`` (every rank builds the same tokens
    and keeps its zig-zag chunk). Parameters are not counted (``measure.saved_activation_bytes``)."""
    from course_lib.measure import saved_activation_bytes
    from course_lib.model import TinyGPT
    from course_lib.parallel.context_parallel.in_trainer import apply_context_parallel

    out = []
    for s in seq_lens:
        torch.manual_seed(seed)
        model = TinyGPT(dataclasses.replace(cfg, block_size=s)).train()
        cp_model = apply_context_parallel(model, None, world_size, rank)
        g = torch.Generator().manual_seed(seed)
        idx, targets = (torch.randint(0, cfg.vocab_size, (1, s), generator=g) for _ in range(2))
        skip = tuple(model.parameters()) + tuple(model.buffers())
        out.append(saved_activation_bytes(lambda: cp_model(idx, targets)[1], skip=skip).total_bytes)
    return out


def train_counted(rank: int, world_size: int, cfg: dict, out_dir: str) -> dict:
    """One trainer run with every collective counted: ``wire`` = {kind: bytes charged to this rank,
    whole run}, ``ring`` = the bytes this rank's ring attention sent (forward / backward, counted
    by the attention cores), ``losses`` (rank 0's metrics.jsonl, None elsewhere), ``steps``."""
    from course_lib.parallel.context_parallel import in_trainer
    from course_lib.parallel.wire import count_collectives
    from course_lib.train import train

    ring = {}
    in_trainer.ContextParallelCore.stats = ring  # every attention core of this process adds to it
    try:
        with count_collectives() as wire:
            result = train(cfg, out_dir)
    finally:
        in_trainer.ContextParallelCore.stats = None
    mesh = getattr(result.strategy, "mesh", None)
    losses = None
    if rank == 0:
        losses = [json.loads(line)["loss"] for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"steps": result.steps, "losses": losses, "ring": ring,
            "wire": {kind: {"count": row["count"], "bytes": row["charged_bytes"]}
                     for kind, row in wire.by_kind().items()},
            "coords": None if mesh is None else dict(mesh.coords)}


def cp_launch(rank: int, world_size: int, cases: list[tuple], cfg, seq_lens: list[int], train_cfg: dict,
              out_dir: str) -> dict:
    """Everything the lab runs on ranks, in one launch: :func:`ring_cases`, :func:`saved_bytes`,
    :func:`train_counted`."""
    result = {"ring": ring_cases(rank, world_size, cases), "saved": saved_bytes(rank, world_size, cfg, seq_lens),
              "train": train_counted(rank, world_size, train_cfg, out_dir)}
    dist.barrier()
    return result
