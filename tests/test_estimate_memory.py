"""Model-state bytes per rank: the ZeRO paper, the Ultra-Scale Playbook, recipes, properties, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.estimate import (
    RECIPES, ModelStateBytes, PrecisionRecipe, deepspeed_zero2_estimate, format_bytes, model_state_bytes,
)

GB = 1e9


# ZeRO paper (Rajbhandari et al. 2020), Figure 1 / Sec. 1: Psi = 7.5B, Nd = 64, K = 12:
# baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB (decimal GB, one decimal).
@pytest.mark.parametrize("stage, published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, published_gb):
    state = model_state_bytes(7.5e9, recipe="mixed-adam", zero_stage=stage, dp=64)
    assert round(state.total / GB, 1) == published_gb


def test_zero_paper_formulas_exact():
    # Sec. 5.1-5.3: 2Psi + 2Psi + K Psi/Nd; 2Psi + (2 + K) Psi/Nd; (2 + 2 + K) Psi/Nd.
    psi, nd, k = 7.5e9, 64, 12
    assert model_state_bytes(psi, zero_stage=1, dp=nd).total == pytest.approx(4 * psi + k * psi / nd)
    assert model_state_bytes(psi, zero_stage=2, dp=nd).total == pytest.approx(2 * psi + (2 + k) * psi / nd)
    assert model_state_bytes(psi, zero_stage=3, dp=nd).total == pytest.approx((4 + k) * psi / nd)


# Ultra-Scale Playbook (Tazi et al. 2025), "Memory usage in Transformers" table:
# FP32 or BF16 w/o FP32 grad acc | BF16 w/ FP32 grad acc, in GB.
@pytest.mark.parametrize("params, without_gb, with_gb", [
    (1e9, 16, 20), (7e9, 112, 140), (70e9, 1120, 1400), (405e9, 6480, 8100)])
def test_playbook_table(params, without_gb, with_gb):
    assert model_state_bytes(params, recipe="mixed-adam").total / GB == pytest.approx(without_gb)
    assert model_state_bytes(params, recipe="fp32-adam").total / GB == pytest.approx(without_gb)
    assert model_state_bytes(params, recipe="mixed-adam-fp32-grads").total / GB == pytest.approx(with_gb)


def test_recipe_bytes_per_param_and_the_rule_of_thumbs_omission():
    assert {n: r.bytes_per_param for n, r in RECIPES.items()} == {
        "mixed-adam": 16, "mixed-adam-fp32-grads": 20, "fp32-adam": 16, "fp32-sgd-momentum": 12, "bf16-adam-no-master": 12,
        "fp8-params-adam": 15}
    # The 2 + 2 + 8 rule of thumb differs from the ZeRO paper by exactly the fp32 master copy.
    rule, zero = model_state_bytes(7e9, recipe="bf16-adam-no-master"), model_state_bytes(7e9, recipe="mixed-adam")
    assert zero.total - rule.total == pytest.approx(4 * 7e9)
    assert zero.master_weights == 4 * 7e9 and rule.master_weights == 0
    for r in RECIPES.values():
        assert r.source, r.name


def test_components_and_units():
    s = model_state_bytes(1e9, recipe="mixed-adam", zero_stage=2, dp=4)
    assert isinstance(s, ModelStateBytes)
    assert (s.params, s.grads, s.master_weights, s.optimizer_states) == (2e9, 0.5e9, 1e9, 2e9)
    assert s.optimizer == 3e9 and s.total == 5.5e9
    assert s.unit == "bytes per rank"
    assert s.to_dict()["total"] == s.total
    assert "5.50 GB" in s.format("GB") and "per rank" in s.format("GB")


def test_custom_recipe():
    r = PrecisionRecipe(2, 2, 4, 4, name="mixed-adafactor-ish")
    assert model_state_bytes(10, recipe=r).total == 120
    with pytest.raises(ValueError, match="optimizer_bytes must be >= 0"):
        PrecisionRecipe(2, 2, 4, -1)


def test_zero2_with_fp32_grads_matches_deepspeed_zero2():
    # DeepSpeed's ZeRO-2 estimate is 2 + 18/n B/param, i.e. the Playbook's 20 B/param with
    # everything but the 16-bit weights sharded - our "mixed-adam-fp32-grads" at stage 2.
    for n_params, gpus in [(7e9, 8), (1_234_567, 3), (2_851_598_336, 16)]:
        ours = model_state_bytes(n_params, recipe="mixed-adam-fp32-grads", zero_stage=2, dp=gpus).total
        ds = deepspeed_zero2_estimate(n_params, num_gpus_per_node=gpus).gpu_bytes_per_gpu
        assert 0 <= ours - ds < 1  # DeepSpeed truncates to whole bytes


sizes = st.integers(min_value=0, max_value=10**13)
recipes = st.sampled_from(sorted(RECIPES))


@settings(max_examples=200, deadline=None)
@given(n=sizes, recipe=recipes, dp=st.integers(1, 4096), stage=st.integers(0, 2))
def test_higher_zero_stage_never_uses_more_memory(n, recipe, dp, stage):
    lo = model_state_bytes(n, recipe=recipe, zero_stage=stage, dp=dp)
    hi = model_state_bytes(n, recipe=recipe, zero_stage=stage + 1, dp=dp)
    assert hi.total <= lo.total
    assert hi.params <= lo.params and hi.grads <= lo.grads and hi.optimizer <= lo.optimizer


@settings(max_examples=200, deadline=None)
@given(n=sizes, recipe=recipes, dp=st.integers(1, 4096), stage=st.integers(0, 3))
def test_more_data_parallel_ranks_never_use_more_memory_per_rank(n, recipe, dp, stage):
    a = model_state_bytes(n, recipe=recipe, zero_stage=stage, dp=dp).total
    b = model_state_bytes(n, recipe=recipe, zero_stage=stage, dp=dp + 1).total
    assert b <= a
    if stage == 0:
        assert a == b  # plain data parallelism replicates everything


@settings(max_examples=200, deadline=None)
@given(n=sizes, recipe=recipes, dp=st.integers(1, 4096))
def test_stage3_shards_everything(n, recipe, dp):
    full = model_state_bytes(n, recipe=recipe).total
    assert full == pytest.approx(n * RECIPES[recipe].bytes_per_param)
    assert model_state_bytes(n, recipe=recipe, zero_stage=3, dp=dp).total * dp == pytest.approx(full)


def test_format_bytes_is_explicit():
    assert format_bytes(112e9, "GB") == "112.00 GB"
    assert format_bytes(2**30, "GiB") == "1.00 GiB"
    assert format_bytes(112e9, "GiB") == "104.31 GiB"
    with pytest.raises(ValueError, match="unit must be one of"):
        format_bytes(1, "gb")


def test_auto_units_suit_the_size():
    """A toy job's memory and step time are not printed as "0.00 GiB" and "0.00 s"."""
    from course_lib.estimate import format_seconds

    assert [format_bytes(n, "auto") for n in (512, 924.75 * 2**10, 3 * 2**20, 70.28 * 2**30, -2**31)] == \
        ["512.00 B", "924.75 KiB", "3.00 MiB", "70.28 GiB", "-2.00 GiB"]
    assert [format_seconds(s) for s in (0.0042, 0.25, 191.9)] == ["4.20 ms", "0.25 s", "191.90 s"]


