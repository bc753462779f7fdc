"""Rank functions for lab 10 (tensor and sequence parallelism).

They live here, not in the notebook, because spawned ranks can only run importable code. Each has
the ``fn(rank, world_size, ...)`` signature :func:`course_lib.parallel.run_ranks` calls and returns
plain dicts (small tensors where the notebook prints values). Tensor parallelism splits the
*model*, not the batch: every rank builds the same dense module from the same seed and feeds the
same input, so each rank can also compute the dense reference itself, locally, with no
communication, and compare its shard with the matching slice of it.

* :func:`split_matmul` - ``y = x W^T`` split by output columns (all-gather) and by input rows
  (all-reduce), by hand and with the library's layers (section 1);
* :func:`conjugate_ops` - ``f`` and ``g`` forward and backward on readable numbers, their adjoint
  identity, a two-layer MLP with and without them (section 2); :func:`primitives` runs both;
* :func:`megatron_blocks` - TPMLP / TPAttention / TPBlock against the dense block, collectives
  counted, saved-activation bytes measured, with and without sequence parallelism (sections 3-4);
* :func:`dtensor_vs_scratch` - a short AdamW run of the dense TinyGPT, ``tp_tinygpt`` and
  ``parallelize_tinygpt`` side by side (section 5);
* :func:`comm_timings` - lab 00's all-reduce sweep and :func:`replay_collectives`: a step's
  collectives timed alone, back to back (section 6).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.measure import saved_activation_bytes
from course_lib.model import ModelConfig, TinyGPT
from course_lib.model.layers import Block, rope_tables
from course_lib.parallel.wire import count_collectives


def _kinds(wire) -> dict:
    """{kind: count} of a WireCounter."""
    return {k: v["count"] for k, v in wire.by_kind().items()}


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _shard_of(full: torch.Tensor, param, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a dense tensor, cut as the tensor-parallel ``param`` was."""
    dim = getattr(param, "tp_partition_dim", None)
    return full if dim is None else full.chunk(world, dim=dim)[rank]


def _grad_diff(tp_module: nn.Module, dense: nn.Module, rank: int, world: int) -> float:
    """Largest |TP gradient - matching slice of the dense gradient| over every parameter."""
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in tp_module.named_parameters(remove_duplicate=False):
        worst = max(worst, _maxdiff(p.grad, _shard_of(dense_params[name].grad, p, rank, world)))
    return worst


# ---- section 1 --------------------------------------------------------------------------------
def split_matmul(rank: int, world_size: int, tokens: int = 4, n_in: int = 8, n_out: int = 6) -> dict:
    """``y = x W^T`` on ``world_size`` ranks: column split + all-gather, row split + all-reduce."""
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    lin = nn.Linear(n_in, n_out, bias=False)
    x = torch.randn(tokens, n_in)
    W = lin.weight.detach()
    y = x @ W.T                                     # the dense answer, on every rank
    w_col = W.chunk(world_size, dim=0)[rank]        # my output channels (rows of W)
    y_col = x @ w_col.T                             # [tokens, n_out / N]: a slice of y's columns
    with count_collectives() as wire_col:
        parts = [torch.empty_like(y_col) for _ in range(world_size)]
        dist.all_gather(parts, y_col)
    y_from_cols = torch.cat(parts, dim=-1)
    w_row = W.chunk(world_size, dim=1)[rank]        # my input channels (columns of W)
    x_row = x.chunk(world_size, dim=-1)[rank]       # ... and the matching slice of x
    partial = x_row @ w_row.T                       # [tokens, n_out]: a partial sum of y
    with count_collectives() as wire_row:
        y_from_rows = partial.clone()
        dist.all_reduce(y_from_rows)
    col_layer = ColumnParallelLinear.from_linear(lin, gather_output=True)
    row_layer = RowParallelLinear.from_linear(lin, input_is_parallel=False)
    with torch.no_grad():
        y_lib_col, y_lib_row = col_layer(x), row_layer(x)
    return {"w_col_shape": tuple(w_col.shape), "y_col_shape": tuple(y_col.shape),
            "w_row_shape": tuple(w_row.shape), "partial_shape": tuple(partial.shape),
            "partial_vs_y": _maxdiff(partial, y),
            "col_diff": _maxdiff(y_from_cols, y), "row_diff": _maxdiff(y_from_rows, y),
            "lib_col_diff": _maxdiff(y_lib_col, y), "lib_row_diff": _maxdiff(y_lib_row, y),
            "col_wire": _kinds(wire_col), "row_wire": _kinds(wire_row),
            "col_bytes": wire_col.bytes_per_rank(), "row_bytes": wire_row.bytes_per_rank()}


