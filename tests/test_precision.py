"""Precision: format facts, underflow / loss-scaling helpers, policies; fp16 training under `gpu`."""

import math
import warnings

import pytest
import torch

from course_lib.data import BatchStream, MarkovTask
from course_lib.model import ModelConfig, TinyGPT
from course_lib.precision import (cast_report, dtype_ranges, flat_grads, format_dtype_table, log_uniform_values,
                                  loss_scaling_report, make_policy, round_to, ulp)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- number formats
def test_dtype_ranges_golden_values():
    rows = {r["dtype"]: r for r in dtype_ranges()}
    fp16, bf16, fp32 = rows["fp16"], rows["bf16"], rows["fp32"]
    assert (fp16["exponent_bits"], fp16["mantissa_bits"], bf16["exponent_bits"], bf16["mantissa_bits"]) == (5, 10, 8, 7)
    assert (fp32["exponent_bits"], fp32["mantissa_bits"]) == (8, 23)
    assert fp16["max"] == 65504.0 and fp16["min_normal"] == 2.0**-14 and fp16["min_subnormal"] == 2.0**-24
    assert fp16["eps"] == 2.0**-10
    assert bf16["max"] == (2 - 2.0**-7) * 2.0**127 and bf16["min_normal"] == 2.0**-126
    assert bf16["min_subnormal"] == 2.0**-133 and bf16["eps"] == 2.0**-7
    assert fp32["min_subnormal"] == 2.0**-149 and fp32["eps"] == 2.0**-23
    table = format_dtype_table()
    assert "65504" in table.replace("6.55e+04", "65504") and "bf16" in table


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ranges_agree_with_real_casts(dtype):
    row = dtype_ranges([dtype])[0]
    as_dtype = lambda v: torch.tensor(v, dtype=torch.float64).to(dtype)
    assert as_dtype(row["min_subnormal"]).item() == row["min_subnormal"]
    assert as_dtype(row["min_subnormal"] * 0.49).item() == 0.0  # below half the smallest: gone
    assert as_dtype(row["max"]).item() == row["max"]
    assert math.isinf(as_dtype(row["max"] * 1.01).item())
    assert round_to(1 + row["eps"], dtype) > 1 and round_to(1 + row["eps"] * 0.49, dtype) == 1


def test_rounding_helpers():
    assert round_to(1 + 1 / 256, torch.bfloat16) == 1.0  # bf16 cannot tell 1 from 1 + 1/256
    assert round_to(1 + 1 / 256, torch.float16) == 1 + 1 / 256
    assert ulp(1.0, torch.bfloat16) == 2.0**-7 and ulp(1000.0, torch.float16) == 0.5
    assert ulp(1e-6, torch.float16) == 2.0**-24  # subnormal range: fixed spacing
    assert round_to(1000.0 + 0.2, torch.float16) == 1000.0


def test_cast_report_counts_underflow_overflow_and_subnormals():
    values = torch.tensor([1e-9, -1e-9, 1e-6, 1e-3, 1e5, 0.0])
    plain = cast_report(values, torch.float16)
    assert plain["count"] == 5  # zeros are not counted
    assert (plain["underflow"], plain["overflow"], plain["subnormal"]) == (2, 1, 1)
    scaled = cast_report(values, torch.float16, scale=1024.0)
    assert (scaled["underflow"], scaled["overflow"], scaled["subnormal"]) == (0, 1, 2)
    assert scaled["kept_fraction"] == pytest.approx(4 / 5)
    bf = cast_report(values, torch.bfloat16)
    assert (bf["underflow"], bf["overflow"]) == (0, 0) and bf["max_rel_error"] < 2.0**-8


def test_loss_scaling_recovers_small_gradients_and_too_much_overflows():
    grads = log_uniform_values(20_000, low=1e-10, high=1e-2, seed=0)
    none, good, huge = loss_scaling_report(grads, scales=(1.0, 2.0**16, 2.0**30))
    assert none["underflow"] > 0.2 * none["count"]  # a large share of tiny gradients vanishes in fp16
    assert good["underflow"] < none["underflow"] / 10 and good["overflow"] == 0
    assert good["kept_fraction"] > 0.9
    assert huge["overflow"] > 0  # scale too large: the big gradients become inf


