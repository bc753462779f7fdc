"""The mixture-of-experts MLP (course_lib/model/moe.py) against plain per-token loops, its balancing
(auxiliary loss into the training loss, DeepSeek-V3's bias), capacity and dropping, the published
presets' parameter counts (meta device, against transformers' own classes and the published
figures), and ``course ckpt export-hf`` / ``model.init_from`` with ``MixtralForCausalLM`` both ways.
Logit parity and gradients against Mixtral are in tests/test_hf_parity.py."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from course_lib.model import ModelConfig, TinyGPT
from course_lib.model import moe as moe_lib
from course_lib.model.published import PUBLISHED, exact_counts, rounds_to


SMALL = dict(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, moe_ffn_dim=8)


def cfg_(**kw) -> ModelConfig:
    return ModelConfig.preset("moe-tiny", **{"moe_experts": 4, **kw})


def reference_moe(m: moe_lib.MoE, x: torch.Tensor, cap: int | None = None, policy: str = "position") -> torch.Tensor:
    """The MoE written as loops over tokens: route, drop over capacity by hand, run each chosen
    expert on its token, weigh, sum; plus the shared experts."""
    h = x.reshape(-1, x.shape[-1])
    r = m.router(h)
    E, ex = m.n_experts, m.experts
    keep = torch.ones_like(r.experts, dtype=torch.bool)
    if cap is not None:  # each expert's queue: by token order or by weight, first cap kept
        for e in range(E):
            pairs = [(t, j) for t in range(h.shape[0]) for j in range(m.top_k) if r.experts[t, j] == e]
            if policy == "probs":
                pairs.sort(key=lambda p: -r.weights[p].item())
            for t, j in pairs[cap:]:
                keep[t, j] = False
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(m.top_k):
            if keep[t, j]:
                e = r.experts[t, j]
                y = F.linear(F.silu(F.linear(h[t], ex.gate[e])) * F.linear(h[t], ex.up[e]), ex.down[e])
                out[t] += r.weights[t, j] * y
    if m.shared is not None:
        out = out + m.shared(h)
    return out.view_as(x), keep


@pytest.mark.parametrize("kw", [
    dict(),  # Mixtral/Qwen3: softmax, normalised top-2, dropless
    dict(moe_score="sigmoid", moe_route_scale=2.5, moe_shared_experts=1, moe_top_k=3),  # DeepSeek-V3's kind
    dict(moe_capacity_factor=0.5),  # tokens dropped (position)
    dict(moe_capacity_factor=0.75, moe_drop_policy="probs", moe_norm_topk=False),
])
def test_moe_equals_a_loop_over_tokens(kw):
    torch.manual_seed(0)
    cfg = cfg_(**kw)
    m = moe_lib.MoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(2, 12, cfg.d_model)
    cap = None if cfg.moe_capacity_factor is None else moe_lib.capacity(24, cfg.moe_top_k, 4, cfg.moe_capacity_factor)
    want, keep = reference_moe(m, x, cap, cfg.moe_drop_policy)
    got = m(x)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert m.last_dropped.item() == (~keep).sum().item()
    assert m.last_load.sum().item() == 24 * cfg.moe_top_k  # load counts the router's choice, before dropping
    if cap is not None:
        assert m.last_dropped.item() > 0  # the case drops something
        kept_per_expert = torch.bincount(m.router(x.view(24, -1)).experts[keep], minlength=4)
        assert kept_per_expert.max().item() <= cap


def test_router_bias_picks_but_does_not_weigh_and_scores_normalise():
    torch.manual_seed(1)
    r = moe_lib.Router(8, 4, 2, "sigmoid", norm_topk=False, bias_balancing=True)
    x = torch.randn(5, 8)
    r.expert_bias[3] = 10.0  # expert 3 always picked ...
    out = r(x)
    assert (out.experts == 3).any(1).all()
    scores = r.proj(x).sigmoid()
    assert torch.equal(out.weights, scores.gather(1, out.experts))  # ... at its own score, bias not added
    assert torch.allclose(out.probs.sum(1), torch.ones(5))
    r2 = moe_lib.Router(8, 4, 2, "softmax", norm_topk=True)
    assert torch.allclose(r2(x).weights.sum(1), torch.ones(5))


def test_balancing_loss_values_and_it_reaches_the_training_loss():
    E = 4
    uniform = torch.full((8, E), 1 / E)
    spread = torch.tensor([[0, 1], [2, 3]] * 4)
    assert moe_lib.load_balancing_loss(uniform, spread, E).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, E)
    collapsed[:, 0] = 1
    assert moe_lib.load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), E).item() == pytest.approx(E)

    torch.manual_seed(0)
    model = TinyGPT(cfg_(moe_aux_loss_coef=0.1))
    x = torch.randint(0, 256, (2, 16))
    _, ce = model.eval()(x, x)
    _, loss = model.train()(x, x)
    aux = sum(m.aux_loss for m in moe_lib.moe_layers(model))
    assert loss.item() == pytest.approx(ce.item() + aux.item(), abs=1e-6)
    assert model.moe_aux_loss.item() == pytest.approx(aux.item()) and aux.item() > 0.1 * 2  # >= 1 per layer
    # the aux loss alone trains the router: its gradient is what the loss adds
    model.zero_grad()
    aux.backward()
    assert model.blocks[0].mlp.router.proj.weight.grad.abs().sum() > 0


def test_checkpointed_blocks_give_equal_gradients_and_count_load_once():
    torch.manual_seed(0)
    cfg = cfg_(moe_bias_update_rate=0.01, moe_capacity_factor=1.0, moe_shared_experts=1, **SMALL)
    x = torch.randint(0, 64, (2, 16))
    grads, loads = {}, {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = TinyGPT(dataclasses.replace(cfg, checkpointing=mode)).train()
        for _ in range(2):  # two micro-batches of one step
            model(x, x)[1].backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
        loads[mode] = [m.step_load.clone() for m in moe_lib.moe_layers(model)]
        before = [m.router.expert_bias.clone() for m in moe_lib.moe_layers(model)]
        used = moe_lib.update_expert_bias(model)
        for m, b, load in zip(moe_lib.moe_layers(model), before, used):
            want = b + 0.01 * torch.sign(load.mean() - load)
            assert torch.equal(m.router.expert_bias, want) and m.step_load is None
            assert load.sum().item() == 2 * 32 * cfg.moe_top_k  # two forwards' routed pairs, not three
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads["none"], grads["full"]))
    assert all(torch.equal(a, b) for a, b in zip(loads["none"], loads["full"]))


def test_bias_balancing_evens_out_a_skewed_router():
    """The update alone (no aux loss, no training) moves tokens off an overloaded expert: the
    busiest expert's load over the mean falls (measured 2.03 -> 1.1-1.2 in 30 steps)."""
    torch.manual_seed(0)
    layer = moe_lib.MoE(cfg_(moe_experts=8, moe_bias_update_rate=0.01, **SMALL))
    torch.nn.init.normal_(layer.router.proj.weight, 0, 0.3)
    h = torch.randn(128, 16) + 0.5
    with torch.no_grad():  # a router that prefers expert 0 for these tokens
        layer.router.proj.weight[0] += 0.15
    imbalance = []
    for _ in range(30):
        with torch.no_grad():
            layer(h)
        moe_lib.collect_aux([layer], training=True)  # what TinyGPT.forward does after its blocks
        load = moe_lib.update_expert_bias(layer)[0]
        imbalance.append((load.max() / load.mean()).item())
    assert imbalance[0] > 1.8 and sum(imbalance[-6:]) / 6 < 0.7 * imbalance[0], imbalance
    assert layer.router.expert_bias[0] < 0  # the overloaded expert's bias went down