# ---- section 2 --------------------------------------------------------------------------------
def conjugate_ops(rank: int, world_size: int) -> dict:
    """``f`` and ``g`` on 4 readable numbers per rank; the adjoint identity; a tiny MLP."""
    from course_lib.parallel.tensor_parallel import copy_to_tp_region, reduce_from_tp_region

    base = torch.arange(1.0, 5.0) * 10 ** rank      # rank 0: 1 2 3 4, rank 1: 10 20 30 40
    out = {}
    for name, op in (("f", copy_to_tp_region), ("g", reduce_from_tp_region)):
        x = base.clone().requires_grad_(True)
        with count_collectives() as fwd:
            y = op(x)
        # the gradient arriving from above: per rank for f (each rank's branch differs), the same
        # on every rank for g (its output is replicated, so everything after it is too)
        upstream = torch.full((4,), float(rank + 1)) if name == "f" else torch.tensor([1.0, 0.0, -1.0, 2.0])
        with count_collectives() as bwd:
            y.backward(upstream)
        out[name] = {"x": x.detach().tolist(), "y": y.detach().tolist(), "upstream": upstream.tolist(),
                     "x_grad": x.grad.tolist(), "fwd": _kinds(fwd), "bwd": _kinds(bwd)}

    # Adjoint ("dot-product") test: f replicates x to every rank, g sums per-rank tensors, and
    # sum_r <f(x)_r, y_r> = <x, g(y)> for every x, y: g is f's transpose.
    # (float64, so that rounding does not hide the equality)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(9), dtype=torch.float64)  # same on every rank
    y = torch.randn(1000, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)  # per rank
    lhs = (copy_to_tp_region(x) * y).sum()
    dist.all_reduce(lhs)
    rhs = (x * reduce_from_tp_region(y)).sum()
    out["adjoint"] = {"lhs": lhs.item(), "rhs": rhs.item()}

    # A 2-layer MLP, column- then row-parallel, with f and g, without f, without g.
    torch.manual_seed(1)
    dense_up, dense_down = nn.Linear(8, 16), nn.Linear(16, 8)
    xin = torch.randn(4, 8)
    ref_x = xin.clone().requires_grad_(True)
    ref_y = dense_down(F.gelu(dense_up(ref_x)))
    ref_y.sum().backward()
    up = dense_up.weight.detach().chunk(world_size, 0)[rank], dense_up.bias.detach().chunk(world_size, 0)[rank]
    down = dense_down.weight.detach().chunk(world_size, 1)[rank]
    mlp = {}
    for variant, use_f, use_g in (("f and g", True, True), ("no f", False, True), ("no g", True, False)):
        xv = xin.clone().requires_grad_(True)
        with count_collectives() as fwd:
            h = copy_to_tp_region(xv) if use_f else xv
            partial = F.linear(F.gelu(F.linear(h, *up)), down)
            yv = (reduce_from_tp_region(partial) if use_g else partial) + dense_down.bias.detach()
        with count_collectives() as bwd:
            yv.sum().backward()
        mlp[variant] = {"y_diff": _maxdiff(yv.detach(), ref_y.detach()), "x_grad_diff": _maxdiff(xv.grad, ref_x.grad),
                        "fwd": _kinds(fwd), "bwd": _kinds(bwd)}
    out["mlp"] = mlp
    return out