def test_real_model_gradients_underflow_in_fp16_without_scaling():
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig.preset("tiny", vocab_size=32, block_size=16))
    x = torch.randint(0, 32, (4, 16))
    _, loss = model(x, x)
    (loss * 1e-4).backward()  # a small loss (e.g. divided by many accumulation steps)
    g = flat_grads(model)
    assert cast_report(g, torch.float16)["underflow"] > cast_report(g, torch.float16, 2.0**16)["underflow"]
    with pytest.raises(ValueError, match="backward"):
        flat_grads(TinyGPT(ModelConfig.preset("tiny", vocab_size=32, block_size=16)))


def test_helper_argument_errors():
    with pytest.raises(ValueError, match="scale"):
        cast_report(torch.ones(2), torch.float16, scale=0)
    with pytest.raises(TypeError, match="values"):
        cast_report(torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="low"):
        log_uniform_values(10, low=1.0, high=0.5)
    with pytest.raises(TypeError, match="dtypes"):
        dtype_ranges([torch.int32])


# ----------------------------------------------------------------------------- policies
def test_make_policy_validates_arguments():
    with pytest.raises(ValueError, match="precision"):
        make_policy("fp4")
    with pytest.raises(ValueError, match="device"):
        make_policy("fp32", "meta")
    with pytest.raises(ValueError, match="init_scale"):
        make_policy("fp16", init_scale=-1.0, cpu_fp16="allow")
    with pytest.raises(ValueError, match="growth_interval"):
        make_policy("fp16", growth_interval=0, cpu_fp16="allow")
    with pytest.raises(ValueError, match="cpu_fp16"):
        make_policy("fp16", cpu_fp16="maybe")
    with pytest.raises(ValueError, match="GPU path"):
        make_policy("fp16", "cpu", cpu_fp16="error")
    with pytest.warns(UserWarning, match="demonstration"):
        make_policy("fp16", "cpu")


def test_fp32_and_bf16_policies_on_cpu():
    lin = torch.nn.Linear(8, 8)
    fp32, bf16 = make_policy("fp32"), make_policy("bf16")
    with fp32.autocast():
        assert lin(torch.randn(2, 8)).dtype == torch.float32
    with bf16.autocast():
        assert lin(torch.randn(2, 8)).dtype == torch.bfloat16
    assert lin.weight.dtype == torch.float32  # master weights stay fp32
    assert fp32.scaler is None and bf16.scaler is None and bf16.loss_scale == 1.0
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with bf16.autocast():
        loss = lin(torch.randn(2, 8)).float().pow(2).mean()
    bf16.backward(loss)
    before = lin.weight.detach().clone()
    assert bf16.step(opt) is True and not torch.equal(before, lin.weight)