@pytest.fixture(scope="module")
def meta_counts():
    """TinyGPT's (total, active) of the published presets, built on the meta device (no memory)."""
    out = {}
    for name in PUBLISHED:
        cfg = ModelConfig.preset(name)
        with torch.device("meta"):
            model = TinyGPT(cfg)
        out[name] = exact_counts(name, cfg, model.num_params(), model.num_active_params())
    return out


def test_published_presets_count_the_published_parameters(meta_counts):
    for name, (total, active) in meta_counts.items():
        pub = PUBLISHED[name]
        assert rounds_to(total, pub["total"], pub["step"]), (name, total)
        assert rounds_to(active, pub["active"], pub["step"], pub.get("active_truncated", False)), (name, active)
    assert meta_counts["mixtral-8x7b"] == (46_702_792_704, 12_879_925_248)
    assert meta_counts["qwen3-30b-a3b"] == (30_532_122_624, 3_353_032_704)  # its QK-norm weights included
    assert meta_counts["deepseek-v3"][0] == 671_026_404_352


def test_published_presets_equal_transformers_own_classes(meta_counts):
    tf = pytest.importorskip("transformers")
    specs = {
        "mixtral-8x7b": (tf.MixtralForCausalLM, tf.MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)),
        "qwen3-30b-a3b": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, tie_word_embeddings=False)),
        "deepseek-v3": (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config()),  # its defaults are V3's shape
    }
    for name, (cls, config) in specs.items():
        with torch.device("meta"):
            hf = cls(config)
        assert sum(p.numel() for p in hf.parameters()) == meta_counts[name][0], name


