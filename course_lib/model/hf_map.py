"""TinyGPT <-> Hugging Face ``transformers``: which class, which config keys, which tensor names.

Torch-free (the trainer's config check reads it): the name mapping is the only thing written by
hand; the HF side is ``transformers``' own config classes and ``from_pretrained``
(:mod:`course_lib.model.hf_weights` moves the tensors).

Three HF classes express TinyGPT:

| TinyGPT switches | HF class | config |
| --- | --- | --- |
| rmsnorm, swiglu, rope, any kv heads, bias on or off, tied or not | ``LlamaForCausalLM`` | ``LlamaConfig`` |
| the Llama switches with qk_norm (RMSNorm on each head's q and k), bias off | ``Qwen3ForCausalLM`` | ``Qwen3Config`` |
| layernorm with bias, gelu, learned positions, kv heads = heads, bias on, tied or not | ``GPT2LMHeadModel`` | ``GPT2Config`` |

Anything else (a bounded embedding, a sliding window, no positions, a mix of the families,
soft-capped logits) has no HF class that computes the same function: :func:`hf_unsupported` names
the switch. model.z_loss and model.smooth_swiglu change training only, not the function: they export.

GPT-2 stores its linear layers as ``Conv1D`` with the weight transposed ([in, out]) and q, k, v as
one fused ``c_attn`` matrix; the mapping says so per tensor (``kind``).
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
    ``kind``: "same" (copied), "T" (transposed: GPT-2's Conv1D) or "qkv" (q, k, v concatenated
    along the output dim, then transposed: GPT-2's ``c_attn``; ``ours`` lists the three)."""

    hf: str
    ours: tuple[str, ...]
    kind: str = "same"


def family(cfg: ModelConfig) -> str:
    """"llama", "qwen3" or "gpt2": which HF class family the switches call for (see :func:`hf_unsupported`)."""
    if cfg.qk_norm:
        return "qwen3"
    return "llama" if cfg.position == "rope" or cfg.norm == "rmsnorm" or cfg.mlp == "swiglu" else "gpt2"


def hf_unsupported(cfg: ModelConfig) -> list[str]:
    """Why no HF class computes what ``cfg`` computes, one reason per switch (empty: exportable)."""
    why = []
    if cfg.embedding_bound is not None:
        why.append(f"model.embedding_bound = {cfg.embedding_bound} (a bounded token embedding): no HF class "
                   f"bounds its embedding output")
    if cfg.attention_window is not None:
        why.append(f"model.attention_window = {cfg.attention_window} (sliding window): LlamaConfig and GPT2Config "
                   f"carry no window")
    for key in ("logit_softcap", "attn_logit_softcap"):
        if getattr(cfg, key) is not None:
            why.append(f"model.{key} = {getattr(cfg, key)} (soft-capping): LlamaConfig, Qwen3Config and GPT2Config "
                       f"carry no cap")
    if family(cfg) in ("llama", "qwen3"):
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


def hf_config_kwargs(cfg: ModelConfig) -> tuple[str, dict]:
    """``(HF class name, keyword arguments of its config class)`` for ``cfg`` (exportable only)."""
    if family(cfg) == "qwen3":  # Llama plus q_norm / k_norm; every layer full attention
        return "Qwen3ForCausalLM", dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.block_size,
            rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=False, use_sliding_window=False, attention_dropout=cfg.dropout,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family(cfg) == "llama":
        return "LlamaForCausalLM", dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.block_size,
            rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=cfg.bias, mlp_bias=cfg.bias, attention_dropout=cfg.dropout,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    # GPT-2's "gelu_new" is the tanh approximation TinyGPT's MLP uses (layers.MLP).
    return "GPT2LMHeadModel", dict(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=cfg.ffn_dim, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None)


