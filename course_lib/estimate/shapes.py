"""Model shapes and exact parameter counts for GPT-2/GPT-3/Llama-style decoder-only transformers.

`ModelShape` describes a model by its hyper-parameters; `.num_params()` counts every weight the
way PyTorch would (a tied matrix once). The presets reproduce the published counts exactly
(GPT-2 checkpoints, Llama 2 / Llama 3 Hugging Face checkpoints), except GPT-3, whose paper only
gives the rounded "175.0B" (Brown et al. 2020, Table 2.1); see `PRESETS`.

Counting conventions (chosen to match TinyGPT in course_lib/model/tinygpt.py, nanoGPT and Hugging Face):

- attention: q and o are d_model x d_model; k and v are d_model x (n_kv_heads * head_dim);
  with `bias=True` each projection has a bias of its output width;
- MLP: "gelu" is up (d_model -> d_ff) + down; "swiglu" is gate + up + down (three matrices);
- norms: two per block plus a final one; "layernorm" has weight and bias, but like nanoGPT and
  TinyGPT its bias exists only when `bias=True`; "rmsnorm" has a weight only;
- embeddings: vocab x d_model token table (+ seq_len x d_model when `learned_pos_emb`); the output
  head is a separate vocab x d_model matrix (no bias) unless `tied_embeddings`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from course_lib.validate import check_bool, check_choice, check_divides, check_int, check_number

MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")


def default_d_ff(d_model: int, mlp: str) -> int:
    """MLP hidden width when none is given: 4*d_model for GELU; for SwiGLU 8*d_model/3 rounded up to
    a multiple of 8 (2/3 of 4*d_model keeps the GELU parameter count; Shazeer 2020, Llama paper
    Section 2.2). The rounding is TinyGPT's (course_lib/model/tinygpt.py), so both agree by default."""
    check_int("d_model", d_model, 1)
    check_choice("mlp", mlp, MLPS)
    if mlp == "gelu":
        return 4 * d_model
    return 8 * ((8 * d_model // 3 + 7) // 8)


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters of a decoder-only transformer (counts, never bytes).

    `seq_len` is the training context length (it sizes the learned position table and is the
    default sequence length of the FLOP and activation estimates). `d_ff=None` takes
    `default_d_ff`; `n_kv_heads=None` means n_kv_heads = n_heads (multi-head attention), fewer is
    grouped-query attention. Derive variants with `dataclasses.replace(shape, ...)`.
    """

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    d_ff: int | None = None
    n_kv_heads: int | None = None
    tied_embeddings: bool = True
    learned_pos_emb: bool = True
    bias: bool = True
    mlp: str = "gelu"
    norm: str = "layernorm"
    # RoPE's base (rotary models only): it changes the model, not its size, yet an engine given
    # another base trains another model (Llama 3 uses 500,000, Llama 2 and GPT-NeoX 10,000).
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len"):
            check_int(name, getattr(self, name), 1)
        check_divides("n_heads", self.n_heads, "d_model", self.d_model)
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, 1)
        if self.n_kv_heads is not None:
            check_int("n_kv_heads", self.n_kv_heads, 1, self.n_heads, "n_heads")
            check_divides("n_kv_heads", self.n_kv_heads, "n_heads", self.n_heads)
        for name in ("tied_embeddings", "learned_pos_emb", "bias"):
            check_bool(name, getattr(self, name))
        check_choice("mlp", self.mlp, MLPS)
        check_choice("norm", self.norm, NORMS)
        check_number("rope_theta", self.rope_theta, 0, lo_open=True)

    # ------------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        """Channels per attention head (d_model / n_heads)."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used (n_kv_heads, or n_heads when None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """MLP hidden width (for SwiGLU: of each of gate and up)."""
        return default_d_ff(self.d_model, self.mlp) if self.d_ff is None else self.d_ff

    # ------------------------------------------------------------------ parameter counts
    def _norm_params(self) -> int:
        # LayerNorm bias follows `bias`, as in nanoGPT/TinyGPT (GPT-2 itself has bias=True).
        return self.d_model * (2 if self.norm == "layernorm" and self.bias else 1)

    def attention_params(self) -> int:
        """Parameters of one attention block (q, k, v, o and their biases), a count."""
        d, kv_dim = self.d_model, self.kv_heads * self.head_dim
        weights = 2 * d * d + 2 * d * kv_dim
        biases = (2 * d + 2 * kv_dim) if self.bias else 0
        return weights + biases

    def mlp_params(self) -> int:
        """Parameters of one MLP block (2 matrices for gelu, 3 for swiglu, plus biases), a count."""
        d, f = self.d_model, self.ffn_dim
        if self.mlp == "gelu":
            return 2 * d * f + ((f + d) if self.bias else 0)
        return 3 * d * f + ((2 * f + d) if self.bias else 0)

    def layer_params(self) -> int:
        """Parameters of one transformer block (attention + MLP + its two norms), a count."""
        return self.attention_params() + self.mlp_params() + 2 * self._norm_params()

    def embedding_params(self) -> int:
        """Token table plus learned position table (0 for RoPE / no positions), a count."""
        pos = self.seq_len * self.d_model if self.learned_pos_emb else 0
        return self.vocab_size * self.d_model + pos

    def position_params(self) -> int:
        """The learned position table alone (nanoGPT leaves it out of its 6N), a count."""
        return self.seq_len * self.d_model if self.learned_pos_emb else 0

    def head_params(self) -> int:
        """Final norm plus the output projection when it is not tied to the token table, a count."""
        untied = 0 if self.tied_embeddings else self.vocab_size * self.d_model
        return self._norm_params() + untied

    def num_params(self) -> int:
        """Exact total parameter count (a tied matrix counted once), a count - not bytes."""
        return self.embedding_params() + self.n_layers * self.layer_params() + self.head_params()

    def largest_module_params(self) -> int:
        """Parameters of the largest single module, as DeepSpeed's `model_to_params` takes it
        (max over modules of directly-owned parameters). Assumes separate q/k/v/o and MLP Linear
        modules and the token table as one module; a fused qkv Linear is larger. A count."""
        d, f, kv_dim = self.d_model, self.ffn_dim, self.kv_heads * self.head_dim
        b = 1 if self.bias else 0
        return max(self.vocab_size * d, self.position_params(), d * d + b * d,
                   d * kv_dim + b * kv_dim, d * f + b * f)

    def params_on_busiest_rank(self, *, tp: int = 1, pp: int = 1) -> float:
        """Parameters held by the most loaded rank under tensor (tp) and pipeline (pp) parallelism.

        Megatron layout (Shoeybi et al. 2019; Narayanan et al. 2021): pp stages of n_layers/pp
        blocks; the first stage also holds the embeddings, the last the final norm and the output
        projection (with tied embeddings the last stage keeps its own copy of the token table when
        pp > 1). Tensor parallelism splits matrices, embeddings and column-parallel biases (q, k, v,
        MLP up/gate) by tp; norms and row-parallel biases (o, down) are replicated. A count (may be
        fractional when tp does not divide a width).
        """
        check_int("tp", tp, 1)
        check_int("pp", pp, 1)
        check_divides("pp", pp, "n_layers", self.n_layers)
        check_divides("tp", tp, "n_heads", self.n_heads)
        d = self.d_model
        replicated = 2 * self._norm_params() + ((2 * d) if self.bias else 0)  # norms, o and down biases
        layer = replicated + (self.layer_params() - replicated) / tp
        layers = self.n_layers // pp * layer
        table = self.vocab_size * d / tp
        first = layers + table + self.position_params() / tp
        # The output side: final norm (replicated) plus the output projection; with pp > 1 and tied
        # embeddings the last stage holds its own copy of the token table to compute logits.
        out = self._norm_params() + (table if (not self.tied_embeddings or pp > 1) else 0)
        if pp == 1:
            return first + out
        return max(first, layers + out)

    def params_on_rank(self, *, tp: int = 1, pp: int = 1, stage: int = 0, blocks: int | None = None) -> int | float:
        """Parameters held by one rank of pipeline stage ``stage`` (of ``pp``) and a tensor-parallel
        group of ``tp``, as the trainer's model-parallel strategy lays TinyGPT out - a count, what
        :func:`~course_lib.estimate.memory.model_state_bytes` takes as ``num_params`` for the
        data-parallel group of that rank. ``blocks``: blocks on this stage (default n_layers / pp).

        Tensor parallelism splits the matrices, the token table (vocab rows) and the
        column-parallel biases (q, k, v, MLP up/gate) by tp; the norms, the row-parallel biases
        (o, down) and the learned position table are replicated (unlike
        :meth:`params_on_busiest_rank`, which also divides the position table). The first stage
        holds the embeddings, the last the final norm and the output projection - with tied
        embeddings and pp > 1 its own copy of the token table. A count (fractional when tp does not
        divide a width)."""
        check_int("tp", tp, 1)
        check_int("pp", pp, 1)
        check_int("stage", stage, 0, pp - 1, "pp - 1")
        if blocks is None:
            check_divides("pp", pp, "n_layers", self.n_layers)
            blocks = self.n_layers // pp
        check_int("blocks", blocks, 0, self.n_layers, "n_layers")
        d = self.d_model
        replicated = 2 * self._norm_params() + ((2 * d) if self.bias else 0)
        split = self.layer_params() - replicated
        total = blocks * replicated + (blocks * split) / tp
        table = self.vocab_size * d
        if stage == 0:
            total += table / tp + self.position_params()
        if stage == pp - 1:
            total += self._norm_params() + (table / tp if (not self.tied_embeddings or pp > 1) else 0)
        return int(total) if float(total).is_integer() else total

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelShape":
        """A published model shape by name (see `PRESETS`), with optional field overrides."""
        check_choice("name", name, PRESETS)
        return dataclasses.replace(PRESETS[name], **overrides) if overrides else PRESETS[name]


_LLAMA = dict(tied_embeddings=False, learned_pos_emb=False, bias=False, mlp="swiglu", norm="rmsnorm")
_LLAMA3 = dict(_LLAMA, rope_theta=500000.0)  # Llama 3 paper, Section 3.1.1 (HF config.json: rope_theta)

#: Published shapes. Sources: GPT-2 - Radford et al. 2019 Table 2 and the released checkpoints
#: (vocab 50257, context 1024); GPT-3 - Brown et al. 2020 Table 2.1 (context 2048, GPT-2
#: architecture); Llama 2 - Touvron et al. 2023 and the HF `config.json` files (context 4096,
#: 70B uses 8 KV heads); Llama 3/3.1 - Llama 3 paper (Dubey et al. 2024) Table 3 and HF configs
#: (vocab 128256, 8 KV heads, RoPE base 500,000; seq_len is the 8192-token pre-training context).
PRESETS: dict[str, ModelShape] = {
    "gpt2-small": ModelShape(12, 768, 12, 50257, 1024),
    "gpt2-medium": ModelShape(24, 1024, 16, 50257, 1024),
    "gpt2-large": ModelShape(36, 1280, 20, 50257, 1024),
    "gpt2-xl": ModelShape(48, 1600, 25, 50257, 1024),
    "gpt3-175b": ModelShape(96, 12288, 96, 50257, 2048),
    "llama2-7b": ModelShape(32, 4096, 32, 32000, 4096, d_ff=11008, **_LLAMA),
    "llama2-13b": ModelShape(40, 5120, 40, 32000, 4096, d_ff=13824, **_LLAMA),
    "llama2-70b": ModelShape(80, 8192, 64, 32000, 4096, d_ff=28672, n_kv_heads=8, **_LLAMA),
    "llama3-8b": ModelShape(32, 4096, 32, 128256, 8192, d_ff=14336, n_kv_heads=8, **_LLAMA3),
    "llama3-70b": ModelShape(80, 8192, 64, 128256, 8192, d_ff=28672, n_kv_heads=8, **_LLAMA3),
    "llama3-405b": ModelShape(126, 16384, 128, 128256, 8192, d_ff=53248, n_kv_heads=8, **_LLAMA3),
}
