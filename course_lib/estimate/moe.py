"""Mixture-of-experts shapes: total vs active parameters, FLOPs per token, expert-parallel
all-to-all bytes, model state per rank under EP x expert-data-parallel, and the activation spike
of an unbalanced router. Torch-free, like the rest of ``course_lib.estimate``.

A MoE transformer replaces the MLP of most blocks with ``n_experts`` SwiGLU experts of width
``expert_d_ff``, of which a router picks ``top_k`` per token, plus ``n_shared_experts`` that
every token passes through. Only the picked experts run, so the model has many more parameters
(memory) than it uses per token (FLOPs): MFU counts the *active* parameters.

Counting conventions (the published checkpoints'): SwiGLU experts of three bias-free matrices
(gate, up, down; d_model x d_ff each); a router of n_experts x d_model (no bias); RMSNorm weights
(two per block, a final one); untied input and output embeddings; the first ``n_dense_layers``
blocks keep a dense SwiGLU MLP of width ``d_ff`` (DeepSeek-V3: 3). Attention is grouped-query
(``head_dim`` may differ from d_model / n_heads, as in Qwen3, optionally with a per-head RMSNorm
on q and k, "QK-norm") or DeepSeek's multi-head latent attention (MLA, :class:`MLA`). The
aux-loss-free routing bias (DeepSeek-V3) is a buffer, not a parameter, and is not counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from course_lib.validate import check_bool, check_choice, check_int, check_number
from .shapes import ModelShape

COUNT_BYTES = 8  # the count exchange sends int64 token counts (torch.long), 8 bytes each


@dataclass(frozen=True)
class MLA:
    """DeepSeek multi-head latent attention (DeepSeek-V2 Sec. 2.1; V3 Sec. 2.1.1), a shape.

    q: d_model -> q_lora_rank (RMSNorm) -> n_heads x (qk_nope + qk_rope), or one d_model ->
    n_heads x (qk_nope + qk_rope) matrix when ``q_lora_rank`` is 0; kv: d_model -> kv_lora_rank +
    qk_rope (the shared rotary key), RMSNorm on the latent, then kv_lora_rank -> n_heads x
    (qk_nope + v_head_dim); output n_heads x v_head_dim -> d_model."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        check_int("q_lora_rank", self.q_lora_rank, 0)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(name, getattr(self, name), 1)

    def params(self, d_model: int, n_heads: int) -> int:
        """Parameters of one MLA block (weights and its two latent norms), a count."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (d_model * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n_heads * qk
             if self.q_lora_rank else d_model * n_heads * qk)
        kv = (d_model * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + n_heads * self.v_head_dim * d_model


@dataclass(frozen=True)
class MoEShape:
    """Hyper-parameters of a decoder-only MoE transformer (counts, never bytes).

    ``d_ff``: the dense blocks' MLP width (0 when every block is MoE); ``expert_d_ff``: one routed
    expert's width; ``shared_d_ff``: one shared expert's width (default ``expert_d_ff``);
    ``n_dense_layers``: how many blocks, from the first, keep a dense MLP. ``head_dim`` None means
    d_model / n_heads. ``mla`` replaces grouped-query attention. ``mtp_layers``: DeepSeek-V3's
    multi-token-prediction modules (each one MoE block, two norms, a 2d x d projection and a
    second output head in the released checkpoint), counted apart (``mtp_params``)."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    n_experts: int
    top_k: int
    expert_d_ff: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int = 0
    n_dense_layers: int = 0
    n_shared_experts: int = 0
    shared_d_ff: int | None = None
    qk_norm: bool = False
    mla: MLA | None = None
    mtp_layers: int = 0
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "n_experts", "expert_d_ff"):
            check_int(name, getattr(self, name), 1)
        check_int("top_k", self.top_k, 1, self.n_experts, "n_experts")
        if self.n_kv_heads is not None:
            check_int("n_kv_heads", self.n_kv_heads, 1, self.n_heads, "n_heads")
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}) unless head_dim is given")
        if self.head_dim is not None:
            check_int("head_dim", self.head_dim, 1)
        check_int("n_dense_layers", self.n_dense_layers, 0, self.n_layers, "n_layers")
        check_int("d_ff", self.d_ff, 1 if self.n_dense_layers else 0)
        check_int("n_shared_experts", self.n_shared_experts, 0)
        if self.shared_d_ff is not None:
            check_int("shared_d_ff", self.shared_d_ff, 1)
        check_bool("qk_norm", self.qk_norm)
        if self.mla is not None and not isinstance(self.mla, MLA):
            raise TypeError(f"mla must be an MLA or None, got {type(self.mla).__name__}")
        check_int("mtp_layers", self.mtp_layers, 0)
        check_number("rope_theta", self.rope_theta, 0, lo_open=True)

    # ------------------------------------------------------------------ sizes
    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def attn_head_dim(self) -> int:
        """Channels per query head in the q.k product (MLA: nope + rope)."""
        if self.mla is not None:
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def value_head_dim(self) -> int:
        """Channels per head of the values (MLA: v_head_dim)."""
        if self.mla is not None:
            return self.mla.v_head_dim
        return self.attn_head_dim

    @property
    def n_moe_layers(self) -> int:
        """Blocks with experts (n_layers - n_dense_layers)."""
        return self.n_layers - self.n_dense_layers

    @property
    def shared_width(self) -> int:
        """Width of one shared expert."""
        return self.expert_d_ff if self.shared_d_ff is None else self.shared_d_ff

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has experts (the first n_dense_layers do not)."""
        check_int("index", index, 0, self.n_layers - 1, "n_layers - 1")
        return index >= self.n_dense_layers

    # ------------------------------------------------------------------ parameter counts
    def attention_params(self) -> int:
        """Parameters of one attention block (q, k, v, o, QK-norms or MLA's latent norms), a count."""
        d = self.d_model
        if self.mla is not None:
            return self.mla.params(d, self.n_heads)
        hd = self.attn_head_dim
        return 2 * d * self.n_heads * hd + 2 * d * self.kv_heads * hd + (2 * hd if self.qk_norm else 0)

    def expert_params(self) -> int:
        """One routed expert (gate, up, down: 3 x d_model x expert_d_ff), a count."""
        return 3 * self.d_model * self.expert_d_ff

    def router_params(self) -> int:
        """The router of one MoE block (n_experts x d_model), a count."""
        return self.n_experts * self.d_model

    def shared_expert_params(self) -> int:
        """All shared experts of one MoE block, a count."""
        return self.n_shared_experts * 3 * self.d_model * self.shared_width

    def dense_layer_params(self) -> int:
        """One dense block: attention, SwiGLU MLP of width d_ff, two RMSNorms, a count."""
        return self.attention_params() + 3 * self.d_model * self.d_ff + 2 * self.d_model

    def moe_layer_params(self, *, active: bool = False) -> int:
        """One MoE block: attention, two norms, router, shared experts and all routed experts
        (``active``: only top_k of them), a count."""
        routed = (self.top_k if active else self.n_experts) * self.expert_params()
        return (self.attention_params() + 2 * self.d_model + self.router_params() + self.shared_expert_params()
                + routed)

    def embedding_params(self) -> int:
        """The input token table (vocab x d_model), a count."""
        return self.vocab_size * self.d_model

    def head_params(self) -> int:
        """Final RMSNorm plus the untied output projection, a count."""
        return self.d_model + self.vocab_size * self.d_model

    def routed_expert_params(self) -> int:
        """Every routed expert of every MoE block: what expert parallelism shards, a count."""
        return self.n_moe_layers * self.n_experts * self.expert_params()

    def num_params(self) -> int:
        """Exact total parameters of the main model (MTP modules excluded), a count."""
        return (self.embedding_params() + self.n_dense_layers * self.dense_layer_params()
                + self.n_moe_layers * self.moe_layer_params() + self.head_params())

    def active_params(self, *, input_embedding: bool = True) -> int:
        """Parameters one token uses: every weight but the n_experts - top_k routed experts it
        is not sent to. ``input_embedding=False`` leaves out the token table (a lookup: it costs no
        FLOPs), the count :func:`moe_flops_per_token` multiplies by 6. A count."""
        n = (self.n_dense_layers * self.dense_layer_params() + self.n_moe_layers * self.moe_layer_params(active=True)
             + self.head_params())
        return n + (self.embedding_params() if input_embedding else 0)

    def mtp_params(self) -> int:
        """DeepSeek-V3's multi-token-prediction modules as released (per module: one MoE block,
        the two RMSNorms on its inputs, the 2d -> d projection, its own token table, final norm and
        output head), a count; 0 without MTP."""
        d = self.d_model
        per = self.moe_layer_params() + 2 * d + 2 * d * d + self.embedding_params() + self.head_params()
        return self.mtp_layers * per

    # ------------------------------------------------------------------ per rank
    def params_on_rank(self, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                       stage: int = 0, blocks: tuple | list | None = None) -> tuple[float, float]:
        """(non-expert, routed-expert) parameters held by one rank of pipeline stage ``stage``,
        a pair of counts (fractional when a split does not divide).

        Megatron's layout: blocks split over pp stages (``blocks``: blocks per stage, default
        equal); the first stage holds the token table, the last the final norm and output head.
        Non-expert weights (attention, dense MLPs, shared experts, router, embeddings) are split by
        tp (norms and the router replicated); each MoE block's routed experts are split over ep
        ranks (n_experts / ep whole experts each) and each expert's matrices over etp (default tp)."""
        check_int("tp", tp, 1)
        check_int("pp", pp, 1)
        check_int("ep", ep, 1)
        etp = tp if etp is None else check_int("etp", etp, 1)
        if self.n_experts % ep:
            raise ValueError(f"ep ({ep}) must divide n_experts ({self.n_experts})")
        check_int("stage", stage, 0, pp - 1, "pp - 1")
        if blocks is None:
            if self.n_layers % pp:
                raise ValueError(f"pp ({pp}) must divide n_layers ({self.n_layers}) unless blocks are given")
            blocks = [self.n_layers // pp] * pp
        blocks = list(blocks)
        if len(blocks) != pp or sum(blocks) != self.n_layers:
            raise ValueError(f"blocks ({blocks}) must be pp ({pp}) counts summing to n_layers ({self.n_layers})")
        first = sum(blocks[:stage])
        d = self.d_model
        dense = expert = 0.0
        for i in range(first, first + blocks[stage]):
            replicated = 2 * d + (self.router_params() if self.is_moe_layer(i) else 0)
            if self.is_moe_layer(i):
                split = self.moe_layer_params() - replicated - self.n_experts * self.expert_params()
                expert += self.n_experts // ep * self.expert_params() / etp
            else:
                split = self.dense_layer_params() - replicated
            dense += replicated + split / tp
        if stage == 0:
            dense += self.embedding_params() / tp
        if stage == pp - 1:
            dense += d + self.vocab_size * d / tp
        return dense, expert

    def active_equivalent(self) -> ModelShape:
        """A dense :class:`ModelShape` that does per token what this model does: the same
        attention width, heads and vocabulary, an MLP as wide as the experts a token passes through
        (top_k x expert_d_ff + shared). Its matmul FLOPs per token and saved MLP activations per
        token equal the MoE's in the MoE blocks (MLA and a head_dim other than d_model / n_heads
        are approximated by d_model-wide attention). For the planner's activation and
        sequence-traffic terms; the parameters come from this shape's own counts."""
        width = self.top_k * self.expert_d_ff + self.n_shared_experts * self.shared_width
        heads = self.n_heads
        kv = self.kv_heads if self.mla is None else None
        if self.d_model % heads:  # an explicit head_dim: keep d_model, use the largest dividing head count
            heads = math.gcd(self.d_model, heads)
            kv = math.gcd(heads, self.kv_heads)
        return ModelShape(self.n_layers, self.d_model, heads, self.vocab_size, self.seq_len, d_ff=width,
                          n_kv_heads=kv, tied_embeddings=False, learned_pos_emb=False, bias=False,
                          mlp="swiglu", norm="rmsnorm", rope_theta=self.rope_theta)


# ---------------------------------------------------------------------- FLOPs
def moe_flops_per_token(shape: MoEShape, *, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward, no recomputation) - the *model* FLOPs MFU
    divides by: 6 x active matmul parameters (``active_params(input_embedding=False)``: the
    token table is a lookup; the router's and the output head's matmuls count) plus PaLM's
    attention term 6 L H T (d_qk + d_v) (Chowdhery et al. 2022 App. B writes 12 L H Q T for
    d_qk = d_v = Q; no halving for the causal mask). FLOPs, not FLOP/s."""
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape must be a MoEShape, got {type(shape).__name__}")
    s = shape.seq_len if seq_len is None else check_int("seq_len", seq_len, 1)
    attention = 6 * shape.n_layers * shape.n_heads * s * (shape.attn_head_dim + shape.value_head_dim)
    return 6.0 * shape.active_params(input_embedding=False) + attention


# ---------------------------------------------------------------------- all-to-all
@dataclass(frozen=True)
class AllToAllBytes:
    """Expert-parallel all-to-all traffic of one MoE block and one micro-batch, **bytes sent by
    one rank** (see :func:`alltoall_bytes_per_layer` for the formula)."""

    dispatch: float        # forward dispatch: tokens routed off-rank x d_model x bytes_per_element
    combine: float         # forward combine: copies received x d_model x bytes_per_element, sent back
    counts: float          # forward count exchange (token counts per local expert of every peer)
    forward: float         # dispatch + combine + counts (+ the recomputed forward's, with recompute="full")
    backward: float        # gradient of combine (dispatch-sized) + gradient of dispatch (combine-sized)
    tokens_off_rank: float
    unit: str = "bytes sent per rank per MoE layer per micro-batch"

    @property
    def total(self) -> float:
        """forward + backward, bytes sent by one rank."""
        return self.forward + self.backward


def expected_tokens_off_rank(tokens: float, top_k: int, ep: int) -> float:
    """Token copies one rank sends to other EP ranks when routing is uniform: each of its
    ``tokens`` goes to ``top_k`` experts, each on another rank with probability (ep-1)/ep:
    tokens x top_k x (ep - 1) / ep (a count; the mean, not a bound)."""
    check_number("tokens", tokens, 0)
    check_int("top_k", top_k, 1)
    check_int("ep", ep, 1)
    return tokens * top_k * (ep - 1) / ep


def alltoall_bytes_per_layer(*, tokens_off_rank: float, d_model: int, ep: int, n_experts: int,
                             tokens_received: float | None = None, bytes_per_element: float = 2,
                             grad_bytes_per_element: float | None = None, count_bytes: int = COUNT_BYTES,
                             recompute: str = "none") -> AllToAllBytes:
    """Bytes one rank sends in the expert-parallel all-to-alls of one MoE block and micro-batch.

    The formula, per rank (every term is bytes **sent**; a token copy whose expert is on its own
    rank is never sent):

    * dispatch = tokens_off_rank x d_model x bytes_per_element - every (token, expert) pair of
      this rank whose expert lives on another EP rank is one copy of the token's hidden vector (no
      deduplication of a token sent to two experts of one rank: Megatron's ``alltoall``
      dispatcher and torchtitan do the same);
    * combine = tokens_received x d_model x bytes_per_element - the outputs of the copies this
      rank's experts processed for other ranks, sent back (``tokens_received`` defaults to
      tokens_off_rank: equal under balanced routing, and equal summed over the EP group always);
    * counts = (ep - 1) x (n_experts / ep) x count_bytes - the count exchange before the tokens:
      to each peer, the number of tokens for each of that peer's n_experts / ep experts (int64);
    * forward = dispatch + combine + counts;
    * backward = (tokens_off_rank + tokens_received) x d_model x grad_bytes_per_element - the
      gradient of combine travels as a dispatch (tokens_off_rank copies), the gradient of dispatch
      as a combine (tokens_received); the splits are known, no new counts;
    * recompute="full" repeats the forward's three (the block runs again before its backward).

    ``tokens_off_rank``: the rank's token copies routed to experts on other ranks (measured, or
    :func:`expected_tokens_off_rank`); ``grad_bytes_per_element`` defaults to bytes_per_element.
    With ep = 1 everything is 0. Bytes (floats)."""
    check_number("tokens_off_rank", tokens_off_rank, 0)
    received = tokens_off_rank if tokens_received is None else check_number("tokens_received", tokens_received, 0)
    check_int("d_model", d_model, 1)
    check_int("ep", ep, 1)
    check_int("n_experts", n_experts, 1)
    if n_experts % ep:
        raise ValueError(f"ep ({ep}) must divide n_experts ({n_experts})")
    check_number("bytes_per_element", bytes_per_element, 0, lo_open=True)
    g = bytes_per_element if grad_bytes_per_element is None else grad_bytes_per_element
    check_number("grad_bytes_per_element", g, 0, lo_open=True)
    check_int("count_bytes", count_bytes, 1)
    check_choice("recompute", recompute, ("none", "selective", "full"))
    if ep == 1 and (tokens_off_rank or received):
        raise ValueError(f"tokens_off_rank and tokens_received must be 0 with ep = 1, got {tokens_off_rank}, {received}")
    dispatch = tokens_off_rank * d_model * bytes_per_element
    combine = received * d_model * bytes_per_element
    counts = (ep - 1) * (n_experts // ep) * count_bytes
    forward = (dispatch + combine + counts) * (2 if recompute == "full" else 1)
    backward = (tokens_off_rank + received) * d_model * g
    return AllToAllBytes(float(dispatch), float(combine), float(counts), float(forward), float(backward),
                         float(tokens_off_rank))


def alltoall_bytes_per_token(shape: MoEShape, *, ep: int, bytes_per_element: float = 2) -> float:
    """Mean bytes one rank sends per token it holds, per MoE block, forward + backward, under
    uniform routing (the count exchange, which does not grow with tokens, left out):
    4 x top_k x (ep - 1)/ep x d_model x bytes_per_element."""
    check_int("ep", ep, 1)
    check_number("bytes_per_element", bytes_per_element, 0, lo_open=True)
    return 4 * shape.top_k * (ep - 1) / ep * shape.d_model * bytes_per_element


# ---------------------------------------------------------------------- memory
@dataclass(frozen=True)
class MoEStateBytes:
    """Model state per rank, bytes: the non-expert part (ZeRO over dp x cp) and the routed
    experts (ZeRO over the expert-data-parallel group), each a ModelStateBytes."""

    dense: object
    experts: object
    edp: int
    unit: str = "bytes per rank"

    @property
    def total(self) -> float:
        """Both parts, bytes per rank."""
        return self.dense.total + self.experts.total

    @property
    def params(self) -> float:
        return self.dense.params + self.experts.params

    @property
    def grads(self) -> float:
        return self.dense.grads + self.experts.grads

    @property
    def optimizer(self) -> float:
        return self.dense.optimizer + self.experts.optimizer


def expert_data_parallel(*, dp: int, tp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """The expert-data-parallel degree: ranks holding the same experts. Megatron folds the
    non-pipeline ranks tp x cp x dp into etp x ep x edp (Parallel Folding, Liu et al. 2025), so
    edp = tp cp dp / (ep etp); ValueError when ep x etp does not divide tp x cp x dp."""
    for name, value in (("dp", dp), ("tp", tp), ("cp", cp), ("ep", ep)):
        check_int(name, value, 1)
    etp = tp if etp is None else check_int("etp", etp, 1)
    ranks = tp * cp * dp
    if ranks % (ep * etp):
        raise ValueError(f"ep x etp ({ep} x {etp}) must divide tp x cp x dp ({ranks})")
    return ranks // (ep * etp)


def moe_model_state_bytes(shape: MoEShape, *, recipe="mixed-adam", zero_stage: int = 0, dp: int = 1, tp: int = 1,
                          pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None, stage: int = 0,
                          blocks=None, expert_zero_stage: int | None = None) -> MoEStateBytes:
    """Parameters, gradients and optimizer state of one rank of pipeline stage ``stage``, bytes.

    Non-expert weights are split by tp (and pp) and ZeRO-sharded over dp x cp, as a dense model;
    each MoE block's routed experts are split over ep x etp and ZeRO-sharded over the
    expert-data-parallel group (:func:`expert_data_parallel`) at ``expert_zero_stage`` (default
    ``zero_stage``). Both parts use :func:`~course_lib.estimate.memory.model_state_bytes` with the
    recipe's bytes per parameter (an FP8 recipe, e.g. "fp8-params-adam", included)."""
    from .memory import model_state_bytes

    edp = expert_data_parallel(dp=dp, tp=tp, cp=cp, ep=ep, etp=etp)
    dense, expert = shape.params_on_rank(tp=tp, pp=pp, ep=ep, etp=etp, stage=stage, blocks=blocks)
    ez = zero_stage if expert_zero_stage is None else expert_zero_stage
    return MoEStateBytes(model_state_bytes(dense, recipe=recipe, zero_stage=zero_stage, dp=dp * cp),
                         model_state_bytes(expert, recipe=recipe, zero_stage=ez, dp=edp), edp)


