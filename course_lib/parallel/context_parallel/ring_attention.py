"""Ring attention from scratch: exact attention over a sequence split across ranks.

Each of the N ranks of ``group`` holds the q, k, v of its own tokens, shape
[batch, heads, seq_chunk, head_dim] (which tokens: ``layout``, see :mod:`.layout`). Nobody holds
the whole sequence, and nobody builds the [S x S] score matrix.

Forward, N steps. At step s rank r holds the K/V block of rank (r - s) mod N. It first *posts*
the hand-over (``dist.isend`` of that block to rank r+1, ``dist.irecv`` of the next one from
rank r-1), then scores its queries against the block it holds while the transfer runs, and only
then waits. Per (query segment, key segment) pair under a causal mask: keys entirely in the
future are skipped, keys entirely in the past are used as they are, the diagonal pair gets the
triangular mask. Partial results are merged with the online softmax (Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022): per query row a running max m, a running sum l of exp(score - m)
and an unnormalised output acc. A new block with row max m_b gives m' = max(m, m_b), and the old
l and acc are *rescaled* by exp(m - m') before the block's exp(score - m') terms are added. At the
end out = acc / l, and the log-sum-exp lse = m + log l is kept for the backward.

Backward, N steps again (FlashAttention-2's recomputation, Dao 2023): from the saved q, k, v,
out and lse, each block's probabilities are recomputed as p = exp(q k^T scale - lse), so no
probabilities are stored. With D = rowsum(dO * out):
dV_j += p^T dO,  dS = p * (dO V_j^T - D),  dQ += dS K_j scale,  dK_j += dS^T Q scale.
K/V travel the ring as in the forward; the dK/dV accumulator of a block starts on the rank after
its owner, travels with the block, and the last hop brings it home, where the owner adds its own
share. Bytes per rank: see :mod:`.cost` (forward (N-1)(K+V), backward (N-1)(K+V)(1 + g/e)).

The arithmetic runs in at least fp32 (bf16 inputs are upcast per block). Without a process group
(and ``group=None``) it runs as one rank: plain attention, no communication. Every rank of the
group must call it with the same shapes (not checked: it would cost a collective).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.parallel.context_parallel.layout import LAYOUTS, chunk_segments
from course_lib.validate import check_bool, check_choice, check_number

_NEG_INF = float("-inf")


def _ring_peers(group):
    """(rank in group, group size, global rank of next, global rank of previous)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("group was given but no process group is initialised")
        return 0, 1, None, None
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group it was given")
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    return rank, n, nxt, prv


class _Ring:
    """Posts point-to-point transfers to the next rank / from the previous one; ``wait`` ends them.
    ``dist.isend``/``dist.irecv`` are looked up at call time, so ``count_collectives`` sees them."""

    def __init__(self, group, nxt, prv, stats, key):
        self.group, self.nxt, self.prv, self.stats, self.key = group, nxt, prv, stats, key
        self.pending = []

    def send(self, tensors, tag):
        for i, t in enumerate(tensors):
            self.pending.append(dist.isend(t, dst=self.nxt, group=self.group, tag=tag + i))
            if self.stats is not None:
                self.stats[self.key] += t.numel() * t.element_size()

    def recv(self, likes, tag):
        bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in likes]
        for i, b in enumerate(bufs):
            self.pending.append(dist.irecv(b, src=self.prv, group=self.group, tag=tag + i))
        return bufs

    def wait(self):
        for work in self.pending:
            work.wait()
        self.pending = []


def _pairs(q_segs, k_segs, causal):
    """(query slice, key slice, diagonal?) for every segment pair with something to score."""
    out, q_off = [], 0
    for qs, ql in q_segs:
        k_off = 0
        for ks, kl in k_segs:
            if not causal or ks + kl <= qs:
                out.append((slice(q_off, q_off + ql), slice(k_off, k_off + kl), False))
            elif ks == qs:
                out.append((slice(q_off, q_off + ql), slice(k_off, k_off + kl), True))
            elif ks < qs + ql:  # equal-size pieces never overlap partially
                raise AssertionError(f"segments overlap partially: {(qs, ql)} vs {(ks, kl)}")
            k_off += kl
        q_off += ql
    return out


def _scores(q, k, scale, diagonal, stats):
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:  # same positions: key j is in the future of query i when j > i
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), _NEG_INF)
    if stats is not None:
        stats["peak_score_elements"] = max(stats["peak_score_elements"], s.numel())
        stats["score_elements"] += s.numel()
    return s


def online_softmax_update(m, l, acc, s, v, *, rescale_sum: bool = True) -> None:
    """Fold one score block ``s`` [.., rows, keys] and its values ``v`` into the running max ``m``,
    running sum ``l`` and unnormalised output ``acc`` (all updated in place). ``rescale_sum=False``
    is the classic bug (forgetting to rescale l when the max grows), kept to prove the tests fail."""
    m_new = torch.maximum(m, s.amax(dim=-1))
    safe = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)  # rows with no key yet
    alpha = torch.exp(m - safe)  # 0 on the first block (m = -inf)
    p = torch.exp(s - safe.unsqueeze(-1))
    if rescale_sum:
        l.mul_(alpha)
    l.add_(p.sum(dim=-1))
    acc.mul_(alpha.unsqueeze(-1)).add_(p @ v)
    m.copy_(m_new)


