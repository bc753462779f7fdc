"""Rank functions (and the dense references) for tests/test_tensor_parallel.py.

One launch per world size runs every case, because starting ranks is the slow part. Every input
is drawn from a fixed seed, so the test process can rebuild each rank's inputs and the dense
reference itself; ranks hand back plain dicts of tensors and the test compares.
Sizes: B=2, T=8 (divisible by 4 for sequence parallelism); widths divisible by 2 and 4."""

import torch
import torch.nn.functional as F
from torch import nn

B, T = 2, 8
IN, OUT = 8, 12          # the lone Linear layers
VOCAB, EMB = 16, 6       # the lone embedding and loss
OP_C = 4                 # channels of the comm-op tensors


# ---- inputs and dense references (imported by the test too) ----------------------------------
def op_inputs(rank, world):
    """Per-rank tensors for the comm operators (distinct on every rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    t = T // world
    return {"full": torch.randn(B, T, OP_C, generator=g), "grad_full": torch.randn(B, T, OP_C, generator=g),
            "seq": torch.randn(B, t, OP_C, generator=g), "grad_seq": torch.randn(B, t, OP_C, generator=g),
            "chan": torch.randn(B, T, 2, generator=g), "grad_chan": torch.randn(B, T, 2, generator=g),
            "grad_wide": torch.randn(B, T, 2 * world, generator=g)}


def shared_full():
    """A tensor every rank holds identically (the input of a scatter)."""
    return torch.randn(B, T, OP_C, generator=torch.Generator().manual_seed(7))


def dense_layers():
    torch.manual_seed(0)
    col, row = nn.Linear(IN, OUT), nn.Linear(OUT, IN)
    emb = nn.Embedding(VOCAB, EMB)
    g = torch.Generator().manual_seed(1)
    return {"col": col, "row": row, "emb": emb, "x": torch.randn(B, T, IN, generator=g),
            "gy_col": torch.randn(B, T, OUT, generator=g), "x_row": torch.randn(B, T, OUT, generator=g),
            "gy_row": torch.randn(B, T, IN, generator=g),
            "idx": torch.arange(B * T).reshape(B, T) % VOCAB,  # every token id, on every rank's rows
            "gy_emb": torch.randn(B, T, EMB, generator=g)}


def ce_inputs(scale=3.0):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T, VOCAB, generator=g) * scale
    targets = torch.randint(0, VOCAB, (B, T), generator=g)
    targets[0, :3] = -100  # ignored tokens
    weights = torch.randn(B, T, generator=g)  # upstream gradient for reduction="none"
    return logits, targets, weights


def block_cfg(kind):
    from course_lib.model import ModelConfig

    if kind == "gpt":  # LayerNorm, GELU MLP, biases, multi-head
        return ModelConfig(vocab_size=32, block_size=16, n_layers=2, n_heads=4, d_model=16)
    # Llama: RMSNorm, SwiGLU, RoPE, no bias, grouped-query (8 q heads, 4 k/v heads), sliding window
    return ModelConfig(vocab_size=32, block_size=16, n_layers=2, n_heads=8, n_kv_heads=4, d_model=32,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
                       attention_window=5)


def dense_block(kind):
    """A dense Block with perturbed norms (so their gradients matter), its input, upstream gradient
    and RoPE tables."""
    from course_lib.model.layers import Block, rope_tables

    cfg = block_cfg(kind)
    torch.manual_seed(3)
    block = Block(cfg)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(4)
    x, gy = torch.randn(B, T, cfg.d_model, generator=g), torch.randn(B, T, cfg.d_model, generator=g)
    cos = sin = None
    if cfg.position == "rope":
        cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta)
    return block, x, gy, cos, sin


def dense_model(kind):
    from course_lib.model import TinyGPT

    import dataclasses

    torch.manual_seed(5)  # init_std 0.2, not 0.02: gradients well above the tolerance's atol
    model = TinyGPT(dataclasses.replace(block_cfg(kind), init_std=0.2))
    g = torch.Generator().manual_seed(6)
    idx = torch.randint(0, 32, (B, T), generator=g)
    targets = torch.randint(0, 32, (B, T), generator=g)
    targets[1, -2:] = -100
    return model, idx, targets


# ---- helpers inside ranks --------------------------------------------------------------------
def _counted(fn):
    """Run fn(); return (its result, the wire counter's plain dict)."""
    from course_lib.parallel.wire import count_collectives

    with count_collectives() as wire:
        out = fn()
    return out, wire.to_dict()


def _grads(module):
    """{name: (grad, tp_partition_dim or None)} for every parameter name (ties under both names)."""
    return {n: (None if p.grad is None else p.grad.detach().clone(), getattr(p, "tp_partition_dim", None))
            for n, p in module.named_parameters(remove_duplicate=False)}


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


# ---- cases ------------------------------------------------------------------------------------
def comm_op_cases(rank, world):
    from course_lib.parallel.tensor_parallel import comm_ops as ops

    inp, out = op_inputs(rank, world), {}

    def run(name, fn, x, grad):
        x = _leaf(x)
        y, fwd = _counted(lambda: fn(x))
        _, bwd = _counted(lambda: y.backward(grad))
        out[name] = {"y": y.detach(), "grad": x.grad, "fwd": fwd, "bwd": bwd}

    run("f", ops.copy_to_tp_region, inp["full"], inp["grad_full"])
    run("g", ops.reduce_from_tp_region, inp["full"], inp["grad_full"])
    run("gather_seq", ops.gather_from_sequence_region, inp["seq"], inp["grad_full"])
    run("reduce_scatter_seq", ops.reduce_scatter_to_sequence_region, inp["full"], inp["grad_seq"])
    run("scatter_seq", ops.scatter_to_sequence_region, shared_full(), inp["grad_seq"])
    run("gather_tp", ops.gather_from_tp_region, inp["chan"], inp["grad_wide"])
    run("scatter_tp", ops.scatter_to_tp_region, inp["grad_wide"], inp["grad_chan"])
    return out


def layer_cases(rank, world):
    from course_lib.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                     VocabParallelEmbedding)

    d, out = dense_layers(), {}

    def run(name, layer, x, gy):
        x = _leaf(x) if x.is_floating_point() else x
        y = layer(x)
        y.backward(gy)
        out[name] = {"y": y.detach(), "x_grad": getattr(x, "grad", None), "grads": _grads(layer)}

    mine = lambda t: t.chunk(world, dim=-1)[rank]  # noqa: E731 - this rank's channels
    run("col_gather", ColumnParallelLinear.from_linear(d["col"], gather_output=True), d["x"], d["gy_col"])
    run("col_local", ColumnParallelLinear.from_linear(d["col"], gather_output=False), d["x"], mine(d["gy_col"]))
    run("row_full_input", RowParallelLinear.from_linear(d["row"], input_is_parallel=False), d["x_row"], d["gy_row"])
    run("row_parallel_input", RowParallelLinear.from_linear(d["row"], input_is_parallel=True), mine(d["x_row"]),
        d["gy_row"])
    run("emb", VocabParallelEmbedding.from_embedding(d["emb"]), d["idx"], d["gy_emb"])
    return out


