"""FSDP2 as the data-parallel dimension under DTensor tensor parallelism, in the trainer
(``train.strategy = "fsdp"`` with ``parallel.tp = 2`` on 4 gloo ranks: dp 2 x tp 2).

The tiny config (fp32) on the same global batch as one process: each dp replica reads half of
each step's sequences, its two TP ranks the same ones (the 30-step runs in one micro-batch, the
bf16 run in ACCUM). Checked: per-step losses and
gradient norms within 1e-4 relative of one process over 30 steps (bf16 with sequence parallelism
within the tolerance stated below; the fp32 sequence-parallel variant, whose DTensor plan
tests/test_dtensor_tp.py holds to the dense model in fp32, runs with ``-m slow``), the rank layout (tp innermost, as
course_lib.parallel.mesh numbers it), a bit-exact resume from a sharded (DCP) checkpoint 4 steps
before the end, the cross-layout chain fsdp x tp 2x2 -> plain fsdp on 4 ranks -> one process
(weights and AdamW state equal), model-state bytes per rank equal to
``course_lib.estimate.model_state_bytes``, one host read per step (counted step by step in the
fresh run), a skipped step and a roll-back in the resumed tail; the same match, resume and host-read
count for fsdp x cp 2x2.

Launches: one of 4 ranks runs everything in sequence (fresh runs with their host-read count,
resumes, fsdp 4 loads and trains on, the faults), one of 1 rank loads the sharded checkpoints into
``single`` (a sharded load needs a process group).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import fsdp_tp_rank_fns as fns
from course_lib.trainer import config as train_config
from course_lib.estimate.memory import model_state_bytes
from course_lib.parallel import run_ranks
from course_lib.train import train
from layout_checks import (assert_matches_one_process, max_rel, micro_batch, micro_batches_per_step, resume_save_every,
                           rows, tiny_cfg)

MB, ACCUM, STEPS, SHORT = 8, 2, 30, 5
# The 30-step family (the loss match, its resume, the cross-layout chain, the faults, fsdp x cp)
# takes the global batch (MB x ACCUM sequences) as LONG micro-batches; the bf16 run keeps ACCUM, so
# accumulation under fsdp x tp (FSDP2's gradient sync on the last micro-batch only) is still run.
LONG = micro_batches_per_step(STEPS, ACCUM)
EVERY = resume_save_every(STEPS)  # saves at 26 and at the end (30): the resume from 26 runs the last 4 steps
# The faults ride on a resume from step 26: the spike detector needs 16 steps of history (its
# window comes back from the checkpoint). Step 28 is skipped (inf), a save at 28, then a spike at
# step 30 rolled back to it.
FAULT_SAVE_EVERY, FAULTS = 14, ["inf_grad@27", "grad_scale@29=10"]
MORE = STEPS + 2  # plain FSDP2 trains on from the loaded step to here, then one process loads that
BF16_REL = 2e-3  # bf16: FSDP2 casts the weights (MixedPrecisionPolicy), one process autocasts; measured 2.4e-4 (8 steps)


def cfg(grad_accum=ACCUM, **sets):
    return tiny_cfg(grad_accum, **sets)


def mb(sequences, grad_accum):
    """The micro-batch of ``grad_accum`` micro-batches per step that holds the sequences of ACCUM
    micro-batches of ``sequences`` (layout_checks.micro_batch)."""
    return micro_batch(sequences, ACCUM, grad_accum)


def fsdp_tp(grad_accum=ACCUM, **sets):
    return cfg(grad_accum, train__strategy="fsdp", parallel__tp=2, train__micro_batch=mb(MB // 2, grad_accum), **sets)


def fsdp_cp(grad_accum=ACCUM, **sets):
    """fsdp x cp 2x2: each dp replica reads MB / 2 sequences per ACCUM micro-batches, its two cp
    ranks a zig-zag half of every sequence each (ring attention), FSDP2 shards over the 4 ranks
    (dp x cp)."""
    return cfg(grad_accum, train__strategy="fsdp", parallel__cp=2, train__micro_batch=mb(MB // 2, grad_accum), **sets)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_tp")
    single = {
        "main": train(cfg(LONG, train__max_steps=STEPS, train__micro_batch=mb(MB, LONG)), root / "single"),
        "bf16": train(cfg(train__max_steps=SHORT, train__micro_batch=MB, train__precision="bf16"),
                      root / "single-bf16"),
    }
    faulty = {"train__max_steps": STEPS, "checkpoint__save_every": FAULT_SAVE_EVERY,
              "stability__spike_policy": "rollback"}
    single["faulty"] = train(cfg(LONG, train__micro_batch=mb(MB, LONG), **faulty), root / "single-faulty", faults=FAULTS)
    main = str(root / "fsdp_tp")
    short = [("bf16", fsdp_tp(train__max_steps=SHORT, parallel__sequence_parallel=True, train__precision="bf16",
                              parallel__reshard_after_forward=False), str(root / "bf16"))]
    fsdp4 = {"train__strategy": "fsdp", "train__micro_batch": mb(MB // 4, LONG)}
    to_fsdp = (cfg(LONG, train__max_steps=STEPS, **fsdp4), cfg(LONG, train__max_steps=MORE, **fsdp4), str(root / "fsdp4"))
    # The 4-rank runs that save (fsdp x tp, fsdp x cp, the roll-back run) save asynchronously
    # (checkpoint.async_save: a staged copy, the write in the background); their checkpoints are
    # loaded bit-exact below, so the async path is held to the same bar as the sync one.
    cp_run = (fsdp_cp(LONG, train__max_steps=STEPS, checkpoint__save_every=EVERY, checkpoint__async_save=True),
              str(root / "fsdp_cp"))
    four = run_ranks(fns.fresh_then_loads, 4, (fsdp_tp(LONG, train__max_steps=STEPS, checkpoint__save_every=EVERY,
                                                      checkpoint__async_save=True), main),
                     short, to_fsdp, (fsdp_tp(LONG, **faulty, checkpoint__async_save=True), str(root / "faulty"), FAULTS),
                     cp_run, timeout=900)
    one_cfg = {"train__micro_batch": mb(MB, LONG), "checkpoint__format": "sharded"}
    one = run_ranks(fns.single_loads, 1, [
        (cfg(LONG, train__max_steps=MORE, **one_cfg), str(root / "fsdp4"), str(root / "single-from-fsdp4")),
        (cfg(LONG, train__max_steps=STEPS, **one_cfg), main, str(root / "single-from-fsdp_tp")),
    ], timeout=300)[0]
    return {"root": root, "single": single, "four": four, "one": one}


def assert_states_equal(got, want, what):
    assert set(got["model"]) == set(want["model"]), f"{what}: other parameter names"
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{what}: weight {k} differs"
    assert set(got["optim"]["state"]) == set(want["optim"]["state"]), f"{what}: optimizer state for other names"
    for name, state in want["optim"]["state"].items():
        for key, v in state.items():
            assert torch.equal(got["optim"]["state"][name][key], v), f"{what}: optimizer {name}.{key} differs"
    strip = [{k: v for k, v in g.items() if k != "params"} for g in got["optim"]["param_groups"]]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in want["optim"]["param_groups"]]


def test_strategy_and_rank_layout(runs):
    """The registry picks FSDPTensorParallel; tp innermost (TP peers adjacent), as mesh.py numbers
    ranks; dp_rank/dp_size are the data-parallel coordinates only."""
    four = runs["four"]
    assert {r["strategy"] for r in four} == {"FSDPTensorParallel"}
    assert [r["coords"] for r in four] == [{"pp": 0, "dp": d, "cp": 0, "tp": t} for d in (0, 1) for t in (0, 1)]
    assert [r["dp"] for r in four] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_losses_and_grad_norms_match_one_process(runs):
    root = runs["root"]
    got = rows(root / "fsdp_tp")
    assert len(got) == STEPS
    # One all-reduce of local shard squares: TP-replicated tensors counted once, sharded ones whole.
    assert_matches_one_process("fsdp_tp", got, rows(root / "single"), runs["four"][0]["fresh"]["model"],
                               runs["single"]["main"].model)


@pytest.mark.slow
def test_sequence_parallel_fp32_matches_one_process(tmp_path):
    """fsdp x tp with sequence parallelism in fp32, SHORT steps, in a launch of its own: losses,
    gradient norms and final weights within 1e-4 of one process. Default runs hold SP under
    fsdp x tp to the bf16 tolerance (test_bf16_tracks_one_process) and the DTensor SP plan to the
    dense model in fp32 (tests/test_dtensor_tp.py)."""
    single = train(cfg(train__max_steps=SHORT, train__micro_batch=MB), tmp_path / "single")
    c = fsdp_tp(train__max_steps=SHORT, parallel__sequence_parallel=True)
    states = run_ranks(fns.train_states, 4, [(c, str(tmp_path / "sp"))], timeout=600)
    got = rows(tmp_path / "sp")
    assert len(got) == SHORT
    assert_matches_one_process("sp", got, rows(tmp_path / "single"), states[0][0]["model"], single.model)


def test_bf16_tracks_one_process(runs):
    """bf16 with sequence parallelism and reshard_after_forward = False: FSDP2 runs the model in
    bf16 weights (fp32 masters and reductions), one process autocasts fp32 weights - not the same
    rounding, so a tolerance: BF16_REL relative per step over SHORT steps (measured 2.4e-4 over 8
    steps; the gap grows with training, so fewer steps stay below that)."""
    got, ref = rows(runs["root"] / "bf16"), rows(runs["root"] / "single-bf16")
    assert len(got) == SHORT and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in got)
    rel = max_rel([r["loss"] for r in got], [r["loss"] for r in ref])
    print(f"bf16 fsdp x tp over {SHORT} steps: per-step loss max relative diff {rel:.2e}")
    assert rel <= BF16_REL, f"bf16: per-step losses differ from one process by up to {rel:.2e}"
    assert got[-1]["loss"] < got[0]["loss"], "bf16: the loss should fall"


def test_skip_and_rollback_match_one_process(runs):
    """Resumed from the step-26 sharded checkpoint: an inf gradient (step 28 skipped, diagnostics
    written from the sharded model) and, after the asynchronous save at 28, a gradient spike at
    step 30 rolled back to that sharded checkpoint: the same decisions and losses as one process
    running the same faults from step 0."""
    root = runs["root"]
    events = [json.loads(line) for line in (root / "faulty" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["rolled_back_to"]) for e in events] == [("rollback", 28)]
    assert [r["faulty"]["rollbacks"] for r in runs["four"]] == [1] * 4
    assert [r["faulty"]["resumed_from"] for r in runs["four"]] == [EVERY] * 4
    got, ref = rows(root / "faulty"), rows(root / "single-faulty")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["nonfinite"] for r in got] == [r["nonfinite"] for r in ref] and got[27]["nonfinite"]
    assert sum(r["nonfinite"] for r in got) == 1
    finite = [(a["loss"], b["loss"]) for a, b in zip(got, ref) if a["loss"] is not None]
    assert max_rel(*zip(*finite)) <= 1e-4


def test_device_mesh_follows_the_kit_rank_order(runs):
    """dp x tp, and dp x cp x tp with the flattened dp_cp dim FSDP would shard over when cp > 1."""
    for r in runs["four"]:
        for key, (torch_ranks, kit) in r["meshes"].items():
            assert torch_ranks == kit, (key, torch_ranks, kit)


def test_resume_is_bit_exact(runs):
    four = runs["four"][0]
    assert four["resume"]["resumed_from"] == EVERY and four["resume"]["steps"] == STEPS
    assert_states_equal(four["resume"]["state"], four["fresh"], "resumed fsdp x tp")
    root = runs["root"]
    cut, full = ([r["loss"] for r in rows(root / d)][EVERY:] for d in ("fsdp_tp-cut", "fsdp_tp"))
    assert cut == full, "losses after the resume differ"
    gn_cut, gn_full = ([r["grad_norm"] for r in rows(root / d)][EVERY:] for d in ("fsdp_tp-cut", "fsdp_tp"))
    assert gn_cut == gn_full


def test_checkpoint_loads_across_layouts(runs):
    """fsdp x tp 2x2 -> plain fsdp on 4 ranks (DCP reshards the 2-D DTensors) -> one process, and
    fsdp x tp -> one process directly: weights and AdamW state equal at every hop."""
    four, one = runs["four"][0], runs["one"]
    loaded = four["fsdp4_loaded"]
    assert loaded["strategy"] == "FSDP2" and loaded["resumed_from"] == STEPS
    assert_states_equal(loaded["state"], four["fresh"], "fsdp 4 from fsdp x tp")
    more = four["fsdp4_more"]
    assert more["resumed_from"] == STEPS and more["steps"] == MORE
    from_fsdp4, from_fsdp_tp = one
    assert from_fsdp4["strategy"] == "Single" and from_fsdp4["resumed_from"] == MORE
    assert_states_equal(from_fsdp4["state"], more["state"], "single from fsdp 4")
    assert from_fsdp_tp["resumed_from"] == STEPS
    assert_states_equal(from_fsdp_tp["state"], four["fresh"], "single from fsdp x tp")
    tail = [r["loss"] for r in rows(runs["root"] / "fsdp4")][STEPS:]  # trained on from the loaded state
    assert len(tail) == MORE - STEPS and all(math.isfinite(x) for x in tail)


def tp_replicated_params(mcfg) -> int:
    """Parameters every TP rank holds whole under parallelize_tinygpt, for the GPT-2-style tiny
    preset (LayerNorm with bias, biased linears, learned positions): per block two LayerNorms and
    the row-parallel out_proj and mlp.down biases; the final LayerNorm; the position table (the
    DTensor plan leaves it replicated)."""
    assert mcfg.norm == "layernorm" and mcfg.bias and mcfg.position == "learned"
    d = mcfg.d_model
    return mcfg.n_layers * (2 * 2 * d + 2 * d) + 2 * d + mcfg.block_size * d


def test_model_state_bytes_equal_the_estimate(runs):
    c = fsdp_tp()
    mcfg = train_config.build_model_config(c)
    from course_lib.model import TinyGPT

    psi = TinyGPT(mcfg).num_params()
    est = model_state_bytes(psi, recipe="fp32-adam", zero_stage=3, dp=2, tp=2, tp_replicated=tp_replicated_params(mcfg))
    for rank, r in enumerate(runs["four"]):
        m = r["census"]
        assert (m["params"], m["grads"], m["optimizer_moments"], m["total"]) == \
            (est.params, est.grads, est.optimizer, est.total), f"rank {rank}: {m} vs {est.to_dict()}"
    # a fraction of the dense model: (psi - R) / 4 + R / 2 parameters per rank
    assert runs["four"][0]["census"]["param_elements"] * 4 == est.params < 4 * psi / 2


def test_one_host_read_per_step(runs):
    """Counted step by step over the fresh run, steps 2 .. EVERY (before its first save;
    model_parallel_rank_fns.train_counting_reads)."""
    assert [r["host_reads_per_step"] for r in runs["four"]] == [{s: 1 for s in range(2, EVERY + 1)}] * 4


def test_estimator_tp_split():
    """Pure arithmetic: the tp split before ZeRO's dp split."""
    e = model_state_bytes(1000, recipe="fp32-adam", zero_stage=3, dp=2, tp=4, tp_replicated=200)
    assert e.num_params == 400 and e.params == 400 * 4 / 2 and e.optimizer == 400 * 8 / 2
    assert model_state_bytes(1000, recipe="fp32-adam", tp=1, tp_replicated=200).num_params == 1000
    with pytest.raises(ValueError, match="tp_replicated"):
        model_state_bytes(10, tp=2, tp_replicated=11)