# ---------------------------------------------------------------------- imbalance
@dataclass(frozen=True)
class RoutingSpike:
    """Tokens and saved expert activations on the mean and the busiest EP rank, one MoE block
    and micro-batch."""

    mean_tokens: float          # token copies an EP rank's experts receive when routing is even
    busiest_tokens: float       # ... on the rank holding the busiest expert
    mean_bytes: float           # saved expert activations, bytes per rank
    busiest_bytes: float
    dropped_tokens: float       # copies over capacity, dropped (0 without a capacity factor)
    unit: str = "token copies / bytes per rank per MoE layer per micro-batch"

    @property
    def ratio(self) -> float:
        """busiest / mean: the factor the expert activations grow by on the busiest rank."""
        return self.busiest_tokens / self.mean_tokens if self.mean_tokens else 1.0


def expert_activation_bytes(token_copies: float, *, d_model: int, expert_d_ff: int, etp: int = 1,
                            bytes_per_element: float = 2) -> float:
    """Bytes a SwiGLU expert saves for backward for ``token_copies`` tokens it processed: the
    input (d_model) and four hidden tensors (gate, up, silu, product: 4 x expert_d_ff / etp), as
    ``activations.activation_breakdown_per_layer`` counts a SwiGLU MLP. Bytes."""
    check_number("token_copies", token_copies, 0)
    check_int("d_model", d_model, 1)
    check_int("expert_d_ff", expert_d_ff, 1)
    check_int("etp", etp, 1)
    check_number("bytes_per_element", bytes_per_element, 0, lo_open=True)
    return token_copies * (d_model + 4 * expert_d_ff / etp) * bytes_per_element


