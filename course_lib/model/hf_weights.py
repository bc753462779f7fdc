"""Tensors between TinyGPT and Hugging Face ``transformers`` (the names: :mod:`course_lib.model.hf_map`).

``to_hf(state, cfg)`` gives the state dict ``save_pretrained`` would write for the HF model of
``cfg``; ``from_hf`` the reverse; ``hf_model(cfg)`` builds that HF model from its config class,
locally (nothing is downloaded). ``transformers`` is optional at run time: :func:`require_transformers`
says how to install it.
"""
from __future__ import annotations

import torch

from course_lib.model.config import ModelConfig
from course_lib.model.hf_map import hf_config_kwargs, hf_unsupported, name_map, runtime_names

INSTALL_HINT = ("Hugging Face transformers is not installed; `course ckpt export-hf` and the parity tests need it: "
                "pip install 'transformers==5.24.0' (or reinstall the kit with its dev extra: ./kit setup)")


def require_transformers():
    """The ``transformers`` module; ImportError with the install command when it is missing."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return transformers


def hf_config(cfg: ModelConfig):
    """``(HF model class, its config object)`` for ``cfg``, from ``transformers``' own config classes.
    ValueError naming the switches when no HF class computes what ``cfg`` does."""
    why = hf_unsupported(cfg)
    if why:
        raise ValueError("no Hugging Face class expresses this TinyGPT: " + "; ".join(why))
    tf = require_transformers()
    cls_name, kwargs = hf_config_kwargs(cfg)
    config_cls = getattr(tf, cls_name.replace("LMHeadModel", "Config").replace("ForCausalLM", "Config"))
    config = config_cls(**kwargs)
    config.architectures = [cls_name]
    return getattr(tf, cls_name), config


def hf_model(cfg: ModelConfig, state: dict | None = None, dtype: torch.dtype = torch.float32):
    """The HF model of ``cfg``, built on the CPU from its config (random weights), in eval mode;
    with ``state`` (a TinyGPT state dict) its weights copied in, every tensor checked (strict)."""
    cls, config = hf_config(cfg)
    model = cls(config).to(dtype).eval()
    if state is not None:
        hf_state = to_runtime(to_hf(state, cfg), cfg)
        model.load_state_dict(hf_state, strict=not cfg.tie_embeddings)
        if cfg.tie_embeddings:  # the head is the embedding matrix: nothing else may be missing
            missing = set(model.state_dict()) - set(hf_state) - {"lm_head.weight"}
            if missing:
                raise ValueError(f"the HF model has tensors the mapping does not fill: {sorted(missing)[:5]}")
            model.tie_weights()
    return model


def to_runtime(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The file layout (:func:`to_hf`) -> the HF model's in-memory state dict: the same for Llama,
    Qwen3 and GPT-2; Mixtral's and Qwen3-MoE's per-expert tensors fused the way transformers holds
    them (:func:`course_lib.model.hf_map.runtime_names`)."""
    out = dict(hf_state)
    for name, (how, files) in runtime_names(cfg).items():
        ts = [out.pop(f) for f in files]
        if how == "gate_up":  # [gate_0, up_0, gate_1, up_1, ...] -> [E, 2F, C]
            out[name] = torch.stack([torch.cat(ts[j:j + 2]) for j in range(0, len(ts), 2)])
        elif how == "stack":
            out[name] = torch.stack(ts)
        else:
            out[name] = ts[0]
    return out


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """TinyGPT state dict -> the HF model's (contiguous CPU tensors, same dtype). KeyError names a
    TinyGPT tensor the state lacks."""
    out = {}
    for e in name_map(cfg):
        ts = [state[n].detach().cpu() for n in e.ours]
        if e.kind == "expert":
            out[e.hf] = ts[0][e.index].contiguous()
        elif e.kind == "T":
            out[e.hf] = ts[0].t().contiguous()
        elif e.kind == "qkv":  # GPT-2's fused c_attn: [C, 3C] (Conv1D: input rows), bias [3C]
            cat = torch.cat(ts, dim=0)
            out[e.hf] = (cat.t() if cat.dim() == 2 else cat).contiguous()
        else:
            out[e.hf] = ts[0].contiguous()
    return out


def from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF model state dict -> TinyGPT's (the tied head included, as the embedding itself)."""
    out = {}
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    experts: dict[str, list] = {}
    for e in name_map(cfg):
        t = hf_state[e.hf]
        if e.kind == "expert":  # stacked below, in expert order
            experts.setdefault(e.ours[0], [None] * cfg.moe_experts)[e.index] = t
        elif e.kind == "T":
            out[e.ours[0]] = t.t().contiguous()
        elif e.kind == "qkv":
            rows = t.t() if t.dim() == 2 else t
            for name, part in zip(e.ours, torch.split(rows, [q_rows, kv_rows, kv_rows], dim=0)):
                out[name] = part.contiguous()
        else:
            out[e.ours[0]] = t
    for name, parts in experts.items():
        out[name] = torch.stack(parts)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out
