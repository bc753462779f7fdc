"""FLOPs, MFU, time to train and the hardware table, against published arithmetic."""

import pytest

from course_lib.estimate import (
    ACCELERATORS, ModelShape, accelerator, flops_per_token, mfu, model_flops_per_iteration, palm_flops_per_token,
    training_days,
)

# GPT-3 175B as Narayanan et al. 2021 count it (Table 1): l=96, h=12288, a=96, V=51200, s=2048.
GPT3 = ModelShape(96, 12288, 96, 51200, 2048)


@pytest.mark.parametrize("batch", [1, 8, 1536])
def test_narayanan_flops_per_iteration_with_full_recompute(batch):
    # Narayanan et al. 2021, Sec. 5.1, eq. (3): F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    B, s, l, h, V = batch, 2048, 96, 12288, 51200
    published = 96 * B * s * l * h**2 + 16 * B * s * s * l * h + 6 * B * s * h * V  # eq. (3) expanded, exact
    assert model_flops_per_iteration(GPT3, batch=batch, recompute=True) == published
    assert model_flops_per_iteration(GPT3, batch=batch, recompute="full") == published


def test_korthikanti_model_flops_without_recompute():
    # Korthikanti et al. 2022, Sec. 6 (model FLOPs): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    B, s, l, h, V = 4, 2048, 96, 12288, 51200
    published = 72 * B * s * l * h**2 + 12 * B * s * s * l * h + 6 * B * s * h * V
    assert model_flops_per_iteration(GPT3, batch=B) == published
    assert model_flops_per_iteration(GPT3, batch=B, recompute="none") == published
    selective = model_flops_per_iteration(GPT3, batch=B, recompute="selective")
    assert published < selective < model_flops_per_iteration(GPT3, batch=B, recompute=True)


def test_palm_540b_mfu():
    # Chowdhery et al. 2022 (PaLM), Sec. 4.1 and Appendix B: 540.35B parameters, L=118, H=48,
    # Q=256, T=2048; 238.3K tokens/s on 6144 TPU v4 at 275 peak TFLOP/s: "The MFU of PaLM 540B is
    # 45.7% without self-attention or 46.2% with it."
    n, tok_s = 540.35e9, 238.3e3
    peak = accelerator("tpu-v4").peak_flops("bf16")
    with_attention = palm_flops_per_token(n, n_layers=118, n_heads=48, head_dim=256, seq_len=2048)
    assert round(mfu(tok_s, with_attention, n_devices=6144, peak_flops_per_device=peak), 3) == 0.462
    assert round(mfu(tok_s, 6 * n, n_devices=6144, peak_flops_per_device=peak), 3) == 0.457


def test_narayanan_training_time_estimates():
    # Narayanan et al. 2021, Sec. 5.1: end-to-end time ~ 8 T P / (n X). GPT-3 175B on 300B tokens,
    # 1024 A100s at 140 TFLOP/s: "about 34 days"; the 1T model (Table 1: 1008B params) on 450B
    # tokens, 3072 A100s at 163 TFLOP/s: "84 days".
    gpt3 = training_days(300e9, 175e9, n_devices=1024, achieved_flops_per_device=140e12, flops_per_param_per_token=8)
    assert round(gpt3) == 34
    one_t = ModelShape(128, 25600, 160, 51200, 2048).num_params()
    days = training_days(450e9, one_t, n_devices=3072, achieved_flops_per_device=163e12, flops_per_param_per_token=8)
    assert round(days) == 84
    # The model-FLOPs count (6 per parameter and token) is 3/4 of that.
    assert training_days(300e9, 175e9, n_devices=1024, achieved_flops_per_device=140e12) == pytest.approx(0.75 * gpt3)


def test_flops_per_token_formulas():
    g = ModelShape.preset("gpt2-small")
    assert flops_per_token(g) == 6 * 124_439_808  # Kaplan et al. 2020, Sec. 2.1: C = 6N
    # nanoGPT's estimate_mfu: N without the position table, plus PaLM's 12 L H Q T.
    nano = 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 12 * 64 * 1024
    assert flops_per_token(g, formula="palm", params="no-position") == nano == 855_166_464
    assert flops_per_token(g, params="non-embedding") == 6 * (124_439_808 - 50257 * 768 - 1024 * 768)
    assert flops_per_token(g, formula="narayanan") == model_flops_per_iteration(g, batch=1) / 1024


def test_narayanan_and_6n_agree_for_large_models():
    # For a large model the h^2 terms dominate: the matmul count and 6N differ by a few percent.
    for name in ("gpt3-175b", "llama2-70b", "llama3-405b"):
        shape = ModelShape.preset(name)
        ratio = flops_per_token(shape, formula="narayanan") / flops_per_token(shape)
        assert 0.98 < ratio < 1.10, (name, ratio)


def test_hardware_table_has_sources_and_known_peaks():
    # A100: 312 TFLOP/s bf16 (NVIDIA datasheet; the denominator nanoGPT's estimate_mfu uses).
    assert accelerator("a100-sxm4-80gb").peak_flops("bf16") == 312e12
    assert accelerator("tpu-v4").peak_flops("bf16") == 275e12  # PaLM Appendix B
    assert accelerator("h100-sxm5-80gb").peak_flops("bf16") == 1979e12 / 2  # dense = sparse / 2
    assert accelerator("a100-sxm4-80gb").memory_bytes == 80 * 2**30
    for acc in ACCELERATORS.values():
        assert acc.source and acc.memory_gib > 0
        for dtype in ("bf16", "fp16", "tf32", "fp32"):
            peak = getattr(acc, dtype)
            assert peak is None or 1e12 < peak < 1e16
    with pytest.raises(ValueError, match="no bf16 matrix throughput"):
        accelerator("v100-sxm2-32gb").peak_flops("bf16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        accelerator("a100-sxm4-80gb").peak_flops("int8")
    with pytest.raises(ValueError, match="name must be one of"):
        accelerator("rtx-9090")


@pytest.mark.parametrize("call, exc, words", [
    (lambda: mfu(1e3, 1e9, n_devices=0, peak_flops_per_device=1e12), ValueError, ["n_devices", ">= 1"]),
    (lambda: mfu(-1, 1e9, n_devices=1, peak_flops_per_device=1e12), ValueError, ["tokens_per_second", ">= 0"]),
    (lambda: mfu(1, 1e9, n_devices=1, peak_flops_per_device=0), ValueError, ["peak_flops_per_device", "> 0"]),
    (lambda: training_days(1e9, -7, n_devices=1, achieved_flops_per_device=1e12), ValueError, ["num_params"]),
    (lambda: training_days(1e9, 7e9, n_devices=1, achieved_flops_per_device=0), ValueError,
     ["achieved_flops_per_device", "> 0"]),
    (lambda: flops_per_token(ModelShape.preset("gpt2-small"), formula="chinchilla"), ValueError, ["formula", "'palm'"]),
    (lambda: flops_per_token(ModelShape.preset("gpt2-small"), params="some"), ValueError, ["params", "'no-position'"]),
    (lambda: flops_per_token(124e6), TypeError, ["shape", "ModelShape"]),
    (lambda: model_flops_per_iteration(GPT3, batch=0), ValueError, ["batch", ">= 1"]),
    (lambda: model_flops_per_iteration(GPT3, batch=1, recompute="half"), ValueError, ["recompute", "'full'"]),
    (lambda: palm_flops_per_token(1e9, n_layers=0, n_heads=1, head_dim=1, seq_len=1), ValueError, ["n_layers"]),
])
def test_invalid_arguments_name_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value)
