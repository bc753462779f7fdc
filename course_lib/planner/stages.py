"""Pipeline stages of a layout: blocks per stage, what each pipeline rank holds and computes.

A layout with ``pp`` pipeline ranks and ``v`` virtual stages per rank (interleaved 1F1B) has
``S = pp * v`` stages; stage ``i`` runs on rank ``i % pp`` (Megatron's interleaved placement, as
:func:`course_lib.estimate.stage_split.stage_split`). Stage 0 also holds the embedding, stage S-1
the final norm, the LM head and the loss. A synchronous pipeline runs at the pace of its
**busiest rank**, and every rank must fit, so the planner's memory and time come from the busiest
rank (see ``costs.evaluate``).

* :func:`balanced_counts` - the split ``stage_split(..., split="balanced")`` gives (the end stages
  count the embedding's parameters and the head's parameters or FLOPs as extra blocks,
  :func:`~course_lib.estimate.stage_split.end_weights`), found by enumerating the two end stages'
  block counts and spreading the rest evenly: O(n_layers^2) instead of the exact dynamic
  programme's O(S n_layers^2) on Fractions (seconds for 64 stages; the search asks hundreds of
  times). ``tests/test_planner_layouts.py`` checks both give the same split.
* :func:`rank_blocks` - blocks per pipeline rank (the sum of its stages).
* :func:`in_flight_layers` - layer-equivalents of activations a rank keeps at its peak.
* :func:`rank_flop_loads` - forward FLOPs per rank and sequence (blocks plus the head on the last
  rank), whose max over mean is the stage imbalance that stretches the step.
"""
from __future__ import annotations

from functools import lru_cache

from course_lib.estimate.stage_split import _block_flops, end_weights


@lru_cache(maxsize=4096)
def balanced_counts(shape, stages: int, seq_len: int) -> tuple[int, ...]:
    """Blocks per stage (``stages`` counts summing to ``shape.n_layers``) minimising the heaviest
    stage load (blocks + end weights), then the sum of squared loads, then giving earlier stages
    fewer blocks: the objective of ``stage_split(..., "balanced")``. A tuple of ints."""
    n = shape.n_layers
    if stages == 1:
        return (n,)
    first, last = end_weights(shape, seq_len)
    # Exact integer arithmetic: every load times the common denominator q of the two end weights.
    q = first.denominator * last.denominator
    f, l = int(first * q), int(last * q)
    inner = stages - 2
    best = None
    for a in range(1, n - stages + 2):          # blocks on the first stage
        for c in range(1, n - a - inner + 1):   # blocks on the last stage
            rest = n - a - c
            if inner == 0:
                if rest:
                    continue
                base = extra = 0
            else:
                if rest < inner:
                    continue
                base, extra = divmod(rest, inner)  # later stages take the extra blocks
            ends = (a * q + f, c * q + l)
            heaviest = max(ends + ((base + (1 if extra else 0)) * q,) if inner else ends)
            squares = ends[0] ** 2 + ends[1] ** 2 + ((inner - extra) * base ** 2 + extra * (base + 1) ** 2) * q * q
            key = (heaviest, squares, a, base, extra)  # = the counts list in lexicographic order
            if best is None or key < best:
                best = key
    _, _, a, base, extra = best
    c = n - a - base * inner - extra
    return tuple([a] + [base] * (inner - extra) + [base + 1] * extra + [c])


def rank_blocks(counts, pp: int) -> list[int]:
    """Blocks held by each pipeline rank: stage i runs on rank i % pp (a list of pp ints)."""
    out = [0] * pp
    for i, n in enumerate(counts):
        out[i % pp] += n
    return out


def in_flight_layers(blocks: int, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> float:
    """Layer-equivalents of saved activations pipeline rank ``rank`` holds at its peak (multiply by
    one layer's activation bytes for one micro-batch).

    1F1B: rank r runs pp - r forwards before its first backward (min with the micro-batches), each
    of its ``blocks`` layers (Korthikanti et al. 2022, Sec. 4.2.3 for r = 0). Interleaved 1F1B with
    v chunks of blocks/v layers: Megatron's warm-up of (pp - r - 1) x 2 + (v - 1) x pp chunk
    forwards plus the one in steady state; for r = 0 that is Korthikanti's
    pp (1 + (pp - 1)/(pp v)) micro-batches of blocks layers."""
    if pp == 1:
        return float(blocks)
    if virtual_stages == 1:
        return float(blocks * min(pp - rank, micro_batches))
    v = virtual_stages
    chunks = min(micro_batches * v, (pp - rank - 1) * 2 + (v - 1) * pp + 1)
    return blocks * chunks / v


def rank_flop_loads(shape, counts, pp: int, seq_len: int) -> list[float]:
    """Forward matmul FLOPs per sequence of each pipeline rank: its blocks, plus the LM head
    (2 s d V) on the rank of the last stage. The embedding is a lookup (no matmul)."""
    block = _block_flops(shape, seq_len)
    loads = [float(b * block) for b in rank_blocks(counts, pp)]
    loads[(len(counts) - 1) % pp] += 2.0 * seq_len * shape.d_model * shape.vocab_size
    return loads


def stage_imbalance(shape, counts, pp: int, seq_len: int) -> float:
    """Busiest rank's forward FLOPs over the mean rank's (>= 1; 1 without a pipeline): how much
    longer the step's compute takes than a perfectly balanced pipeline's."""
    if pp == 1:
        return 1.0
    loads = rank_flop_loads(shape, counts, pp, seq_len)
    return max(loads) * pp / sum(loads)


def compact_counts(counts) -> str:
    """Counts as short text, runs folded: (5, 6, 6, 6, 5) -> "5,6*3,5"."""
    out, i = [], 0
    counts = list(counts)
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(str(counts[i]) if j - i == 1 else f"{counts[i]}*{j - i}")
        i = j
    return ",".join(out)
