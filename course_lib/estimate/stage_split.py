"""How many transformer blocks each pipeline stage gets: even, balanced, or chosen by hand.

Torch-free (standard library only): the trainer (``parallel.pp_split``), the planner and the labs
all ask :func:`stage_split` and get the same list.

A pipeline of ``S = pp * virtual_stages`` stages gives every stage a contiguous run of blocks; stage
0 also holds the embeddings and stage S-1 the final norm, the LM head and the loss. A synchronous
pipeline runs at the pace of its slowest stage, and every stage must fit in memory, so real runs
shorten the end stages:

* BLOOM-176B: 70 blocks on 12 stages, 5 on the first and last, 6 on the others (Megatron-DeepSpeed's
  partition counted the embedding as a layer);
* Llama 3 405B: 126 blocks on 16 stages, one block fewer on the first and the last (Dubey et al.
  2024, Section 3.3.2: "we reduce one Transformer layer each from the first and the last stages").

The split choices (``split``):

* ``"even"``: as even as possible; the first ``n_layers % S`` stages get one block more (the
  trainer's behaviour before the key existed).
* ``"balanced"``: the ends count as extra blocks, :func:`end_weights`, and the split minimises the
  heaviest stage. The embedding does no matmul work (a table lookup) but holds a ``vocab x d``
  table with its gradient and optimizer state, as a block holds its weights; the LM head holds as
  much and also costs ``2 s d V`` FLOPs a sequence. Each end weighs the *larger* of its parameter
  share and its FLOP share of one block (a stage must both keep pace and fit). With these weights
  the rule reproduces both splits above (tests/test_train_pipeline_layouts.py).
* a list of ints (blocks per stage, one entry per stage, each >= 1, summing to ``n_layers``).

Note: :func:`course_lib.parallel.pipeline.stages.balanced_split` (the lab's pipeline module) balances
forward FLOPs only, with a free embedding: the timing view lab 11 measures. This module adds the
memory side; the trainer's ``pp_split = "balanced"`` uses this one.
"""
from __future__ import annotations

from fractions import Fraction

from course_lib.validate import check_int

__all__ = ["SPLIT_CHOICES", "even_blocks", "end_weights", "balanced_blocks", "stage_split", "split_loads", "check_counts",
           "shape_of_model_config", "split_for_config"]

SPLIT_CHOICES = ("even", "balanced")


def even_blocks(n_layers: int, stages: int) -> list[int]:
    """Blocks per stage (a count per stage), as even as possible; the first ``n_layers % stages``
    stages get one more."""
    check_int("n_layers", n_layers, 1)
    check_int("stages", stages, 1, n_layers, "n_layers")
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _block_flops(shape, seq_len: int) -> int:
    """Forward matmul FLOPs of one block for one sequence (as estimate.flops: projections + scores)."""
    s, h, f = seq_len, shape.d_model, shape.ffn_dim
    kv_dim = shape.kv_heads * shape.head_dim
    mats = 2 if shape.mlp == "gelu" else 3
    return 2 * s * (h * (h + 2 * kv_dim) + h * h + mats * h * f) + 4 * s * s * h


def end_weights(shape, seq_len: int | None = None) -> tuple[Fraction, Fraction]:
    """(first-stage extra, last-stage extra), in blocks (exact fractions), for a
    :class:`~course_lib.estimate.shapes.ModelShape`.

    First: the embedding's parameters (token table + learned positions) over one block's; it does
    no matmul. Last: the larger of the output side's parameters (the ``vocab x d`` head matrix -
    with tied embeddings and pp > 1 the last stage holds its own copy - plus the final norm) over
    a block's, and the head's forward FLOPs ``2 s d V`` over a block's forward FLOPs at ``seq_len``
    tokens (default ``shape.seq_len``). The loss (softmax over the logits) adds about ``4 s V``
    element-wise operations, under 1% of the head's matmul for d >= 512: not counted."""
    s = shape.seq_len if seq_len is None else check_int("seq_len", seq_len, 1)
    block_params = shape.layer_params()
    first = Fraction(shape.embedding_params(), block_params)
    head_params = shape.vocab_size * shape.d_model + shape._norm_params()
    head_flops = 2 * s * shape.d_model * shape.vocab_size
    last = max(Fraction(head_params, block_params), Fraction(head_flops, _block_flops(shape, s)))
    return first, last


def split_loads(counts: list[int], first: Fraction, last: Fraction) -> list[Fraction]:
    """Each stage's load in blocks: its block count plus ``first`` on stage 0 and ``last`` on the
    final stage (both on one stage when there is only one)."""
    loads = [Fraction(n) for n in counts]
    loads[0] += first
    loads[-1] += last
    return loads


