"""Rank functions (and the single-process reference) for tests/test_context_parallel.py.

One launch per world size runs every case: starting ranks is the slow part. Every rank builds the
same full q, k, v, dout from a seed, keeps its own chunk, and hands back its chunk of the output
and gradients; the test merges the chunks and compares them with one-process attention."""

import torch
import torch.nn.functional as F

# name: (batch, heads, seq_chunk, head_dim, v_head_dim, causal, layout, dtype)
CASES = {
    "causal": (2, 3, 4, 8, 8, True, "contiguous", torch.float32),
    "noncausal_uneven": (2, 2, 3, 5, 3, False, "contiguous", torch.float32),
    "causal_uneven": (3, 2, 5, 5, 7, True, "contiguous", torch.float32),
    "zigzag_causal": (2, 2, 6, 5, 3, True, "zigzag", torch.float32),
    "zigzag_noncausal": (1, 2, 4, 4, 4, False, "zigzag", torch.float32),
    "bf16_causal": (1, 2, 4, 8, 8, True, "contiguous", torch.bfloat16),
}


def full_inputs(name, world_size, seed=0):
    """The whole sequence: q, k, v, dout (fp32 or the case's dtype), the same on every process."""
    b, h, c, d, dv, _, _, dtype = CASES[name]
    g = torch.Generator().manual_seed(seed)
    s = c * world_size
    q, k = (torch.randn(b, h, s, d, generator=g) for _ in range(2))
    v, dout = (torch.randn(b, h, s, dv, generator=g) for _ in range(2))
    return [t.to(dtype) for t in (q, k, v, dout)]


def reference(name, world_size):
    """Full attention on one process: out and the q, k, v gradients for dout (in fp32)."""
    causal = CASES[name][5]
    q, k, v, dout = (t.float().requires_grad_(i < 3) for i, t in enumerate(full_inputs(name, world_size)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_case(name, world_size, rank, group=None):
    from course_lib.parallel.context_parallel import ring_attention, split_sequence
    from course_lib.parallel.wire import count_collectives

    causal, layout = CASES[name][5], CASES[name][6]
    q, k, v, dout = (split_sequence(t, world_size, rank, layout=layout) for t in full_inputs(name, world_size))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    stats = {}
    with count_collectives() as fwd_wire:
        out = ring_attention(q, k, v, group=group, causal=causal, layout=layout, stats=stats)
    after_forward = dict(stats)
    with count_collectives() as bwd_wire:
        out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "stats": stats,
            "forward_stats": after_forward,
            "wire_forward": fwd_wire.exact_bytes_per_rank(), "wire_backward": bwd_wire.exact_bytes_per_rank(),
            "wire_forward_kinds": fwd_wire.by_kind(), "wire_backward_kinds": bwd_wire.by_kind()}


def sabotaged(world_size, rank):
    """The forward with the running sum never rescaled: must NOT match full attention."""
    from course_lib.parallel.context_parallel import split_sequence
    from course_lib.parallel.context_parallel.ring_attention import _forward

    q, k, v, _ = (split_sequence(t, world_size, rank) for t in full_inputs("causal", world_size))
    out, _ = _forward(q, k, v, None, True, "contiguous", q.shape[-1] ** -0.5, None, rescale_sum=False)
    return out


def subgroups(rank, world_size):
    """Two rings of 2 inside 4 ranks ([0, 2] and [1, 3]): the group's ranks, not the global ones."""
    groups = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
    mine = groups[rank % 2]
    return run_case("causal", 2, rank // 2, group=mine)


def everything(rank, world_size):
    out = {name: run_case(name, world_size, rank) for name in CASES}
    out["sabotaged"] = sabotaged(world_size, rank)
    if world_size == 4:
        out["subgroup"] = subgroups(rank, world_size)
    torch.distributed.barrier()
    return out
