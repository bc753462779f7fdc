"""Tensor parallelism from scratch (Megatron-LM), one short module per idea, then the DTensor path.

* :mod:`.comm_ops` - the conjugate operators ``f`` (:func:`copy_to_tp_region`) and ``g``
  (:func:`reduce_from_tp_region`), and sequence parallelism's all-gather / reduce-scatter pair;
* :mod:`.layers` - :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`;
* :mod:`.cross_entropy` - :func:`vocab_parallel_cross_entropy` from logit slices, never gathered;
* :mod:`.blocks` - :class:`TPMLP`, :class:`TPAttention` (heads split, grouped-query k/v),
  :class:`TPBlock`, each ``from_dense`` out of TinyGPT's blocks, optionally sequence-parallel;
* :mod:`.gpt` - :func:`tp_tinygpt`: a whole TinyGPT, vocab-parallel at both ends;
* :mod:`.dtensor_plan` - the production path: :func:`tinygpt_tp_plan` (the same layout declared as
  DTensor ``ParallelStyle``s) and :func:`parallelize_tinygpt` (``parallelize_module`` on an explicit
  1-D ``DeviceMesh``), tested equal to the dense model and to :func:`tp_tinygpt`
  (tests/test_dtensor_tp.py). Imported on first use: ``torch.distributed.tensor`` adds ~0.5 s.

Each scratch piece is tested equal to its dense counterpart (outputs and gradients, fp32) on 2 and 4
gloo ranks, and its all-reduce count and bytes equal ``course_lib.estimate.comm.tp_comm_bytes_per_layer``
(tests/test_tensor_parallel.py).
"""
from course_lib.parallel.tensor_parallel.blocks import (TPAttention, TPBlock, TPMLP,  # noqa: F401
                                                        sync_sequence_parallel_grads)
from course_lib.parallel.tensor_parallel.comm_ops import (copy_to_tp_region,  # noqa: F401
                                                          gather_from_sequence_region, gather_from_tp_region,
                                                          reduce_from_tp_region,
                                                          reduce_scatter_to_sequence_region,
                                                          scatter_to_sequence_region, scatter_to_tp_region)
from course_lib.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from course_lib.parallel.tensor_parallel.gpt import TPTinyGPT, tp_tinygpt  # noqa: F401
from course_lib.parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,  # noqa: F401
                                                        VocabParallelEmbedding)

__all__ = ["copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region", "scatter_to_tp_region",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region", "scatter_to_sequence_region",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "TPMLP", "TPAttention", "TPBlock", "sync_sequence_parallel_grads", "TPTinyGPT", "tp_tinygpt",
           "tinygpt_tp_plan", "parallelize_tinygpt"]

_DTENSOR_EXPORTS = ("tinygpt_tp_plan", "parallelize_tinygpt")


def __getattr__(name):
    # The DTensor path is imported on first use, so the from-scratch layers stay a light import.
    if name in _DTENSOR_EXPORTS:
        from course_lib.parallel.tensor_parallel import dtensor_plan

        return getattr(dtensor_plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
