"""Expert parallelism (course_lib/parallel/expert_parallel) equal to one process, on 4 gloo ranks.

One launch (tests/ep_rank_fns.py) checks EP 4 and EP 2 (x expert-DP 2): an MoE layer with uneven
routing (one expert preferred, two never chosen: empty on every rank), with and without dropped
tokens, with shared experts and sigmoid scores: outputs and every gradient equal the one-process
layer on each rank's tokens; the bytes each rank handed to all_to_all_single equal the formula
(course_lib/parallel/expert_parallel/wire.py) to the byte, and the kit's wire counter saw the same
payload; and three AdamW steps of a TinyGPT with experts (capacity 1.0, aux loss, bias balancing)
give the one-process losses and weights. fp32: the same arithmetic in another order (rows summed
per expert on another rank), so rounding only."""
from __future__ import annotations

import pytest
import torch

import ep_rank_fns as fns
from course_lib.parallel import run_ranks

ATOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from layout_checks import tiny_cfg

    cfg = tiny_cfg(1, train__strategy="fsdp", train__max_steps=2, schedule__warmup_steps=1, model__preset="moe-tiny",
                   model__moe_bias_update_rate=0.01, model__moe_capacity_factor=1.25)
    return run_ranks(fns.ep_everything, fns.WORLD, cfg, tmp_path_factory.mktemp("moe_fsdp"), timeout=600)


def test_the_trainer_runs_experts_under_fsdp_with_one_bias_on_every_rank(ranks):
    runs = [r["trainer"] for r in ranks]
    assert all(r["steps"] == 2 for r in runs)
    for layer in range(len(runs[0]["bias"])):
        assert all(torch.equal(r["bias"][layer], runs[0]["bias"][layer]) for r in runs)  # loads summed over ranks
    assert sum(b.abs().sum() for b in runs[0]["bias"]) > 0


@pytest.mark.parametrize("size", [4, 2])
@pytest.mark.parametrize("case", list(fns.LAYER_CASES))
def test_layer_forward_and_gradients_equal_one_process(ranks, size, case):
    ref = fns.layer_reference(case)
    dropped = 0
    for rank, got in enumerate(ranks):
        res = got[(size, case)]
        assert torch.allclose(res["out"], ref["out"][rank], atol=ATOL), (rank, (res["out"] - ref["out"][rank]).abs().max())
        assert torch.allclose(res["dx"], ref["dx"][rank], atol=ATOL), rank  # the gradient back to the tokens
        dropped += res["dropped"].item()
        for name, g in res["grads"].items():
            want = ref[name][res["local"][0]:res["local"][-1] + 1] if name.startswith("experts.") else ref[name]
            assert torch.allclose(g, want, atol=ATOL), (rank, name, (g - want).abs().max())
        assert res["counts_sent"][5] == res["counts_sent"][6] == 0  # empty experts
    if case == "dropped":
        assert dropped > 0
    sent = [sum(r[(size, case)]["send"]) for r in ranks]
    assert max(sent) > 0 and len({tuple(r[(size, case)]["send"]) for r in ranks}) > 1  # uneven traffic


@pytest.mark.parametrize("size", [4, 2])
def test_bytes_on_the_wire_equal_the_formula_to_the_byte(ranks, size):
    for rank, got in enumerate(ranks):
        for case in fns.LAYER_CASES:
            res = got[(size, case)]
            assert res["measured"] == res["expected"], (rank, case, res["measured"], res["expected"])
            # the kit's own counter saw every exchange, with the whole input (own rows included)
            row = 16 * 4
            s, r = sum(res["send"]), sum(res["recv"])
            assert res["wire_count"] == 5  # counts, dispatch, combine, and the two backward
            assert res["wire_payload"] == 8 * 8 + 2 * (s + r) * row
    # what one rank sends to another is what that rank receives from it
    for case in fns.LAYER_CASES:
        for a in range(4):
            for b in range(4):
                if a // size == b // size:
                    assert ranks[a][(size, case)]["send"][b % size] == ranks[b][(size, case)]["recv"][a % size]


@pytest.mark.parametrize("size", [4, 2])
def test_training_steps_equal_one_process(ranks, size):
    ref = fns.train_reference()
    for rank, got in enumerate(ranks):
        res = got[(size, "train")]
        assert res["losses"] == pytest.approx(ref["losses"], abs=1e-5), (res["losses"], ref["losses"])
        for k, v in ref["state"].items():
            assert torch.allclose(res["state"][k], v, atol=1e-5), (rank, k, (res["state"][k] - v).abs().max())
    torch.manual_seed(0)
    start = fns.TinyGPT(fns.model_cfg()).state_dict()
    assert not torch.equal(start["blocks.0.mlp.experts.gate"], ref["state"]["blocks.0.mlp.experts.gate"])
    assert ref["state"]["blocks.0.mlp.router.expert_bias"].abs().sum() > 0  # the bias moved too
