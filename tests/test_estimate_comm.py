"""Communication volumes (ring collectives, ZeRO, tensor parallelism) and the alpha-beta fit."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.estimate import (
    collective_time, comm_elements_per_step, fit_alpha_beta, ring_bytes_per_rank, ring_steps,
    tp_comm_bytes_per_layer,
)


def test_zero_paper_section_7_volumes():
    # Rajbhandari et al. 2020, Sec. 7.1-7.2: data parallelism moves 2 Psi per rank per step;
    # P_os and P_os+g also 2 Psi; P_os+g+p 3 Psi (1.5x).
    psi = 7.5e9
    assert comm_elements_per_step(psi, "ddp").elements_per_rank == 2 * psi
    assert comm_elements_per_step(psi, "zero1").elements_per_rank == 2 * psi
    assert comm_elements_per_step(psi, "zero2").elements_per_rank == 2 * psi
    assert comm_elements_per_step(psi, "zero3").elements_per_rank == 3 * psi


def test_exact_ring_factors():
    psi, n = 1_000_000, 4
    assert comm_elements_per_step(psi, "ddp", world_size=n).elements_per_rank == pytest.approx(2 * (n - 1) / n * psi)
    z3 = comm_elements_per_step(psi, "zero3", world_size=n)
    assert z3.elements_per_rank == pytest.approx(3 * (n - 1) / n * psi)
    assert z3.bytes_per_rank(2) == pytest.approx(2 * z3.elements_per_rank)
    assert z3.unit == "elements sent per rank per step"
    assert comm_elements_per_step(psi, "ddp", world_size=1).elements_per_rank == 0


def test_ring_collectives():
    # Patarasuk & Yuan 2009; NCCL tests' bus bandwidth: all-reduce 2(n-1)/n S, the others (n-1)/n S.
    assert ring_bytes_per_rank("all-reduce", 800, 8) == 1400
    assert ring_bytes_per_rank("reduce-scatter", 800, 8) == 700
    assert ring_bytes_per_rank("all-gather", 800, 8) == 700
    assert ring_bytes_per_rank("all-reduce", 800, 1) == 0
    assert ring_steps("all-reduce", 8) == 14 and ring_steps("all-gather", 8) == 7


@settings(max_examples=100, deadline=None)
@given(size=st.floats(0, 1e12), n=st.integers(1, 4096))
def test_ring_volume_grows_with_ranks_and_stays_below_two_buffers(size, n):
    ar = ring_bytes_per_rank("all-reduce", size, n)
    assert ar <= ring_bytes_per_rank("all-reduce", size, n + 1) <= 2 * size
    halves = ring_bytes_per_rank("reduce-scatter", size, n) + ring_bytes_per_rank("all-gather", size, n)
    assert ar == pytest.approx(halves)


def test_tensor_parallel_traffic_per_layer():
    # Shoeybi et al. 2019 Sec. 3 / Korthikanti et al. 2022 Sec. 4.2.2: 4 all-reduces of s*b*h per
    # layer (2 forward, 2 backward); sequence parallelism: 4 all-gathers + 4 reduce-scatters, same
    # volume; full recomputation repeats the forward's 2.
    s, b, h, t, e = 2048, 1, 12288, 8, 2
    msg = s * b * h * e
    plain = tp_comm_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, tp=t)
    assert plain.collectives == {"all-reduce": 4} and plain.message_bytes == msg
    assert plain.bytes_per_rank == pytest.approx(4 * 2 * (t - 1) / t * msg)
    sp = tp_comm_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, tp=t, sequence_parallel=True)
    assert sp.collectives == {"all-gather": 4, "reduce-scatter": 4}
    assert sp.bytes_per_rank == pytest.approx(plain.bytes_per_rank)
    full = tp_comm_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, tp=t, recompute="full")
    assert full.bytes_per_rank == pytest.approx(1.5 * plain.bytes_per_rank)
    selective = tp_comm_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, tp=t, recompute="selective")
    assert selective.bytes_per_rank == plain.bytes_per_rank
    assert tp_comm_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, tp=1).bytes_per_rank == 0


def test_fit_recovers_latency_and_bandwidth():
    alpha, bw = 25e-6, 5e9
    sizes = [2**k for k in range(10, 27, 2)]
    exact = fit_alpha_beta(sizes, [alpha + x / bw for x in sizes])
    assert exact.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert exact.bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert exact.r_squared == pytest.approx(1.0)
    rng = random.Random(0)
    noisy = fit_alpha_beta(sizes, [(alpha + x / bw) * rng.uniform(0.97, 1.03) for x in sizes])
    assert noisy.bandwidth_bytes_per_s == pytest.approx(bw, rel=0.05)
    assert noisy.predict(2**20) == pytest.approx(alpha + 2**20 / bw, rel=0.05)


def test_fit_against_ring_bytes_gives_bus_bandwidth():
    # Timing an all-reduce on n ranks: t = alpha + 2(n-1)/n S / busbw.
    n, alpha, busbw = 4, 40e-6, 2e9
    sizes = [2**k for k in range(12, 26)]
    seconds = [alpha + ring_bytes_per_rank("all-reduce", x, n) / busbw for x in sizes]
    fit = fit_alpha_beta(sizes, seconds, collective="all-reduce", n_ranks=n)
    assert fit.bandwidth_bytes_per_s == pytest.approx(busbw, rel=1e-6)
    assert fit.predict(2**22) == pytest.approx(seconds[10], rel=1e-9)
    per_step = fit.alpha_s / ring_steps("all-reduce", n)
    modelled = collective_time("all-reduce", 2**22, n, alpha_s=per_step, bandwidth_bytes_per_s=busbw)
    assert modelled == pytest.approx(seconds[10])


def test_relative_weighting_keeps_the_latency_that_an_absolute_fit_loses():
    # Lab 00's situation: 1 KiB .. 64 MiB, a few % noise, latency 0.6 ms, 0.4 GB/s. The largest
    # message's noise (~ms) dwarfs the latency, so ordinary least squares finds alpha = 0 and
    # mispredicts small messages by 100x; fitting relative errors keeps both terms.
    alpha, bw = 6e-4, 4e8
    sizes = [2**k for k in range(10, 27, 2)]
    rng = random.Random(1)
    seconds = [(alpha + x / bw) * rng.uniform(0.9, 1.1) for x in sizes]
    rel = fit_alpha_beta(sizes, seconds)
    assert rel.alpha_s == pytest.approx(alpha, rel=0.15)
    assert rel.bandwidth_bytes_per_s == pytest.approx(bw, rel=0.15)
    assert rel.predict(1024) == pytest.approx(alpha + 1024 / bw, rel=0.15)
    absolute = fit_alpha_beta(sizes, seconds, weighting="absolute")
    assert abs(absolute.predict(1024) / (alpha + 1024 / bw) - 1) > 0.15
    with pytest.raises(ValueError, match="weighting"):
        fit_alpha_beta(sizes, seconds, weighting="log")
    with pytest.raises(ValueError, match=r"seconds\[0\]"):
        fit_alpha_beta([1, 2], [0.0, 1.0])


def test_fit_never_returns_negative_latency_or_bandwidth():
    # Timer noise can make the unconstrained intercept negative; the fit clamps to the bound.
    sizes, seconds = [1e3, 1e6, 1e7], [1e-6, 0.5e-3, 1.05e-2]
    mx, my = sum(sizes) / 3, sum(seconds) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sum((x - mx) ** 2 for x in sizes)
    assert my - slope * mx < 0  # ordinary least squares would report a negative latency here
    fit = fit_alpha_beta(sizes, seconds, weighting="absolute")
    assert fit.alpha_s == 0 and fit.seconds_per_byte > 0
    through_origin = sum(x * y for x, y in zip(sizes, seconds)) / sum(x * x for x in sizes)
    assert fit.seconds_per_byte == pytest.approx(through_origin)
    flat = fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3], weighting="absolute")  # time falls with size
    assert flat.seconds_per_byte == 0 and flat.alpha_s == pytest.approx(1.5e-3)
    assert flat.bandwidth_bytes_per_s == float("inf")


@pytest.mark.parametrize("call, exc, words", [
    (lambda: fit_alpha_beta([1, 2], [1.0]), ValueError, ["same length"]),
    (lambda: fit_alpha_beta([8, 8, 8], [1.0, 1.1, 0.9]), ValueError, ["two distinct sizes"]),
    (lambda: fit_alpha_beta([1, 2], [1.0, -1.0]), ValueError, ["seconds[1]", "> 0"]),
    (lambda: fit_alpha_beta([1, 2], [1.0, 2.0], collective="all-reduce"), TypeError, ["n_ranks"]),
    (lambda: fit_alpha_beta([1, 2], [1.0, 2.0], collective="alltoall", n_ranks=2), ValueError, ["collective"]),
    (lambda: ring_bytes_per_rank("broadcast", 1, 2), ValueError, ["collective", "'all-gather'"]),
    (lambda: ring_bytes_per_rank("all-reduce", -1, 2), ValueError, ["size_bytes", ">= 0"]),
    (lambda: ring_bytes_per_rank("all-reduce", 1, 0), ValueError, ["n_ranks", ">= 1"]),
    (lambda: comm_elements_per_step(1e9, "fsdp"), ValueError, ["strategy", "'zero3'"]),
    (lambda: comm_elements_per_step(-1, "ddp"), ValueError, ["num_params"]),
    (lambda: comm_elements_per_step(1e9, "ddp", world_size=0), ValueError, ["world_size", ">= 1"]),
    (lambda: tp_comm_bytes_per_layer(seq_len=1, micro_batch=1, d_model=8, tp=0), ValueError, ["tp", ">= 1"]),
    (lambda: collective_time("all-reduce", 1, 2, alpha_s=0, bandwidth_bytes_per_s=0), ValueError,
     ["bandwidth_bytes_per_s", "> 0"]),
])
def test_invalid_arguments_name_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value)


def test_context_parallel_ring_traffic_and_score_block():
    """Ring attention: values the 2- and 4-rank measurements in tests/test_context_parallel.py
    reproduce to the byte (B=2, H=3, C=4, D=8, fp32), and a realistic layer."""
    from course_lib.estimate.comm import cp_comm_bytes_per_layer

    two = cp_comm_bytes_per_layer(seq_len=8, micro_batch=2, n_kv_heads=3, head_dim=8, cp=2, bytes_per_element=4)
    assert (two.forward_bytes, two.backward_bytes) == (1536, 3072)
    four = cp_comm_bytes_per_layer(seq_len=16, micro_batch=2, n_kv_heads=3, head_dim=8, cp=4, bytes_per_element=4)
    assert (four.forward_bytes, four.backward_bytes, four.bytes_per_rank) == (4608, 9216, 13824)
    # bf16 inputs, fp32 gradient accumulators on the wire: backward (N-1)(K+V)(1 + 4/2)
    bf16 = cp_comm_bytes_per_layer(seq_len=16, micro_batch=2, n_kv_heads=3, head_dim=8, cp=4)
    assert bf16.backward_bytes == 3 * (2 * 3 * 4 * 16) * (2 + 4)
    big = cp_comm_bytes_per_layer(seq_len=2048, micro_batch=1, n_kv_heads=8, head_dim=64, cp=4,
                                  bytes_per_element=4, n_heads=8)
    assert big.forward_bytes == 3 * 8 * 512 * 128 * 4 == 6_291_456
    assert big.peak_score_elements == 8 * 512 * 512  # (cp)^2 = 16x below the full 8 x 2048^2
    zig = cp_comm_bytes_per_layer(seq_len=2048, micro_batch=1, n_kv_heads=8, head_dim=64, cp=4,
                                  layout="zigzag")
    assert zig.peak_score_elements == 8 * 256 * 256
    assert cp_comm_bytes_per_layer(seq_len=64, micro_batch=1, n_kv_heads=2, head_dim=4, cp=1).bytes_per_rank == 0
    with pytest.raises(ValueError, match="seq_len"):
        cp_comm_bytes_per_layer(seq_len=10, micro_batch=1, n_kv_heads=2, head_dim=4, cp=4)
    with pytest.raises(ValueError, match="2 x cp"):
        cp_comm_bytes_per_layer(seq_len=12, micro_batch=1, n_kv_heads=2, head_dim=4, cp=4, layout="zigzag")
    with pytest.raises(ValueError, match="cp"):
        cp_comm_bytes_per_layer(seq_len=8, micro_batch=1, n_kv_heads=2, head_dim=4, cp=0)