def test_bad_moe_settings_are_named():
    for kw, named in [(dict(moe_top_k=5), "moe_top_k"), (dict(moe_score="relu"), "moe_score"),
                      (dict(moe_capacity_factor=0.0), "moe_capacity_factor"), (dict(mlp="gelu"), "mlp"),
                      (dict(moe_first_dense=2), "moe_first_dense"), (dict(moe_drop_policy="random"), "moe_drop_policy")]:
        with pytest.raises(ValueError, match=named):
            cfg_(**kw)


# ----------------------------------------------------------------------------- transformers, both ways
def perturbed_moe(cfg: ModelConfig) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_export_hf_and_init_from_round_trip_through_mixtral(tmp_path):
    tf = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from course_lib import cli
    from course_lib.model.init_source import CONFIG_KEY, check_init_source, load_init_state

    cfg = ModelConfig.preset("moe-tiny", moe_experts=4, vocab_size=96)
    model = perturbed_moe(cfg)
    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights),
              metadata={CONFIG_KEY: json.dumps(cfg.to_dict())})
    idx = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(idx)[0]

    # ours -> HF: the folder transformers' from_pretrained reads (its own key conversion for experts)
    assert cli.main(["ckpt", "export-hf", str(weights), "--out", str(tmp_path / "hf")]) == 0
    hf = tf.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        assert (hf(input_ids=idx).logits - ours).abs().max().item() <= 1e-5

    # HF -> ours: a folder transformers wrote itself (save_pretrained, its own random init)
    torch.manual_seed(7)
    theirs = tf.MixtralForCausalLM(hf.config).eval()
    theirs.save_pretrained(str(tmp_path / "pretrained"))
    check_init_source(tmp_path / "pretrained", cfg)
    loaded = TinyGPT(cfg).eval()
    loaded.load_state_dict(load_init_state(tmp_path / "pretrained", cfg))
    with torch.no_grad():
        assert (loaded(idx)[0] - theirs(input_ids=idx).logits).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"model\.moe_top_k = 1 vs 2 in the source"):
        check_init_source(tmp_path / "pretrained", dataclasses.replace(cfg, moe_top_k=1))


# ----------------------------------------------------------------------------- in the trainer
def test_the_trainer_trains_experts_with_both_balancers(tmp_path):
    """A moe-tiny run: the logged loss carries the balancing loss, every expert bias entry moved by
    +-rate or 0 each step (DeepSeek-V3's update, called by the loop), MFU counts active parameters."""
    from course_lib.train import train
    from course_lib.trainer.config import ConfigError
    from course_lib.trainer.mfu import model_flops_per_token
    from layout_checks import rows, tiny_cfg

    cfg = tiny_cfg(1, train__max_steps=2, schedule__warmup_steps=1, model__preset="moe-tiny",
                   model__moe_bias_update_rate=0.01,
                   model__moe_capacity_factor=1.25)
    result = train(cfg, tmp_path / "run")
    assert result.steps == 2 and all(r["loss"] > 0 for r in rows(tmp_path / "run"))
    steps = torch.stack([m.router.expert_bias for m in moe_lib.moe_layers(result.model)]) / 0.01
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 2  # +-1 or 0 a step
    assert steps.abs().sum() > 0  # (a layer may come back to 0 after +1, -1)
    model = result.model
    assert model.num_active_params() < model.num_params()
    from course_lib.estimate.flops import palm_flops_per_token
    c = model.cfg
    assert model_flops_per_token(model, 64) == palm_flops_per_token(
        model.num_active_params(), n_layers=c.n_layers, n_heads=c.n_heads, head_dim=c.head_dim, seq_len=64)
    # MoE runs under tp only with sequence parallelism (each rank routes its own tokens; experts not cut by tp)
    with pytest.raises(ConfigError, match=r"model\.moe_experts with parallel\.tp = 2 needs parallel\."
                                          r"sequence_parallel"):
        tiny_cfg(1, model__preset="moe-tiny", parallel__tp=2, train__strategy="ddp")
