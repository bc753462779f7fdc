"""TinyGPT <-> Hugging Face ``transformers``: which class, which config keys, which tensor names.

Torch-free (the trainer's config check reads it): the name mapping is the only thing written by
hand; the HF side is ``transformers``' own config classes and ``from_pretrained``
(:mod:`course_lib.model.hf_weights` moves the tensors).

Five HF classes express TinyGPT:

| TinyGPT switches | HF class | config |
| --- | --- | --- |
| rmsnorm, swiglu, rope (plain or linearly scaled), any kv heads, bias on or off, tied or not | ``LlamaForCausalLM`` | ``LlamaConfig`` |
| the Llama switches with qk_norm (RMSNorm on each head's q and k), bias off | ``Qwen3ForCausalLM`` | ``Qwen3Config`` |
| layernorm with bias, gelu, learned positions, kv heads = heads, bias on, tied or not | ``GPT2LMHeadModel`` | ``GPT2Config`` |
| the Llama switches with experts (softmax top-k, normalised, no shared experts, dropless), no qk_norm | ``MixtralForCausalLM`` | ``MixtralConfig`` |
| the Llama switches with experts and qk_norm (softmax top-k, normalised or not, no shared experts, dropless; the first k layers dense or none; a sliding window or none) | ``Qwen3MoeForCausalLM`` | ``Qwen3MoeConfig`` |

Anything else (a bounded embedding, a sliding window outside Qwen3-MoE, no positions, a mix of the families,
soft-capped logits) has no HF class that computes the same function: :func:`hf_unsupported` names
the switch. model.z_loss and model.smooth_swiglu change training only, not the function: they export.
The other way (``model.init_from`` of an HF folder), :data:`FUNCTION_KEYS` lists every ``config.json``
key transformers' Llama, Qwen3-MoE and GPT-2 code reads and whether :func:`config_from_hf` reads it or refuses it.

GPT-2 stores its linear layers as ``Conv1D`` with the weight transposed ([in, out]) and q, k, v as
one fused ``c_attn`` matrix; the mapping says so per tensor (``kind``). Mixtral's files (what
``save_pretrained`` writes) keep one tensor per expert (``block_sparse_moe.experts.E.w1/w3/w2``: gate,
up, down); TinyGPT stacks them ([E, F, C]), so each is ``kind="expert"`` with its ``index``. In
memory transformers fuses them again (``mlp.experts.gate_up_proj``): :func:`mixtral_runtime_names`.
Qwen3-MoE's files do the same under other names (``mlp.experts.E.gate_proj/up_proj/down_proj``, the
router ``mlp.gate``), fused alike in memory (:func:`runtime_names`); its dense layers
(``mlp_only_layers``: TinyGPT's ``moe_first_dense``) keep Qwen3's ``mlp.gate_proj/up_proj/down_proj``.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from course_lib.model.config import ModelConfig

#: file names of an HF model folder
HF_CONFIG, HF_WEIGHTS = "config.json", "model.safetensors"


@dataclass(frozen=True)
class Entry:
    """One HF tensor: its name, the TinyGPT tensor(s) it is made of, and how.
    ``kind``: "same" (copied), "T" (transposed: GPT-2's Conv1D), "qkv" (q, k, v concatenated
    along the output dim, then transposed: GPT-2's ``c_attn``; ``ours`` lists the three) or
    "expert" (row ``index`` of a stacked expert tensor: Mixtral's per-expert files)."""

    hf: str
    ours: tuple[str, ...]
    kind: str = "same"
    index: int | None = None


def family(cfg: ModelConfig) -> str:
    """"mixtral", "qwen3_moe", "qwen3", "llama" or "gpt2": which HF class family the switches call for
    (see :func:`hf_unsupported`). Experts with QK-norm are Qwen3-MoE (Mixtral has no q/k norm, and
    Qwen3-MoE has no switch to turn its q/k norm off); experts without it are Mixtral."""
    if cfg.moe_experts is not None:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    return "llama" if cfg.position == "rope" or cfg.norm == "rmsnorm" or cfg.mlp == "swiglu" else "gpt2"


#: family -> its HF class
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel",
              "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

_QWEN3_MOE_ONLY = "Qwen3MoeForCausalLM expresses it, but only with model.qk_norm = true (another function)"
#: The MoE switches each HF MoE family fixes: {ModelConfig field: (the value it needs, why)}. The
#: fields not listed are free: Qwen3-MoE's ``norm_topk_prob`` carries model.moe_norm_topk and its
#: ``mlp_only_layers`` the first dense layers (model.moe_first_dense); ``moe_drop_policy`` only
#: matters with a capacity factor.
MOE_NEEDS = {
    "mixtral": {
        "moe_score": ("softmax", "Mixtral's router is a softmax"),
        "moe_norm_topk": (True, f"Mixtral divides the top-k scores by their sum; {_QWEN3_MOE_ONLY}"),
        "moe_route_scale": (1.0, "Mixtral does not scale the combine weights"),
        "moe_shared_experts": (0, "Mixtral has no shared experts"),
        "moe_first_dense": (0, f"every Mixtral layer has experts; {_QWEN3_MOE_ONLY}"),
        "moe_bias_update_rate": (None, "Mixtral's router has no selection bias"),
        "moe_capacity_factor": (None, "Mixtral is dropless"),
    },
    "qwen3_moe": {
        "moe_score": ("softmax", "Qwen3-MoE's router is a softmax"),
        "moe_route_scale": (1.0, "Qwen3-MoE does not scale the combine weights"),
        "moe_shared_experts": (0, "Qwen3-MoE has no shared experts"),
        "moe_bias_update_rate": (None, "Qwen3-MoE's router has no selection bias"),
        "moe_capacity_factor": (None, "Qwen3-MoE is dropless (no token is dropped over a capacity)"),
    },
}


def hf_unsupported(cfg: ModelConfig) -> list[str]:
    """Why no HF class computes what ``cfg`` computes, one reason per switch (empty: exportable)."""
    why = []
    if cfg.embedding_bound is not None:
        why.append(f"model.embedding_bound = {cfg.embedding_bound} (a bounded token embedding): no HF class "
                   f"bounds its embedding output")
    if cfg.attention_window is not None and family(cfg) != "qwen3_moe":  # Qwen3-MoE's use_sliding_window is it
        why.append(f"model.attention_window = {cfg.attention_window} (sliding window): LlamaConfig, Qwen3Config "
                   f"(a window on some layers only), MixtralConfig (TinyGPT's MoE exports as Mixtral without "
                   f"qk_norm) and GPT2Config carry none for every layer")
    for key in ("logit_softcap", "attn_logit_softcap"):
        if getattr(cfg, key) is not None:
            why.append(f"model.{key} = {getattr(cfg, key)} (soft-capping): LlamaConfig, Qwen3Config and GPT2Config "
                       f"carry no cap")
    if family(cfg) in MOE_NEEDS:
        cls = HF_CLASSES[family(cfg)]
        for key, (want, why_not) in MOE_NEEDS[family(cfg)].items():
            if getattr(cfg, key) != want:
                why.append(f"model.{key} = {getattr(cfg, key)!r}: {why_not} ({cls} needs {want!r})")
    if family(cfg) in ("llama", "qwen3", "mixtral", "qwen3_moe"):
        wrong = [f"model.{k} = {getattr(cfg, k)!r} (Llama needs {v!r})" for k, v in
                 (("norm", "rmsnorm"), ("mlp", "swiglu"), ("position", "rope")) if getattr(cfg, k) != v]
        if wrong:
            why.append("a mix of GPT-2 and Llama switches: " + ", ".join(wrong))
        if family(cfg) == "qwen3" and cfg.bias:
            why.append("model.qk_norm = true with model.bias = true: Qwen3's MLP has no biases")
    else:
        if cfg.position != "learned":
            why.append(f"model.position = {cfg.position!r}: GPT-2 has a learned position table")
        if not cfg.bias:
            why.append("model.bias = false: GPT2LMHeadModel always has biases (LayerNorm and linear)")
        if cfg.kv_heads != cfg.n_heads:
            why.append(f"model.n_kv_heads = {cfg.kv_heads} < n_heads = {cfg.n_heads}: GPT-2 has no grouped-query "
                       f"attention (use the Llama switches)")
    return why


def _rope_family_kwargs(cfg: ModelConfig, intermediate_size: int) -> dict:
    """The config keys the Llama, Qwen3 and Mixtral classes share (RMSNorm, SwiGLU, RoPE plain or
    linearly scaled); ``intermediate_size``: the MLP's width (an expert's for Mixtral)."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=intermediate_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=({"rope_type": "default", "rope_theta": cfg.rope_theta} if cfg.rope_linear_factor == 1.0
                         else {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_linear_factor}),
        attention_dropout=cfg.dropout, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config_kwargs(cfg: ModelConfig) -> tuple[str, dict]:
    """``(HF class name, keyword arguments of its config class)`` for ``cfg`` (exportable only)."""
    if family(cfg) == "mixtral":
        return "MixtralForCausalLM", dict(
            _rope_family_kwargs(cfg, cfg.expert_dim), sliding_window=None, num_local_experts=cfg.moe_experts,
            num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=cfg.moe_aux_loss_coef, router_jitter_noise=0.0,
            output_router_logits=False)
    if family(cfg) == "qwen3_moe":  # every layer from moe_first_dense on sparse, the ones before dense
        return "Qwen3MoeForCausalLM", dict(
            _rope_family_kwargs(cfg, cfg.ffn_dim), moe_intermediate_size=cfg.expert_dim, num_experts=cfg.moe_experts,
            num_experts_per_tok=cfg.moe_top_k, norm_topk_prob=cfg.moe_norm_topk, decoder_sparse_step=1,
            mlp_only_layers=list(range(cfg.moe_first_dense)), router_aux_loss_coef=cfg.moe_aux_loss_coef,
            output_router_logits=False, attention_bias=False,
            # the same window: each token sees itself and the w - 1 before it (transformers' sliding mask)
            use_sliding_window=cfg.attention_window is not None, sliding_window=cfg.attention_window)
    if family(cfg) == "qwen3":  # Llama plus q_norm / k_norm; every layer full attention
        return "Qwen3ForCausalLM", dict(_rope_family_kwargs(cfg, cfg.ffn_dim), attention_bias=False,
                                        use_sliding_window=False)
    if family(cfg) == "llama":
        return "LlamaForCausalLM", dict(_rope_family_kwargs(cfg, cfg.ffn_dim), attention_bias=cfg.bias,
                                        mlp_bias=cfg.bias)
    # GPT-2's "gelu_new" is the tanh approximation TinyGPT's MLP uses (layers.MLP).
    return "GPT2LMHeadModel", dict(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=cfg.ffn_dim, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None)


#: Every key of an HF ``config.json`` that changes what a Llama, Qwen3-MoE or GPT-2 checkpoint computes, as
#: ``transformers`` 5.24 reads it (``modeling_llama.py``, ``modeling_qwen3_moe.py``, ``modeling_gpt2.py``: each ``config.X`` of
#: their forward paths; tests/test_hf_parity.py holds this list against those files), and what
#: :func:`config_from_hf` does with it: "read" (a ModelConfig field), "refused" unless its value is
#: the one TinyGPT computes (named in the error), or "no effect" (why the weights compute the same).
#: Keys transformers' Llama and GPT-2 code never reads do not change what they compute either.
FUNCTION_KEYS = {
    "llama": {
        "vocab_size": "read", "hidden_size": "read", "intermediate_size": "read", "num_hidden_layers": "read",
        "num_attention_heads": "read", "num_key_value_heads": "read", "max_position_embeddings": "read",
        "rms_norm_eps": "read", "tie_word_embeddings": "read",
        "rope_parameters": "read: rope_theta, and rope_type 'linear' (factor -> model.rope_linear_factor); "
                           "refused: any other rope_type (dynamic, yarn, llama3, longrope, ...) and a "
                           "partial_rotary_factor with 'linear'",
        "rope_scaling": "as rope_parameters (transformers 4.x spelling, with rope_theta beside it)",
        "rope_theta": "read (transformers 4.x spelling)",
        "attention_bias": "read; refused when it differs from mlp_bias (TinyGPT has one model.bias switch)",
        "mlp_bias": "read, as attention_bias",
        "head_dim": "read: model.attn_head_dim when head_dim x num_attention_heads != hidden_size",
        "hidden_act": "refused unless 'silu' (TinyGPT's SwiGLU)",
        "attention_dropout": "no effect: dropout acts in training only; the run's model.dropout decides",
        "pretraining_tp": "no effect: transformers 5.x no longer reads it (4.x split the same matmuls)",
        "pad_token_id": "no effect on the forward pass (transformers' Embedding(padding_idx) only freezes that row's "
                        "gradient; TinyGPT trains it)",
        "quantization_config": "refused: quantized weights are not TinyGPT's fp32/bf16 tensors",
    },
    "qwen3_moe": {  # the Llama keys read as for Llama, then the experts'
        "vocab_size": "read", "hidden_size": "read", "num_hidden_layers": "read", "num_attention_heads": "read",
        "num_key_value_heads": "read", "max_position_embeddings": "read", "rms_norm_eps": "read (also the eps of "
        "q_norm / k_norm, as TinyGPT's qk_norm uses model.norm_eps)", "tie_word_embeddings": "read",
        "rope_parameters": "read as for Llama", "head_dim": "read as for Llama", "hidden_act": "as for Llama",
        "intermediate_size": "read: model.d_ff, the width of the dense layers (mlp_only_layers)",
        "moe_intermediate_size": "read: model.moe_ffn_dim", "num_experts": "read: model.moe_experts",
        "num_local_experts": "read: the name save_pretrained writes num_experts under (attribute_map)",
        "num_experts_per_tok": "read: model.moe_top_k", "norm_topk_prob": "read: model.moe_norm_topk",
        "decoder_sparse_step": "read with mlp_only_layers: the dense layers must be the first k "
                               "(model.moe_first_dense), at least one layer sparse; refused otherwise",
        "mlp_only_layers": "read, as decoder_sparse_step",
        "router_aux_loss_coef": "read: model.moe_aux_loss_coef (the training loss only)",
        "output_router_logits": "no effect on the logits (the router logits returned, and the aux loss added to "
                                "the loss)",
        "attention_bias": "refused unless false (Qwen3-MoE's MLP has no bias, TinyGPT's experts neither)",
        "use_sliding_window": "read: true sets model.attention_window = sliding_window (every layer, the same "
                              "window: each token sees itself and the sliding_window - 1 before it)",
        "sliding_window": "read with use_sliding_window; no effect without it (Qwen3MoeConfig sets it to None)",
        "attention_dropout": "no effect: dropout, training only",
        "pad_token_id": "no effect on the forward pass (see llama)",
        "quantization_config": "refused: quantized weights are not TinyGPT's fp32/bf16 tensors",
    },
    "gpt2": {
        "vocab_size": "read", "n_embd": "read", "n_layer": "read", "n_head": "read", "n_positions": "read",
        "n_inner": "read", "layer_norm_epsilon": "read", "tie_word_embeddings": "read",
        "activation_function": "refused unless 'gelu_new' or 'gelu_pytorch_tanh' (the tanh GELU TinyGPT uses)",
        "scale_attn_weights": "refused unless true (TinyGPT divides the scores by sqrt(head_dim))",
        "scale_attn_by_inverse_layer_idx": "refused unless false",
        "reorder_and_upcast_attn": "refused unless false",
        "add_cross_attention": "refused unless false (cross-attention layers TinyGPT does not have)",
        "resid_pdrop": "no effect: dropout, training only", "embd_pdrop": "no effect: dropout, training only",
        "attn_pdrop": "no effect: dropout, training only",
        "pad_token_id": "no effect on the forward pass (transformers' Embedding(padding_idx) only freezes that row's "
                        "gradient; TinyGPT trains it)",
        "quantization_config": "refused: quantized weights are not TinyGPT's fp32/bf16 tensors",
    },
}

#: Qwen3MoeConfig's defaults (transformers 5.24) of the expert keys, for a config.json that leaves
#: one out (tests/test_hf_parity.py holds them against the class). norm_topk_prob is *false* by
#: default there, though Qwen3-30B-A3B's own config.json sets it true.
QWEN3_MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                          sliding_window=4096)

#: GPT-2 activations that are the tanh GELU TinyGPT's MLP computes (transformers' ACT2FN)
GPT2_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def _llama_rope(hf: dict) -> tuple[float, float]:
    """``(rope_theta, linear factor)`` of a Llama config (5.x ``rope_parameters`` or 4.x ``rope_theta``
    + ``rope_scaling``, read the way transformers' ``convert_rope_params_to_dict`` does: ``rope_scaling``
    first). ValueError for any RoPE but the plain and the linearly scaled one, naming the key and its
    type."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{key} = {rope!r}: TinyGPT reads one plain RoPE for every layer")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "linear":  # transformers' _compute_linear_scaling_rope_parameters: inv_freq / factor
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"{key}: rope_type 'linear' with partial_rotary_factor = {partial!r}: TinyGPT rotates "
                             f"every channel of a head")
        if not isinstance(rope.get("factor"), (int, float)) or rope["factor"] <= 0:
            raise ValueError(f"{key}: rope_type 'linear' needs a factor > 0, got {rope.get('factor')!r}")
        return theta, float(rope["factor"])
    if kind != "default":
        extra = ", ".join(f"{k} = {v!r}" for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta"))
        raise ValueError(f"{key}.rope_type = {kind!r} ({extra or 'no parameters'}): TinyGPT computes plain RoPE "
                         f"(rope_type 'default') and its linear scaling only, and these weights were trained with "
                         f"another")
    return theta, 1.0


def config_from_hf(hf: dict) -> dict:
    """The ModelConfig fields an HF ``config.json`` (a dict) fixes. ValueError for a model type or a
    setting TinyGPT does not compute (naming the key and its value; :data:`FUNCTION_KEYS` lists
    every key that changes what the weights compute and what happens to it)."""
    kind = hf.get("model_type")
    if kind not in ("llama", "qwen3", "mixtral", "qwen3_moe", "gpt2"):
        raise ValueError(f"model_type = {kind!r}: TinyGPT reads 'llama', 'qwen3', 'mixtral', 'qwen3_moe' and 'gpt2' "
                         f"folders only")
    if hf.get("quantization_config"):
        method = (hf["quantization_config"] or {}).get("quant_method", "?") if isinstance(
            hf["quantization_config"], dict) else "?"
        raise ValueError(f"quantization_config (quant_method {method!r}): quantized weights are not TinyGPT's tensors")
    tied = bool(hf.get("tie_word_embeddings", kind == "gpt2"))
    if kind == "mixtral":
        if hf.get("sliding_window"):
            raise ValueError(f"sliding_window = {hf['sliding_window']}: TinyGPT's experts preset has full attention")
        if hf.get("router_jitter_noise"):
            raise ValueError(f"router_jitter_noise = {hf['router_jitter_noise']}: TinyGPT's router has no jitter")
        llama = config_from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False})
        return {**llama, "d_ff": None, "moe_experts": hf["num_local_experts"], "moe_top_k": hf["num_experts_per_tok"],
                "moe_ffn_dim": hf["intermediate_size"],
                "moe_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0))}
    if kind == "qwen3_moe":
        return _qwen3_moe_fields(hf)
    if kind == "qwen3":
        if hf.get("use_sliding_window", False):
            raise ValueError("use_sliding_window = true: TinyGPT's qk_norm model attends to every earlier token")
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias = true: TinyGPT has one model.bias switch and Qwen3's MLP has no bias")
        return {**config_from_hf({**hf, "model_type": "llama", "mlp_bias": False}), "qk_norm": True}
    if kind == "llama":
        theta, linear = _llama_rope(hf)
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            raise ValueError(f"attention_bias = {hf.get('attention_bias', False)} != mlp_bias = "
                             f"{hf.get('mlp_bias', False)}: TinyGPT has one model.bias switch")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        # attention wider or narrower than the residual stream: TinyGPT's attn_head_dim
        own_dim = None if head_dim * hf["num_attention_heads"] == hf["hidden_size"] else head_dim
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act = {hf.get('hidden_act')!r}: TinyGPT's SwiGLU uses silu")
        return dict(vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"], d_model=hf["hidden_size"],
                    n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                    n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                    d_ff=hf["intermediate_size"], norm="rmsnorm", mlp="swiglu", position="rope",
                    bias=bool(hf.get("attention_bias", False)), tie_embeddings=tied,
                    norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_linear_factor=linear,
                    attn_head_dim=own_dim)
    if hf.get("activation_function", "gelu_new") not in GPT2_TANH_GELU:
        raise ValueError(f"activation_function = {hf.get('activation_function')!r}: TinyGPT's GPT-2 MLP is the "
                         f"tanh GELU ({' or '.join(GPT2_TANH_GELU)})")
    if not hf.get("scale_attn_weights", True):
        raise ValueError("scale_attn_weights = false (attention scores not divided by sqrt(head_dim)): TinyGPT's "
                         "attention always divides them")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(key):
            raise ValueError(f"{key} = true: TinyGPT's attention does not do this")
    return dict(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], d_model=hf["n_embd"],
                n_layers=hf["n_layer"], n_heads=hf["n_head"], n_kv_heads=None,
                d_ff=hf.get("n_inner") or 4 * hf["n_embd"], norm="layernorm", mlp="gelu", position="learned",
                bias=True, tie_embeddings=tied, norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def qwen3_moe_dense_layers(hf: dict) -> list[int]:
    """The layers (0-based indices) of a ``qwen3_moe`` config.json that keep a dense MLP, chosen the
    way ``Qwen3MoeDecoderLayer`` chooses: listed in ``mlp_only_layers``, or no experts, or
    (index + 1) not a multiple of ``decoder_sparse_step``."""
    d = QWEN3_MOE_DEFAULTS
    only = hf.get("mlp_only_layers") or []
    step = hf.get("decoder_sparse_step", d["decoder_sparse_step"])
    experts = hf.get("num_experts", hf.get("num_local_experts", d["num_experts"]))
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step = {step!r}: an integer >= 1 expected")
    return [i for i in range(hf["num_hidden_layers"]) if i in only or not experts > 0 or (i + 1) % step]


def _qwen3_moe_fields(hf: dict) -> dict:
    """The ModelConfig fields of a ``qwen3_moe`` config.json (see :func:`config_from_hf`)."""
    d = QWEN3_MOE_DEFAULTS
    # Qwen3MoeConfig keeps sliding_window only with use_sliding_window, and None there is full attention
    window = hf.get("sliding_window", d["sliding_window"]) if hf.get("use_sliding_window", False) else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"use_sliding_window = true with sliding_window = {window!r}: a window of >= 1 tokens "
                         f"(or null: none) expected")
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias = true: TinyGPT's experts and router carry no bias (model.bias = false)")
    dense = qwen3_moe_dense_layers(hf)
    if dense != list(range(len(dense))) or len(dense) == hf["num_hidden_layers"]:
        raise ValueError(
            f"decoder_sparse_step = {hf.get('decoder_sparse_step', d['decoder_sparse_step'])}, mlp_only_layers = "
            f"{hf.get('mlp_only_layers') or []}, num_experts = {hf.get('num_experts', hf.get('num_local_experts'))}: "
            f"dense layers {dense} of {hf['num_hidden_layers']}; TinyGPT's dense layers are the first k "
            f"(model.moe_first_dense) with experts in every later one, at least one")
    llama = config_from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False})
    return {**llama, "qk_norm": True, "attention_window": window,
            "moe_experts": hf.get("num_experts", hf.get("num_local_experts", d["num_experts"])),
            "moe_top_k": hf.get("num_experts_per_tok", d["num_experts_per_tok"]),
            "moe_ffn_dim": hf.get("moe_intermediate_size", d["moe_intermediate_size"]),
            "moe_norm_topk": bool(hf.get("norm_topk_prob", d["norm_topk_prob"])), "moe_first_dense": len(dense),
            "moe_aux_loss_coef": float(hf.get("router_aux_loss_coef", d["router_aux_loss_coef"]))}


