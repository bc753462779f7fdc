"""Activation recomputation (``model.checkpointing``) under tensor and pipeline parallelism.

Two claims, on gloo CPU ranks in fp32:

1. **Recomputation does not change the numbers.** On 4 ranks, in one launch, the trainer runs
   selective recomputation under tp 2 x dp 2 (30 steps), full recomputation under tp 2 x pp 2
   (1F1B), selective recomputation of every 2nd block (``checkpoint_every = 2``) with activation
   offloading under tp 2 x dp 2 with sequence parallelism, and selective (attention core)
   recomputation under tp 2 x pp 2 with sequence parallelism and GPipe (8 steps each). Per-step
   losses and gradient norms equal one process *without* recomputation on the same global batch
   within 1e-4 relative, and every layout resumes bit-exact from its checkpoint 4 steps before the
   end (in the same launch). A recomputed TP block re-runs its collectives inside backward: a rank that recomputed
   in another order than its peers would deadlock or mix up tensors, not pass. Since equal losses
   would also follow from no recomputation at all, each rank then counts the bytes its trained part
   (TP model or TP pipeline stage) saves with and without the run's recomputation: the difference
   is the estimator's, block by block.
2. **Saved bytes per rank equal the estimator.** On 2 ranks, in one launch, a saved-tensor hooks
   census over one forward of ``tp_tinygpt`` (GPT- and Llama-style blocks) with 1 and 2 blocks:
   their difference, one block's bytes on this rank, equals
   ``course_lib.estimate.activation_bytes_per_layer`` for tp 2, SP off and on, recompute none /
   selective / full, counting the kit's SP variant (``sp_gathered_inputs="keep"``: the gathered
   QKV and MLP inputs are kept, where Megatron re-gathers them). ``checkpoint_every = 2`` on 3
   blocks saves exactly 2 x (full - none) per layer less than no recomputation.
"""
from __future__ import annotations

import pytest

import recompute_rank_fns
from course_lib.trainer import config as train_config
from course_lib.estimate import activation_bytes_per_layer
from course_lib.measure import tinygpt_activation_kwargs
from course_lib.parallel import run_ranks
from course_lib.labs import lab10_tensor_parallel as lab_runs
from course_lib.train import train
from layout_checks import (RESUME_TAIL, assert_matches_one_process, assert_resumed_bit_exact, micro_batch,
                           micro_batches_per_step, one_read_per_step, resume_save_every, rows, tiny_cfg)

pytestmark = pytest.mark.usefixtures("one_thread")

MB, ACCUM = 8, 2  # the reference: 8 sequences per micro-batch, 2 micro-batches per step

