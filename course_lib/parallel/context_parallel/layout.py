"""Which part of the sequence each rank holds: contiguous chunks or the load-balanced "zig-zag".

With N ranks and a sequence of S tokens, every rank holds S/N tokens of q, k and v.

* ``"contiguous"``: rank r holds tokens [r*S/N, (r+1)*S/N). Simple, but under a causal mask
  rank r's queries see the keys of ranks 0..r, so rank r scores r+1 blocks of (S/N)^2 while
  rank 0 scores one (and of those, the diagonal block is half masked). The last rank does N times
  the work of the first, and a ring step takes as long as its slowest rank: everybody waits for
  rank N-1.
* ``"zigzag"``: cut the sequence into 2N equal pieces; rank r holds pieces r and 2N-1-r (one early
  piece, one late piece). Every rank then scores 2N+1 pairs of half-chunks, the same work on every
  rank (Brandon et al. 2023 "Striped Attention" and the zig-zag variant used by Megatron-LM
  context parallelism / ring-flash-attention).

A rank's tokens are described by its *segments*: ``[(global_start, length), ...]`` in local
order, one segment for contiguous, two for zig-zag. The ring code only needs these positions to
decide, for each (query segment, key segment) pair, "all in the past" / "diagonal" / "all in the
future".

Only :func:`split_sequence` and :func:`merge_sequence` touch tensors (they take any object with
``.shape``/``.narrow`` and ``torch.cat``); the rest is plain integer arithmetic.
"""
from __future__ import annotations

from course_lib.validate import check_choice, check_int

LAYOUTS = ("contiguous", "zigzag")


def pieces_per_rank(layout: str) -> int:
    """How many equal pieces of the sequence one rank holds: 1 (contiguous) or 2 (zig-zag)."""
    check_choice("layout", layout, LAYOUTS)
    return 1 if layout == "contiguous" else 2


def chunk_segments(seq_chunk: int, world_size: int, rank: int, layout: str = "contiguous") -> list[tuple[int, int]]:
    """Global ``(start, length)`` of each contiguous run of tokens rank ``rank`` holds, in the
    order they appear in its local chunk of ``seq_chunk`` tokens."""
    check_int("seq_chunk", seq_chunk, 1)
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, world_size - 1, hi_name="world_size - 1")
    k = pieces_per_rank(layout)
    if seq_chunk % k:
        raise ValueError(f"seq_chunk ({seq_chunk}) must be even for layout 'zigzag' "
                         "(each rank holds two equal pieces)")
    if layout == "contiguous":
        return [(rank * seq_chunk, seq_chunk)]
    half = seq_chunk // 2
    return [(rank * half, half), ((2 * world_size - 1 - rank) * half, half)]


def _check_split(x, world_size: int, layout: str, dim: int) -> int:
    check_int("world_size", world_size, 1)
    k = pieces_per_rank(layout)
    if not hasattr(x, "shape"):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    ndim = len(x.shape)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim must be in [{-ndim}, {ndim - 1}] for x with {ndim} dims, got {dim}")
    seq = x.shape[dim]
    if seq % (k * world_size):
        raise ValueError(f"x's sequence length (dim {dim}) is {seq}, not divisible by "
                         f"{'2 x ' if k == 2 else ''}world_size = {k * world_size} "
                         f"(layout {layout!r}); pad or trim the sequence")
    return seq // (k * world_size)


def split_sequence(x, world_size: int, rank: int, *, layout: str = "contiguous", dim: int = 2):
    """Rank ``rank``'s chunk of the full sequence ``x`` (sequence along ``dim``; 2 for
    [batch, heads, seq, head_dim]), laid out as :func:`chunk_segments` says."""
    piece = _check_split(x, world_size, layout, dim)
    check_int("rank", rank, 0, world_size - 1, hi_name="world_size - 1")
    parts = [x.narrow(dim, start, length) for start, length in
             chunk_segments(piece * pieces_per_rank(layout), world_size, rank, layout)]
    if len(parts) == 1:
        return parts[0]
    import torch

    return torch.cat(parts, dim=dim)


def merge_sequence(chunks, *, layout: str = "contiguous", dim: int = 2):
    """Inverse of :func:`split_sequence`: the rank-ordered list of chunks back to one sequence."""
    import torch

    if not isinstance(chunks, (list, tuple)) or not chunks:
        raise TypeError("chunks must be a non-empty list of tensors, one per rank in rank order")
    n = len(chunks)
    k = pieces_per_rank(layout)
    shape = tuple(chunks[0].shape)
    for r, c in enumerate(chunks):
        if tuple(c.shape) != shape:
            raise ValueError(f"chunks[{r}] has shape {tuple(c.shape)}, chunks[0] has {shape}: "
                             "every rank holds the same number of tokens")
    if shape[dim] % k:
        raise ValueError(f"chunks' sequence length (dim {dim}) is {shape[dim]}, must be even for layout 'zigzag'")
    piece = shape[dim] // k
    pieces = [None] * (k * n)
    for r, c in enumerate(chunks):
        for i, (start, _) in enumerate(chunk_segments(shape[dim], n, r, layout)):
            pieces[start // piece] = c.narrow(dim, i * piece, piece)
    return torch.cat(pieces, dim=dim)


def causal_score_elements(seq_chunk: int, world_size: int, rank: int, layout: str = "contiguous",
                          causal: bool = True) -> int:
    """Query-key score elements rank ``rank`` computes over a whole ring pass, per (batch, head),
    with the block skipping of :mod:`ring_attention`: a key segment entirely in the future is
    skipped, a diagonal one is computed in full and masked. Contiguous causal: (rank+1) x chunk^2
    (grows with the rank); zig-zag causal: (2N+1) x (chunk/2)^2 on every rank."""
    mine = chunk_segments(seq_chunk, world_size, rank, layout)
    total = 0
    for src in range(world_size):
        for qs, ql in mine:
            for ks, kl in chunk_segments(seq_chunk, world_size, src, layout):
                if not causal or ks < qs + ql:  # not entirely in the future
                    total += ql * kl
    return total
