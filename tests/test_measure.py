"""course_lib.measure: saved-activation bytes, allocated model state, CUDA peak, matmul peak, timers,
and the estimator checked against the measurement on TinyGPT."""

import pytest
import torch
import torch.nn as nn

from course_lib import estimate
from course_lib.measure import (
    CudaUnavailableError, StepTimer, Throughput, compare_tinygpt_activations, cpu_matmul_peak_flops,
    cuda_peak_memory, model_state_bytes_allocated, saved_activation_bytes, time_steps,
    tinygpt_activation_kwargs, tinygpt_shape,
)
from course_lib.model import ModelConfig, TinyGPT


# ------------------------------------------------------------------------------ saved activations
def test_each_storage_counts_once_and_whole():
    x = torch.randn(10, 10, requires_grad=True)
    # x * x saves x twice: one storage, 400 bytes.
    assert saved_activation_bytes(lambda: x * x).total_bytes == 400
    # A view saved for backward keeps its whole storage alive: 400 bytes, not 40.
    got = saved_activation_bytes(lambda: x[0].exp())  # exp saves its output (40 B, new storage)
    assert got.total_bytes == 40
    got = saved_activation_bytes(lambda: x[0] * x[0])
    assert got.total_bytes == 400 and got.n_storages == 1 and got.n_saved_tensors == 2


def test_parameters_and_buffers_are_not_activations():
    lin = nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    got = saved_activation_bytes(lin, x)  # Linear saves its input and weight; only the input counts
    assert got.total_bytes == 4 * 8 * 4
    # A lambda hides the module: pass its state in `skip`.
    assert saved_activation_bytes(lambda: lin(x), skip=tuple(lin.parameters())).total_bytes == 128
    assert saved_activation_bytes(lambda: lin(x)).total_bytes == 128 + 16 * 8 * 4


def test_bytes_are_attributed_to_the_innermost_module():
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    got = saved_activation_bytes(net, torch.randn(5, 8))
    # "0" saves its input for the weight gradient ([5, 8] fp32 = 160 B), GELU its input and "2"
    # its input, the GELU output (both [5, 32] fp32 = 640 B).
    assert got.by_module == {"0": 160, "1": 640, "2": 640}
    assert got.module_bytes("") == got.total_bytes == 1440
    assert got.module_bytes("1") == 640
    assert got.by_dtype == {"float32": 1440}


def test_saved_activation_errors():
    with pytest.raises(TypeError, match="callable"):
        saved_activation_bytes(42)
    with pytest.raises(TypeError, match="skip must hold tensors"):
        saved_activation_bytes(lambda: None, skip=(1,))
    with torch.no_grad(), pytest.raises(RuntimeError, match="no_grad"):
        saved_activation_bytes(lambda: None)


def _rows(cfg, seq, batch):
    return {r["component"].strip(): r for r in compare_tinygpt_activations(cfg, seq_len=seq, micro_batch=batch)}


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("seq, batch", [(32, 3), (64, 1)])
def test_estimator_equals_tinygpt_measurement(preset, recompute, seq, batch):
    cfg = ModelConfig.preset(preset, checkpointing=recompute)
    rows = _rows(cfg, seq, batch)
    # Exact to the byte for every block component the estimator models (fp32, CPU flash SDPA) ...
    for name, row in rows.items():
        if name in ("embedding + output layer", "total"):
            continue
        assert row["measured"] == row["estimated"], f"{name}: {row}"
    # ... and the output layer keeps one extra scalar: cross-entropy's fp32 total_weight (4 B).
    assert rows["embedding + output layer"]["measured"] - rows["embedding + output layer"]["estimated"] == 4
    assert rows["total"]["measured"] - rows["total"]["estimated"] == 4
    assert ("norms (one block)" in rows) == (recompute != "full")


def test_estimator_matches_a_wider_model_with_grouped_query_attention():
    cfg = ModelConfig.preset("llama-tiny", d_model=96, n_heads=6, n_kv_heads=3, n_layers=3, block_size=48)
    rows = _rows(cfg, 48, 2)
    assert rows["all blocks"]["measured"] == rows["all blocks"]["estimated"]
    assert abs(rows["total"]["ratio"] - 1) < 1e-4


def test_tinygpt_kwargs_refuse_what_they_cannot_account():
    kw = tinygpt_activation_kwargs(ModelConfig.preset("tiny"), seq_len=16, micro_batch=2)
    assert kw["dropout"] is False and kw["attention"] == "flash" and kw["bytes_per_element"] == 4
    with pytest.raises(ValueError, match="dropout=0.1"):
        tinygpt_activation_kwargs(ModelConfig.preset("tiny", dropout=0.1), seq_len=16, micro_batch=2)
    with pytest.raises(ValueError, match="attention_window"):
        tinygpt_activation_kwargs(ModelConfig.preset("tiny", attention_window=8), seq_len=16, micro_batch=2)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "gpt2-small", "llama2-7b"])
