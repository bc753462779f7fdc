"""TinyGPT against the reference implementations in Hugging Face ``transformers``: Llama mode vs
``LlamaForCausalLM`` (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings), GPT-2
mode vs ``GPT2LMHeadModel`` (LayerNorm, tanh GELU, learned positions, fused qkv Conv1D, tied head).
Both HF models are built locally from their config classes (nothing is downloaded), the TinyGPT
weights copied in through ``course_lib.model.hf_weights``.

Tolerance (fp32): the two implementations do the same arithmetic in another order (GPT-2 multiplies
one fused [C, 3C] qkv matrix through ``addmm``, its ``gelu_new`` spells the tanh formula out where
TinyGPT calls ``F.gelu(approximate="tanh")``), so they may differ by rounding only: a few ulps per
operation, growing with depth. LOGIT_ATOL = 1e-5 on logits of magnitude ~2 (float32 ulp there:
2.4e-7) is ~40 ulps; measured: Llama 0.0 (bit-identical), GPT-2 4.8e-7 (tiny) and 1.2e-6 (3 layers).
Gradients: GRAD_REL = 1e-5 of each tensor's largest HF gradient; measured 3e-7 to 7e-7. A wrong
mapping (a transposed matrix, q and k swapped, a missed bias) moves logits by O(0.1-1): see
``test_a_wrong_mapping_is_caught``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from course_lib.model import ModelConfig, TinyGPT  # noqa: E402
from course_lib.model import hf_map  # noqa: E402
from course_lib.model.hf_weights import from_hf, hf_model, to_hf, to_runtime  # noqa: E402

LOGIT_ATOL = 1e-5
GRAD_REL = 1e-5

CONFIGS = {
    "llama-tiny": ModelConfig.preset("llama-tiny"),
    "tiny": ModelConfig.preset("tiny"),
    # GPT-2-shaped: 3 layers, 6 heads, the GPT-2 residual init, a vocabulary not a power of two
    "gpt2-3layer": ModelConfig.preset("gpt2-small", vocab_size=515, block_size=96, n_layers=3, n_heads=6, d_model=96),
    # the other Llama switches HF carries: biases on (attention_bias, mlp_bias), multi-query, tied head
    "llama-bias-mqa-tied": ModelConfig.preset("llama-tiny", bias=True, n_kv_heads=1, tie_embeddings=True),
    # experts (course_lib/model/moe.py): 4 SwiGLU experts, top 2, dropless, vs MixtralForCausalLM
    "mixtral-moe-tiny": ModelConfig.preset("moe-tiny", moe_experts=4),
}
HF_CLASS = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "tiny": "GPT2LMHeadModel",
            "gpt2": "GPT2LMHeadModel"}


def perturbed(cfg: ModelConfig, seed: int = 0) -> TinyGPT:
    """TinyGPT with every parameter moved off its init (norm weights off 1, biases off 0), so a
    norm or bias the mapping dropped would show."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def logits_and_grads(model, hf, cfg, seed=1):
    """Both models on one batch: logits, and the gradients of the same cross-entropy, HF-named."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=g)
    ours, loss = model(idx, tgt)
    theirs = hf(input_ids=idx).logits
    hf_loss = torch.nn.functional.cross_entropy(theirs.view(-1, theirs.shape[-1]), tgt.view(-1))
    loss.backward()
    hf_loss.backward()
    grads = to_runtime(to_hf({n: p.grad for n, p in model.named_parameters()}, cfg), cfg)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    return ours, theirs, grads, hf_grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_gradients_equal_the_hf_reference(name):
    cfg = CONFIGS[name]
    model = perturbed(cfg)
    hf = hf_model(cfg, model.state_dict())
    assert type(hf).__name__ == HF_CLASS[name.split("-")[0]]
    ours, theirs, grads, hf_grads = logits_and_grads(model, hf, cfg)
    assert (ours - theirs).abs().max().item() <= LOGIT_ATOL
    assert set(grads) == set(hf_grads)  # every HF parameter has a TinyGPT gradient, and back
    for k, want in hf_grads.items():
        rel = ((grads[k] - want).abs().max() / want.abs().max()).item()
        assert rel <= GRAD_REL, (k, rel)


def test_the_mapping_round_trips_every_tensor_bit_exactly():
    for cfg in CONFIGS.values():
        sd = perturbed(cfg).state_dict()
        back = from_hf(to_hf(sd, cfg), cfg)
        assert set(back) == set(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
        assert {k: tuple(v.shape) for k, v in to_hf(sd, cfg).items()} == hf_map.hf_shapes(cfg)
        assert {k: tuple(v.shape) for k, v in sd.items()} == hf_map.tinygpt_shapes(cfg)


def test_a_wrong_mapping_is_caught(monkeypatch):
    """The parity check can fail: swap q and k in the Llama mapping (same shapes under MHA) and
    forget GPT-2's Conv1D transpose of the MLP output (square when d_ff = d_model)."""
    cfg = dataclasses.replace(CONFIGS["llama-tiny"], n_kv_heads=None)
    real = hf_map.name_map

    def q_k_swapped(c):
        out = real(c)
        swap = {"attn.q_proj": "attn.k_proj", "attn.k_proj": "attn.q_proj"}
        return [dataclasses.replace(e, ours=tuple(next((n.replace(a, b) for a, b in swap.items() if a in n), n)
                                                  for n in e.ours)) for e in out]

    import course_lib.model.hf_weights as hw
    monkeypatch.setattr(hw, "name_map", q_k_swapped)
    model = perturbed(cfg)
    ours, theirs, _, _ = logits_and_grads(model, hf_model(cfg, model.state_dict()), cfg)
    assert (ours - theirs).abs().max().item() > 100 * LOGIT_ATOL

    gpt = ModelConfig.preset("tiny", d_ff=64)

    def no_transpose(c):
        return [dataclasses.replace(e, kind="same") if e.hf.endswith("mlp.c_proj.weight") else e for e in real(c)]

    monkeypatch.setattr(hw, "name_map", no_transpose)
    model = perturbed(gpt)
    ours, theirs, _, _ = logits_and_grads(model, hf_model(gpt, model.state_dict()), gpt)
    assert (ours - theirs).abs().max().item() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("overrides, named", [
    (dict(embedding_bound=2.0), "model.embedding_bound"),
    (dict(attention_window=8), "model.attention_window"),
    (dict(position="rope"), "model.norm"),          # Llama positions on a GPT-2 body
    (dict(bias=False), "model.bias"),
    (dict(n_kv_heads=2), "model.n_kv_heads"),
    (dict(preset="moe-tiny", moe_score="sigmoid"), "model.moe_score"),
    (dict(preset="moe-tiny", moe_shared_experts=1), "model.moe_shared_experts"),
    (dict(preset="moe-tiny", moe_capacity_factor=1.25), "model.moe_capacity_factor"),
    (dict(preset="moe-tiny", moe_bias_update_rate=1e-3), "model.moe_bias_update_rate"),
])
def test_variants_no_hf_class_expresses_are_refused_by_switch(overrides, named):
    cfg = ModelConfig.preset(overrides.pop("preset", "tiny"), **overrides)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        hf_model(cfg)


def test_hf_configs_read_back_as_the_same_model_config():
    for cfg in CONFIGS.values():
        fields = hf_map.config_from_hf(hf_model(cfg).config.to_dict())
        back = ModelConfig(**fields)
        for k in ("vocab_size", "block_size", "d_model", "n_layers", "n_heads", "kv_heads", "ffn_dim", "norm", "mlp",
                  "position", "bias", "tie_embeddings", "norm_eps", "rope_theta", "moe_experts", "moe_top_k",
                  "expert_dim", "moe_aux_loss_coef"):
            if k == "rope_theta" and cfg.position != "rope":
                continue
            assert getattr(back, k) == getattr(cfg, k), (k, getattr(back, k), getattr(cfg, k))