def balanced_blocks(n_layers: int, stages: int, first: Fraction, last: Fraction) -> list[int]:
    """Blocks per stage minimising the heaviest :func:`split_loads` entry; among splits with the
    same maximum, the most even (smallest sum of squared loads), then the one that gives *earlier*
    stages fewer blocks (under 1F1B the first stage holds the most micro-batches in flight).
    Exact dynamic programming over contiguous splits, O(stages * n_layers^2)."""
    check_int("n_layers", n_layers, 1)
    check_int("stages", stages, 1, n_layers, "n_layers")
    first, last = Fraction(first), Fraction(last)

    def load(k: int, n: int) -> Fraction:
        return n + (first if k == 0 else 0) + (last if k == stages - 1 else 0)

    # best[k][i]: (max load, sum of squares, counts) for stages k.. covering blocks i..L-1.
    L = n_layers
    best: list[list[tuple | None]] = [[None] * (L + 1) for _ in range(stages + 1)]
    best[stages][L] = (Fraction(0), Fraction(0), [])
    for k in range(stages - 1, -1, -1):
        for i in range(L):
            for n in range(1, L - i + 1):  # stage k takes n blocks
                rest = best[k + 1][i + n]
                if rest is None:
                    continue
                c = load(k, n)
                cand = (max(c, rest[0]), c * c + rest[1], [n] + rest[2])
                if best[k][i] is None or cand[:2] < best[k][i][:2]:  # strict: fewest blocks first wins
                    best[k][i] = cand
    return best[0][0][2]


def stage_split(shape, pp: int, virtual_stages: int = 1, split="even", seq_len: int | None = None) -> list[int]:
    """Blocks per stage for ``shape`` (a :class:`~course_lib.estimate.shapes.ModelShape`) on ``pp``
    pipeline ranks with ``virtual_stages`` stages each: ``pp * virtual_stages`` counts, stage i on
    pipeline rank ``i % pp`` (the interleaved placement). ``split``: "even", "balanced" or a list
    of counts (checked and returned as a new list). ValueError naming the argument and the
    accepted values otherwise."""
    check_int("pp", pp, 1)
    check_int("virtual_stages", virtual_stages, 1)
    n_layers, stages = shape.n_layers, pp * virtual_stages
    if stages > n_layers:
        raise ValueError(f"pp * virtual_stages = {stages} stages, but n_layers = {n_layers}: every stage needs "
                         f"at least one block")
    if isinstance(split, str):
        if split not in SPLIT_CHOICES:
            raise ValueError(f"split must be 'even', 'balanced' or a list of blocks per stage; got {split!r}")
        if split == "even":
            return even_blocks(n_layers, stages)
        return balanced_blocks(n_layers, stages, *end_weights(shape, seq_len))
    return check_counts(split, n_layers, stages)


def check_counts(counts, n_layers: int, stages: int, name: str = "split") -> list[int]:
    """``counts`` as a checked list: one int >= 1 per stage, summing to ``n_layers``."""
    if not isinstance(counts, (list, tuple)):
        raise ValueError(f"{name} must be 'even', 'balanced' or a list of blocks per stage; "
                         f"got {type(counts).__name__} {counts!r}")
    if len(counts) != stages:
        raise ValueError(f"{name} must have one entry per stage (pp * virtual_stages = {stages}), got "
                         f"{len(counts)}: {list(counts)}")
    for s, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}[{s}] must be an int >= 1 (every stage holds a block), got {n!r}")
    if sum(counts) != n_layers:
        raise ValueError(f"{name} must sum to n_layers = {n_layers} (every block on exactly one stage), got "
                         f"sum({list(counts)}) = {sum(counts)}")
    return list(counts)


def shape_of_model_config(mcfg, seq_len: int | None = None):
    """The :class:`~course_lib.estimate.shapes.ModelShape` of a TinyGPT ``ModelConfig`` (read by
    attribute, so this module never imports torch): same parameter count as the model."""
    from course_lib.estimate.shapes import ModelShape

    return ModelShape(mcfg.n_layers, mcfg.d_model, mcfg.n_heads, mcfg.vocab_size,
                      mcfg.block_size if seq_len is None else seq_len, d_ff=mcfg.ffn_dim,
                      n_kv_heads=mcfg.n_kv_heads, tied_embeddings=mcfg.tie_embeddings,
                      learned_pos_emb=mcfg.position == "learned", bias=mcfg.bias, mlp=mcfg.mlp, norm=mcfg.norm)


def split_for_config(cfg: dict, mcfg) -> list[int]:
    """Blocks per stage for a trainer config (``cfg`` from ``course_lib.trainer.config``, ``mcfg`` its
    ``ModelConfig``): ``parallel.pp_split`` over ``parallel.pp * parallel.virtual_stages`` stages,
    balanced at ``data.seq_len`` tokens. ValueError as :func:`stage_split`."""
    par = cfg["parallel"]
    shape = shape_of_model_config(mcfg, cfg["data"]["seq_len"])
    return stage_split(shape, par["pp"], par["virtual_stages"], par["pp_split"])
