"""The MoE estimator (course_lib/estimate/moe.py) and the FP8 bytes (memory.py, comm.py): published
parameter counts, the all-to-all byte formula against an enumeration of the all-to-all's own splits,
EP x expert-DP memory conserving the model, the routing spike, FP8 weights and all-gathers.
Pure Python, well under a second."""
from __future__ import annotations

import math
import random

import pytest

from course_lib.estimate import (MOE_PRESETS, alltoall_bytes_per_layer, alltoall_bytes_per_token,
                                 comm_elements_per_step, expected_tokens_off_rank, expert_data_parallel,
                                 model_state_bytes, moe_flops_per_token, moe_model_state_bytes, moe_preset,
                                 routing_spike, zero_comm_bytes_per_step)


def printed(value: float, published: float, step: float) -> bool:
    """``value`` is ``published`` at its printed precision ``step``: publishers round (Mistral:
    12.88B -> "12.9B") or truncate (Qwen: 3.35B -> "3.3B"; DeepSeek: 37.55B -> "37B")."""
    return round(value / step) * step == pytest.approx(published) or \
        math.floor(value / step) * step == pytest.approx(published)


# name: (total, active, printed step) as published (sources in moe.MOE_PRESETS' comment)
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9, 0.1e9),
    "mixtral-8x22b": (141e9, 39e9, 1e9),
    "deepseek-v3": (671e9, 37e9, 1e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 0.1e9),
    "qwen3-235b-a22b": (235e9, 22e9, 1e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters_are_the_published_ones(name):
    shape = MOE_PRESETS[name]
    total, active, step = PUBLISHED[name]
    assert printed(shape.num_params(), total, step), (name, shape.num_params())
    assert printed(shape.active_params(), active, step), (name, shape.active_params())
    assert not printed(shape.num_params() * 1.02, total, step) or step >= 1e9  # the check can fail


def test_exact_counts_of_the_released_checkpoints():
    # Hugging Face's safetensors index of mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 parameters
    assert MOE_PRESETS["mixtral-8x7b"].num_params() == 46_702_792_704
    ds = MOE_PRESETS["deepseek-v3"]
    # DeepSeek-V3's HF checkpoint: 671B main + "14B" MTP = 684.5B weights (the page's 685B also counts
    # the FP8 block scales, one fp32 per 128 x 128 block: + 671e9 / 16384 = 0.04B)
    assert (ds.num_params() + ds.mtp_params()) / 1e9 == pytest.approx(684.49, abs=0.01)
    assert 13e9 < ds.mtp_params() < 14e9
    # 3 dense blocks first; MLA attention 187M parameters per block
    assert [ds.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert ds.attention_params() == 187_107_328


def test_flops_per_token_count_active_parameters():
    ds = MOE_PRESETS["deepseek-v3"]
    attention = 6 * 61 * 128 * 4096 * (192 + 128)
    assert moe_flops_per_token(ds) == 6 * ds.active_params(input_embedding=False) + attention
    # 6 x active, not 6 x total: the matmul term is 18x smaller for DeepSeek-V3
    assert 18 < ds.num_params() / ds.active_params(input_embedding=False) < 19
    # the dense equivalent does the same matmul work per token in an MoE block (same d_ff per token)
    mx = MOE_PRESETS["mixtral-8x7b"]
    dense = mx.active_equivalent()
    assert dense.mlp_params() == 2 * mx.expert_params() and dense.attention_params() == mx.attention_params()
    assert dense.num_params() + mx.n_layers * mx.router_params() == mx.active_params()


def enumerate_alltoall(routes, ep, n_experts, d_model, e, g):
    """Bytes each rank sends, from the all-to-all's own split sizes: routes[r] = the expert of
    every (token, choice) on rank r. Dispatch: rank r sends to peer q the copies for q's experts;
    combine sends them back; backward the reverse of each; counts: each peer's local counts."""
    local = n_experts // ep
    sent = []
    for r, experts in enumerate(routes):
        splits = [0] * ep
        for x in experts:
            splits[x // local] += 1
        off = sum(n for q, n in enumerate(splits) if q != r)
        received = sum(1 for q, other in enumerate(routes) if q != r for x in other if x // local == r)
        counts = (ep - 1) * local * 8
        sent.append({"dispatch": off * d_model * e, "combine": received * d_model * e, "counts": counts,
                     "backward": (off + received) * d_model * g, "off": off, "received": received})
    return sent


def test_alltoall_bytes_equal_the_enumerated_splits():
    rng = random.Random(0)
    ep, n_experts, top_k, d, tokens = 4, 8, 2, 16, 50
    routes = [[x for _ in range(tokens) for x in rng.sample(range(n_experts), top_k)] for _ in range(ep)]
    sent = enumerate_alltoall(routes, ep, n_experts, d, 2, 4)
    # over the EP group, what is dispatched is what comes back (the default tokens_received)
    assert sent[0]["off"] != sent[0]["received"]
    assert sum(s["dispatch"] for s in sent) == sum(s["combine"] for s in sent)
    total = 0.0
    for s in sent:
        a = alltoall_bytes_per_layer(tokens_off_rank=s["off"], tokens_received=s["received"], d_model=d, ep=ep,
                                     n_experts=n_experts, bytes_per_element=2, grad_bytes_per_element=4)
        assert a.dispatch == s["dispatch"] and a.combine == s["combine"] and a.backward == s["backward"]
        assert a.counts == s["counts"] == 3 * 2 * 8
        assert a.forward == a.dispatch + a.combine + a.counts
        total += a.total
    assert total == sum(s["dispatch"] + s["combine"] + s["counts"] + s["backward"] for s in sent)
    # full recomputation repeats the forward's all-to-alls; ep = 1 sends nothing
    full = alltoall_bytes_per_layer(tokens_off_rank=10, d_model=d, ep=ep, n_experts=n_experts, recompute="full")
    assert full.forward == 2 * (2 * 10 * d * 2 + 48) and full.backward == 2 * 10 * d * 2
    assert alltoall_bytes_per_layer(tokens_off_rank=0, d_model=d, ep=1, n_experts=n_experts).total == 0
    with pytest.raises(ValueError, match="ep .3. must divide n_experts .8."):
        alltoall_bytes_per_layer(tokens_off_rank=1, d_model=d, ep=3, n_experts=8)


def test_expected_tokens_off_rank_is_the_mean_of_uniform_routing():
    rng = random.Random(1)
    ep, n_experts, top_k, tokens = 8, 64, 8, 4000
    local = n_experts // ep
    off = sum(x // local != 0 for _ in range(tokens) for x in rng.sample(range(n_experts), top_k))
    assert off == pytest.approx(expected_tokens_off_rank(tokens, top_k, ep), rel=0.02)
    mx = MOE_PRESETS["mixtral-8x7b"]
    assert alltoall_bytes_per_token(mx, ep=8) == 4 * 2 * 7 / 8 * 4096 * 2  # 57,344 bytes per token per block


def test_ep_and_expert_dp_memory_conserves_the_model():
    shape = moe_preset("mixtral-8x7b", n_layers=4)
    dp, ep, pp = 8, 4, 2
    edp = expert_data_parallel(dp=dp, ep=ep, etp=1)
    assert edp == 2
    params = 0.0
    for stage in range(pp):
        s = moe_model_state_bytes(shape, recipe="mixed-adam", zero_stage=3, dp=dp, pp=pp, ep=ep, etp=1, stage=stage)
        assert s.edp == edp
        params += s.dense.params * dp + s.experts.params * ep * edp  # every rank of the stage
    assert params == pytest.approx(shape.num_params() * 2)  # bf16 weights, each held once
    # ZeRO-1 over the expert-DP group: experts' optimizer state / edp, their weights whole on the rank
    z1 = moe_model_state_bytes(shape, zero_stage=1, dp=dp, ep=ep, etp=1)
    assert z1.experts.params == 2 * 4 * 2 * shape.expert_params()   # 4 layers x 2 local experts
    assert z1.experts.optimizer == 12 * 4 * 2 * shape.expert_params() / edp
    with pytest.raises(ValueError, match="must divide tp x cp x dp"):
        expert_data_parallel(dp=6, ep=4)


def test_routing_spike_busiest_rank_vs_mean():
    shape = moe_preset("mixtral-8x7b")
    # 8 experts on 4 ranks, 1000 tokens per rank, top-2: 8000 copies, mean 1000 per expert
    s = routing_spike(shape, tokens=1000, ep=4, max_over_mean=3.0)
    assert s.mean_tokens == 2000 and s.busiest_tokens == 3000 + 5000 / 7
    assert s.busiest_bytes / s.mean_bytes == pytest.approx(s.ratio)
    assert s.mean_bytes == 2000 * (4096 + 4 * 14336) * 2
    capped = routing_spike(shape, tokens=1000, ep=4, max_over_mean=3.0, capacity_factor=1.25)
    assert capped.busiest_tokens == 1250 + 5000 / 7 and capped.dropped_tokens == 3000 - 1250
    loads = [4000, 0, 1000, 1000, 500, 500, 500, 500]
    assert routing_spike(shape, tokens=1000, ep=4, expert_loads=loads).busiest_tokens == 4000


def test_fp8_weights_and_all_gathers():
    n, dp = 7e9, 8
    bf16 = zero_comm_bytes_per_step(n, "zero3", world_size=dp)
    fp8 = zero_comm_bytes_per_step(n, "zero3", world_size=dp, gather_bytes_per_element=1, fp8_tensors=224)
    assert bf16.total == comm_elements_per_step(n, "zero3", world_size=dp).bytes_per_rank(2)
    assert fp8.gather == bf16.gather / 2 and fp8.reduce == bf16.reduce
    assert fp8.scales == 2 * 2 * 7 / 8 * 4 * 224
    assert zero_comm_bytes_per_step(n, "ddp", world_size=dp).total == comm_elements_per_step(
        n, "ddp", world_size=dp).bytes_per_rank(2)
    fp8_state = model_state_bytes(n, recipe="fp8-params-adam", zero_stage=3, dp=dp)
    assert fp8_state.params == n / dp and fp8_state.total == model_state_bytes(n, zero_stage=3, dp=dp).total * 15 / 16