def fp16_scaler_checks(device):
    """Shared by the CPU demonstration and the CUDA test: a clean step applies, an inf step is
    skipped (weights untouched) and halves the scale; the scale state round-trips."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(device)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    pol = make_policy("fp16", device, init_scale=2.0**10, growth_interval=1, cpu_fp16="allow")
    x = torch.randn(4, 8, device=device)
    with pol.autocast():
        ref = torch.autograd.grad(lin(x).float().pow(2).mean(), lin.weight)[0]  # no scaling
        loss = lin(x).float().pow(2).mean()
    pol.backward(loss)
    assert lin.weight.grad.abs().max() > 100 * ref.abs().max()  # scaled by 2**10 in backward
    pol.unscale_(opt)
    # unscaled: the true gradient again (a power-of-two scale is exact unless something under/overflows)
    assert torch.allclose(lin.weight.grad, ref, rtol=1e-3, atol=1e-7)
    before = lin.weight.detach().clone()
    assert pol.step(opt) is True and not torch.equal(before, lin.weight)
    assert pol.loss_scale == 2.0**11  # growth_interval=1: doubled after one clean step

    opt.zero_grad()
    with pol.autocast():
        bad = lin(x).float().pow(2).mean() * float("inf")
    pol.backward(bad)
    before = lin.weight.detach().clone()
    assert pol.step(opt) is False and torch.equal(before, lin.weight)
    assert pol.loss_scale == 2.0**10  # halved after the skipped step

    state = pol.state_dict()
    other = make_policy("fp16", device, cpu_fp16="allow")
    other.load_state_dict(state)
    assert other.loss_scale == 2.0**10
    with pytest.raises(ValueError, match="bf16"):
        make_policy("bf16", device).load_state_dict(state)


def test_fp16_loss_scaling_demonstration_on_cpu():
    fp16_scaler_checks("cpu")


def test_fp16_scale_follows_the_callers_verdict_not_this_ranks_shard():
    """ZeRO-2/3: the inf can sit in another rank's gradient shard. When the trainer's global
    check says found_inf=True, this rank must skip and halve its scale like the rank that saw it,
    although its own unscale_ found nothing; and found_inf=False must not halve it."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    policy = make_policy("fp16", "cpu", cpu_fp16="allow")
    start = policy.scaler.get_scale()
    policy.backward((p * 2).sum())
    policy.unscale_(opt)  # finite here
    assert policy.step(opt, found_inf=True) is False
    assert torch.equal(p.detach(), torch.ones(4)), "the step must be skipped"
    assert policy.scaler.get_scale() == start * 0.5, "the scale must halve with the other ranks"
    opt.zero_grad()
    policy.backward((p * 2).sum())
    policy.unscale_(opt)
    assert policy.step(opt, found_inf=False) is True
    assert policy.scaler.get_scale() == start * 0.5  # growth only after growth_interval good steps


def train_losses(policy_name, device, steps, batch_size=16, seed=0):
    torch.manual_seed(seed)
    task = MarkovTask(vocab_size=32, seq_len=32, seed=0)
    model = TinyGPT(ModelConfig.preset("tiny", vocab_size=32, block_size=32)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    policy = make_policy(policy_name, device, cpu_fp16="allow")
    stream = BatchStream(task, batch_size, seed=0, device=device)
    losses, applied = [], 0
    for _ in range(steps):
        x, y = next(stream)
        with policy.autocast():
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        policy.backward(loss)
        policy.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        applied += policy.step(opt)
        losses.append(loss.item())
    return losses, applied, task


def test_bf16_autocast_trains_within_a_band_of_fp32_on_cpu():
    # Small on purpose: bf16 matmuls are emulated (slow) on CPUs without bf16 instructions.
    steps = 30
    fp32, _, task = train_losses("fp32", "cpu", steps, batch_size=8)
    bf16, applied, _ = train_losses("bf16", "cpu", steps, batch_size=8)
    assert applied == steps
    tail = lambda ls: sum(ls[-8:]) / 8
    assert tail(fp32) < task.unigram_entropy() - 0.8  # both really learn
    assert abs(tail(bf16) - tail(fp32)) < 0.05
    assert fp32 != bf16  # bf16 really ran in lower precision


# ----------------------------------------------------------------------------- CUDA (gpu marker)
@pytest.mark.gpu
@needs_cuda
def test_fp16_loss_scaling_on_cuda():
    fp16_scaler_checks("cuda")


@pytest.mark.gpu
@needs_cuda
def test_fp16_and_bf16_train_within_a_band_of_fp32_on_cuda():
    steps = 60
    fp32, _, task = train_losses("fp32", "cuda", steps)
    fp16, applied16, _ = train_losses("fp16", "cuda", steps)
    tail = lambda ls: sum(ls[-10:]) / 10
    assert applied16 >= steps - 5  # at most a few skipped steps while the scale settles
    assert tail(fp32) < task.unigram_entropy() - 0.8
    assert abs(tail(fp16) - tail(fp32)) < 0.05
    if torch.cuda.is_bf16_supported():
        bf16, applied, _ = train_losses("bf16", "cuda", steps)
        assert applied == steps and abs(tail(bf16) - tail(fp32)) < 0.05


@pytest.mark.gpu
@needs_cuda
def test_fp16_policy_on_cuda_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_policy("fp16", "cuda").scaler is not None
