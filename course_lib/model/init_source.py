"""``model.init_from``: start a run from weights made elsewhere.

Two kinds of source, told apart by what the path is:

* a Hugging Face model folder (``config.json`` + ``model.safetensors``: ``LlamaForCausalLM``,
  ``Qwen3ForCausalLM``, ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` or ``GPT2LMHeadModel``;
  what ``course ckpt export-hf`` writes, or a pretrained model saved with ``save_pretrained``): its
  config must describe the run's model, its tensors are renamed (:mod:`course_lib.model.hf_map`);
* a consolidated file ``FILE.safetensors`` (``course ckpt consolidate``), TinyGPT's own names, its
  model config in the file's metadata (and in ``FILE.json`` beside it for people).

:func:`check_init_source` runs at config time and is torch-free: it reads only JSON and the
safetensors header. Every difference between the source and the run's ``[model]`` is named with
both values, before any file is written. :func:`load_init_state` (torch) returns the state dict.
"""
from __future__ import annotations

import json
from pathlib import Path

from course_lib.model.config import ModelConfig
from course_lib.model.hf_map import (HF_CONFIG, HF_WEIGHTS, config_from_hf, hf_shapes, safetensors_header,
                                     shape_mismatches, tinygpt_shapes)

#: the metadata key of a consolidated file that holds its ModelConfig (JSON)
CONFIG_KEY = "course_lib.model_config"
#: ModelConfig fields that change the function a set of weights computes (block_size only with a
#: learned position table, where it is a shape; RoPE reads any length up to the run's block_size)
FUNCTION_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "kv_heads", "head_dim", "ffn_dim", "norm", "mlp",
                   "position", "bias", "tie_embeddings", "norm_eps", "rope_theta", "rope_linear_factor", "moe_experts", "moe_top_k",
                   "expert_dim", "moe_shared_experts", "moe_first_dense", "moe_score", "moe_norm_topk",
                   "moe_route_scale", "qk_norm", "attention_window", "logit_softcap",
                   "attn_logit_softcap")


def source_kind(path: str | Path) -> str:
    """"hf" (a folder with config.json) or "file" (a .safetensors file); ValueError otherwise."""
    p = Path(path)
    if p.is_dir():
        if not (p / HF_CONFIG).is_file() or not (p / HF_WEIGHTS).is_file():
            raise ValueError(f"{p} is a folder without {HF_CONFIG} and {HF_WEIGHTS}: not a Hugging Face model folder "
                             f"(course ckpt export-hf writes one)")
        return "hf"
    if p.is_file():
        return "file"
    raise ValueError(f"{p}: no such file or folder")


def source_config(path: str | Path) -> ModelConfig:
    """The ModelConfig the weights at ``path`` were made for (block_size as the source has it)."""
    p = Path(path)
    if source_kind(p) == "hf":
        try:
            fields = config_from_hf(json.loads((p / HF_CONFIG).read_text()))
        except (ValueError, KeyError) as e:
            raise ValueError(f"{p / HF_CONFIG}: {e if isinstance(e, ValueError) else f'no key {e}'}") from None
        return ModelConfig(**fields)
    _, meta = safetensors_header(p)
    if CONFIG_KEY not in meta:
        raise ValueError(f"{p}: a safetensors file without {CONFIG_KEY!r} in its metadata: not a consolidated "
                         f"checkpoint (course ckpt consolidate writes one)")
    return ModelConfig.from_dict(json.loads(meta[CONFIG_KEY]))


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether some block of ``cfg`` has a dense MLP (whose width, ``ffn_dim``, is then a shape)."""
    return not all(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


def check_init_source(path: str | Path, cfg: ModelConfig) -> None:
    """Torch-free: ValueError naming every difference between the weights at ``path`` and the
    run's model ``cfg`` (config fields: the run's value and the source's; then tensor shapes, the
    file's and the model's). Returns None when they fit."""
    p = Path(path)
    src = source_config(p)
    fields = FUNCTION_FIELDS + (("block_size",) if cfg.position == "learned" else ())
    if not (_has_dense_mlp(cfg) or _has_dense_mlp(src)):  # the dense width is then no tensor's shape: an
        fields = tuple(k for k in fields if k != "ffn_dim")  # HF MoE folder's intermediate_size may be anything
    diffs = [f"model.{k} = {getattr(cfg, k)!r} vs {getattr(src, k)!r} in the source" for k in fields
             if getattr(cfg, k) != getattr(src, k)]
    if cfg.position == "rope" and src.block_size < cfg.block_size:
        diffs.append(f"model.block_size = {cfg.block_size} vs {src.block_size} in the source (the source was not "
                     f"made for sequences this long)")
    if diffs:
        raise ValueError(f"{p} does not describe the run's model: " + "; ".join(diffs))
    if source_kind(p) == "hf":
        found, _ = safetensors_header(p / HF_WEIGHTS)
        problems = shape_mismatches(found, hf_shapes(src), f"{p / HF_WEIGHTS}")
    else:
        found, _ = safetensors_header(p)
        want = tinygpt_shapes(src)
        if src.tie_embeddings:
            want.pop("lm_head.weight")  # stored once, as tok_emb.weight
        problems = shape_mismatches(found, want, str(p))
    if problems:
        raise ValueError(f"{p}: tensors do not fit the run's model: " + "; ".join(problems))


def load_init_state(path: str | Path, cfg: ModelConfig) -> dict:
    """The TinyGPT state dict (CPU tensors) for ``cfg`` from ``path``, checked first
    (:func:`check_init_source`); ready for ``model.load_state_dict(..., strict=True)``."""
    from safetensors.torch import load_file

    from course_lib.model.hf_weights import from_hf

    check_init_source(path, cfg)  # the header: names, shapes, and bytes that fill the file exactly
    p = Path(path)
    weights = p / HF_WEIGHTS if source_kind(p) == "hf" else p
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a file it cannot read
        raise ValueError(f"{weights}: cannot be read as safetensors ({type(e).__name__}: {e})") from None
    if source_kind(p) == "hf":
        return from_hf(state, cfg)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state

