"""TinyGPT's shape and switches (:class:`ModelConfig`) and the named presets, without torch.

The trainer's config validator (``course_lib.trainer.config``) builds a ModelConfig for every TOML it
checks; keeping the dataclass here, apart from the model (:mod:`course_lib.model`, which re-exports
it), lets ``course plan``, ``course launch`` and ``python -m course_lib.train --check-config``
validate a config without importing torch (~2-3 CPU-seconds per process).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from course_lib.validate import check_bool as _check_bool
from course_lib.validate import check_choice as _check_choice
from course_lib.validate import check_int as _check_int
from course_lib.validate import check_number as _check_float

INIT_SCHEMES = ("normal", "scaled_residual", "zero_out_proj", "kaiming", "xavier", "small")
CHECKPOINTING = ("none", "full", "selective")

# Overrides on top of the ModelConfig defaults. Real-model shapes are here so labs can count
# parameters and bytes on the meta device; only `tiny` and `llama-tiny` are meant to train on a CPU.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, block_size=64, n_layers=2, n_heads=4, d_model=64),
    "llama-tiny": dict(
        vocab_size=256, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
        norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
    ),
    "gpt2-small": dict(
        vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768, init="scaled_residual",
    ),
    "gpt2-medium": dict(
        vocab_size=50257, block_size=1024, n_layers=24, n_heads=16, d_model=1024, init="scaled_residual",
    ),
    # Mixture-of-experts (course_lib/model/moe.py). moe-tiny trains on a CPU; the three published
    # shapes are for counting on the meta device (tests/test_moe.py holds their totals and active
    # counts against the published figures and transformers' own classes).
    "moe-tiny": dict(
        vocab_size=256, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
        norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
        moe_experts=8, moe_top_k=2, moe_ffn_dim=32, moe_aux_loss_coef=0.01,
    ),
    # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1): 46.7B total, 12.9B active (2 of 8 experts).
    "mixtral-8x7b": dict(
        vocab_size=32000, block_size=32768, n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, d_ff=14336,
        norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False, rope_theta=1e6,
        moe_experts=8, moe_top_k=2, moe_aux_loss_coef=0.02,
    ),
    # Qwen3-30B-A3B: 30.5B total, 3.3B active (8 of 128 experts of width 768, normalised top-8, no
    # shared expert, every layer sparse). head_dim 128 with 32 heads: the attention is 4096 wide on a
    # 2048 residual stream. QK-norm (2 x 128 weights a layer) as Qwen3 has it, so the preset exports
    # as transformers' Qwen3MoeForCausalLM (tests/test_hf_parity.py). d_ff: Qwen's intermediate_size,
    # the width its dense layers would have (it has none).
    "qwen3-30b-a3b": dict(
        vocab_size=151936, block_size=40960, n_layers=48, n_heads=32, n_kv_heads=4, attn_head_dim=128, d_model=2048,
        d_ff=6144, norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
        norm_eps=1e-6, rope_theta=1e6, qk_norm=True, moe_experts=128, moe_top_k=8, moe_ffn_dim=768,
        moe_aux_loss_coef=0.001,
    ),
    # DeepSeek-V3: 671B total, 37B active. 61 layers, the first 3 dense (width 18432), then 256
    # routed experts (top 8, sigmoid scores, normalised top-k weights x 2.5, bias balancing) plus one
    # shared expert, all 2048 wide. Its attention is MLA (low-rank q and kv): TinyGPT's attention
    # stands in as 128 heads x 128 (see course_lib/model/moe_counts.py for the exact MLA count).
    "deepseek-v3": dict(
        vocab_size=129280, block_size=4096, n_layers=61, n_heads=128, attn_head_dim=128, d_model=7168, d_ff=18432,
        norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False, norm_eps=1e-6,
        moe_experts=256, moe_top_k=8, moe_ffn_dim=2048, moe_shared_experts=1, moe_first_dense=3,
        moe_score="sigmoid", moe_route_scale=2.5, moe_aux_loss_coef=0.0001, moe_bias_update_rate=0.001,
    ),
    "llama2-7b": dict(
        vocab_size=32000, block_size=4096, n_layers=32, n_heads=32, d_model=4096, d_ff=11008,
        norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False, norm_eps=1e-5,
    ),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of a TinyGPT. Frozen: derive variants with `dataclasses.replace`.

    Sizes are counts (tokens, channels, heads), never bytes. `block_size` is the longest sequence
    the model accepts (learned position table / RoPE table length).
    """

    vocab_size: int = 256
    block_size: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (multi-head attention)
    d_model: int = 64
    # Channels per attention head. None: d_model // n_heads. Set it where the attention is wider or
    # narrower than the residual stream (Qwen3: 32 heads x 128 on d_model 2048).
    attn_head_dim: int | None = None
    d_ff: int | None = None  # None: 4*d_model for gelu, round_up(8*d_model/3, 8) for swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu | swiglu
    position: str = "learned"  # learned | rope | none
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Linear RoPE scaling (position interpolation; Hugging Face's rope_type "linear"): every
    # frequency is divided by this factor, so position p turns as plain RoPE's p / factor does.
    # 1.0: plain RoPE. A model stretched to a longer context is trained (or fine-tuned) with it.
    rope_linear_factor: float = 1.0
    init: str = "normal"  # one of INIT_SCHEMES
    init_std: float = 0.02
    # Bounded embedding: None (off) or b > 0, applied to the token embedding output before
    # positions are added, so one row grown large (rare token, big Adam steps) cannot flood the
    # residual stream. "tanh": e -> b*tanh(e/b), identity near 0, gradient shrinks smoothly (it
    # underflows to 0 in fp32 only beyond ~9b). "clamp": clip to [-b, b], gradient 0 outside.
    embedding_bound: float | None = None
    embedding_bound_mode: str = "tanh"
    attention_window: int | None = None  # None: full causal; w: each token sees itself + w-1 before
    # Architecture-level stabilizers, all off by default (lab 05 section 8; layers.py, tinygpt.py):
    # qk_norm: RMSNorm (weight [head_dim], eps norm_eps) on each head's q and k before RoPE and the
    #   scores (Qwen3, Gemma 3, OLMo-2 style), so q.k cannot grow with the q/k weights.
    # z_loss: coefficient c; the loss gains c * mean(logsumexp(logits)^2) over the scored tokens
    #   (PaLM: 1e-4), pulling log Z toward 0 so the logits cannot drift off together.
    # logit_softcap / attn_logit_softcap: None or cap > 0; logits (or attention scores, after the
    #   1/sqrt(D)) -> cap * tanh(x / cap) (Gemma 2: 30 and 50): bounded by cap, identity near 0.
    # smooth_swiglu: SwiGLU's output divided per channel by its absolute max (over the batch's
    #   tokens, no gradient) before the down projection, whose weight columns are multiplied by it:
    #   the same function, a down-projection input bounded by 1 in every channel (FP8 outliers).
    qk_norm: bool = False
    z_loss: float = 0.0
    logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    smooth_swiglu: bool = False
    checkpointing: str = "none"  # none | full | selective
    checkpoint_every: int | None = None  # selective only: checkpoint whole blocks 0, k, 2k, ...
    offload_activations: bool = False
    # Mixture of experts (course_lib/model/moe.py). moe_experts None: every MLP is dense.
    moe_experts: int | None = None  # routed experts per MoE layer
    moe_top_k: int = 2  # experts each token is sent to
    moe_ffn_dim: int | None = None  # hidden width of one expert (None: the dense width, ffn_dim)
    moe_shared_experts: int = 0  # experts every token passes through (DeepSeek), each moe_ffn_dim wide
    moe_first_dense: int = 0  # the first k layers keep a dense MLP of width ffn_dim (DeepSeek-V3: 3)
    moe_score: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3) router scores
    moe_norm_topk: bool = True  # divide the k chosen scores by their sum (Mixtral, Qwen3, DeepSeek-V3)
    moe_route_scale: float = 1.0  # multiply the combine weights (DeepSeek-V3: 2.5)
    moe_aux_loss_coef: float = 0.0  # load-balancing loss E * sum f_i P_i per MoE layer, times this
    moe_bias_update_rate: float | None = None  # aux-loss-free balancing (DeepSeek-V3: 0.001); None: off
    moe_capacity_factor: float | None = None  # None: dropless; c: each expert takes ceil(c*N*k/E) slots
    moe_drop_policy: str = "position"  # over capacity, keep the earliest tokens | the highest "probs"

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("n_layers", self.n_layers, 1)
        _check_int("n_heads", self.n_heads, 1)
        _check_int("d_model", self.d_model, 1)
        if self.d_model % self.n_heads and self.attn_head_dim is None:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_kv_heads is not None:
            _check_int("n_kv_heads", self.n_kv_heads, 1, self.n_heads)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.d_ff is not None:
            _check_int("d_ff", self.d_ff, 1)
        _check_choice("norm", self.norm, ("layernorm", "rmsnorm"))
        _check_choice("mlp", self.mlp, ("gelu", "swiglu"))
        _check_choice("position", self.position, ("learned", "rope", "none"))
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"position='rope' needs an even head dimension, got {self.head_dim}")
        for name in ("bias", "tie_embeddings", "offload_activations"):
            _check_bool(name, getattr(self, name))
        _check_float("dropout", self.dropout, 0.0, 1.0)
        if self.dropout >= 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        _check_float("norm_eps", self.norm_eps, 0.0, lo_open=True)
        _check_float("rope_theta", self.rope_theta, 0.0, lo_open=True)
        _check_float("rope_linear_factor", self.rope_linear_factor, 0.0, lo_open=True)
        _check_choice("init", self.init, INIT_SCHEMES)
        _check_float("init_std", self.init_std, 0.0, lo_open=True)
        if self.embedding_bound is not None:
            _check_float("embedding_bound", self.embedding_bound, 0.0, lo_open=True)
        _check_choice("embedding_bound_mode", self.embedding_bound_mode, ("tanh", "clamp"))
        if self.attention_window is not None:
            _check_int("attention_window", self.attention_window, 1)
        self._check_stabilizers()
        _check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        if self.checkpoint_every is not None:
            _check_int("checkpoint_every", self.checkpoint_every, 1)
            if self.checkpointing != "selective":
                raise ValueError(
                    "checkpoint_every applies only to checkpointing='selective' (every k-th block); "
                    f"got checkpointing={self.checkpointing!r}"
                )
        self._check_moe()

    def _check_moe(self) -> None:
        if self.attn_head_dim is not None:
            _check_int("attn_head_dim", self.attn_head_dim, 1)
        if self.moe_experts is None:
            return
        _check_int("moe_experts", self.moe_experts, 1)
        _check_int("moe_top_k", self.moe_top_k, 1, self.moe_experts)
        if self.moe_ffn_dim is not None:
            _check_int("moe_ffn_dim", self.moe_ffn_dim, 1)
        _check_int("moe_shared_experts", self.moe_shared_experts, 0)
        _check_int("moe_first_dense", self.moe_first_dense, 0, self.n_layers - 1)
        _check_choice("moe_score", self.moe_score, ("softmax", "sigmoid"))
        _check_bool("moe_norm_topk", self.moe_norm_topk)
        _check_float("moe_route_scale", self.moe_route_scale, 0.0, lo_open=True)
        _check_float("moe_aux_loss_coef", self.moe_aux_loss_coef, 0.0)
        if self.moe_bias_update_rate is not None:
            _check_float("moe_bias_update_rate", self.moe_bias_update_rate, 0.0, lo_open=True)
        if self.moe_capacity_factor is not None:
            _check_float("moe_capacity_factor", self.moe_capacity_factor, 0.0, lo_open=True)
        _check_choice("moe_drop_policy", self.moe_drop_policy, ("position", "probs"))
        if self.mlp != "swiglu":
            raise ValueError(f"moe_experts = {self.moe_experts} needs mlp = 'swiglu' (the experts are SwiGLU), "
                             f"got mlp = {self.mlp!r}")
        if self.bias:
            raise ValueError("moe_experts needs bias = false (the stacked experts and the router carry no bias)")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has a mixture-of-experts MLP."""
        return self.moe_experts is not None and layer >= self.moe_first_dense

    @property
    def expert_dim(self) -> int:
        """Hidden width of one routed (or shared) expert."""
        return self.moe_ffn_dim if self.moe_ffn_dim is not None else self.ffn_dim

    def _check_stabilizers(self) -> None:
        for name in ("qk_norm", "smooth_swiglu"):
            _check_bool(name, getattr(self, name))
        _check_float("z_loss", self.z_loss, 0.0)
        for name in ("logit_softcap", "attn_logit_softcap"):
            if getattr(self, name) is not None:
                _check_float(name, getattr(self, name), 0.0, lo_open=True)
        if self.smooth_swiglu and self.mlp != "swiglu":
            raise ValueError(f"smooth_swiglu applies to mlp='swiglu' only (it rescales SwiGLU's output); "
                             f"got mlp={self.mlp!r}")

    @property
    def stabilizers(self) -> list[str]:
        """The architecture-level stabilizers switched on, as ``model.KEY = value`` strings."""
        on = {"qk_norm": self.qk_norm, "z_loss": self.z_loss or None, "logit_softcap": self.logit_softcap,
              "attn_logit_softcap": self.attn_logit_softcap, "smooth_swiglu": self.smooth_swiglu}
        return [f"model.{k} = {'true' if v is True else v}" for k, v in on.items() if v]

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head (attn_head_dim, else d_model // n_heads)."""
        return self.attn_head_dim if self.attn_head_dim is not None else self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP (for SwiGLU: of each of gate and up)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.d_model
        # SwiGLU has three matrices; 2/3 of 4C keeps the parameter count of the 4C GELU MLP.
        return 8 * ((8 * self.d_model // 3 + 7) // 8)

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named configuration (see PRESETS) with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}")
        return cls.from_dict({**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """Build from a plain dict (e.g. a TOML table); an unknown key is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        """Plain dict of all fields (round-trips through from_dict)."""
        return dataclasses.asdict(self)
