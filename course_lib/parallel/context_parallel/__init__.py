"""Context parallelism from scratch: ring attention over a sequence split across ranks.

* :func:`ring_attention` - exact attention; K/V (and in backward their gradients) travel a ring.
* :func:`split_sequence` / :func:`merge_sequence` - contiguous or load-balanced zig-zag chunks.
* :func:`ring_attention_bytes_per_rank`, :func:`peak_score_elements`, :func:`causal_score_elements`
  - the closed forms the measured bytes, block sizes and work are compared with.

In the trainer (``parallel.cp > 1``): :mod:`.in_trainer` (``apply_context_parallel``), imported by
the strategy that uses it.
"""
from course_lib.parallel.context_parallel.cost import peak_score_elements, ring_attention_bytes_per_rank
from course_lib.parallel.context_parallel.layout import (LAYOUTS, causal_score_elements, chunk_segments,
                                                         merge_sequence, split_sequence)
from course_lib.parallel.context_parallel.ring_attention import (RingAttention, online_softmax_update,
                                                                 ring_attention)

__all__ = ["LAYOUTS", "RingAttention", "causal_score_elements", "chunk_segments", "merge_sequence",
           "online_softmax_update", "peak_score_elements", "ring_attention", "ring_attention_bytes_per_rank",
           "split_sequence"]