def ce_cases(rank, world):
    from course_lib.parallel.tensor_parallel import vocab_parallel_cross_entropy as vpce

    out = {}
    for scale in (3.0, 200.0):  # 200: exp() would overflow without subtracting the max
        logits, targets, weights = ce_inputs(scale)
        for reduction in ("mean", "sum", "none"):
            shard = _leaf(logits.chunk(world, dim=-1)[rank])
            loss, fwd = _counted(lambda: vpce(shard, targets, reduction=reduction))
            _, bwd = _counted(lambda: loss.backward(weights if reduction == "none" else None))
            out[(scale, reduction)] = {"loss": loss.detach(), "grad": shard.grad, "fwd": fwd, "bwd": bwd}
    return out


def block_cases(rank, world):
    from course_lib.parallel.tensor_parallel import TPMLP, TPAttention, TPBlock, sync_sequence_parallel_grads

    out = {}
    for kind in ("gpt", "llama"):
        for sp in (False, True):
            block, x, gy, cos, sin = dense_block(kind)
            tp = TPBlock.from_dense(block, sequence_parallel=sp)
            if sp:  # this rank's tokens in, this rank's tokens out
                x, gy = x.chunk(world, dim=1)[rank], gy.chunk(world, dim=1)[rank]
            x = _leaf(x)
            y, fwd = _counted(lambda: tp(x, cos, sin))
            _, bwd = _counted(lambda: y.backward(gy))
            synced = sync_sequence_parallel_grads(tp)
            out[(kind, sp, "block")] = {"y": y.detach(), "x_grad": x.grad, "grads": _grads(tp), "fwd": fwd,
                                        "bwd": bwd, "synced": synced}
            for part, cls, dense in (("mlp", TPMLP, block.mlp), ("attn", TPAttention, block.attn)):
                layer = cls.from_dense(dense, sequence_parallel=sp)
                xp = _leaf(x.detach())
                yp, fwd = _counted(lambda: layer(xp, cos, sin) if part == "attn" else layer(xp))
                _, bwd = _counted(lambda: yp.backward(gy))
                out[(kind, sp, part)] = {"y": yp.detach(), "x_grad": xp.grad, "grads": _grads(layer),
                                         "fwd": fwd, "bwd": bwd}
    return out