# name -> (steps, [parallel] settings, micro_batch per data-parallel replica with ACCUM micro-batches
# per step (see accum()), [model] settings)
LAYOUTS = {
    "tp2-dp2-selective": (30, {"tp": 2}, MB // 2, {"n_layers": 2, "checkpointing": "selective"}),
    "tp2-pp2-full-1f1b": (8, {"tp": 2, "pp": 2, "pp_schedule": "1f1b"}, MB,
                          {"n_layers": 2, "checkpointing": "full"}),
    "tp2-dp2-sp-every2-offload": (8, {"tp": 2, "sequence_parallel": True}, MB // 2,
                                  {"n_layers": 3, "checkpointing": "selective", "checkpoint_every": 2,
                                   "offload_activations": True}),
    "tp2-pp2-sp-selective-gpipe": (8, {"tp": 2, "pp": 2, "pp_schedule": "gpipe", "sequence_parallel": True}, MB,
                                   {"n_layers": 3, "checkpointing": "selective"}),
}
REFERENCES = sorted({(steps, model["n_layers"]) for steps, _, _, model in LAYOUTS.values()})


every = resume_save_every  # the resume starts RESUME_TAIL steps before the end


def cfg(grad_accum=ACCUM, **sets):
    return tiny_cfg(grad_accum, **sets)


def accum(steps):
    """Micro-batches per step (layout_checks.micro_batches_per_step)."""
    return micro_batches_per_step(steps, ACCUM)


def layout_cfg(name):
    steps, par, mb, model = LAYOUTS[name]
    sets = {f"parallel__{k}": v for k, v in par.items()} | {f"model__{k}": v for k, v in model.items()}
    return cfg(accum(steps), train__max_steps=steps, train__micro_batch=micro_batch(mb, ACCUM, accum(steps)),
               train__strategy="ddp", checkpoint__save_every=every(steps), **sets)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute_tp")
    for steps, layers in REFERENCES:  # one process, no recomputation
        train(cfg(accum(steps), train__max_steps=steps, train__micro_batch=micro_batch(MB, ACCUM, accum(steps)),
                  model__n_layers=layers), root / f"single-{steps}-{layers}")
    # one launch: the fresh runs (each followed by its census), then each resume from the checkpoint before the last
    out = run_ranks(recompute_rank_fns.train_measure_resume, 4, [(layout_cfg(n), str(root / n)) for n in LAYOUTS],
                    timeout=600, show_output=False)
    return {"root": root, "first": dict(zip(LAYOUTS, out[0]["first"])), "second": dict(zip(LAYOUTS, out[0]["second"])),
            "census": [dict(zip(LAYOUTS, rank["first"])) for rank in out]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recomputation_matches_one_process_without_it(runs, name):
    steps, _, _, model = LAYOUTS[name]
    root = runs["root"]
    got, ref = rows(root / name / "full"), rows(root / f"single-{steps}-{model['n_layers']}")
    assert len(got) == steps
    assert_matches_one_process(name, got, ref)  # losses, gradient norms and clipping decisions


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recomputation_keeps_one_host_read_per_step(runs, name):
    """Recomputing a block replays its forward, never a host read: every rank's fresh run makes
    the stabilizer's one read per step (every step from 2 on but the one after the save)."""
    steps = LAYOUTS[name][0]
    got = [rank[name]["reads"] for rank in runs["census"]]
    assert got == [one_read_per_step(steps)] * 4, got


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_is_bit_exact(runs, name):
    steps = LAYOUTS[name][0]
    start = steps - RESUME_TAIL
    assert_resumed_bit_exact(name, runs["first"][name], runs["second"][name], start, steps, runs["root"] / name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_trained_stages_recompute_what_the_config_says(runs, name):
    """The part each rank trained (TP model, or TP pipeline stage) saves, over one forward of a
    micro-batch, exactly the estimator's per-layer difference less with the run's recomputation
    than without it, summed over the blocks it holds: block i is recomputed whole under ``full``
    and under ``checkpoint_every = k`` when i % k == 0, its attention core under ``selective``.
    Recomputation that silently did nothing would save 0 bytes here."""
    import dataclasses

    _, par, _, model = LAYOUTS[name]
    c = layout_cfg(name)
    mb = c["train"]["micro_batch"]  # the census's micro-batch: the run's (see accum())
    mcfg = train_config.build_model_config(c)
    kw = tinygpt_activation_kwargs(dataclasses.replace(mcfg, checkpointing="none", checkpoint_every=None,
                                                       offload_activations=False), seq_len=64, micro_batch=mb)
    sp = par.get("sequence_parallel", False)
    per_layer = {mode: activation_bytes_per_layer(**(kw | {"recompute": mode}), tp=par["tp"], sequence_parallel=sp,
                                                  sp_gathered_inputs="keep") for mode in ("none", "selective", "full")}
    k = model.get("checkpoint_every")
    for rank, layouts in enumerate(runs["census"]):
        got = layouts[name]["census"]
        modes = ["full" if model["checkpointing"] == "full" or (k and i % k == 0) else "none" if k else "selective"
                 for i in got["blocks"]]
        want = sum(per_layer["none"] - per_layer[m] for m in modes)
        assert want > 0 and got["without"] - got["with"] == want, (rank, got, modes, want)


# ------------------------------------------------------------------------ saved bytes per rank
B, T, C, N = 2, 8, 16, 2
KINDS = ("gpt", "llama")  # LayerNorm + GELU + learned positions; RMSNorm + SwiGLU + RoPE + GQA


@pytest.fixture(scope="module")
def census():
    configs = [(kind, lab_runs.block_config(kind, T, C)) for kind in KINDS]
    return run_ranks(recompute_rank_fns.saved_bytes_census, N, configs, B, T, timeout=300, show_output=False)


def _estimate(kind, sp, mode):
    kw = tinygpt_activation_kwargs(lab_runs.block_config(kind, T, C), seq_len=T, micro_batch=B)
    kw["recompute"] = mode
    return activation_bytes_per_layer(**kw, tp=N, sequence_parallel=sp, sp_gathered_inputs="keep")


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", KINDS)
def test_saved_bytes_per_rank_equal_the_estimator(census, kind, sp, mode):
    want = _estimate(kind, sp, mode)
    for rank, got in enumerate(census):
        assert got[(kind, sp, mode)]["one_block"] == want, (rank, got[(kind, sp, mode)], want)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_every_2_saves_two_blocks_worth(census, kind, sp):
    saved_per_block = _estimate(kind, sp, "none") - _estimate(kind, sp, "full")
    assert saved_per_block > 0
    for got in census:
        row = got[(kind, sp, "every2")]
        assert row["none"] - row["saved"] == 2 * saved_per_block, row


def test_the_kit_keeps_the_gathered_inputs_megatron_does_not():
    """The two SP variants differ by the two all-gathered matmul inputs, 2 e s b h (1 - 1/t); without
    SP, and under full recomputation (only the layer input is kept), they are the same."""
    kw = dict(seq_len=T, micro_batch=B, d_model=C, n_heads=4, tp=N, bytes_per_element=4)
    for mode in ("none", "selective"):
        keep = activation_bytes_per_layer(**kw, recompute=mode, sequence_parallel=True, sp_gathered_inputs="keep")
        regather = activation_bytes_per_layer(**kw, recompute=mode, sequence_parallel=True)
        assert keep - regather == 2 * 4 * B * T * C * (1 - 1 / N)
    for sp, mode in ((False, "none"), (True, "full")):
        assert (activation_bytes_per_layer(**kw, recompute=mode, sequence_parallel=sp, sp_gathered_inputs="keep")
                == activation_bytes_per_layer(**kw, recompute=mode, sequence_parallel=sp))
    with pytest.raises(ValueError, match="sp_gathered_inputs"):
        activation_bytes_per_layer(**kw, sp_gathered_inputs="gather")


def test_recomputation_with_tp_is_accepted_by_the_config():
    """The refusal is gone: every mode validates with tp (with and without SP) and with tp x pp."""
    for par in ({"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"tp": 2, "pp": 2}):
        for model in ({"checkpointing": "full"}, {"checkpointing": "selective"},
                      {"checkpointing": "selective", "checkpoint_every": 2}, {"offload_activations": True}):
            sets = {f"parallel__{k}": v for k, v in par.items()} | {f"model__{k}": v for k, v in model.items()}
            c = cfg(train__strategy="ddp", train__micro_batch=4, **sets)
            assert c["model"] | model == c["model"]
