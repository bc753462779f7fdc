"""The lab 01 memory calculator: its pure logic, and the widget driven headless like a learner would."""

import pytest

from course_lib import estimate
from course_lib.labs.widgets import MemoryCalculator, memory_per_rank, zero_stage_chart_png


def test_budget_is_the_estimators_numbers():
    b = memory_per_rank("llama2-7b", micro_batch=2, seq=2048, zero_stage=1, dp=8, recompute="selective")
    n = estimate.ModelShape.preset("llama2-7b").num_params()
    states = estimate.model_state_bytes(n, recipe="mixed-adam", zero_stage=1, dp=8)
    assert (b.parts["params"], b.parts["grads"], b.parts["optimizer"]) == (states.params, states.grads,
                                                                           states.optimizer)
    shape = estimate.ModelShape.preset("llama2-7b")
    acts = estimate.activation_bytes_first_stage(
        n_layers=32, vocab_size=32000, seq_len=2048, micro_batch=2, d_model=4096, n_heads=32,
        n_kv_heads=32, mlp="swiglu", d_ff=shape.ffn_dim, recompute="selective")
    assert b.parts["activations"] == acts
    assert b.total == pytest.approx(sum(b.parts.values()))


def test_zero_paper_16_bytes_per_param_and_monotone_in_stage():
    # ZeRO paper Sec. 3.1: mixed-precision Adam keeps 16 bytes per parameter without sharding.
    b0 = memory_per_rank("llama2-7b", zero_stage=0, dp=64)
    n = b0.num_params
    assert b0.parts["params"] + b0.parts["grads"] + b0.parts["optimizer"] == 16 * n
    totals = [memory_per_rank("llama2-7b", zero_stage=z, dp=64).total for z in range(4)]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0]
    assert memory_per_rank("llama2-7b", zero_stage=3, dp=64).parts["params"] == pytest.approx(2 * n / 64)


def test_recompute_and_flash_shrink_activations():
    a = {r: memory_per_rank("gpt2-small", recompute=r).parts["activations"] for r in ("none", "selective", "full")}
    assert a["full"] < a["selective"] < a["none"]
    flash = memory_per_rank("gpt2-small", attention="flash", dropout=False).parts["activations"]
    assert flash < a["none"]


def test_budget_table_and_verdict():
    small = memory_per_rank("gpt2-small", micro_batch=1, seq=1024)
    assert small.fits and small.largest in ("optimizer", "activations")
    big = memory_per_rank("llama2-70b", zero_stage=0, dp=1)
    assert not big.fits and big.largest == "optimizer"
    text = big.text("GB")
    assert "does NOT fit" in text and "GB" in text and "total" in text
    assert "<table>" in big.html()
    assert memory_per_rank("gpt2-small", seq=8192).notes[-1].startswith("seq 8192 is longer")


@pytest.mark.parametrize("kwargs, words", [
    (dict(zero_stage=4), "zero_stage"),
    (dict(model="gpt5"), "name must be one of"),
    (dict(recompute="some"), "recompute"),
    (dict(device="tpu-v9"), "device must be one of"),
    (dict(dp=0), "dp"),
])
def test_bad_settings_name_the_argument(kwargs, words):
    with pytest.raises(ValueError, match=words):
        memory_per_rank(**kwargs)


def test_chart_is_a_png():
    png = zero_stage_chart_png(dict(model="gpt2-small", dp=4, zero_stage=2))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_widget_updates_when_a_slider_moves():
    calc = MemoryCalculator(model="llama2-7b", dp=8, zero_stage=0)
    table0, chart0 = calc.table.value, calc.chart.value
    want0 = memory_per_rank(**calc.values())
    assert estimate.format_bytes(want0.total, "GiB") in table0 and chart0[:4] == b"\x89PNG"

    calc.controls["zero_stage"].value = 3  # what a learner's drag does: the observer recomputes
    want3 = memory_per_rank(**{**calc.values(), "zero_stage": 3})
    assert calc.budget.total == want3.total < want0.total
    assert estimate.format_bytes(want3.total, "GiB") in calc.table.value and calc.table.value != table0
    assert calc.chart.value != chart0  # the marked stage moved

    calc.controls["model"].value = "gpt2-small"
    assert "gpt2-small" in calc.table.value
    calc.controls["recompute"].value = "full"
    assert calc.budget.settings["recompute"] == "full"
    assert calc.budget.parts["activations"] == memory_per_rank(**calc.values()).parts["activations"]


def test_widget_rejects_unknown_settings():
    with pytest.raises(ValueError, match="unknown setting"):
        MemoryCalculator(batch=4)