def name_map(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of the HF model's state dict (as ``save_pretrained`` writes it: a tied head is
    stored once, as the embedding) and the TinyGPT tensors it comes from."""
    out: list[Entry] = []
    if family(cfg) in ("llama", "qwen3", "mixtral", "qwen3_moe"):
        out.append(Entry("model.embed_tokens.weight", ("tok_emb.weight",)))
        parts = [("norm1", "input_layernorm"), ("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
                 ("attn.v_proj", "self_attn.v_proj"), ("attn.out_proj", "self_attn.o_proj"),
                 ("norm2", "post_attention_layernorm")]
        dense = [("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj")]
        for i in range(cfg.n_layers):
            for ours, theirs in parts + ([] if cfg.is_moe_layer(i) else dense):
                suffixes = ("weight", "bias") if cfg.bias and not ours.startswith("norm") else ("weight",)
                out += [Entry(f"model.layers.{i}.{theirs}.{s}", (f"blocks.{i}.{ours}.{s}",)) for s in suffixes]
            if cfg.qk_norm:
                out += [Entry(f"model.layers.{i}.self_attn.{n}_norm.weight", (f"blocks.{i}.attn.{n}_norm.weight",))
                        for n in "qk"]
            if cfg.is_moe_layer(i):  # as save_pretrained writes it: one tensor per expert
                out += _expert_entries(cfg, i)
        out.append(Entry("model.norm.weight", ("norm_f.weight",)))
    else:
        out += [Entry("transformer.wte.weight", ("tok_emb.weight",)), Entry("transformer.wpe.weight", ("pos_emb.weight",))]
        for i in range(cfg.n_layers):
            b, h = f"blocks.{i}", f"transformer.h.{i}"
            qkv = tuple(f"{b}.attn.{p}_proj" for p in "qkv")
            out += [Entry(f"{h}.ln_1.weight", (f"{b}.norm1.weight",)), Entry(f"{h}.ln_1.bias", (f"{b}.norm1.bias",)),
                    Entry(f"{h}.attn.c_attn.weight", tuple(f"{n}.weight" for n in qkv), "qkv"),
                    Entry(f"{h}.attn.c_attn.bias", tuple(f"{n}.bias" for n in qkv), "qkv"),
                    Entry(f"{h}.attn.c_proj.weight", (f"{b}.attn.out_proj.weight",), "T"),
                    Entry(f"{h}.attn.c_proj.bias", (f"{b}.attn.out_proj.bias",)),
                    Entry(f"{h}.ln_2.weight", (f"{b}.norm2.weight",)), Entry(f"{h}.ln_2.bias", (f"{b}.norm2.bias",)),
                    Entry(f"{h}.mlp.c_fc.weight", (f"{b}.mlp.up.weight",), "T"),
                    Entry(f"{h}.mlp.c_fc.bias", (f"{b}.mlp.up.bias",)),
                    Entry(f"{h}.mlp.c_proj.weight", (f"{b}.mlp.down.weight",), "T"),
                    Entry(f"{h}.mlp.c_proj.bias", (f"{b}.mlp.down.bias",))]
        out += [Entry("transformer.ln_f.weight", ("norm_f.weight",)), Entry("transformer.ln_f.bias", ("norm_f.bias",))]
    if not cfg.tie_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head.weight",)))
    return out


#: the file names of one expert's (gate, up, down) and the router, per MoE family
EXPERT_FILE_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                     "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def _expert_entries(cfg: ModelConfig, layer: int) -> list[Entry]:
    """The file tensors of MoE layer ``layer``: the router (``<prefix>.gate``), then each expert's
    gate, up and down, row e of TinyGPT's stacked [E, ...] tensors."""
    prefix, names = EXPERT_FILE_NAMES[family(cfg)]
    moe, ours = f"model.layers.{layer}.{prefix}", f"blocks.{layer}.mlp"
    out = [Entry(f"{moe}.gate.weight", (f"{ours}.router.proj.weight",))]
    out += [Entry(f"{moe}.experts.{e}.{w}.weight", (f"{ours}.experts.{part}",), "expert", e)
            for e in range(cfg.moe_experts) for w, part in zip(names, ("gate", "up", "down"))]
    return out


