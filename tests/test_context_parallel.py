"""Ring attention (context parallelism from scratch) against one-process attention, on 2 and 4
gloo ranks, plus its traffic and score-block size against the closed forms of
``course_lib.parallel.context_parallel.cost``.

Tolerance: fp32 ``rtol=1e-5, atol=1e-6`` (the online softmax adds the same terms in another order
than one softmax over the whole row). bf16 inputs: a loose band only; that case is there for its
traffic (fp32 gradient accumulators on the wire)."""

import math

import pytest
import torch
import torch.nn.functional as F

import cp_rank_fns as fns
from course_lib.parallel import run_ranks
from course_lib.parallel.context_parallel import (causal_score_elements, chunk_segments, merge_sequence,
                                                  peak_score_elements, ring_attention,
                                                  ring_attention_bytes_per_rank, split_sequence)

pytestmark = pytest.mark.usefixtures("one_thread")
RTOL, ATOL = 1e-5, 1e-6
FP32_CASES = [n for n, c in fns.CASES.items() if c[7] == torch.float32]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    """Every case on `world` ranks, in one launch: (world, per-rank results)."""
    return request.param, run_ranks(fns.everything, request.param, timeout=240, show_output=False)


def merged(results, name, key):
    return merge_sequence([r[name][key] for r in results], layout=fns.CASES[name][6])


def close(a, b, rtol=RTOL, atol=ATOL):
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", FP32_CASES)
def test_output_and_gradients_equal_full_attention(ranks, name):
    world, results = ranks
    ref = fns.reference(name, world)
    for key in ("out", "dq", "dk", "dv"):
        got = merged(results, name, key)
        diff = (got - ref[key]).abs().max().item()
        print(f"{world} ranks {name} {key}: max |diff| {diff:.2e}")
        assert close(got, ref[key]), (name, key, diff)


def test_bf16_inputs_stay_close(ranks):
    world, results = ranks
    ref = fns.reference("bf16_causal", world)
    for key in ("out", "dq", "dk", "dv"):
        got = merged(results, "bf16_causal", key)
        assert got.dtype == torch.bfloat16
        assert close(got, ref[key], rtol=0.05, atol=0.05), (key, (got.float() - ref[key]).abs().max())


@pytest.mark.parametrize("name", list(fns.CASES))
def test_bytes_sent_equal_the_formula_exactly(ranks, name):
    world, results = ranks
    b, h, c, d, dv, _, _, dtype = fns.CASES[name]
    want = ring_attention_bytes_per_rank(b, h, c, d, world, v_head_dim=dv,
                                         bytes_per_element=torch.empty(0, dtype=dtype).element_size())
    for r in range(world):
        res = results[r][name]
        # counted by course_lib.parallel.wire (isend charged its size, irecv 0) and by the function
        assert res["wire_forward"] == want["forward"] == res["stats"]["bytes_sent_forward"], (r, res["wire_forward"], want)
        assert res["wire_backward"] == want["backward"] == res["stats"]["bytes_sent_backward"], (r, want)
        # forward: K and V once per step for N-1 steps; backward: K, V, dK, dV N-1 times each
        assert res["wire_forward_kinds"]["send"]["count"] == 2 * (world - 1)
        assert res["wire_backward_kinds"]["send"]["count"] == 4 * (world - 1)
        assert set(res["wire_forward_kinds"]) == {"send", "recv"}  # nothing but the ring
    if name == "causal":
        print(f"{world} ranks, {name}: {want['forward']} B forward + {want['backward']} B backward per rank")


@pytest.mark.parametrize("name", list(fns.CASES))
def test_no_rank_builds_more_than_one_chunk_sized_score_block(ranks, name):
    world, results = ranks
    b, h, c, _, _, causal, layout, _ = fns.CASES[name]
    for r in range(world):
        fwd = results[r][name]["forward_stats"]
        assert fwd["peak_score_elements"] == peak_score_elements(b, h, c, layout=layout)
        assert fwd["peak_score_elements"] * world ** 2 <= b * h * (c * world) ** 2  # vs full [S x S]
        # the work: future blocks skipped, and the same again in the backward
        want = b * h * causal_score_elements(c, world, r, layout, causal)
        assert fwd["score_elements"] == want
        assert results[r][name]["stats"]["score_elements"] == 2 * want


