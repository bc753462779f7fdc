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
    d_ff: int | None = None  # None: 4*d_model for gelu, round_up(8*d_model/3, 8) for swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu | swiglu
    position: str = "learned"  # learned | rope | none
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
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

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("n_layers", self.n_layers, 1)
        _check_int("n_heads", self.n_heads, 1)
        _check_int("d_model", self.d_model, 1)
        if self.d_model % self.n_heads:
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
        if self.position == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"position='rope' needs an even head dimension, got {self.d_model // self.n_heads}")
        for name in ("bias", "tie_embeddings", "offload_activations"):
            _check_bool(name, getattr(self, name))
        _check_float("dropout", self.dropout, 0.0, 1.0)
        if self.dropout >= 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        _check_float("norm_eps", self.norm_eps, 0.0, lo_open=True)
        _check_float("rope_theta", self.rope_theta, 0.0, lo_open=True)
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
        """Channels per attention head."""
        return self.d_model // self.n_heads

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
