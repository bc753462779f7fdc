"""Closed forms for ring attention: bytes each rank sends, and the largest score block it holds.

Torch-free. The byte count is the estimator's ``course_lib.estimate.comm.cp_comm_bytes_per_layer``
(one formula; the tests measure it to the byte), given here in the ring's own terms. Symbols, per
attention layer:

* N: ranks in the context-parallel group; S: full sequence; C = S/N tokens per rank;
* B: batch, H: heads, D_k: query/key head dim, D_v: value head dim;
* e: bytes per element of q, k, v; g: bytes per element of the k/v gradient accumulators,
  ``max(e, 4)`` (ring_attention accumulates in at least fp32, so bf16 inputs send fp32 grads);
* K = B H C D_k e and V = B H C D_v e: the bytes of one rank's key and value blocks.

Forward: every block has to visit every other rank, one hop per step, so each rank sends
its current K/V block N-1 times:  ``fwd = (N-1) (K + V)``.
Backward: K/V travel the ring again (N-1 hops; they are not kept from the forward, which would
cost N times the memory) and the gradient accumulators dK/dV travel N-1 hops too (created on the
rank after the owner, passed along, the last hop brings them home; the owner adds its own
contribution locally):  ``bwd = (N-1) (K + V) (1 + g/e)``, i.e. ``2 (N-1) (K + V)`` in fp32.
Each is charged as the ``send`` kind of ``course_lib.parallel.wire`` (S bytes per isend, recv 0).

The causal mask does not shrink the traffic of a ring: rank N-1 needs block 0, and it gets there
through every rank in between. It shrinks the *compute* (see ``layout.causal_score_elements``).

Score memory: a rank never builds the [S x S] scores; its largest block is one
[B, H, C/p, C/p] tensor (p = 1 piece per rank contiguous, 2 zig-zag), against [B, H, S, S] for
full attention: a factor (pN)^2 smaller. K/V memory: its own block, the one being sent and the one
being received: about 3 (K + V) at a time, whatever N.
"""
from __future__ import annotations

from course_lib.estimate.comm import cp_comm_bytes_per_layer
from course_lib.parallel.context_parallel.layout import pieces_per_rank
from course_lib.validate import check_int


def ring_attention_bytes_per_rank(batch: int, heads: int, seq_chunk: int, head_dim: int, world_size: int,
                                  *, v_head_dim: int | None = None, bytes_per_element: int = 4,
                                  grad_bytes_per_element: int | None = None) -> dict[str, int]:
    """Bytes one rank sends in one ring-attention layer: ``{"forward", "backward", "total"}``
    (formulas in the module docstring). ``seq_chunk`` is C = S/N, the tokens this rank holds."""
    for name, value in (("batch", batch), ("heads", heads), ("seq_chunk", seq_chunk),
                        ("head_dim", head_dim), ("world_size", world_size),
                        ("bytes_per_element", bytes_per_element)):
        check_int(name, value, 1)
    est = cp_comm_bytes_per_layer(seq_len=seq_chunk * world_size, micro_batch=batch, n_kv_heads=heads,
                                  head_dim=head_dim, cp=world_size, v_head_dim=v_head_dim,
                                  bytes_per_element=bytes_per_element,
                                  grad_bytes_per_element=grad_bytes_per_element)
    forward, backward = int(est.forward_bytes), int(est.backward_bytes)
    return {"forward": forward, "backward": backward, "total": forward + backward}


def peak_score_elements(batch: int, heads: int, seq_chunk: int, *, layout: str = "contiguous") -> int:
    """Elements of the largest score block one rank holds: B H (C/p)^2 (see the module docstring).
    Full attention on one rank: ``peak_score_elements(B, H, S)`` with S the whole sequence."""
    for name, value in (("batch", batch), ("heads", heads), ("seq_chunk", seq_chunk)):
        check_int(name, value, 1)
    piece = seq_chunk // pieces_per_rank(layout)
    return batch * heads * piece * piece
