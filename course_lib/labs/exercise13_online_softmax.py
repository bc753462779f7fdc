"""Exercise 13 (online softmax): partial attention over one key block, and the checks of the
learner's ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``.

A *partial* is what attention over one block of keys gives a block of queries: ``out`` [..., rows,
dv], the softmax-weighted values of that block's keys alone, and ``lse`` [..., rows], the log of the
sum of exp(score) over those keys. A row that sees no key of the block (all masked) has out 0 and
lse -inf. Everything here runs in one process: :func:`simulate_ring` plays N ranks of ring
attention, folding each K/V block a rank receives into its running partial with the learner's merge.

The references never call a merge: they run attention over the keys of both blocks (or the whole
sequence) at once, on the very same scores. Checks raise :class:`course_lib.kit.checks.CheckFailed`
with a sentence that says what came out and where (``NotImplementedError`` while the learner's code
raises it), and otherwise return what the notebook prints and records.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from course_lib.kit.checks import CheckFailed
from course_lib.parallel.context_parallel.layout import chunk_segments, merge_sequence, split_sequence

RTOL, ATOL = 1e-5, 1e-6  # fp32: the merge adds the same terms in another order than one softmax
# float32 holds a score near 200 to about 1.5e-5, so two right merges of such rows differ by up to ~1e-5
LARGE_RTOL = 1e-4


# ============================================================= partials
def partial_from_scores(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of scores ``s`` [..., rows, keys] (-inf = masked) over values ``v`` [..., keys, dv].
    A row whose scores are all -inf gets out 0 and lse -inf."""
    lse = torch.logsumexp(s, dim=-1)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # all-masked rows: exp(-inf) = 0
    return torch.exp(s - shift.unsqueeze(-1)) @ v, lse


