"""TinyGPT: parameter counts, switches, attention patterns, memory strategies, init, accumulation."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.model import INIT_SCHEMES, ModelConfig, TinyGPT
from course_lib.model.layers import apply_rope, rope_tables, sliding_window_mask


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def small(style="tiny", **kw):
    return ModelConfig.preset(style, vocab_size=32, block_size=16, **kw)


def batch(cfg, B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (B, T), generator=g),
            torch.randint(0, cfg.vocab_size, (B, T), generator=g))


def grads_of(model, x, y, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in every run
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def saved_bytes(model, x, y):
    """Bytes autograd keeps for backward (unique storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    loss.backward()
    return total


# ----------------------------------------------------------------------------- sizes
def test_gpt2_small_has_124_439_808_parameters():
    with torch.device("meta"):
        model = TinyGPT(ModelConfig.preset("gpt2-small"))
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.num_params() == 124_439_808
    assert model.num_params(include_position_embedding=False) == 124_439_808 - 1024 * 768


def test_llama2_7b_shape_has_6_738_415_616_parameters():
    with torch.device("meta"):
        model = TinyGPT(ModelConfig.preset("llama2-7b"))
    assert model.num_params() == 6_738_415_616


def test_untied_embeddings_add_one_matrix():
    tied, untied = TinyGPT(small()), TinyGPT(small(tie_embeddings=False))
    assert untied.num_params() - tied.num_params() == 32 * 64
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()


def test_param_groups_cover_every_parameter_once():
    model = TinyGPT(small("llama-tiny"))
    decay, no_decay = model.param_groups(0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()


# ----------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("kw, exc, word", [
    (dict(n_heads=3), ValueError, "n_heads"),
    (dict(n_kv_heads=3), ValueError, "n_kv_heads"),
    (dict(n_kv_heads=8), ValueError, "n_kv_heads"),
    (dict(vocab_size="32"), TypeError, "vocab_size"),
    (dict(norm="batchnorm"), ValueError, "norm"),
    (dict(init="orthogonal"), ValueError, "init"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(attention_window=0), ValueError, "attention_window"),
    (dict(checkpointing="some"), ValueError, "checkpointing"),
    (dict(checkpointing="full", checkpoint_every=2), ValueError, "checkpoint_every"),
    (dict(embedding_bound=-1.0), ValueError, "embedding_bound"),
    (dict(bias=1), TypeError, "bias"),
])
def test_bad_config_values_name_the_field(kw, exc, word):
    with pytest.raises(exc, match=word):
        ModelConfig(**{**dict(d_model=64, n_heads=4), **kw})


def test_unknown_keys_and_presets_are_named():
    with pytest.raises(ValueError, match="n_layer"):
        ModelConfig.from_dict({"n_layer": 2})
    with pytest.raises(ValueError, match="gpt5"):
        ModelConfig.preset("gpt5")
    cfg = ModelConfig.preset("llama-tiny")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_forward_rejects_bad_inputs():
    model = TinyGPT(small())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("style", ["tiny", "llama-tiny"])
def test_initial_loss_is_log_vocab_and_ignore_index_is_respected(style):
    cfg = small(style)
    model = TinyGPT(cfg)
    x, y = batch(cfg)
    logits, loss = model(x, y)
    assert logits.shape == (2, 12, 32)
    assert abs(loss.item() - math.log(32)) < 0.1  # near-uniform predictions at init
    y2 = y.clone()
    y2[:, ::2] = -100
    _, masked = model(x, y2)
    manual = F.cross_entropy(logits[:, 1::2].reshape(-1, 32), y[:, 1::2].reshape(-1))
    assert torch.allclose(masked, manual, atol=1e-6)
    assert model(x)[1] is None


def test_causality_future_tokens_do_not_change_past_logits():
    cfg = small("llama-tiny", attention_window=4)
    model = TinyGPT(cfg).eval()
    x, _ = batch(cfg)
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % 32
    a, b = model(x)[0], model(x2)[0]
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


