"""Measured vs estimated, to the byte: model-state memory per rank and bytes on the wire per step
for DDP (torch, NaiveDDP, BucketedDDP), ZeRO-1/2 (ShardedOptimizer) and ZeRO-3 (SimpleFSDP, FSDP2),
on 2 and 4 gloo ranks, against course_lib.estimate (model_state_bytes, comm_elements_per_step).

Model: 4 bias-free Linear(32, 32) (Psi = 4096, shards even for N = 2 and 4), one AdamW step.
One launch per world size (tests/dp_measured_rank_fns.all_checks) runs every measurement."""
import functools

import pytest

import dp_measured_rank_fns as fns
from course_lib.estimate.comm import comm_elements_per_step, ring_bytes_per_rank
from course_lib.estimate.memory import model_state_bytes
from course_lib.parallel import run_ranks
from course_lib.labs.lab09_zero_fsdp_deepspeed import COMM_STRATEGY, STRATEGIES, ZERO_STAGE

PSI, LAYERS = 4096, 4
WORLDS = [2, 4]
EXACT = [s for s in STRATEGIES if s != "zero1"]  # zero1: its own test below


@functools.lru_cache(maxsize=None)
def results(world_size):
    return run_ranks(fns.all_checks, world_size, threads_per_rank=1, timeout=240)


def _fraction(n):
    return (n - 1) / n


@pytest.mark.parametrize("world_size", WORLDS)
def test_counter_sees_a_known_all_reduce(world_size):
    """1000 fp32 all-reduced: 2(N-1)/N x 4000 B; a 4N-float all-gather: (N-1)/N x 16N B; a
    10-float64 broadcast: (N-1)/N x 80 B. Nested counters, patch removal (also on error)."""
    n = world_size
    for s in (r["sanity"] for r in results(n)):
        assert s["reduced"] == n, "the wrapped all_reduce must still reduce"
        kinds = s["by_kind"]
        assert kinds["all-reduce"]["count"] == 1 and kinds["all-reduce"]["payload_bytes"] == 4 * fns.KNOWN
        assert kinds["all-gather"]["count"] == 1, "all_gather_into_tensor -> all_gather_single counted twice"
        assert kinds["all-gather"]["payload_bytes"] == 16 * n
        assert kinds["broadcast"]["payload_bytes"] == 80
        expected = (ring_bytes_per_rank("all-reduce", 4000, n) + ring_bytes_per_rank("all-gather", 16 * n, n)
                    + _fraction(n) * 80)
        assert s["bytes"] == pytest.approx(expected, rel=1e-15, abs=0)
        assert s["fp32_only"] == pytest.approx(expected - _fraction(n) * 80, rel=1e-15, abs=0)
        assert s["elements"] == pytest.approx(2 * _fraction(n) * 1000 + _fraction(n) * (4 * n + 10), rel=1e-15)
        assert s["outer_calls"] == 4, "the outer counter should see the inner calls and its own"
        assert s["restored"] and s["restored_after_error"], "patches left behind"
        assert s["ddp_without_hook_calls"] == 0, "torch DDP's reducer is invisible without the hook"


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("strategy", EXACT)
def test_memory_per_rank_equals_estimate(strategy, world_size):
    est = model_state_bytes(PSI, recipe="fp32-adam", zero_stage=ZERO_STAGE[strategy], dp=world_size)
    for rank, r in enumerate(results(world_size)):
        row = r["main"][strategy]
        assert row["num_params"] == PSI
        m = row["memory_measured"]
        assert (m["params"], m["grads"], m["optimizer"], m["total"]) == \
            (est.params, est.grads, est.optimizer, est.total), f"{strategy} rank {rank}: {m}"
        # AdamW's step counter: one 0-d fp32 tensor per parameter tensor this rank steps
        census = row["census"]
        assert row["optimizer_step_bytes"] == 4 * census["step_tensors"] > 0


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("strategy", EXACT)
def test_wire_bytes_equal_estimate(strategy, world_size):
    """Measured ring bytes per rank = comm_elements_per_step x 4 + the engine's documented flags."""
    n = world_size
    est = comm_elements_per_step(PSI, COMM_STRATEGY[strategy], world_size=n).elements_per_rank * 4
    flags = ring_bytes_per_rank("all-reduce", 4 * LAYERS, n)  # one 4-byte flag per parameter tensor
    overhead = {"ddp": 0, "fsdp2": 0, "zero3-scratch": 0}.get(strategy, flags)
    rows = [r["main"][strategy] for r in results(n)]
    for row in rows:
        assert row["wire_estimated_bytes"] == est
        assert row["wire_overhead_bytes"] == overhead
        assert row["wire_measured_bytes"] == est + overhead, f"{strategy}: {row['wire_by_kind']}"
    assert len({row["wire_measured_bytes"] for row in rows}) == 1, "every rank is charged the same"
    kinds = rows[0]["wire_by_kind"]
    if COMM_STRATEGY[strategy] == "zero3":  # each layer gathered in forward and backward, grads scattered
        assert kinds["all-gather"]["count"] == 2 * LAYERS and kinds["reduce-scatter"]["count"] == LAYERS
        assert kinds["all-gather"]["payload_bytes"] == 2 * 4 * PSI
    elif strategy == "zero2":  # reduce-scatter of the grads, one broadcast per owner (+ flags)
        assert kinds["reduce-scatter"]["payload_bytes"] == 4 * PSI
        assert kinds["broadcast"]["count"] == n and kinds["broadcast"]["payload_bytes"] == 4 * PSI
    else:
        assert set(kinds) == {"all-reduce"}