def config_from_hf(hf: dict) -> dict:
    """The ModelConfig fields an HF ``config.json`` (a dict) fixes. ValueError for a model type or a
    setting TinyGPT cannot take (naming the key)."""
    kind = hf.get("model_type")
    tied = bool(hf.get("tie_word_embeddings", kind == "gpt2"))
    if kind == "qwen3":
        if hf.get("use_sliding_window", False):
            raise ValueError("use_sliding_window = true: TinyGPT's qk_norm model attends to every earlier token")
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias = true: TinyGPT has one model.bias switch and Qwen3's MLP has no bias")
        return {**config_from_hf({**hf, "model_type": "llama", "mlp_bias": False}), "qk_norm": True}
    if kind == "llama":
        rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.rope_type = {rope.get('rope_type')!r}: TinyGPT has plain RoPE only")
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            raise ValueError("attention_bias != mlp_bias: TinyGPT has one model.bias switch")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
            raise ValueError(f"head_dim = {head_dim} x heads != hidden_size = {hf['hidden_size']}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act = {hf.get('hidden_act')!r}: TinyGPT's SwiGLU uses silu")
        return dict(vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"], d_model=hf["hidden_size"],
                    n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                    n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                    d_ff=hf["intermediate_size"], norm="rmsnorm", mlp="swiglu", position="rope",
                    bias=bool(hf.get("attention_bias", False)), tie_embeddings=tied,
                    norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", 10000.0)))
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"activation_function = {hf.get('activation_function')!r}: TinyGPT's GPT-2 MLP is the "
                             f"tanh GELU")
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(key):
                raise ValueError(f"{key} = true: TinyGPT's attention does not do this")
        return dict(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], d_model=hf["n_embd"],
                    n_layers=hf["n_layer"], n_heads=hf["n_head"], n_kv_heads=None,
                    d_ff=hf.get("n_inner") or 4 * hf["n_embd"], norm="layernorm", mlp="gelu", position="learned",
                    bias=True, tie_embeddings=tied, norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    raise ValueError(f"model_type = {kind!r}: TinyGPT reads 'llama', 'qwen3' and 'gpt2' folders only")


def name_map(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of the HF model's state dict (as ``save_pretrained`` writes it: a tied head is
    stored once, as the embedding) and the TinyGPT tensors it comes from."""
    out: list[Entry] = []
    if family(cfg) in ("llama", "qwen3"):
        out.append(Entry("model.embed_tokens.weight", ("tok_emb.weight",)))
        parts = [("norm1", "input_layernorm"), ("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
                 ("attn.v_proj", "self_attn.v_proj"), ("attn.out_proj", "self_attn.o_proj"),
                 ("norm2", "post_attention_layernorm"), ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"),
                 ("mlp.down", "mlp.down_proj")]
        for i in range(cfg.n_layers):
            for ours, theirs in parts:
                suffixes = ("weight", "bias") if cfg.bias and not ours.startswith("norm") else ("weight",)
                out += [Entry(f"model.layers.{i}.{theirs}.{s}", (f"blocks.{i}.{ours}.{s}",)) for s in suffixes]
            if cfg.qk_norm:
                out += [Entry(f"model.layers.{i}.self_attn.{n}_norm.weight", (f"blocks.{i}.attn.{n}_norm.weight",))
                        for n in "qk"]
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


def tinygpt_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """TinyGPT's state-dict keys and shapes (counts) for ``cfg``, computed without building it."""
    C, V, F, D = cfg.d_model, cfg.vocab_size, cfg.ffn_dim, cfg.head_dim
    q, kv = cfg.n_heads * D, cfg.kv_heads * D
    shapes = {"tok_emb.weight": (V, C)}
    if cfg.position == "learned":
        shapes["pos_emb.weight"] = (cfg.block_size, C)
    norm_bias = cfg.norm == "layernorm" and cfg.bias
    mats = {"attn.q_proj": (q, C), "attn.k_proj": (kv, C), "attn.v_proj": (kv, C), "attn.out_proj": (C, q)}
    mats.update({"mlp.gate": (F, C), "mlp.up": (F, C), "mlp.down": (C, F)} if cfg.mlp == "swiglu"
                else {"mlp.up": (F, C), "mlp.down": (C, F)})
    for i in range(cfg.n_layers):
        for n in ("norm1", "norm2"):
            shapes[f"blocks.{i}.{n}.weight"] = (C,)
            if norm_bias:
                shapes[f"blocks.{i}.{n}.bias"] = (C,)
        for n, shape in mats.items():
            shapes[f"blocks.{i}.{n}.weight"] = shape
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
        if e.kind == "T":
            out[e.hf] = first[::-1]
        elif e.kind == "qkv":
            rows = sum(ours[n][0] for n in e.ours)
            out[e.hf] = (first[1], rows) if len(first) == 2 else (rows,)
        else:
            out[e.hf] = first
    return out


def safetensors_header(path: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``({tensor name: shape}, metadata)`` of a ``.safetensors`` file, read from its JSON header
    (8-byte little-endian length, then the JSON) without torch. ValueError when it is not one."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20 or n > path.stat().st_size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} B does not fit the file)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    meta = header.pop("__metadata__", None) or {}
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
