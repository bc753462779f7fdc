"""Activation bytes: Korthikanti et al. 2022's formulas, pipeline stages, properties, errors, and an
exact cross-check against what TinyGPT saves for backward."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.estimate import (
    activation_breakdown_per_layer, activation_bytes_first_stage, activation_bytes_per_layer,
    first_stage_activation_breakdown,
)

# GPT-3 175B as Korthikanti et al. train it (Table 3): s=2048, h=12288, a=96, t=8, V=51200.
S, B, H, A, T, V, L = 2048, 1, 12288, 96, 8, 51200, 96
BASE = dict(seq_len=S, micro_batch=B, d_model=H, n_heads=A)


# Korthikanti et al. 2022, Table 2 ("activations memory per transformer layer").
@pytest.mark.parametrize("kwargs, published", [
    (dict(), S * B * H * (34 + 5 * A * S / H)),
    (dict(tp=T), S * B * H * (10 + 24 / T + 5 * A * S / (H * T))),
    (dict(tp=T, sequence_parallel=True), S * B * H / T * (34 + 5 * A * S / H)),
    (dict(tp=T, recompute="selective"), S * B * H * (10 + 24 / T)),
    (dict(tp=T, sequence_parallel=True, recompute="selective"), S * B * H * 34 / T),
    (dict(recompute="full"), 2 * S * B * H),
    (dict(tp=T, recompute="full"), 2 * S * B * H),
], ids=["none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full", "tp+full"])
def test_korthikanti_table_2(kwargs, published):
    assert activation_bytes_per_layer(**BASE, **kwargs) == pytest.approx(published, rel=1e-12)


def test_korthikanti_section_4_1_breakdown():
    # Sec. 4.1: attention block 11sbh + 5as^2b, MLP 19sbh, two layer norms 4sbh.
    c = activation_breakdown_per_layer(**BASE).components
    sbh = S * B * H
    attention = c["qkv_input"] + c["q_k_v"] + c["attention_core"] + c["out_proj_input"] + c["dropout_masks"] / 2
    assert attention == pytest.approx(11 * sbh + 5 * A * S * S * B)
    assert c["mlp_input"] + c["mlp_hidden"] + c["dropout_masks"] / 2 == pytest.approx(19 * sbh)
    assert c["norm_inputs"] == 4 * sbh


def test_selective_recompute_saves_70_percent_for_gpt3():
    # Ultra-Scale Playbook, "Activation recomputation" (after Korthikanti et al.): for GPT-3 175B
    # selective recomputation means "a 70% activation memory reduction". (34 + 80) -> 34.
    none = activation_bytes_per_layer(**BASE)
    selective = activation_bytes_per_layer(**BASE, recompute="selective")
    assert round(1 - selective / none, 2) == 0.70


def test_first_stage_holds_n_layers_worth_under_1f1b_whatever_pp():
    # Korthikanti Sec. 4.2.3: the first stage keeps p micro-batches of L/p layers = L layers.
    per_layer = activation_bytes_per_layer(**BASE, tp=T, sequence_parallel=True)
    for pp in (1, 2, 4, 8, 16):
        got = activation_bytes_first_stage(n_layers=L, pp=pp, **BASE, tp=T, sequence_parallel=True)
        assert got == pytest.approx(L * per_layer)


def test_interleaved_schedule_penalty():
    # Korthikanti Sec. 4.2.3: interleaving with m chunks multiplies by 1 + (p - 1)/(p m).
    per_layer = activation_bytes_per_layer(**BASE, tp=T, sequence_parallel=True)
    for pp, v in [(8, 2), (12, 4), (4, 3)]:
        got = activation_bytes_first_stage(n_layers=L, pp=pp, virtual_stages=v, **BASE, tp=T, sequence_parallel=True)
        assert got == pytest.approx(L * per_layer * (1 + (pp - 1) / (pp * v)))


def test_gpipe_and_short_1f1b_in_flight_counts():
    per_layer = activation_bytes_per_layer(**BASE)
    gpipe = activation_bytes_first_stage(n_layers=L, pp=4, schedule="gpipe", micro_batches=16, **BASE)
    assert gpipe == pytest.approx(L / 4 * 16 * per_layer)  # every micro-batch in flight
    short = activation_bytes_first_stage(n_layers=L, pp=8, micro_batches=2, **BASE)
    assert short == pytest.approx(L / 8 * 2 * per_layer)  # 1F1B with m < p keeps m in flight


def test_embedding_and_output_terms_section_4_3():
    # Korthikanti Sec. 4.3 (with sequence parallelism): input-embedding dropout sbhp/t;
    # with p = 1 the output layer adds 4sbh/t (1 + v/h).
    kw = dict(**BASE, tp=T, sequence_parallel=True)
    stage = first_stage_activation_breakdown(n_layers=L, pp=1, vocab_size=V, **kw)
    assert stage.embedding == pytest.approx(S * B * H * 1 / T)
    assert stage.output == pytest.approx(4 * S * B * H / T * (1 + V / H))
    staged = first_stage_activation_breakdown(n_layers=L, pp=8, vocab_size=V, **kw)
    assert staged.embedding == pytest.approx(S * B * H * 8 / T) and staged.output == 0
    assert stage.total == pytest.approx(stage.layers + stage.embedding + stage.output)


def test_tinygpt_deviations_are_parameters():
    kw = dict(seq_len=64, micro_batch=4, d_model=64, n_heads=4)
    eager = activation_bytes_per_layer(**kw)
    no_dropout = activation_bytes_per_layer(**kw, dropout=False)
    flash = activation_bytes_per_layer(**kw, dropout=False, attention="flash")
    sbh, as2b = 64 * 4 * 64, 4 * 64 * 64 * 4
    assert eager - no_dropout == pytest.approx(2 * sbh + 3 * as2b)  # masks + mask/copy of the scores
    assert no_dropout - flash == pytest.approx(2 * as2b - 4 * 4 * 64 * 4)  # s^2 scores -> fp32 lse
    swiglu = activation_bytes_per_layer(**kw, mlp="swiglu", d_ff=176)
    gelu = activation_bytes_per_layer(**kw, d_ff=176)
    assert swiglu - gelu == pytest.approx(2 * 2 * 64 * 4 * 176)  # two more hidden tensors
    gqa = activation_bytes_per_layer(**kw, n_kv_heads=1)
    assert eager - gqa == pytest.approx(2 * 2 * sbh * (1 - 1 / 4))  # K and V of 1 head, not 4


def _saved_bytes_per_layer(model_mod, torch, preset, checkpointing, seq, batch):
    """Bytes autograd saves for one extra block: measure(L=3) - measure(L=2), each storage once."""
    from course_lib.measure import saved_activation_bytes

    totals = []
    for n_layers in (2, 3):
        cfg = model_mod.ModelConfig.preset(preset, n_layers=n_layers, checkpointing=checkpointing)
        model = model_mod.TinyGPT(cfg).train()
        idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        totals.append(saved_activation_bytes(model, idx, idx).total_bytes)
    return totals[1] - totals[0], cfg


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_estimate_equals_what_tinygpt_saves(preset, recompute):
    # fp32 on CPU (flash SDPA, no dropout): the estimate with TinyGPT's deviations spelled out as
    # keywords must equal the bytes autograd actually keeps for one block.
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("course_lib.model")
    measured, cfg = _saved_bytes_per_layer(model_mod, torch, preset, recompute, seq=32, batch=3)
    estimate = activation_bytes_per_layer(
        seq_len=32, micro_batch=3, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        mlp=cfg.mlp, d_ff=cfg.ffn_dim, recompute=recompute, dropout=False, attention="flash",
        bytes_per_element=4, kv_repeat=True,
        norm_saves="unfused-rmsnorm" if cfg.norm == "rmsnorm" else "input+stats")
    assert estimate == measured


dims = st.sampled_from([(64, 4, 1), (128, 8, 2), (96, 6, 3), (256, 16, 8)])  # (d_model, heads, kv heads)


@settings(max_examples=150, deadline=None)
@given(dims=dims, s=st.integers(1, 512), b=st.integers(1, 8), tp=st.sampled_from([1, 2]),
       sp=st.booleans(), attention=st.sampled_from(["eager", "flash"]), dropout=st.booleans(),
       mlp=st.sampled_from(["gelu", "swiglu"]), e=st.sampled_from([2, 4]))
def test_more_recomputation_never_uses_more_memory(dims, s, b, tp, sp, attention, dropout, mlp, e):
    h, a, kv = dims
    if kv % tp or (sp and s % tp):
        return
    kw = dict(seq_len=s, micro_batch=b, d_model=h, n_heads=a, n_kv_heads=kv, tp=tp, sequence_parallel=sp,
              attention=attention, dropout=dropout, mlp=mlp, bytes_per_element=e)
    none, sel, full = (activation_bytes_per_layer(**kw, recompute=r) for r in ("none", "selective", "full"))
    assert full <= sel <= none
    # Linear in the micro-batch, never negative.
    assert activation_bytes_per_layer(**{**kw, "micro_batch": 2 * b}) == pytest.approx(2 * none)
    assert full > 0


@settings(max_examples=100, deadline=None)
@given(s=st.integers(2, 1024).map(lambda x: 2 * x), b=st.integers(1, 4),
       rec=st.sampled_from(["none", "selective", "full"]))
def test_more_parallelism_never_uses_more_memory(s, b, rec):
    kw = dict(seq_len=s, micro_batch=b, d_model=128, n_heads=8, recompute=rec)
    one = activation_bytes_per_layer(**kw)
    tp2 = activation_bytes_per_layer(**kw, tp=2)
    sp2 = activation_bytes_per_layer(**kw, tp=2, sequence_parallel=True)
    assert sp2 <= tp2 <= one
    assert sp2 == pytest.approx(one / 2)  # sequence parallelism splits everything by t
    assert activation_bytes_per_layer(**kw, attention="flash", dropout=False) <= one


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(tp=5), ValueError, ["tp (5)", "n_heads (96)"]),
    (dict(n_heads=7), ValueError, ["n_heads (7)", "d_model"]),
    (dict(n_kv_heads=5), ValueError, ["n_kv_heads (5)", "n_heads (96)"]),
    (dict(n_kv_heads=4, tp=8), ValueError, ["tp (8)", "n_kv_heads (4)"]),
    (dict(seq_len=-4), ValueError, ["seq_len", ">= 1"]),
    (dict(micro_batch=0), ValueError, ["micro_batch", ">= 1"]),
    (dict(recompute="partial"), ValueError, ["recompute", "'selective'"]),
    (dict(attention="sdpa"), ValueError, ["attention", "'flash'"]),
    (dict(tp=8, sequence_parallel=True, seq_len=2047), ValueError, ["tp (8)", "seq_len (2047)"]),
    (dict(bytes_per_element=0), ValueError, ["bytes_per_element", "> 0"]),
    (dict(norm_saves="stats"), ValueError, ["norm_saves", "'input+stats'"]),
    (dict(dropout=0.1), TypeError, ["dropout", "bool"]),
])
def test_invalid_layer_arguments_name_the_argument(kwargs, exc, words):
    with pytest.raises(exc) as info:
        activation_bytes_per_layer(**{**BASE, **kwargs})
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    (dict(pp=5), ["pp * virtual_stages (5)", "n_layers (96)"]),
    (dict(pp=4, virtual_stages=5), ["pp * virtual_stages (20)"]),
    (dict(pp=4, schedule="interleaved"), ["virtual_stages must be >= 2"]),
    (dict(pp=4, schedule="gpipe"), ["micro_batches is required"]),
    (dict(pp=4, virtual_stages=2, schedule="1f1b"), ["virtual_stages must be 1"]),
    (dict(pp=4, schedule="zb-h1"), ["schedule must be one of"]),
    (dict(pp=0), ["pp must be >= 1"]),
    (dict(pp=4, micro_batches=0), ["micro_batches must be >= 1"]),
])
def test_invalid_stage_arguments_name_the_argument(kwargs, words):
    with pytest.raises(ValueError) as info:
        activation_bytes_first_stage(n_layers=L, **BASE, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_output_backward_transient_counts_the_output_layer_gradients():
    """The buffers alive at the start of backward besides the saved activations: d(log-softmax) and
    d(fp32 logits), 4 B per logit each; with 2-byte logits also the gradient cast back; and the
    logits themselves when the loop keeps them. Split over the vocabulary by tp."""
    from course_lib.estimate import output_backward_transient_bytes as transient

    n = 1024 * 16 * 50304  # logits of GPT-2 small at micro-batch 16
    assert transient(seq_len=1024, micro_batch=16, vocab_size=50304, bytes_per_element=4) == 8 * n
    assert transient(seq_len=1024, micro_batch=16, vocab_size=50304, bytes_per_element=4, logits_kept=True) == 12 * n
    assert transient(seq_len=1024, micro_batch=16, vocab_size=50304, bytes_per_element=2) == 10 * n
    assert transient(seq_len=1024, micro_batch=16, vocab_size=50304, bytes_per_element=2, tp=4) == 10 * n / 4
    with pytest.raises(ValueError, match="bytes_per_element"):
        transient(seq_len=8, micro_batch=1, vocab_size=8, bytes_per_element=3)