def routing_spike(shape: MoEShape, *, tokens: float, ep: int = 1, etp: int = 1, max_over_mean: float | None = None,
                  expert_loads=None, capacity_factor: float | None = None,
                  bytes_per_element: float = 2) -> RoutingSpike:
    """The activation spike of an unbalanced router, for one MoE block and micro-batch.

    ``tokens``: tokens entering the block on each of the ep ranks (so tokens x ep x top_k copies
    in the EP group). Give either the measured ``expert_loads`` (token copies per expert over the
    EP group, n_experts numbers; rank r holds experts r x E/ep ... (r+1) x E/ep - 1) or
    ``max_over_mean`` (the busiest expert's tokens over the mean; the other experts then share
    the rest evenly). ``capacity_factor`` c caps every expert at c x the mean (``dropped_tokens``
    counts the rest; Switch Transformer, Fedus et al. 2021). Saved bytes per copy as
    :func:`expert_activation_bytes`."""
    check_number("tokens", tokens, 0)
    check_int("ep", ep, 1)
    e = shape.n_experts
    if e % ep:
        raise ValueError(f"ep ({ep}) must divide n_experts ({e})")
    total = tokens * ep * shape.top_k
    mean = total / e
    if (expert_loads is None) == (max_over_mean is None):
        raise ValueError("give exactly one of expert_loads and max_over_mean")
    if expert_loads is not None:
        loads = [float(check_number(f"expert_loads[{i}]", x, 0)) for i, x in enumerate(expert_loads)]
        if len(loads) != e:
            raise ValueError(f"expert_loads must have n_experts ({e}) entries, got {len(loads)}")
    else:
        check_number("max_over_mean", max_over_mean, 1, e)
        hot = max_over_mean * mean
        loads = [hot] + [(total - hot) / (e - 1) if e > 1 else 0.0] * (e - 1)
    dropped = 0.0
    if capacity_factor is not None:
        check_number("capacity_factor", capacity_factor, 0, lo_open=True)
        cap = capacity_factor * mean
        dropped = sum(max(0.0, x - cap) for x in loads)
        loads = [min(x, cap) for x in loads]
    local = e // ep
    per_rank = [sum(loads[r * local:(r + 1) * local]) for r in range(ep)]
    busiest = max(per_rank)
    mean_rank = total / ep

    def nbytes(copies):
        return expert_activation_bytes(copies, d_model=shape.d_model, expert_d_ff=shape.expert_d_ff, etp=etp,
                                       bytes_per_element=bytes_per_element)
    return RoutingSpike(mean_rank, busiest, nbytes(mean_rank), nbytes(busiest), dropped)