@pytest.mark.parametrize("sets, match", [
    ({"parallel__pp": 2}, r"train.strategy = 'fsdp' with parallel.pp = 2 is not supported.*composes with parallel.tp"),
    ({"parallel__tp": 2, "checkpoint__format": "full"}, r"checkpoint.format = 'full' does not fit train.strategy = 'fsdp'"),
])
def test_refused_before_any_file(tmp_path, sets, match):
    with pytest.raises(train_config.ConfigError, match=match):
        train(cfg(train__strategy="fsdp", **sets), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_fsdp_with_context_parallelism_matches_one_process_and_resumes(runs):
    """fsdp x cp 2x2 over 30 steps: losses and gradient norms within 1e-4 of one process on the
    same global batch; cp innermost beside dp; a bit-exact resume; one host read per step."""
    cp = runs["four"][0]["cp"]
    assert [r["cp"]["fresh"]["coords"] for r in runs["four"]] == \
        [{"pp": 0, "dp": d, "cp": c, "tp": 0} for d in (0, 1) for c in (0, 1)]
    assert cp["fresh"]["strategy"] == "FSDPTensorParallel"
    root = runs["root"]
    got, ref = rows(root / "fsdp_cp"), rows(root / "single")
    assert_matches_one_process("fsdp x cp", got, ref)  # losses, gradient norms and clipping decisions
    assert cp["resumed_from"] == EVERY and cp["steps"] == STEPS
    assert_states_equal(cp["resumed"], cp["fresh"]["state"], "resumed fsdp x cp")
    assert [r["cp"]["host_reads_per_step"] for r in runs["four"]] == [{s: 1 for s in range(2, EVERY + 1)}] * 4