def primitives(rank: int, world_size: int) -> dict:
    """Sections 1 and 2 in one launch (starting ranks is the slow part)."""
    return {"split": split_matmul(rank, world_size), "ops": conjugate_ops(rank, world_size)}


# ---- sections 3 and 4 ----------------------------------------------------------------------------
def block_config(kind: str, seq_len: int, d_model: int) -> ModelConfig:
    """GPT-2 style (LayerNorm, GELU, biases, 4 heads) or Llama style (RMSNorm, SwiGLU, RoPE, 4 query
    heads sharing 2 key/value heads: grouped-query attention)."""
    if kind == "gpt":
        return ModelConfig(vocab_size=64, block_size=seq_len, n_layers=2, n_heads=4, d_model=d_model)
    return ModelConfig(vocab_size=64, block_size=seq_len, n_layers=2, n_heads=4, n_kv_heads=2, d_model=d_model,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)


def _dense_block(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 3):
    torch.manual_seed(seed)
    block = Block(cfg)
    with torch.no_grad():  # non-trivial norms, so their gradients are tested too
        for name, p in block.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed + 1)
    x, gy = torch.randn(batch, seq_len, cfg.d_model, generator=g), torch.randn(batch, seq_len, cfg.d_model, generator=g)
    cos = sin = None
    if cfg.position == "rope":
        cos, sin = rope_tables(cfg.head_dim, seq_len, cfg.rope_theta, cfg.rope_linear_factor)
    return block, x, gy, cos, sin


def _groups(saved) -> dict:
    """Saved bytes of one block by group: norms, attention, MLP (the modules' own saves)."""
    by = {"norms": 0, "attention": 0, "mlp": 0, "other": 0}
    for module, nbytes in saved.by_module.items():
        top = module.split(".")[0]
        key = "norms" if top.startswith("norm") else "attention" if top == "attn" else "mlp" if top == "mlp" else "other"
        by[key] += nbytes
    return by


