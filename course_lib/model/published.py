"""The published parameter counts of the MoE presets, and DeepSeek-V3's attention counted by formula.

Torch-free. TinyGPT builds ``mixtral-8x7b`` and ``qwen3-30b-a3b`` layer for layer (on the meta device:
shapes, no memory); their counts are the models' own. ``deepseek-v3`` has multi-head latent attention
(MLA: q and kv pass through low-rank bottlenecks), which TinyGPT's attention cannot express; its
preset stands in with 128 heads x 128 channels, and :func:`exact_counts` swaps, layer by layer, the
stand-in's q/k/v/o matrices for MLA's seven tensors (:func:`mla_attention_params`). Everything else
(embeddings, norms, dense and expert MLPs, router, shared expert) is TinyGPT's own count, so the
total is exact: 671,026,404,352, equal to ``transformers``' ``DeepseekV3ForCausalLM`` built from its
default config (tests/test_moe.py).

Counting convention, the one Mistral and Qwen use: *active* = every parameter except the routed
experts a token does not visit (both embedding matrices included). DeepSeek-V3's "37B activated"
is stated to two digits; this convention gives 37.55B (36.63B without the input embedding), and
Qwen3-30B-A3B's "3.3B" is 3.353B: both figures are truncated, not rounded (``active_truncated``).
Its preset carries Qwen3's QK-norm (2 x 128 weights a layer), so TinyGPT's counts are the model's own:
30,532,122,624 total, 3,353,032,704 active, equal to ``transformers``' ``Qwen3MoeForCausalLM`` of the
config the preset exports to (tests/test_hf_parity.py).
"""
from __future__ import annotations

#: preset -> published (total, active) parameters, the digits they are stated to, and where
PUBLISHED = {
    "mixtral-8x7b": dict(total=46.7e9, active=12.9e9, step=0.1e9,
                         source="Mistral AI, Mixtral of experts (2023-12-11) and the model card: 46.7B total, "
                                "12.9B per token"),
    "qwen3-30b-a3b": dict(total=30.5e9, active=3.3e9, step=0.1e9, active_truncated=True,
                          source="Qwen3 technical report (2025), model card Qwen/Qwen3-30B-A3B: 30.5B total, "
                                 "3.3B activated"),
    "deepseek-v3": dict(total=671e9, active=37e9, step=1e9, active_truncated=True,
                        source="DeepSeek-V3 technical report (arXiv 2412.19437): 671B total, 37B activated "
                               "per token (the 14B multi-token-prediction module not included)"),
}

#: DeepSeek-V3's MLA shape (its config.json: q_lora_rank, kv_lora_rank, qk_nope_head_dim, ...)
DEEPSEEK_V3_MLA = dict(n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128)


def mla_attention_params(d_model: int, n_heads: int, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                         qk_rope_head_dim: int, v_head_dim: int) -> int:
    """Parameters (a count) of one MLA attention layer, no biases: q down [C -> r_q], its RMSNorm,
    q up [r_q -> H (d_nope + d_rope)], kv down [C -> r_kv + d_rope] (the shared RoPE key rides
    along), its RMSNorm, kv up [r_kv -> H (d_nope + d_v)], output [H d_v -> C]."""
    qk = qk_nope_head_dim + qk_rope_head_dim
    return (d_model * q_lora_rank + q_lora_rank + q_lora_rank * n_heads * qk
            + d_model * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank
            + kv_lora_rank * n_heads * (qk_nope_head_dim + v_head_dim) + n_heads * v_head_dim * d_model)


def standin_attention_params(cfg) -> int:
    """Parameters of TinyGPT's attention of ``cfg`` (a ModelConfig) in one layer: q, k, v, out."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return cfg.d_model * (2 * q + 2 * kv) + ((q + 2 * kv + cfg.d_model) if cfg.bias else 0)


def exact_counts(preset: str, cfg, total: int, active: int) -> tuple[int, int]:
    """(total, active) of the published model from TinyGPT's counts of its preset (``cfg``, counted
    on the meta device): unchanged except for ``deepseek-v3``, whose stand-in attention is swapped
    for MLA in every layer (attention is visited by every token: both counts move alike)."""
    if preset != "deepseek-v3":
        return total, active
    mla = mla_attention_params(cfg.d_model, **DEEPSEEK_V3_MLA)
    delta = cfg.n_layers * (mla - standin_attention_params(cfg))
    return total + delta, active + delta


def rounds_to(count: int, published: float, step: float, truncated: bool = False) -> bool:
    """Whether ``count`` states as ``published`` to the digits it was published with: within half a
    ``step`` (46,702,792,704 is "46.7B" to 0.1B) or, for a figure the source truncated
    (``truncated``: DeepSeek's "37B" for 37.55B), inside [published, published + step)."""
    if truncated:
        return published <= count < published + step
    return abs(count - published) <= step / 2
