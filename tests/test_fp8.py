"""FP8 in course_lib.precision: the formats read from their 256 bit patterns, each scaling recipe
held against a block-by-block reference that rounds by searching the format's value grid (not by
torch's cast), the FP8 Linear's three GEMMs against the same reference, delayed scaling, and the
model conversion."""
import math

import pytest
import torch

from course_lib.model import ModelConfig, TinyGPT
from course_lib.precision import make_policy
from course_lib.precision.fp8 import FORMATS, format_facts, overflow_behaviour, to_fp8
from course_lib.precision.fp8_linear import Fp8Linear, convert_to_fp8, fp8_gemm
from course_lib.precision.recipes import (RECIPES, AmaxHistory, dequantize, fake_quantize, get_recipe, quantize,
                                          quantization_error)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- independent references
_GRIDS = {}


def grid(fmt: str) -> torch.Tensor:
    """Every finite value >= 0 of the format, from its 256 bit patterns (sorted, float64). Sorted,
    a value's position is its bit pattern (0x00, 0x01, ...): the parity of the position is the
    parity of the last mantissa bit."""
    if fmt not in _GRIDS:
        values = torch.arange(256, dtype=torch.uint8).view(FORMATS[fmt]).double()
        _GRIDS[fmt] = torch.unique(values[torch.isfinite(values) & (values >= 0)])
    return _GRIDS[fmt]