def model_cases(rank, world):
    from course_lib.parallel.tensor_parallel import tp_tinygpt

    out = {}
    for kind in ("gpt", "llama"):
        for sp in (False, True):
            model, idx, targets = dense_model(kind)
            tp = tp_tinygpt(model, sequence_parallel=sp)
            logits, loss = tp(idx, targets)
            loss.backward()
            tp.finish_gradient_synchronization()
            out[(kind, sp)] = {"loss": loss.detach(), "logits": logits.detach(), "grads": _grads(tp),
                               "tied": tp.lm_head.weight is tp.tok_emb.weight}
    return out


def sabotage_cases(rank, world):
    """Two classic mistakes, which the comparison must catch: a column layer with no ``f`` (the
    input gradient stays a per-rank partial sum) and a row layer with no ``g`` (the output stays a
    partial sum)."""
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    d = dense_layers()
    col = ColumnParallelLinear.from_linear(d["col"], gather_output=True, skip_input_comm=True)
    x = _leaf(d["x"])
    col(x).backward(d["gy_col"])
    row = RowParallelLinear.from_linear(d["row"], input_is_parallel=False)
    partial = F.linear(d["x_row"].chunk(world, dim=-1)[rank], row.weight) + row.bias
    return {"no_f_x_grad": x.grad, "no_g_y": partial.detach()}


def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def error_cases(rank, world):
    from course_lib.model import ModelConfig, TinyGPT
    from course_lib.model.layers import MLP, Attention
    from course_lib.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TPAttention, TPMLP,
                                                     VocabParallelEmbedding, reduce_scatter_to_sequence_region,
                                                     tp_tinygpt, vocab_parallel_cross_entropy)

    odd_heads = ModelConfig(n_heads=3, d_model=12)
    mqa = ModelConfig(n_heads=4, n_kv_heads=1, d_model=16)
    return {
        "n_heads": _message(lambda: TPAttention.from_dense(Attention(odd_heads))),
        "n_kv_heads": _message(lambda: TPAttention.from_dense(Attention(mqa))),
        "model_heads": _message(lambda: tp_tinygpt(TinyGPT(odd_heads))),
        "vocab": _message(lambda: VocabParallelEmbedding.from_embedding(nn.Embedding(VOCAB + 1, 4))),
        "col_out": _message(lambda: ColumnParallelLinear.from_linear(nn.Linear(4, 5))),
        "row_in": _message(lambda: RowParallelLinear.from_linear(nn.Linear(5, 4))),
        "ffn": _message(lambda: TPMLP.from_dense(MLP(ModelConfig(d_model=16, d_ff=5, n_heads=4)))),
        "dropout": _message(lambda: TPMLP.from_dense(MLP(ModelConfig(d_model=16, n_heads=4, dropout=0.1)))),
        "seq_len": _message(lambda: reduce_scatter_to_sequence_region(torch.zeros(B, world + 1, 4))),
        "sp_model_seq": _message(lambda: tp_tinygpt(TinyGPT(block_cfg("gpt")), sequence_parallel=True)(
            torch.zeros(1, world + 1, dtype=torch.long))),
        "ce_shape": _message(lambda: vocab_parallel_cross_entropy(torch.zeros(2, 3, 4),
                                                                  torch.zeros(2, dtype=torch.long))),
        "ce_target": _message(lambda: vocab_parallel_cross_entropy(torch.zeros(2, 4),
                                                                   torch.tensor([0, 4 * world]))),
        "not_linear": _message(lambda: ColumnParallelLinear.from_linear(nn.Embedding(4, 4))),
    }


def everything(rank, world_size):
    out = {"ops": comm_op_cases(rank, world_size), "layers": layer_cases(rank, world_size),
           "ce": ce_cases(rank, world_size), "blocks": block_cases(rank, world_size),
           "models": model_cases(rank, world_size), "sabotage": sabotage_cases(rank, world_size),
           "errors": error_cases(rank, world_size)}
    torch.distributed.barrier()
    return out