def megatron_blocks(rank: int, world_size: int, kinds=("gpt", "llama"), batch: int = 2, seq_len: int = 16,
                    d_model: int = 32) -> dict:
    """Every part of a block (MLP, attention, whole block), with and without sequence parallelism,
    against the dense block: outputs, gradients, collectives; and the block's saved bytes."""
    from course_lib.parallel.tensor_parallel import TPMLP, TPAttention, TPBlock, sync_sequence_parallel_grads

    out = {}
    for kind in kinds:
        cfg = block_config(kind, seq_len, d_model)
        for sp in (False, True):
            block, x, gy, cos, sin = _dense_block(cfg, batch, seq_len)
            xd = x.clone().requires_grad_(True)
            yd = block(xd, cos, sin)
            yd.backward(gy)
            mine = (lambda t: t.chunk(world_size, dim=1)[rank]) if sp else (lambda t: t)  # noqa: E731
            parts = (("mlp", TPMLP, block.mlp), ("attention", TPAttention, block.attn), ("block", TPBlock, block))
            for part, cls, dense in parts:
                # the dense reference of this part alone (MLP / attention: from the same input)
                xr = x.clone().requires_grad_(True)
                dense.zero_grad(set_to_none=True)
                yr = dense(xr) if part == "mlp" else dense(xr, cos, sin)
                yr.backward(gy)
                tp = cls.from_dense(dense, sequence_parallel=sp)
                xt = mine(x).clone().requires_grad_(True)
                with count_collectives() as fwd:
                    yt = tp(xt) if part == "mlp" else tp(xt, cos, sin)
                with count_collectives() as bwd:
                    yt.backward(mine(gy))
                with count_collectives() as sync:
                    synced = sync_sequence_parallel_grads(tp) if part == "block" else 0
                row = {"y_diff": _maxdiff(yt.detach(), mine(yr.detach())),
                       "x_grad_diff": _maxdiff(xt.grad, mine(xr.grad)),
                       "fwd": _kinds(fwd), "bwd": _kinds(bwd),
                       "bytes": fwd.bytes_per_rank() + bwd.bytes_per_rank(),
                       "payloads": sorted({c.payload_elements for c in fwd.calls + bwd.calls}),
                       "sync": _kinds(sync), "synced_params": synced}
                if part == "block" or not sp:  # SP parts alone leave row biases' gradients partial
                    row["grad_diff"] = _grad_diff(tp, dense, rank, world_size)
                if part == "attention":
                    row["heads"] = (tp.q_proj.weight.shape[0] // cfg.head_dim, tp.k_proj.weight.shape[0] // cfg.head_dim)
                out[(kind, sp, part)] = row
            # saved-activation bytes of one block: dense (tp=1) and this rank's TP block
            tp_block = TPBlock.from_dense(block, sequence_parallel=sp)
            tables = tuple(t for t in (cos, sin) if t is not None)  # RoPE tables: model buffers, not activations
            dense_saved = saved_activation_bytes(block, x.clone().requires_grad_(True), cos, sin, skip=tables)
            tp_saved = saved_activation_bytes(tp_block, mine(x).clone().requires_grad_(True), cos, sin, skip=tables)
            out[(kind, sp, "saved")] = {"dense": dense_saved.total_bytes, "tp": tp_saved.total_bytes,
                                        "dense_groups": _groups(dense_saved), "tp_groups": _groups(tp_saved)}
    return out


# ---- section 5 --------------------------------------------------------------------------------
def lab_model_config(kind: str = "llama", d_model: int = 64, n_layers: int = 2, seq_len: int = 32) -> ModelConfig:
    """The TinyGPT of section 5: ``block_config``'s layer on the Markov task's 64-token vocabulary."""
    return dataclasses.replace(block_config(kind, seq_len, d_model), n_layers=n_layers)


def dtensor_vs_scratch(rank: int, world_size: int, steps: int, batch: int = 8, kind: str = "llama",
                       d_model: int = 64, n_layers: int = 2, seq_len: int = 32, sp: bool = True,
                       lr: float = 3e-3) -> dict:
    """``steps`` AdamW steps of the dense TinyGPT (local reference), the scratch ``tp_tinygpt`` and
    the DTensor ``parallelize_tinygpt``, same batches: losses, first-step gradients, collectives,
    parameter layouts and step times."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    from course_lib.data import make_dataset
    from course_lib.parallel.tensor_parallel import parallelize_tinygpt, tp_tinygpt

    cfg = lab_model_config(kind, d_model, n_layers, seq_len)
    torch.manual_seed(0)
    dense = TinyGPT(cfg)
    scratch = tp_tinygpt(dense, sequence_parallel=sp)
    dt = parallelize_tinygpt(copy.deepcopy(dense), DeviceMesh("cpu", list(range(world_size))), sequence_parallel=sp)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=lr) for name, m in
            (("dense", dense), ("scratch", scratch), ("dtensor", dt))}
    task = make_dataset("markov", seq_len=seq_len, seed=0, vocab_size=cfg.vocab_size)
    losses = {name: [] for name in opts}
    times = {"scratch": [], "dtensor": []}
    first = {}
    for step in range(steps):
        idx, targets = task.get_batch(list(range(step * batch, (step + 1) * batch)))
        _, loss = dense(idx, targets)
        loss.backward()
        losses["dense"].append(loss.item())
        watch = step == 0  # count on the first step only: the counters cost time too
        dist.barrier()
        t0 = time.perf_counter()
        with count_collectives() if watch else contextlib.nullcontext() as wire:
            _, loss = scratch(idx, targets)
            loss.backward()
            scratch.finish_gradient_synchronization()
        times["scratch"].append(time.perf_counter() - t0)
        losses["scratch"].append(loss.item())
        dist.barrier()
        t0 = time.perf_counter()
        with CommDebugMode() if watch else contextlib.nullcontext() as mode, loss_parallel():
            _, dloss = dt(idx, targets)
            dloss.backward()
        times["dtensor"].append(time.perf_counter() - t0)
        losses["dtensor"].append(dloss.full_tensor().item() if isinstance(dloss, DTensor) else dloss.item())
        if step == 0:
            first = {"scratch_wire": _kinds(wire), "scratch_bytes": wire.bytes_per_rank(),
                     "scratch_calls": [(c.kind, c.payload_elements, c.dtype) for c in wire.calls],
                     "dtensor_comm": {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()},
                     "grad_diff": _step_grad_diffs(dense, scratch, dt, rank, world_size)}
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    layouts = [(n, str(p.placements) if isinstance(p, DTensor) else "plain tensor (replicated)",
                tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape), tuple(p.shape))
               for n, p in dt.named_parameters()]
    return {"losses": losses, "first": first, "layouts": layouts, "num_params": dense.num_params(),
            "times_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}}


def _step_grad_diffs(dense, scratch, dt, rank, world):
    """Largest |gradient - dense gradient| for the scratch shards and the DTensor gradients."""
    from torch.distributed.tensor import DTensor

    dense_p = dict(dense.named_parameters(remove_duplicate=False))
    worst_s = _grad_diff(scratch, dense, rank, world)
    worst_d = 0.0
    for name, p in dt.named_parameters(remove_duplicate=False):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst_d = max(worst_d, _maxdiff(g, dense_p[name].grad))
    return {"scratch": worst_s, "dtensor": worst_d}


# ---- section 6 --------------------------------------------------------------------------------
def replay_collectives(rank: int, world_size: int, calls, repeats: int = 10, warmup: int = 2) -> float:
    """Median seconds (slowest rank) to issue ``calls`` back to back, alone: each call is (kind,
    payload elements S, dtype name) as the wire counter recorded it (S = the full tensor)."""
    bufs = []
    for kind, numel, dtype in calls:
        dt = getattr(torch, str(dtype).removeprefix("torch."))
        full = torch.ones(numel, dtype=dt)
        bufs.append((kind, full, torch.ones(numel // world_size, dtype=dt)))
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for kind, full, shard in bufs:
            if kind == "all-reduce":
                dist.all_reduce(full)
            elif kind == "all-gather":
                dist.all_gather_single(full, shard)
            elif kind == "reduce-scatter":
                dist.reduce_scatter_single(shard, full)
            else:
                raise ValueError(f"replay_collectives: no replay for {kind!r}")
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    med = torch.tensor(statistics.median(times), dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def comm_timings(rank: int, world_size: int, sizes_bytes, call_lists: dict, repeats: int = 10) -> dict:
    """Section 6 in one launch: the all-reduce sweep of lab 00 (median seconds per size, slowest
    rank) and :func:`replay_collectives` of each ``{name: calls}`` list."""
    from course_lib.labs.lab00_orientation import time_all_reduce

    return {"sweep": time_all_reduce(rank, world_size, sizes_bytes, repeats),
            "replay": {name: replay_collectives(rank, world_size, calls, repeats) for name, calls in call_lists.items()}}


def describe_style(style) -> str:
    """One line for a DTensor ``ParallelStyle``: its class and the layouts it declares."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    def fmt(layouts):
        items = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
        return ", ".join("-" if p is None else repr(p) for p in items)

    name = type(style).__name__
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return f"{name}: input {fmt(style.input_layouts)}, output {fmt(style.output_layouts)}"
    if isinstance(style, PrepareModuleInput):
        return f"{name}: input {fmt(style.input_layouts)} -> {fmt(style.desired_input_layouts)}"
    if isinstance(style, PrepareModuleOutput):
        return f"{name}: output {fmt(style.output_layouts)} -> {fmt(style.desired_output_layouts)}"
    if isinstance(style, SequenceParallel):
        return f"{name}: input and output Shard(dim={style.sequence_sharding[0].dim}) (this rank's tokens)"
    return name