def test_zigzag_balances_the_causal_work_that_contiguous_piles_on_the_last_rank(ranks):
    world, results = ranks
    c = 4
    contiguous = [causal_score_elements(c, world, r, "contiguous") for r in range(world)]
    zigzag = [causal_score_elements(c, world, r, "zigzag") for r in range(world)]
    assert contiguous == [(r + 1) * c * c for r in range(world)]  # rank r: r+1 blocks
    assert zigzag == [(2 * world + 1) * (c // 2) ** 2] * world  # every rank the same
    got = [results[r]["zigzag_causal"]["forward_stats"]["score_elements"] for r in range(world)]
    assert len(set(got)) == 1


def test_skipping_the_running_sum_rescale_is_caught(ranks):
    world, results = ranks
    got = merge_sequence([r["sabotaged"] for r in results])
    ref = fns.reference("causal", world)["out"]
    assert not close(got, ref), (got - ref).abs().max()


def test_the_gradient_comparison_can_fail(ranks):
    """The same tolerance tells the ring's gradients from non-causal ones and from attention
    within each chunk only (no ring at all), for q, k and v."""
    world, results = ranks
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(fns.full_inputs("causal", world)))
    F.scaled_dot_product_attention(q, k, v, is_causal=False).backward(dout)
    local = {"dq": [], "dk": [], "dv": []}
    for r in range(world):
        qr, kr, vr, dr = (split_sequence(t.detach(), world, r).requires_grad_(i < 3)
                          for i, t in enumerate((q, k, v, dout)))
        grads = torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr, is_causal=True), (qr, kr, vr), dr)
        for key, g in zip(("dq", "dk", "dv"), grads):
            local[key].append(g)
    for key, noncausal in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = merged(results, "causal", key)
        assert not close(got, noncausal), key
        assert not close(got, merge_sequence(local[key])), key


def test_a_subgroup_ring_uses_group_ranks(ranks):
    world, results = ranks
    if world != 4:
        pytest.skip("subgroups are tried in the 4-rank launch")
    ref = fns.reference("causal", 2)
    for ring in ([0, 2], [1, 3]):
        for key in ("out", "dq", "dk", "dv"):
            got = torch.cat([results[r]["subgroup"][key] for r in ring], dim=2)
            assert close(got, ref[key]), (ring, key)


def test_one_process_is_plain_attention_and_passes_gradcheck():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for causal in (True, False):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(ring_attention(q, k, v, causal=causal), want, rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(lambda a, b, c: ring_attention(a, b, c, causal=causal), (q, k, v))


def test_split_and_merge_round_trip_and_zigzag_positions():
    x = torch.arange(2 * 16).reshape(1, 2, 16, 1)
    for layout in ("contiguous", "zigzag"):
        parts = [split_sequence(x, 4, r, layout=layout) for r in range(4)]
        assert torch.equal(merge_sequence(parts, layout=layout), x)
    assert split_sequence(x, 4, 1, layout="zigzag")[0, 0, :, 0].tolist() == [2, 3, 12, 13]
    assert chunk_segments(4, 4, 1, "zigzag") == [(2, 2), (12, 2)]
    assert chunk_segments(4, 4, 1) == [(4, 4)]


def test_bad_input_is_refused_naming_the_argument():
    x = torch.zeros(1, 2, 10, 4)
    with pytest.raises(ValueError, match=r"x's sequence length.*10.*world_size = 3"):
        split_sequence(x, 3, 0)
    with pytest.raises(ValueError, match=r"x's sequence length.*2 x world_size = 4"):
        split_sequence(torch.zeros(1, 2, 6, 4), 2, 0, layout="zigzag")
    with pytest.raises(ValueError, match="rank"):
        split_sequence(x, 2, 2)
    with pytest.raises(ValueError, match="layout"):
        split_sequence(x, 2, 0, layout="striped")
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="k has"):
        ring_attention(q, torch.zeros(1, 2, 5, 8), q)
    with pytest.raises(ValueError, match="v has"):
        ring_attention(q, q, torch.zeros(2, 2, 4, 8))
    with pytest.raises(ValueError, match="k's head_dim"):
        ring_attention(q, torch.zeros(1, 2, 4, 6), q)
    with pytest.raises(ValueError, match="q must be 4-D"):
        ring_attention(torch.zeros(2, 4, 8), q, q)
    with pytest.raises(ValueError, match="v is torch.float64"):
        ring_attention(q, q, q.double())
    with pytest.raises(TypeError, match="causal"):
        ring_attention(q, q, q, causal=1)
    with pytest.raises(ValueError, match="seq_chunk"):
        ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], layout="zigzag")
    with pytest.raises(ValueError, match="scale"):
        ring_attention(q, q, q, scale=0.0)
    with pytest.raises(ValueError, match="world_size"):
        ring_attention_bytes_per_rank(1, 1, 4, 8, 0)
    with pytest.raises(ValueError, match="chunks\\[1\\]"):
        merge_sequence([q, q[:, :, :2]])


def test_formula_values():
    # 2 ranks, B=H=1, C=4, D=8, fp32: K = V = 128 B; forward 1 hop of K+V, backward 2x that
    assert ring_attention_bytes_per_rank(1, 1, 4, 8, 2) == {"forward": 256, "backward": 512, "total": 768}
    # bf16: forward halves, gradients still travel in fp32
    assert ring_attention_bytes_per_rank(1, 1, 4, 8, 2, bytes_per_element=2) == \
        {"forward": 128, "backward": 128 + 256, "total": 512}
    assert ring_attention_bytes_per_rank(2, 3, 4, 5, 4, v_head_dim=7)["forward"] == 3 * 2 * 3 * 4 * 12 * 4
    assert peak_score_elements(2, 3, 8) == 2 * 3 * 64
    assert peak_score_elements(2, 3, 8, layout="zigzag") == 2 * 3 * 16
    assert math.isclose(causal_score_elements(4, 2, 1, "contiguous", causal=False), 2 * 16)