@pytest.mark.parametrize("world_size", WORLDS)
def test_zero1_reduce_gradients_keeps_full_grads(world_size):
    """ZeRO-1 via ShardedOptimizer.reduce_gradients(free_unowned=False): full gradient buffers
    stay (4 Psi), optimizer state 8 Psi / N, wire 2 Psi (N-1)/N x 4 + the flags."""
    res = results(world_size)
    assert res[0]["zero1_available"], "ShardedOptimizer.reduce_gradients(free_unowned=...) is missing"
    n = world_size
    est = model_state_bytes(PSI, recipe="fp32-adam", zero_stage=1, dp=n)
    wire = comm_elements_per_step(PSI, "zero1", world_size=n).elements_per_rank * 4
    for r in res:
        row = r["main"]["zero1"]
        m = row["memory_measured"]
        assert (m["params"], m["grads"], m["optimizer"]) == (est.params, est.grads, est.optimizer)
        assert row["wire_measured_bytes"] == wire + ring_bytes_per_rank("all-reduce", 4 * LAYERS, n)


def _extra(world_size, strategy, spec):
    return [next(x for x in r["extra"] if x["strategy"] == strategy and
                 all(x["spec"][k] == v for k, v in spec.items())) for r in results(world_size)]


@pytest.mark.parametrize("world_size", WORLDS)
def test_simple_fsdp_padding_explained(world_size):
    """Linear(31, 31): 961 elements per weight, not a multiple of N. SimpleFSDP pads each flat
    weight to ceil(961/N) x N, and the padding is held (params, grads, moments) and sent
    (all-gather outputs and reduce-scatter inputs are the padded length): the estimator, which
    divides exactly, is short by exactly the padding."""
    n, numel = world_size, 31 * 31
    psi = LAYERS * numel
    per = -(-numel // n)
    padded = LAYERS * per * n
    assert padded > psi
    est = model_state_bytes(psi, recipe="fp32-adam", zero_stage=3, dp=n)
    for row in _extra(n, "zero3-scratch", fns.PADDED):
        m = row["memory_measured"]
        assert row["num_params"] == psi
        assert m["params"] == m["grads"] == 4 * LAYERS * per == est.params + 4 * (padded - psi) / n
        assert m["optimizer"] == 8 * LAYERS * per
        assert row["wire_measured_bytes"] == pytest.approx(3 * _fraction(n) * 4 * padded, rel=1e-15, abs=0)
        assert row["wire_measured_bytes"] - row["wire_estimated_bytes"] == \
            pytest.approx(3 * _fraction(n) * 4 * (padded - psi), rel=1e-12)


@pytest.mark.parametrize("world_size", WORLDS)
def test_replicated_layernorm_adds_an_all_reduce(world_size):
    """A LayerNorm (64 params) stays replicated in SimpleFSDP: its grads are all-reduced (2 passes
    instead of ZeRO-3's 3) after a flags all-reduce, and it is held whole on every rank. FSDP2
    shards it like any other module: exact."""
    n = world_size
    psi = PSI + 64
    est = model_state_bytes(psi, recipe="fp32-adam", zero_stage=3, dp=n)
    for row in _extra(n, "zero3-scratch", fns.WITH_NORM):
        kinds = row["wire_by_kind"]
        assert kinds["all-reduce"]["count"] == 3  # flags, norm weight, norm bias
        assert kinds["all-reduce"]["payload_bytes"] == 2 * 4 + 64 * 4
        sharded = 3 * _fraction(n) * 4 * PSI
        assert row["wire_measured_bytes"] == pytest.approx(
            sharded + ring_bytes_per_rank("all-reduce", 4 * 64 + 8, n), rel=1e-15, abs=0)
        assert row["wire_measured_bytes"] == pytest.approx(row["wire_estimated_bytes"] + row["wire_overhead_bytes"],
                                                           rel=1e-15)
        assert row["memory_measured"]["params"] == 4 * (PSI / n + 64)
    for row in _extra(n, "fsdp2", fns.WITH_NORM):
        assert row["memory_equal"], row["memory_measured"]
        m = row["memory_measured"]
        assert (m["params"], m["grads"], m["optimizer"]) == (est.params, est.grads, est.optimizer)
        assert row["wire_measured_bytes"] == pytest.approx(row["wire_estimated_bytes"], rel=1e-15, abs=0)


@pytest.mark.parametrize("world_size", WORLDS)
def test_fsdp2_pads_rows_not_elements(world_size):
    """FSDP2 shards dim 0: 31 rows become ceil(31/N) rows per rank, so it pads up to (N-1) x 31
    elements per weight where SimpleFSDP's flat shard pads at most N-1."""
    n = world_size
    rows = -(-31 // n)
    for row in _extra(n, "fsdp2", fns.PADDED):
        m = row["memory_measured"]
        assert m["params"] == m["grads"] == 4 * LAYERS * rows * 31
        assert row["wire_measured_bytes"] == pytest.approx(3 * _fraction(n) * 4 * LAYERS * rows * 31 * n,
                                                           rel=1e-15, abs=0)


@pytest.mark.parametrize("world_size", WORLDS)
def test_first_layer_not_regathered_without_input_grad(world_size):
    """When the input does not require grad, the first Linear's backward needs only its input
    (grad_W = g^T x), so autograd saves no weight and SimpleFSDP does not re-gather it: one
    all-gather of Psi/4 less than ZeRO-3's 3 Psi (N-1)/N. FSDP2 unshards the whole group before
    its backward anyway, so it still matches the estimate."""
    n = world_size
    for row in _extra(n, "zero3-scratch", fns.NO_INPUT_GRAD):
        assert row["wire_by_kind"]["all-gather"]["count"] == 2 * LAYERS - 1
        assert row["wire_measured_bytes"] == pytest.approx(
            row["wire_estimated_bytes"] - _fraction(n) * 4 * PSI / LAYERS, rel=1e-15, abs=0)
    for row in _extra(n, "fsdp2", fns.NO_INPUT_GRAD):
        assert row["wire_measured_bytes"] == row["wire_estimated_bytes"]