# ---------------------------------------------------------------------- presets
#: Published MoE shapes, from each model's Hugging Face config.json, and the published counts the
#: tests hold them to (tests/test_estimate_moe.py), at the precision each publisher prints:
#: - Mixtral 8x7B: "46.7B total parameters but only uses 12.9B parameters per token" (Mistral AI,
#:   "Mixtral of experts" blog, Dec 2023; Jiang et al. 2024, arXiv 2401.04088: 47B / 13B).
#:   HF mistralai/Mixtral-8x7B-v0.1: 32 layers, d 4096, 32 heads, 8 KV heads, experts 8 x 14336, top-2, vocab 32000.
#: - Mixtral 8x22B: "141B parameters, of which 39B are active" (Mistral AI, "Cheaper, Better,
#:   Faster, Stronger" blog, Apr 2024). HF Mixtral-8x22B-v0.1: 56 layers, d 6144, 48 heads, 8 KV,
#:   experts 8 x 16384, top-2, vocab 32000.
#: - DeepSeek-V3: "671B total parameters with 37B activated for each token" and "685B ... includes
#:   671B of the Main Model weights and 14B of the Multi-Token Prediction (MTP) Module weights"
#:   (DeepSeek-AI 2024, arXiv 2412.19437, abstract; HF deepseek-ai/DeepSeek-V3 README). config: 61
#:   layers (3 dense, d_ff 18432), d 7168, 128 heads, MLA (q rank 1536, kv rank 512, nope 128, rope
#:   64, v 128), 256 routed experts x 2048 + 1 shared, top-8, vocab 129280, 1 MTP module.
#: - Qwen3-30B-A3B: "30.5B in total and 3.3B activated"; Qwen3-235B-A22B: "235B in total and 22B
#:   activated" (Qwen HF model cards). 48 / 94 layers, d 2048 / 4096, 32 / 64 heads, 4 KV heads,
#:   head_dim 128, QK-norm, 128 experts x 768 / 1536, top-8, vocab 151936.
MOE_PRESETS: dict[str, MoEShape] = {
    "mixtral-8x7b": MoEShape(32, 4096, 32, 32000, 32768, 8, 2, 14336, n_kv_heads=8, rope_theta=1e6),
    "mixtral-8x22b": MoEShape(56, 6144, 48, 32000, 65536, 8, 2, 16384, n_kv_heads=8, rope_theta=1e6),
    "deepseek-v3": MoEShape(61, 7168, 128, 129280, 4096, 256, 8, 2048, d_ff=18432, n_dense_layers=3,
                            n_shared_experts=1, mla=MLA(1536, 512, 128, 64, 128), mtp_layers=1, rope_theta=10000.0),
    "qwen3-30b-a3b": MoEShape(48, 2048, 32, 151936, 4096, 128, 8, 768, n_kv_heads=4, head_dim=128, qk_norm=True,
                              rope_theta=1e6),
    "qwen3-235b-a22b": MoEShape(94, 4096, 64, 151936, 4096, 128, 8, 1536, n_kv_heads=4, head_dim=128,
                                qk_norm=True, rope_theta=1e6),
}


def moe_preset(name: str, **overrides) -> MoEShape:
    """A published MoE shape by name (see MOE_PRESETS), with optional field overrides."""
    check_choice("name", name, MOE_PRESETS)
    return dataclasses.replace(MOE_PRESETS[name], **overrides) if overrides else MOE_PRESETS[name]