def test_a_toy_plans_table_is_in_kib_and_ms():
    from course_lib.planner import plan
    from course_lib.planner.report import table

    tiny = plan(gpu="custom", gpu_memory_gib=0.001, gpu_tflops=0.05, gpus=4, gpus_per_node=4, tokens="2M",
                seq=64, global_batch_tokens=8 * 64, shape_overrides=dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256))
    text = table(tiny, 3)
    assert "step ms" in text and " KiB " in text and "0.00 GiB" not in text and "> 943.72 KiB usable" in text
    assert "step s" in table(plan(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T"), 2)


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((-1,), {}, ValueError, ["num_params", ">= 0"]),
    ((7e9,), dict(zero_stage=4), ValueError, ["zero_stage", "[0, 3]"]),
    ((7e9,), dict(zero_stage=-1), ValueError, ["zero_stage", "[0, 3]"]),
    ((7e9,), dict(dp=0), ValueError, ["dp", ">= 1"]),
    ((7e9,), dict(dp=True), TypeError, ["dp", "int"]),
    ((7e9,), dict(recipe="bf16-lion"), ValueError, ["recipe", "'mixed-adam'", "'bf16-adam-no-master'"]),
    ((7e9,), dict(recipe=16), TypeError, ["recipe"]),
    ((7.5,), {}, ValueError, ["num_params", "whole"]),
    (("7e9",), {}, TypeError, ["num_params", "number"]),
    ((float("nan"),), {}, ValueError, ["num_params", "finite"]),
])
def test_invalid_arguments_name_the_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        model_state_bytes(*args, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_training_step_peak_is_the_larger_of_backward_start_and_optimizer_step():
    """Backward start: states without gradients + activations + transients; optimizer step: all
    states + the optimizer's temporaries. Numbers of GPT-2 small (124,475,904 params, fp32 AdamW)."""
    from course_lib.estimate import training_step_peak_bytes

    n = 124_475_904
    states = model_state_bytes(n, recipe="fp32-adam")
    big = training_step_peak_bytes(states, 12e9, transient_bytes=6e9, optimizer_temp_bytes=4 * n)
    assert big.backward_start == 12 * n + 12e9 + 6e9 and big.where == "backward start"
    small = training_step_peak_bytes(states, 0.2e9, optimizer_temp_bytes=4 * n)
    assert small.optimizer_step == 20 * n and small.peak == 20 * n and small.where == "optimizer step"
    with pytest.raises(ValueError, match="activation_bytes"):
        training_step_peak_bytes(states, -1.0)


def test_accumulation_keeps_the_gradient_sum_live_from_the_second_micro_batch():
    """Llama 2 7B on 8 GPUs, ZeRO-1, 64 micro-batches: the bf16 gradients (2 B x 6.74e9 = 12.55 GiB)
    are live at the start of every backward but the first; ZeRO-2 keeps its shard (1/8) when it
    reduce-scatters each micro-batch, the whole tensor when it accumulates locally first."""
    from course_lib.estimate import accumulated_grad_bytes, engine_accumulation, training_step_peak_bytes

    n = 6_738_415_616
    z1 = model_state_bytes(n, recipe="mixed-adam", zero_stage=1, dp=8)
    one = training_step_peak_bytes(z1, 30e9, transient_bytes=2e9)
    many = training_step_peak_bytes(z1, 30e9, transient_bytes=2e9, grad_accum=64)
    assert many.backward_start - one.backward_start == 2 * n == z1.grads
    z2 = model_state_bytes(n, recipe="mixed-adam", zero_stage=2, dp=8)
    assert accumulated_grad_bytes(z2, "sharded") == z2.grads == 2 * n / 8
    assert accumulated_grad_bytes(z2, "local") == 2 * n  # this kit's zero2: full local sums until the step
    bucket = 5e8 * 2
    z2_peak = training_step_peak_bytes(z2, 30e9, grad_accum=4, accumulation="sharded", reduce_bucket_bytes=bucket)
    assert z2_peak.backward_start == z2.total + 30e9 + bucket
    assert [engine_accumulation(s) for s in range(4)] == ["local", "local", "sharded", "sharded"]
    with pytest.raises(ValueError, match="accumulation"):
        training_step_peak_bytes(z1, 1.0, grad_accum=2, accumulation="lazy")
    with pytest.raises(ValueError, match="grad_accum"):
        training_step_peak_bytes(z1, 1.0, grad_accum=0)