# ----------------------------------------------------------------------------- attention
def reference_attention(attn, x, window, cos=None, sin=None):
    """Per-head loops, explicit scores and mask: independent of the module's SDPA/repeat path."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.view(B, T, H, D).transpose(1, 2)
    k = k.view(B, T, Hkv, D).transpose(1, 2)
    v = v.view(B, T, Hkv, D).transpose(1, 2)
    if cos is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if window is not None:
        for i in range(T):
            allowed[i, : max(0, i - window + 1)] = False
    heads = []
    for h in range(H):
        kv = h // (H // Hkv)
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(D)
        scores = scores.masked_fill(~allowed, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, kv])
    y = torch.stack(heads, dim=1).transpose(1, 2).reshape(B, T, H * D)
    return attn.out_proj(y)


@pytest.mark.parametrize("n_kv, window, rope", [(4, None, False), (2, None, True), (1, 3, True), (4, 5, False)])
def test_attention_matches_reference(n_kv, window, rope):
    cfg = small("llama-tiny" if rope else "tiny", n_kv_heads=n_kv, attention_window=window)
    model = TinyGPT(cfg).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = (model.rope_cos[:12], model.rope_sin[:12]) if rope else (None, None)
    assert torch.allclose(attn(x, cos, sin), reference_attention(attn, x, window, cos, sin), atol=1e-5)


@pytest.mark.parametrize("window", [12, 16, 100])
def test_sliding_window_at_least_seq_equals_full_causal(window):
    full = TinyGPT(small("llama-tiny")).eval()
    local = TinyGPT(small("llama-tiny", attention_window=window)).eval()
    local.load_state_dict(full.state_dict())
    x, _ = batch(full.cfg)
    assert torch.allclose(full(x)[0], local(x)[0], atol=1e-6)
    assert torch.equal(sliding_window_mask(12, window, "cpu"), torch.ones(12, 12, dtype=torch.bool).tril())


def test_short_window_changes_the_output():
    full = TinyGPT(small("llama-tiny")).eval()
    local = TinyGPT(small("llama-tiny", attention_window=2)).eval()
    local.load_state_dict(full.state_dict())
    x, _ = batch(full.cfg)
    a, b = full(x)[0], local(x)[0]
    assert torch.allclose(a[:, :2], b[:, :2], atol=1e-6)  # first two tokens see the same keys
    assert not torch.allclose(a[:, 2:], b[:, 2:], atol=1e-4)


def test_gqa_equals_mha_with_each_kv_head_repeated():
    gqa = TinyGPT(small("llama-tiny", n_kv_heads=2)).eval()
    mha = TinyGPT(small("llama-tiny", n_kv_heads=4)).eval()
    state = gqa.state_dict()
    D, H, Hkv = 16, 4, 2
    for i in range(gqa.cfg.n_layers):
        for name in ("k_proj", "v_proj"):  # k/v head j becomes heads 2j and 2j+1
            w = state[f"blocks.{i}.attn.{name}.weight"]
            state[f"blocks.{i}.attn.{name}.weight"] = w.view(Hkv, D, -1).repeat_interleave(H // Hkv, 0).reshape(H * D, -1)
    mha.load_state_dict(state)
    x, _ = batch(gqa.cfg)
    assert torch.allclose(gqa(x)[0], mha(x)[0], atol=1e-5)
    assert mha.num_params() > gqa.num_params()


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(16, 64, 10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    score = lambda m, n: (apply_rope(q, cos[m : m + 1], sin[m : m + 1]) * apply_rope(k, cos[n : n + 1], sin[n : n + 1])).sum()
    assert torch.allclose(score(5, 2), score(40, 37), atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-3)


# ----------------------------------------------------------------------------- memory strategies
STRATEGIES = [("full", None, False), ("selective", None, False), ("selective", 2, False),
              ("none", None, True), ("full", None, True)]


@pytest.mark.parametrize("style", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("mode, every, offload", STRATEGIES)
def test_memory_strategies_give_identical_gradients(style, mode, every, offload):
    cfg = small(style, n_layers=4, dropout=0.1, attention_window=6 if style == "tiny" else None)
    model = TinyGPT(cfg)
    x, y = batch(cfg)
    ref_loss, ref = grads_of(model, x, y)
    model.set_memory_strategy(mode, every, offload)
    loss, got = grads_of(model, x, y)
    assert torch.equal(loss, ref_loss)
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=1e-5, atol=1e-7), name


def test_checkpointing_really_saves_activation_memory():
    model = TinyGPT(small(n_layers=4))
    x, y = batch(model.cfg, B=4, T=16)
    sizes = {}
    for key in [("none", None), ("full", None), ("selective", None), ("selective", 2)]:
        model.set_memory_strategy(*key)
        sizes[key] = saved_bytes(model, x, y)
    assert sizes[("full", None)] < sizes[("selective", 2)] < sizes[("none", None)]
    assert sizes[("selective", None)] < sizes[("none", None)]


def test_set_memory_strategy_validates():
    model = TinyGPT(small())
    with pytest.raises(ValueError, match="checkpointing"):
        model.set_memory_strategy("everything")
    with pytest.raises(ValueError, match="checkpoint_every"):
        model.set_memory_strategy("full", 2)


# ----------------------------------------------------------------------------- init
def residual_weights(model):
    return [m.weight for m in model.modules() if getattr(m, "is_residual_projection", False)]


def test_init_schemes_draw_the_documented_distributions():
    L, C = 4, 64
    for scheme in INIT_SCHEMES:
        model = TinyGPT(small(n_layers=L, init=scheme))
        q_w = torch.cat([b.attn.q_proj.weight.flatten() for b in model.blocks])
        res = torch.cat([w.flatten() for w in residual_weights(model)])
        if scheme == "zero_out_proj":
            assert res.abs().max() == 0
        expected_res = {"normal": 0.02, "scaled_residual": 0.02 / math.sqrt(2 * L),
                        "small": math.sqrt(2 / (5 * C))}.get(scheme)
        if expected_res is not None:
            assert res.std().item() == pytest.approx(expected_res, rel=0.05), scheme
        expected_q = {"kaiming": math.sqrt(2 / C), "xavier": math.sqrt(2 / (C + C)),
                        "small": math.sqrt(2 / (5 * C))}.get(scheme, 0.02)
        assert q_w.std().item() == pytest.approx(expected_q, rel=0.05), scheme
        assert all(b.attn.q_proj.bias.abs().max() == 0 for b in model.blocks)


def test_zero_out_proj_blocks_start_as_identity_but_learn():
    model = TinyGPT(small(init="zero_out_proj"))
    x = torch.randn(2, 8, 64)
    assert torch.equal(model.blocks[0](x), x)
    _, loss = model(*batch(model.cfg))
    loss.backward()
    assert residual_weights(model)[0].grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["tanh", "clamp"])
def test_bounded_embedding(mode):
    model = TinyGPT(small(position="none", tie_embeddings=False, embedding_bound=0.5, embedding_bound_mode=mode))
    with torch.no_grad():
        model.tok_emb.weight.mul_(40)  # pretend the rows grew large (std 0.8 vs bound 0.5)
    seen = {}
    model.blocks[0].register_forward_hook(lambda m, inp, out: seen.setdefault("x", inp[0]))
    x, y = batch(model.cfg)
    _, loss = model(x, y)
    assert seen["x"].abs().max() <= 0.5 + 1e-6
    assert seen["x"].abs().max() > 0.45
    loss.backward()
    used = model.tok_emb.weight.grad[x.unique()]
    zero_share = (used == 0).float().mean().item()
    if mode == "tanh":
        assert zero_share == 0  # soft bound: every entry still gets a gradient
    else:
        assert 0.2 < zero_share < 1  # hard bound: saturated entries get none


# ----------------------------------------------------------------------------- training math
@pytest.mark.parametrize("style", ["tiny", "llama-tiny"])
def test_gradient_accumulation_equals_one_big_batch(style):
    cfg = small(style)
    model = TinyGPT(cfg)
    x, y = batch(cfg, B=8, T=16, seed=3)
    big_loss, big = grads_of(model, x, y)

    k = 4
    model.zero_grad(set_to_none=True)
    total = 0.0
    for xm, ym in zip(x.chunk(k), y.chunk(k)):
        _, loss = model(xm, ym)
        (loss / k).backward()  # mean over equal-size micro-batches = mean over the big batch
        total += loss.item() / k
    assert total == pytest.approx(big_loss.item(), rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, big[name], rtol=1e-5, atol=1e-8), name


def test_generate_shapes_and_greedy_is_deterministic():
    model = TinyGPT(small()).eval()
    start = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(start, 20, temperature=0)  # runs past block_size=16: the context is cropped
    assert out.shape == (2, 23) and torch.equal(out[:, :3], start)
    assert torch.equal(out, model.generate(start, 20, temperature=0))
    g = torch.Generator().manual_seed(0)
    sampled = model.generate(start, 5, top_k=3, generator=g)
    assert sampled.shape == (2, 8) and int(sampled.max()) < 32


def test_memory_strategy_survives_dataclass_replace():
    cfg = small(checkpointing="selective")
    model = TinyGPT(cfg)
    assert all(b.attn.recompute_core for b in model.blocks)
    model.set_memory_strategy("none")
    assert not any(b.attn.recompute_core for b in model.blocks)
    assert dataclasses.replace(model.cfg, checkpointing="full").checkpointing == "full"