def test_tinygpt_shape_counts_the_same_parameters(preset):
    cfg = ModelConfig.preset(preset)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    assert tinygpt_shape(cfg).num_params() == model.num_params()
    assert tinygpt_shape(cfg, seq_len=16).seq_len == 16


# ------------------------------------------------------------------------------ model state
def _adamw_step(model, opt):
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_adamw_state_equals_the_fp32_adam_closed_form(preset):
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig.preset(preset))
    n = model.num_params()  # the tied embedding counted once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model_state_bytes_allocated(model, opt)
    assert (before.params, before.grads, before.optimizer) == (4 * n, 0, 0)  # Adam's state is lazy
    _adamw_step(model, opt)
    got = model_state_bytes_allocated(model, opt)
    closed = estimate.model_state_bytes(n, recipe="fp32-adam")
    assert got.num_params == n
    assert (got.params, got.grads, got.optimizer_moments) == (closed.params, closed.grads, closed.optimizer)
    # The closed form leaves out AdamW's per-tensor step counters: one fp32 scalar per parameter tensor.
    assert got.optimizer_scalars == 4 * len(list(model.parameters()))
    assert got.total == closed.total + got.optimizer_scalars
    opt.zero_grad(set_to_none=True)
    assert model_state_bytes_allocated(model, opt).grads == 0


def test_sgd_momentum_state_equals_its_closed_form():
    model = TinyGPT(ModelConfig.preset("tiny"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _adamw_step(model, opt)
    got = model_state_bytes_allocated(model, opt)
    assert got.total == estimate.model_state_bytes(model.num_params(), recipe="fp32-sgd-momentum").total


def test_shared_storage_counts_once():
    model = TinyGPT(ModelConfig.preset("tiny"))
    assert model.lm_head.weight is model.tok_emb.weight
    assert model_state_bytes_allocated(model).params == 4 * model.num_params()
    half = TinyGPT(ModelConfig.preset("tiny")).to(torch.bfloat16)
    assert model_state_bytes_allocated(half).params == 2 * half.num_params()


def test_model_state_errors():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        model_state_bytes_allocated("model")
    with pytest.raises(TypeError, match="optimizer must be"):
        model_state_bytes_allocated(nn.Linear(2, 2), optimizer=object())


# ------------------------------------------------------------------------------ CUDA peak
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_peak_on_cpu_says_what_to_use_instead():
    with pytest.raises(CudaUnavailableError) as info:
        cuda_peak_memory(lambda: None)
    message = str(info.value)
    assert "torch.cuda.is_available() is False" in message
    assert "saved_activation_bytes" in message and "model_state_bytes_allocated" in message


@pytest.mark.gpu
def test_cuda_peak_sees_a_temporary_allocation():
    x = torch.empty(2**20, device="cuda")  # 4 MiB held across the call
    peak = cuda_peak_memory(lambda: torch.empty(2**22, device="cuda"))  # 16 MiB, freed at once
    assert peak.before >= x.numel() * 4
    assert peak.step_peak >= 2**22 * 4 and peak.after == peak.before


# ------------------------------------------------------------------------------ FLOP/s and time
def test_cpu_matmul_peak_is_positive_and_validates():
    peak = cpu_matmul_peak_flops(64, repeats=2, min_seconds=0.005)
    assert peak.flops_per_second > 0 and peak.n == 64 and peak.dtype == "float32"
    assert peak.flops_per_second == pytest.approx(2 * 64**3 / peak.best_seconds)
    with pytest.raises(ValueError, match="n must be >= 16"):
        cpu_matmul_peak_flops(8)
    with pytest.raises(ValueError, match="repeats"):
        cpu_matmul_peak_flops(64, repeats=0)


def test_step_timer_drops_warmup_and_uses_the_median():
    timer = StepTimer(tokens_per_step=100, warmup=1)
    for _ in range(4):
        with timer:
            pass
    timer.all_seconds[:] = [9.0, 0.5, 0.1, 0.2]  # a slow warm-up step, then three real ones
    result = timer.result()
    assert result.seconds == (0.5, 0.1, 0.2) and result.seconds_per_step == 0.2
    assert result.tokens_per_second == pytest.approx(500.0)


def test_time_steps_calls_warmup_plus_n():
    calls = []
    result = time_steps(lambda: calls.append(1), 3, warmup=2, tokens_per_step=8)
    assert len(calls) == 5 and len(result.seconds) == 3


def test_throughput_errors_explain():
    with pytest.raises(ValueError, match="tokens_per_step was not given"):
        Throughput((0.1,)).tokens_per_second
    with pytest.raises(ValueError, match="no timed steps"):
        Throughput(()).seconds_per_step
    with pytest.raises(ValueError, match="n_steps"):
        time_steps(lambda: None, 0)
    with pytest.raises(ValueError, match="warmup"):
        StepTimer(warmup=-1)