def _forward(q, k, v, group, causal, layout, scale, stats, rescale_sum=True):
    rank, n, nxt, prv = _ring_peers(group)
    cdt = torch.promote_types(q.dtype, torch.float32)
    b, h, c, _ = q.shape
    qc = q.to(cdt)
    m = torch.full((b, h, c), _NEG_INF, dtype=cdt, device=q.device)
    l = torch.zeros((b, h, c), dtype=cdt, device=q.device)
    acc = torch.zeros((b, h, c, v.shape[-1]), dtype=cdt, device=q.device)
    mine = chunk_segments(c, n, rank, layout)
    ring = _Ring(group, nxt, prv, stats, "bytes_sent_forward")
    kv = (k.contiguous(), v.contiguous())
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:  # start the hand-over, then compute while it runs
            ring.send(kv, tag=8 * step)
            incoming = ring.recv(kv, tag=8 * step)
        for qsl, ksl, diag in _pairs(mine, chunk_segments(c, n, src, layout), causal):
            s = _scores(qc[:, :, qsl], kv[0][:, :, ksl].to(cdt), scale, diag, stats)
            online_softmax_update(m[:, :, qsl], l[:, :, qsl], acc[:, :, qsl], s, kv[1][:, :, ksl].to(cdt),
                                  rescale_sum=rescale_sum)
        if step < n - 1:
            ring.wait()
            kv = tuple(incoming)
    return acc / l.unsqueeze(-1), m + torch.log(l)


def _backward(q, k, v, out, lse, dout, group, causal, layout, scale, stats):
    rank, n, nxt, prv = _ring_peers(group)
    cdt = torch.promote_types(q.dtype, torch.float32)
    c = q.shape[2]
    qc, do = q.to(cdt), dout.to(cdt)
    delta = (do * out).sum(dim=-1)  # D = rowsum(dO * out)
    dq = torch.zeros_like(qc)
    dk_own = torch.zeros(k.shape, dtype=cdt, device=k.device)
    dv_own = torch.zeros(v.shape, dtype=cdt, device=v.device)
    mine = chunk_segments(c, n, rank, layout)
    ring = _Ring(group, nxt, prv, stats, "bytes_sent_backward")
    kv, grads = (k.contiguous(), v.contiguous()), None
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            ring.send(kv, tag=8 * step)
            incoming = ring.recv(kv, tag=8 * step)
        if step >= 1:  # the accumulator the previous rank finishes during this step
            incoming_grads = ring.recv((dk_own, dv_own), tag=8 * step + 2)
        if step == 0:
            dk, dv = dk_own, dv_own
        elif step == 1:  # this rank is the first stop of block src's accumulator
            dk, dv = torch.zeros_like(dk_own), torch.zeros_like(dv_own)
        else:
            dk, dv = grads
        for qsl, ksl, diag in _pairs(mine, chunk_segments(c, n, src, layout), causal):
            kb, vb, qb, dob = kv[0][:, :, ksl].to(cdt), kv[1][:, :, ksl].to(cdt), qc[:, :, qsl], do[:, :, qsl]
            p = torch.exp(_scores(qb, kb, scale, diag, stats) - lse[:, :, qsl].unsqueeze(-1))
            dv[:, :, ksl] += p.transpose(-1, -2) @ dob
            ds = p * (dob @ vb.transpose(-1, -2) - delta[:, :, qsl].unsqueeze(-1))
            dq[:, :, qsl] += (ds @ kb) * scale
            dk[:, :, ksl] += (ds.transpose(-1, -2) @ qb) * scale
        if step >= 1:
            ring.send((dk, dv), tag=8 * step + 2)
        ring.wait()
        if step < n - 1:
            kv = tuple(incoming)
        if step >= 1:
            grads = incoming_grads
    if n > 1:  # the own block's accumulator, home after its trip round the ring
        dk_own += grads[0]
        dv_own += grads[1]
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """The autograd Function behind :func:`ring_attention` (arguments after v are not tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, stats):
        out, lse = _forward(q, k, v, group, causal, layout, scale, stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, scale, stats)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _check_inputs(q, k, v, causal, layout, scale, stats):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq_chunk, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[:3] != q.shape[:3]:
            raise ValueError(f"{name} has [batch, heads, seq_chunk] = {list(t.shape[:3])}, q has "
                             f"{list(q.shape[:3])}: they must match")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}: they must match")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's head_dim ({k.shape[-1]}) must equal q's ({q.shape[-1]}); v's may differ")
    check_bool("causal", causal)
    check_choice("layout", layout, LAYOUTS)
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"q's seq_chunk ({q.shape[2]}) must be even for layout 'zigzag'")
    if scale is not None:
        check_number("scale", scale, 0, lo_open=True)
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats must be a dict or None, got {type(stats).__name__}")


def ring_attention(q, k, v, *, group=None, causal: bool = True, layout: str = "contiguous",
                   scale: float | None = None, stats: dict | None = None):
    """Exact (causal) attention of this rank's queries over the whole sequence of ``group``.

    ``q``, ``k``: [batch, heads, seq_chunk, head_dim]; ``v``: [batch, heads, seq_chunk, v_head_dim];
    this rank's tokens, laid out as ``layout`` says (``"contiguous"`` or ``"zigzag"``; split a full
    sequence with :func:`split_sequence`). ``scale`` defaults to 1/sqrt(head_dim), as in
    ``scaled_dot_product_attention``. Returns this rank's rows of the output, differentiable in
    q, k, v (the backward is a second ring pass). ``stats``, if a dict, receives
    ``bytes_sent_forward``/``bytes_sent_backward`` (bytes this rank isend-s), ``peak_score_elements``
    (largest score block, elements) and ``score_elements`` (all score elements computed).
    """
    _check_inputs(q, k, v, causal, layout, scale, stats)
    if stats is not None:
        for key in ("bytes_sent_forward", "bytes_sent_backward", "peak_score_elements", "score_elements"):
            stats.setdefault(key, 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, group, causal, layout, scale, stats)