def nearest(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round to the nearest grid value by search; a tie goes to the even bit pattern (IEEE's rule)."""
    g = grid(fmt)
    mag = v.double().abs().reshape(-1)
    idx = torch.searchsorted(g, mag).clamp(1, len(g) - 1)
    below, above = mag - g[idx - 1], g[idx] - mag
    take_lo = (below < above) | ((below == above) & ((idx - 1) % 2 == 0))
    return (torch.where(take_lo, g[idx - 1], g[idx]) * v.double().reshape(-1).sign()).reshape(v.shape)


def reference(x: torch.Tensor, fmt: str, block, pow2: bool = False) -> torch.Tensor:
    """Fake-quantize with one scale per block found by Python slicing: the block's amax over the
    grid's largest value (a power of two per the OCP MX rule when ``pow2``; float32 arithmetic as a
    GPU kernel does it), then clamp to the grid's ends, round by search, scale back."""
    rows, cols = x.shape
    br = rows if block[0] == -1 else block[0]
    bc = cols if block[1] == -1 else block[1]
    top = float(grid(fmt).max())
    scale = torch.empty_like(x, dtype=torch.float32)
    for r in range(0, rows, br):
        for c in range(0, cols, bc):
            amax = x[r:r + br, c:c + bc].abs().max().float()
            pow2_scale = 2.0 ** (math.floor(math.log2(float(amax))) - math.floor(math.log2(top)))
            scale[r:r + br, c:c + bc] = pow2_scale if pow2 else amax / top
    scaled = (x.float() / scale).clamp(-top, top)
    return (nearest(scaled, fmt).float() * scale).float()


def outlier_tensor(rows=256, cols=384, seed=0):
    """Activations with a few hot channels and rows, as transformers have: one scale per tensor wastes
    the format's range on everything but the outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, :3] *= 200.0
    x[5] *= 50.0
    return x * torch.logspace(-2, 1, cols)


# ----------------------------------------------------------------------------- formats
def test_fp8_format_facts_match_the_bit_patterns():
    for fmt, (e, m) in {"e4m3": (4, 3), "e5m2": (5, 2)}.items():
        g = grid(fmt)  # values >= 0
        positive = g[g > 0]
        bias = 2 ** (e - 1) - 1
        facts = format_facts(fmt)
        assert (facts["exponent_bits"], facts["mantissa_bits"]) == (e, m)
        assert facts["max"] == float(g.max())
        assert facts["min_subnormal"] == float(positive.min()) == 2.0 ** (1 - bias - m)
        assert facts["min_normal"] == 2.0 ** (1 - bias)
    assert format_facts("e4m3")["max"] == 448.0 and format_facts("e5m2")["max"] == 57344.0
    assert format_facts("e4m3")["emax"] == 8 and format_facts("e5m2")["emax"] == 15


def test_saturating_cast_never_overflows_while_e5m2s_plain_cast_does():
    big = torch.tensor([1e9, -1e9, 60000.0])
    for fmt in FORMATS:
        back = to_fp8(big, fmt).float()
        assert torch.isfinite(back).all() and back.abs().max() == format_facts(fmt)["max"]
    assert torch.isinf(big.to(torch.float8_e5m2).float()[:2]).all()  # E5M2 has inf, like IEEE formats
    assert overflow_behaviour("e5m2")["2*max verdict"] == "overflows"
    e4m3 = overflow_behaviour("e4m3")  # E4M3 has no inf: whatever torch does, it is not +inf
    assert e4m3["2*max"] != float("inf")


# ----------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("fmt,block,pow2", [
    ("e4m3", (-1, -1), False),     # tensorwise forward
    ("e5m2", (-1, -1), False),     # tensorwise gradients
    ("e4m3", (1, -1), False),      # rowwise
    ("e4m3", (1, 128), False),     # DeepSeek-V3 activations and gradients
    ("e4m3", (128, 128), False),   # DeepSeek-V3 weights
    ("e4m3", (1, 32), True),       # MXFP8: E8M0 scales
])
def test_each_block_recipe_equals_the_block_by_block_reference(fmt, block, pow2):
    x = outlier_tensor(rows=130, cols=300)  # neither dimension a multiple of its block: ragged edges too
    ours = fake_quantize(x, fmt, block, scale_kind="e8m0" if pow2 else "float")
    torch.testing.assert_close(ours, reference(x, fmt, block, pow2), rtol=1e-6, atol=0)


def test_recipe_table_is_the_published_one():
    """Formats per operand and the block shapes, checked through what each recipe *does* to a gradient
    tensor: the reference with the published format and block, not another one."""
    published = {"tensorwise": ("e5m2", (-1, -1), False), "rowwise": ("e4m3", (1, -1), False),
                 "blockwise": ("e4m3", (1, 128), False), "mxfp8": ("e4m3", (1, 32), True)}
    g = outlier_tensor(rows=64, cols=256, seed=1) * 1e-4
    for name, (fmt, block, pow2) in published.items():
        r = get_recipe(name)
        q = dequantize(quantize(g, r.fmt("grad_output"), r.block("grad_output"), scale_kind=r.scale_kind))
        torch.testing.assert_close(q, reference(g, fmt, block, pow2), rtol=1e-6, atol=0, msg=name)
    assert get_recipe("blockwise").block("weight") == (128, 128)
    assert {get_recipe(n).fmt("input") for n in RECIPES} == {"e4m3"}


def test_mx_scales_are_powers_of_two_from_floor_log2_amax():
    x = outlier_tensor(rows=8, cols=96)
    q = quantize(x, "e4m3", (1, 32), scale_kind="e8m0")
    exps = torch.log2(q.scale)
    assert torch.equal(exps, exps.round())  # E8M0: an exponent and nothing else
    amax = x.abs().reshape(8, 3, 32).amax(dim=2)
    assert torch.equal(q.scale, 2.0 ** (torch.floor(torch.log2(amax)) - 8))
    assert q.nbytes == 8 * 96 + 8 * 3  # one byte per value, one per 32-value block


def test_finer_blocks_lose_less_on_outliers_and_tensorwise_loses_small_values():
    x = outlier_tensor()
    err = {name: quantization_error(x, name) for name in ("tensorwise", "rowwise", "blockwise", "mxfp8")}
    # one scale per tensor flushes the quiet channels to zero; 1 x 128 tiles keep nearly all of them
    assert err["tensorwise"]["underflow"] > 0.01 > 10 * err["blockwise"]["underflow"], err
    for finer in ("rowwise", "blockwise", "mxfp8"):
        assert err[finer]["median_rel_error"] < 0.9 * err["tensorwise"]["median_rel_error"], err


def test_delayed_scaling_uses_the_history_and_saturates_a_jump():
    hist = AmaxHistory(length=3)
    scales = [hist.scale("e4m3", amax) for amax in (1.0, 2.0, 1.0, 8.0, 1.0, 1.0, 1.0)]
    # the scale at each step is the max of the amaxes *before* it (the first step: its own)
    expected = [1.0, 1.0, 2.0, 2.0, 8.0, 8.0, 8.0]
    assert scales == pytest.approx([a / 448 for a in expected])
    jump = torch.linspace(-8, 8, 101).reshape(1, -1)  # amax 8 quantized with the history's amax 2
    q = quantize(jump, "e4m3", scale=torch.tensor(2.0 / 448))
    assert (dequantize(q).abs() == 2.0).sum() > 70  # everything past 2 saturated


# ----------------------------------------------------------------------------- the FP8 Linear
@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_fp8_linear_runs_all_three_gemms_through_the_recipe(name):
    r = get_recipe(name)
    pow2 = r.scale_kind == "e8m0"
    torch.manual_seed(0)
    lin = Fp8Linear(256, 160, recipe=name)
    x = outlier_tensor(rows=2 * 96, cols=256).reshape(2, 96, 256).requires_grad_(True)
    y = lin(x)
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    x2, dy2, w = x.detach().reshape(-1, 256), dy.reshape(-1, 160), lin.weight.detach()

    def ref(a, b_t, roles):  # a @ b_t.T with both operands through the reference, blocks along K
        return (reference(a, r.fmt(roles[0]), r.block(roles[0]), pow2)
                @ reference(b_t, r.fmt(roles[1]), r.block(roles[1]), pow2).t())
    torch.testing.assert_close(y.detach().reshape(-1, 160), ref(x2, w, ("input", "weight")) + lin.bias.detach(),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 256), ref(dy2, w.t(), ("grad_output", "weight")), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(lin.weight.grad, ref(dy2.t(), x2.t(), ("grad_output", "input")), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(lin.bias.grad, dy2.sum(0))


def test_scaled_mm_path_equals_the_emulation():
    a, b = outlier_tensor(64, 128), outlier_tensor(48, 128, seed=3)
    for name in ("tensorwise", "rowwise"):
        r = get_recipe(name)
        fused = fp8_gemm(a, b, ("input", "weight"), r)
        emulated = (fake_quantize(a, r.fmt("input"), r.block("input"))
                    @ fake_quantize(b, r.fmt("weight"), r.block("weight")).t())
        torch.testing.assert_close(fused, emulated, rtol=1e-5, atol=1e-4)


def test_convert_to_fp8_keeps_named_layers_and_the_state_dict():
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig.preset("tiny"))
    keys = sorted(model.state_dict())
    report = convert_to_fp8(model, "blockwise", skip=["lm_head", "blocks.1.*"])
    assert report["kept"] == ["blocks.1.attn.q_proj", "blocks.1.attn.k_proj", "blocks.1.attn.v_proj",
                              "blocks.1.attn.out_proj", "blocks.1.mlp.up", "blocks.1.mlp.down", "lm_head"] or \
        sorted(report["kept"]) == sorted(["lm_head"] + [f"blocks.1.{n}" for n in
                                                        ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj",
                                                         "mlp.up", "mlp.down")])
    assert len(report["converted"]) == 6 and all(n.startswith("blocks.0.") for n in report["converted"])
    assert isinstance(model.blocks[0].mlp.up, Fp8Linear) and type(model.lm_head) is torch.nn.Linear
    assert sorted(model.state_dict()) == keys
    with pytest.raises(TypeError, match="skip"):
        convert_to_fp8(model, "tensorwise", skip="lm_head")
    with pytest.raises(ValueError, match="recipe"):
        convert_to_fp8(model, "fp4")


def test_fp8_report_says_the_moe_experts_stay_in_high_precision():
    """An MoE model's experts are stacked [E, F, C] weights, not Linear layers: neither backend converts
    them, and the report and its log line say so (the router is kept by name)."""
    from course_lib.precision.fp8_model import convert_for_training, describe

    model = TinyGPT(ModelConfig.preset("moe-tiny", n_layers=2))
    report = convert_for_training(model, recipe="tensorwise", backend="kit")
    assert report["kept_batched"] == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
    assert not any(".experts" in n for n in report["converted"])
    assert "the MoE experts' batched GEMMs (blocks.0.mlp.experts, blocks.1.mlp.experts)" in describe(report)
    dense = convert_for_training(TinyGPT(ModelConfig.preset("tiny")), recipe="tensorwise", backend="kit")
    assert dense["kept_batched"] == [] and "experts" not in describe(dense)


def test_fp8_policy_runs_the_kept_layers_in_bf16():
    policy = make_policy("fp8")
    assert policy.compute_dtype == torch.bfloat16 and policy.scaler is None
    lin = Fp8Linear(32, 32)
    with policy.autocast():
        assert lin(torch.randn(4, 32)).dtype == torch.bfloat16


def test_kit_tensorwise_matches_torchao_float8_linear():
    """The readable FP8 Linear and torchao's production one compute the same forward (tensorwise,
    fp32): both quantize with amax / 448 and 57344 and multiply with torch._scaled_mm."""
    pytest.importorskip("torchao", reason="needs torchao==0.18.0")
    from course_lib.precision.fp8_model import convert_for_training

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    theirs = torch.nn.Sequential(*[type(m)(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else m
                                   for m in ours])
    theirs.load_state_dict(ours.state_dict())
    convert_to_fp8(ours, "tensorwise", skip=[])
    convert_for_training(theirs, recipe="tensorwise", backend="torchao", keep=[])
    x = torch.randn(32, 64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the accumulator
def test_round_significand_keeps_the_leading_bits_and_cuts_toward_zero():
    from course_lib.precision.accumulate import round_significand

    x = torch.tensor([1 + 2.0**-13, 1 + 2.0**-14, -(1 + 2.0**-14), 3 * 2.0**-20], dtype=torch.float64)
    assert round_significand(x, 14).tolist() == [1 + 2.0**-13, 1.0, -1.0, 3 * 2.0**-20]


def test_a_14_bit_accumulator_drifts_with_k_and_promotion_every_128_stops_it():
    from course_lib.precision.accumulate import accumulate, accumulation_error

    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(8, 2048, generator=g), torch.rand(2048, 8, generator=g)
    exact = a.double() @ b.double()
    torch.testing.assert_close(accumulate(a, b, bits=52), exact, rtol=1e-12, atol=0)  # enough bits: exact
    short, long_ = accumulation_error(a[:, :256], b[:256], bits=14), accumulation_error(a, b, bits=14)
    promoted = accumulation_error(a, b, bits=14, promote_every=128)
    assert long_ > 3 * short and long_ > 5 * promoted, (short, long_, promoted)
    assert (accumulate(a, b, bits=14) <= exact).all()  # truncation only ever drops magnitude
    with pytest.raises(ValueError, match="multiple of chunk"):
        accumulate(a, b, chunk=4, promote_every=126)


@pytest.mark.parametrize("wrong", [("e4m3", (-1, -1), False), ("e5m2", (1, 128), False), ("e4m3", (1, 128), True)],
                         ids=["no-block-scale", "e5m2-for-e4m3", "pow2-scale-for-float"])
def test_the_recipe_check_fails_for_a_wrong_recipe(wrong):
    """The check above can fail: DeepSeek-V3's 1 x 128 E4M3 quantization is told apart from a
    scale without the block, E5M2 where E4M3 belongs, and an MX-style power-of-two scale."""
    x = outlier_tensor(rows=130, cols=300)
    ours = fake_quantize(x, "e4m3", (1, 128), scale_kind="float")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours, reference(x, *wrong), rtol=1e-6, atol=0)