def tinygpt_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """TinyGPT's state-dict keys and shapes (counts) for ``cfg``, computed without building it."""
    C, V, F, D = cfg.d_model, cfg.vocab_size, cfg.ffn_dim, cfg.head_dim
    q, kv = cfg.n_heads * D, cfg.kv_heads * D
    shapes = {"tok_emb.weight": (V, C)}
    if cfg.position == "learned":
        shapes["pos_emb.weight"] = (cfg.block_size, C)
    norm_bias = cfg.norm == "layernorm" and cfg.bias
    mats = {"attn.q_proj": (q, C), "attn.k_proj": (kv, C), "attn.v_proj": (kv, C), "attn.out_proj": (C, q)}
    dense = ({"mlp.gate": (F, C), "mlp.up": (F, C), "mlp.down": (C, F)} if cfg.mlp == "swiglu"
             else {"mlp.up": (F, C), "mlp.down": (C, F)})
    for i in range(cfg.n_layers):
        mats = dict(mats)
        for n in list(mats):
            if n.startswith("mlp."):
                del mats[n]
        if cfg.is_moe_layer(i):
            E, Fe = cfg.moe_experts, cfg.expert_dim
            mats.update({"mlp.router.proj": (E, C), "mlp.experts.gate": (E, Fe, C), "mlp.experts.up": (E, Fe, C),
                         "mlp.experts.down": (E, C, Fe)})
            if cfg.moe_shared_experts:
                S = cfg.moe_shared_experts * Fe
                mats.update({"mlp.shared.gate": (S, C), "mlp.shared.up": (S, C), "mlp.shared.down": (C, S)})
            if cfg.moe_bias_update_rate is not None:
                shapes[f"blocks.{i}.mlp.router.expert_bias"] = (E,)  # a buffer, in the state dict
        else:
            mats.update(dense)
        for n in ("norm1", "norm2"):
            shapes[f"blocks.{i}.{n}.weight"] = (C,)
            if norm_bias:
                shapes[f"blocks.{i}.{n}.bias"] = (C,)
        for n, shape in mats.items():
            shapes[f"blocks.{i}.{n}" + ("" if n.startswith("mlp.experts") else ".weight")] = shape
            if cfg.bias:
                shapes[f"blocks.{i}.{n}.bias"] = (shape[0],)
        if cfg.qk_norm:
            shapes[f"blocks.{i}.attn.q_norm.weight"] = shapes[f"blocks.{i}.attn.k_norm.weight"] = (D,)
    shapes["norm_f.weight"] = (C,)
    if norm_bias:
        shapes["norm_f.bias"] = (C,)
    shapes["lm_head.weight"] = (V, C)  # in the state dict even when tied (the same matrix)
    return shapes


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF state-dict shapes :func:`name_map` produces (GPT-2's Conv1D weights are [in, out])."""
    ours = tinygpt_shapes(cfg)
    out = {}
    for e in name_map(cfg):
        first = ours[e.ours[0]]
        if e.kind == "expert":
            out[e.hf] = first[1:]
        elif e.kind == "T":
            out[e.hf] = first[::-1]
        elif e.kind == "qkv":
            rows = sum(ours[n][0] for n in e.ours)
            out[e.hf] = (first[1], rows) if len(first) == 2 else (rows,)
        else:
            out[e.hf] = first
    return out


#: bytes per element of the safetensors dtypes (the format's spec: safetensors' ``Dtype``)
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def runtime_names(cfg: ModelConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """How the HF MoE classes hold the per-expert file tensors in memory (transformers fuses them
    when it loads): ``{in-memory name: (how, file names)}``, how = "gate_up" (each expert's gate
    then up along the output dim, stacked over experts: [E, 2F, C]), "stack" (down stacked: [E, C, F])
    or "same" (one tensor, renamed). Empty for the dense families (the files are the memory)."""
    if family(cfg) not in EXPERT_FILE_NAMES:
        return {}
    prefix, (gate, up, down) = EXPERT_FILE_NAMES[family(cfg)]
    out = {}
    for i in range(cfg.n_layers):
        if not cfg.is_moe_layer(i):
            continue
        moe, E = f"model.layers.{i}.{prefix}", range(cfg.moe_experts)
        out[f"model.layers.{i}.mlp.gate.weight"] = ("same", (f"{moe}.gate.weight",))
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (
            "gate_up", tuple(f"{moe}.experts.{e}.{w}.weight" for e in E for w in (gate, up)))
        out[f"model.layers.{i}.mlp.experts.down_proj"] = ("stack", tuple(f"{moe}.experts.{e}.{down}.weight" for e in E))
    return out


def mixtral_runtime_names(cfg: ModelConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """:func:`runtime_names` of a Mixtral config (``MixtralForCausalLM``: w1 gate, w3 up, w2 down)."""
    if family(cfg) != "mixtral":
        raise ValueError(f"mixtral_runtime_names: cfg is a {family(cfg)!r} model, not 'mixtral'")
    return runtime_names(cfg)


def safetensors_header(path: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``({tensor name: shape}, metadata)`` of a ``.safetensors`` file, read from its JSON header
    (8-byte little-endian length, then the JSON) without torch. ValueError when it is not one, or
    when its tensors' bytes do not fill the file exactly (a truncated or padded file: safetensors'
    own loader would fail later with a traceback): each tensor's byte range is its shape times its
    dtype's size, the ranges follow one another from 0, and the last ends at the file's end."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20 or n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} B does not fit the file of "
                             f"{size} B: truncated?)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    ranges = []
    for name, t in header.items():
        try:
            shape, (begin, end), dtype = tuple(int(d) for d in t["shape"]), t["data_offsets"], t["dtype"]
            width = SAFETENSORS_DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: not a safetensors file (tensor {name!r} has no valid shape, dtype and "
                             f"data_offsets)") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * width:
            raise ValueError(f"{path}: tensor {name!r} ({dtype} {shape}) needs {numel * width} B but its data_offsets "
                             f"span {end - begin} B: a damaged file")
        ranges.append((begin, end, name))
    data = size - 8 - n
    at = 0
    for begin, end, name in sorted(ranges):
        if begin != at:
            raise ValueError(f"{path}: tensor {name!r} starts at byte {begin} of the data, expected {at}: a damaged file")
        at = end
    if at != data:
        raise ValueError(f"{path}: the tensors need {at} B of data but the file holds {data} B after its header: "
                         f"{'truncated (an interrupted copy or download?)' if at > data else 'a damaged file'}")
    return {k: tuple(v["shape"]) for k, v in header.items()}, meta


def shape_mismatches(found: dict[str, tuple], want: dict[str, tuple], where: str) -> list[str]:
    """What differs between a file's tensors (``found``) and a model's (``want``), by name: shapes
    as ``name: file (..) vs model (..)``, then missing and unexpected names (first five of each)."""
    bad = [f"{k}: {where} {tuple(found[k])} vs model {tuple(v)}" for k, v in want.items()
           if k in found and tuple(found[k]) != tuple(v)]
    missing = [k for k in want if k not in found]
    extra = [k for k in found if k not in want]
    out = [f"shape {b}" for b in bad[:5]] + ([f"... and {len(bad) - 5} more"] if len(bad) > 5 else [])
    if missing:
        out.append(f"missing from {where}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        out.append(f"unexpected in {where}: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return out