def block_attention(q, k, v, mask=None, scale=None):
    """The partial (out, lse) of queries ``q`` [..., rows, d] over one block of keys ``k`` [..., keys, d]
    and values ``v`` [..., keys, dv]. ``mask`` (bool, broadcastable to [rows, keys]): True where a
    query may see a key. ``scale`` defaults to 1/sqrt(d), as in ``scaled_dot_product_attention``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return partial_from_scores(s, v)


def empty_partial(rows_shape, dv: int, dtype=torch.float32):
    """The partial of no keys at all: out 0 [*rows_shape, dv], lse -inf [*rows_shape]."""
    return torch.zeros(*rows_shape, dv, dtype=dtype), torch.full(tuple(rows_shape), float("-inf"), dtype=dtype)


def _randn(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ============================================================= calling the learner's merge
def call_merge(merge, a, b, what: str):
    """``merge(*a, *b)`` on copies of the partials ``a``, ``b``; the result as (out, lse), checked for
    type and shape, and CheckFailed if the merge changed a tensor it was given (the contract: a ring
    keeps its running partial and a received block after the merge, so an in-place merge corrupts
    the next step). The copies are thrown away, so one call cannot spoil the next."""
    out_a, lse_a = (t.clone() for t in a)
    out_b, lse_b = (t.clone() for t in b)
    got = merge(out_a, lse_a, out_b, lse_b)
    for name, given, original in (("out_a", out_a, a[0]), ("lse_a", lse_a, a[1]),
                                  ("out_b", out_b, b[0]), ("lse_b", lse_b, b[1])):
        if not _same(given, original):
            raise CheckFailed(f"{what}: your merge changed the {name} it was given (an in-place operation such as "
                              "mul_, add_, copy_, `+=` or an indexed assignment on an input). The contract says "
                              "the inputs are not changed: a ring still holds the block it received and the "
                              "partial it merged into, and the caller may use them again. Compute into new "
                              "tensors instead")
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailed(f"{what}: merge returned {type(got).__name__}, expected a pair of tensors (out, lse)")
    out, lse = got
    for name, t, like in (("out", out, a[0]), ("lse", lse, a[1])):
        if t.shape != like.shape:
            raise CheckFailed(f"{what}: the merged {name} has shape {tuple(t.shape)}, expected {tuple(like.shape)} "
                              f"(the shape of each block's {name})")
        if t.dtype != like.dtype:
            raise CheckFailed(f"{what}: the merged {name} is {t.dtype}, the blocks' {name} is {like.dtype}: "
                              "keep the inputs' dtype")
    return out.detach(), lse.detach()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit the same values (NaN where the other has NaN counts as the same)."""
    nan = a.isnan()
    return a.shape == b.shape and torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over the largest |want| (finite entries; inf where the patterns of
    non-finite values differ)."""
    g, w = got.double(), want.double()
    if not torch.equal(torch.isfinite(g), torch.isfinite(w)) or not torch.equal(g[~torch.isfinite(w)],
                                                                                w[~torch.isfinite(w)]):
        return float("inf")
    fin = torch.isfinite(w)
    if not fin.any():
        return 0.0
    return ((g - w)[fin].abs().max() / w[fin].abs().max().clamp_min(1e-30)).item()


def _compare(what: str, got, want, rtol: float = RTOL, why: str | None = None) -> tuple[float, float]:
    """Relative errors (out, lse) of ``got`` against ``want``; CheckFailed in words when either is
    over ``rtol``: non-finite values where the reference has none (``why``: the likely cause, by
    default the masked rows' NaN or the overflow's inf), or how far off, in which part."""
    (out, lse), (ref_out, ref_lse) = got, want
    for name, g, w in (("out", out, ref_out), ("lse", lse, ref_lse)):
        bad = torch.isnan(g) & ~torch.isnan(w)
        if bad.any():
            raise CheckFailed(f"{what}: the merged {name} is NaN in {int(bad.sum())} of {g.numel()} entries, where "
                              f"attention over all the keys gives a number. {why or _NAN_WHY}")
        over = torch.isinf(g) & ~torch.isinf(w)
        if over.any():
            raise CheckFailed(f"{what}: the merged {name} is infinite in {int(over.sum())} of {g.numel()} entries, "
                              f"where attention over all the keys is finite. {why or _INF_WHY}")
    err_out, err_lse = _rel(out, ref_out), _rel(lse, ref_lse)
    if err_lse > rtol:
        raise CheckFailed(f"{what}: the merged lse is off by up to {err_lse:.2g} (relative) from the log-sum-exp "
                          "of the row's scores over the keys of both blocks; the merged lse must be exactly "
                          "that, or the next merge of a ring weights this partial wrongly")
    if err_out > rtol:
        raise CheckFailed(f"{what}: the merged out is off by up to {err_out:.2g} (relative) from attention over "
                          "the keys of both blocks (the lse is right). Each block's out is normalised by its "
                          "own keys only: how much of the row's total weight does each block hold?")
    return err_out, err_lse


_NAN_WHY = ("NaN comes from inf - inf, 0 * inf or 0 / 0: look at rows where a block saw no key (its lse is "
            "-inf, its out 0); such a block must count for nothing, and a row with no key in either block "
            "stays out 0, lse -inf")
_INF_WHY = ("exp of a number above about 88 is inf in float32 (709 in float64), and inf / inf is NaN: the "
            "scores here are far larger. Which number can be taken out of every exponential of a row "
            "without changing the result?")


# ============================================================= the visible checks
def check_two_blocks(merge, rows: int = 6, keys_a: int = 5, keys_b: int = 3, d: int = 8, seed: int = 0) -> dict:
    """Queries over keys cut into two blocks (batch 2, heads 3): the merge of the two partials against
    attention over all the keys (``scaled_dot_product_attention`` for out, ``logsumexp`` of the scores
    for lse). Both merge orders. Returns the merged tensors and the errors."""
    q = _randn((2, 3, rows, d), seed)
    k = _randn((2, 3, keys_a + keys_b, d), seed + 1)
    v = _randn((2, 3, keys_a + keys_b, d), seed + 2)
    a = block_attention(q, k[..., :keys_a, :], v[..., :keys_a, :])
    b = block_attention(q, k[..., keys_a:, :], v[..., keys_a:, :])
    got = call_merge(merge, a, b, "two blocks")
    swapped = call_merge(merge, b, a, "two blocks, merged in the other order")
    ref_out = F.scaled_dot_product_attention(q, k, v)
    ref_lse = torch.logsumexp((q @ k.transpose(-1, -2)) / math.sqrt(d), dim=-1)
    err = _compare("two blocks", got, (ref_out, ref_lse))
    err_swapped = _compare("two blocks, merged in the other order", swapped, (ref_out, ref_lse))
    return {"out": got[0], "lse": got[1], "swapped": swapped, "err_out": err[0], "err_lse": err[1],
            "err_swapped": max(err_swapped)}


def large_score_cases(seed: int = 3) -> dict:
    """Partials whose scores are far beyond what exp can take: float32 rows near 200 (exp overflows
    above 88.7) and float64 rows near 2000 (above 709.8); per case the two blocks' scores and values
    (block b's scores sit 2 above block a's in half the rows, 2 below in the others: both count)."""
    cases = {}
    for name, dtype, base in (("float32, scores near 200", torch.float32, 200.0),
                              ("float64, scores near 2000", torch.float64, 2000.0)):
        s = _randn((4, 7), seed, torch.float64)
        shift = torch.tensor([2.0, -2.0, 2.0, -2.0], dtype=torch.float64).unsqueeze(-1)
        s_a, s_b = base + s[:, :4], base + s[:, 4:] + shift
        v = _randn((7, 5), seed + 1, torch.float64)
        cases[name] = tuple(t.to(dtype) for t in (s_a, s_b, v[:4], v[4:]))
    return cases


def check_large_scores(merge) -> dict:
    """The merge of partials with huge scores against one softmax over both blocks' scores (the same
    numbers): finite, and within :data:`LARGE_RTOL` relative. Returns {case: (out, lse)} and the errors."""
    got_all, errs = {}, {}
    for name, (s_a, s_b, v_a, v_b) in large_score_cases().items():
        got = call_merge(merge, partial_from_scores(s_a, v_a), partial_from_scores(s_b, v_b), name)
        want = partial_from_scores(torch.cat([s_a, s_b], dim=-1), torch.cat([v_a, v_b], dim=-2))
        errs[name] = _compare(name, got, want, rtol=LARGE_RTOL, why=_INF_WHY)
        got_all[name] = got
    return {"merged": got_all, "errors": errs}


def masked_cases(seed: int = 5) -> tuple:
    """Two partials of 6 query rows where some rows see no key of a block: rows 0-1 none of block a,
    rows 2-3 none of block b, rows 4-5 none of either; plus the causal mask and values."""
    q, k, v = _randn((6, 4), seed), _randn((5, 4), seed + 1), _randn((5, 3), seed + 2)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[0:2, :3] = False  # block a = keys 0-2, block b = keys 3-4
    mask[2:4, 3:] = False
    mask[4:6, :] = False
    return q, k, v, mask


def check_masked_rows(merge) -> dict:
    """Rows that see no key of one block, or of either: the merge against attention over both blocks
    with the same mask (out 0 and lse -inf for a row that sees nothing). Returns the merged tensors."""
    q, k, v, mask = masked_cases()
    a = block_attention(q, k[:3], v[:3], mask[:, :3])
    b = block_attention(q, k[3:], v[3:], mask[:, 3:])
    got = call_merge(merge, a, b, "rows with no key in a block")
    want = block_attention(q, k, v, mask)
    err = _compare("rows with no key in a block", got, want)
    empty = empty_partial((6,), 3)
    nothing = call_merge(merge, empty, empty, "two empty partials")
    if not (torch.equal(nothing[0], empty[0]) and torch.equal(nothing[1], empty[1])):
        raise CheckFailed("two empty partials (every row: out 0, lse -inf) must merge into an empty partial; got "
                          f"out values {nothing[0].flatten()[:3].tolist()}..., lse {nothing[1][:3].tolist()}... "
                          f"{_NAN_WHY}")
    return {"out": got[0], "lse": got[1], "err_out": err[0], "err_lse": err[1], "empty": nothing}


# ============================================================= the ring, in one process
def ring_inputs(batch: int, heads: int, seq_len: int, head_dim: int, seed: int = 0):
    """q, k, v [batch, heads, seq_len, head_dim], the same for every simulated rank."""
    return [_randn((batch, heads, seq_len, head_dim), seed + i) for i in range(3)]


def _positions(seq_chunk: int, n: int, rank: int, layout: str) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + ln) for s, ln in chunk_segments(seq_chunk, n, rank, layout)])


def simulate_ring(merge, q, k, v, n: int, *, layout: str = "contiguous", skip_future: bool = True) -> dict:
    """One process plays ``n`` ranks of causal ring attention on q, k, v [batch, heads, S, d].

    Rank r keeps the queries of its chunk (``layout``: contiguous or zigzag) and starts from the empty
    partial; at step s it holds the K/V block of rank (r - s) mod n, computes that block's partial for
    its queries (:func:`block_attention`, causal mask at the tokens' true positions) and folds it into
    its running partial with ``merge``. ``skip_future``: a block entirely in the future of every one
    of the rank's queries is not computed (what ring attention does); False merges it anyway (every
    row fully masked). Returns ``out``/``lse`` (whole sequence, reassembled from the ranks), per
    rank and step the block held (``held``), the blocks computed (``computed``), and ``error`` = max
    |running out - the rank's final out| after each step (0 once the rank has seen every key it
    needs)."""
    s_len = q.shape[2]
    c = s_len // n
    outs, lses, held, computed, error = [], [], [], [], []
    for r in range(n):
        qr = split_sequence(q, n, r, layout=layout)
        qpos = _positions(c, n, r, layout)
        acc = empty_partial(qr.shape[:-1], v.shape[-1], q.dtype)
        steps, trace, n_computed = [], [], 0
        for step in range(n):
            src = (r - step) % n
            kpos = _positions(c, n, src, layout)
            mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
            steps.append(src)
            if skip_future and not mask.any():
                trace.append(acc[0])
                continue
            part = block_attention(qr, split_sequence(k, n, src, layout=layout),
                                   split_sequence(v, n, src, layout=layout), mask)
            acc = call_merge(merge, acc, part, f"ring of {n} ({layout}), rank {r}, step {step}")
            n_computed += 1
            trace.append(acc[0])
        held.append(steps)
        computed.append(n_computed)
        error.append([(t - acc[0]).abs().max().item() for t in trace])
        outs.append(acc[0])
        lses.append(acc[1])
    return {"out": merge_sequence(outs, layout=layout), "lse": merge_sequence(lses, layout=layout, dim=2),
            "held": held, "computed": computed, "error": error}


def causal_reference(q, k, v):
    """Full causal attention on one process: out (``scaled_dot_product_attention``) and lse."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    t = s.shape[-1]
    lse = torch.logsumexp(s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True), lse


def check_ring(merge, cases, *, batch: int = 1, heads: int = 2, head_dim: int = 8, seed: int = 7) -> list[dict]:
    """:func:`simulate_ring` for each ``(n, seq_len, layout, skip_future)`` against full causal
    attention on one process. Returns one row per case (the reassembled out and lse, the errors)."""
    rows = []
    for n, seq_len, layout, skip in cases:
        q, k, v = ring_inputs(batch, heads, seq_len, head_dim, seed)
        sim = simulate_ring(merge, q, k, v, n, layout=layout, skip_future=skip)
        what = f"ring of {n} ranks, {seq_len} tokens, {layout}{'' if skip else ', future blocks merged too'}"
        err_out, err_lse = _compare(what, (sim["out"], sim["lse"]), causal_reference(q, k, v), rtol=1e-5)
        rows.append({"n": n, "seq_len": seq_len, "layout": layout, "skip_future": skip, "out": sim["out"],
                     "lse": sim["lse"], "err_out": err_out, "err_lse": err_lse, "held": sim["held"],
                     "computed": sim["computed"], "error": sim["error"]})
    return rows
