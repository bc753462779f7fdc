"""Pipeline stages as real jobs have them: a chosen split (``parallel.pp_split``) and the interleaved
schedule with tensor parallelism and bf16, in the trainer, against one process on the same global batch.

On 4 gloo ranks, one launch for the fresh runs and then every resume (starting ranks and each
process's first train() are the slow part):

* ``split-1-3``: pp 2 x dp 2, 1F1B, 4 blocks split [1, 3] by hand, fp32, 30 steps: per-step losses
  and gradient norms within 1e-4 relative of one process, final weights too;
* ``balanced``: pp 2 x dp 2, 3 blocks, ``pp_split = "balanced"`` (the embedding weighs on stage 0, so
  stage 0 gets 1 block and stage 1 two: the opposite of the even split), fp32, 8 steps, same checks;
* ``interleaved-tp2-bf16``: pp 2 x tp 2, ``ScheduleInterleaved1F1B`` with 2 virtual stages per rank
  (4 blocks), bf16 autocast, 8 steps, against one process under the same bf16 autocast.
  Tolerance (losses): 1e-3 relative. bf16 keeps 8 significant bits (unit roundoff 2^-9, about
  2e-3); TP rounds each rank's partial matmul output to bf16 before the all-reduce, where one
  process rounds the whole sum once, so the two runs see different roundings of every row-parallel
  output and the difference grows with training. Measured on 2 CPU cores: at most 1.5e-4 over 8
  steps (about the size of the bf16 vs fp32 gap of one process here, 1.8e-4), and step 1 equal bit
  for bit to the same layout under our 1F1B runner. 1e-3 leaves 6x headroom and still fails a run
  that, say, drops the loss scale or a micro-batch (several % within a step or two). Gradient norms
  (bf16 gradients, element-wise error near 2^-8 that does not average out in a norm): 5e-2.
  That autocast really reaches torch's stages is checked directly: the last stage's logits are bf16.

Every layout resumes bit-exact from the checkpoint before its last (4 steps before the end) and
makes one host read per step (the stabilizer's), counted step by step in its fresh run
(model_parallel_rank_fns.train_counting_reads). Pure tests of the split
function (course_lib.estimate.stage_split) and of the config refusals need no ranks.
"""
from __future__ import annotations

import pytest

import pipeline_layouts_rank_fns as fns
from course_lib.trainer import config as train_config
from course_lib.estimate import ModelShape
from course_lib.estimate.stage_split import end_weights, split_for_config, split_loads, stage_split
from course_lib.parallel import run_ranks
from course_lib.parallel.mesh import mesh_layout
from course_lib.train import train
from layout_checks import (RESUME_TAIL, assert_matches_one_process, assert_resumed_bit_exact, one_read_per_step,
                           resume_save_every, rows, tiny_cfg)

MB, ACCUM = 8, 2  # the reference: 8 sequences per micro-batch, 2 micro-batches per step
BF16_LOSS_RTOL, BF16_GRAD_NORM_RTOL = 1e-3, 5e-2

# name -> (steps, [parallel] settings, micro_batch per data-parallel replica, model.n_layers, precision)
LAYOUTS = {
    "split-1-3": (30, {"pp": 2, "pp_split": [1, 3]}, MB // 2, 4, "fp32"),
    "balanced": (8, {"pp": 2, "pp_split": "balanced"}, MB // 2, 3, "fp32"),
    "interleaved-tp2-bf16": (8, {"pp": 2, "tp": 2, "pp_schedule": "interleaved", "virtual_stages": 2}, MB, 4,
                             "bf16"),
}
REFERENCES = sorted({(steps, layers, prec) for steps, _, _, layers, prec in LAYOUTS.values()})


every = resume_save_every  # the resume starts RESUME_TAIL steps before the end


def cfg(**sets):
    return tiny_cfg(ACCUM, **sets)  # lists such as [1, 3] written as TOML arrays, parsed like --set would


def layout_cfg(name):
    steps, par, mb, layers, prec = LAYOUTS[name]
    sets = {f"parallel__{k}": v for k, v in par.items()}
    return cfg(train__max_steps=steps, train__micro_batch=mb, train__strategy="ddp", model__n_layers=layers,
               train__precision=prec, checkpoint__save_every=every(steps), **sets)


def reference(steps, layers, prec):
    return f"single-{steps}-{layers}-{prec}"


def rel_diffs(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_layouts")
    single = {key: train(cfg(train__max_steps=key[0], train__micro_batch=MB, model__n_layers=key[1],
                             train__precision=key[2]), root / reference(*key)) for key in REFERENCES}
    counted = range(len(LAYOUTS))  # every fresh run counts the host reads per step
    out = run_ranks(fns.layouts_then_resumes, 4, [(layout_cfg(n), str(root / n)) for n in LAYOUTS], counted,
                    timeout=900)
    return {"root": root, "single": single,
            "reads": {n: [r["reads"][i] for r in out] for i, n in enumerate(LAYOUTS)},
            "first": [dict(zip(LAYOUTS, r["first"])) for r in out],
            "second": [dict(zip(LAYOUTS, r["second"])) for r in out]}


# ------------------------------------------------------------------ on ranks
@pytest.mark.parametrize("name", ["split-1-3", "balanced"])
def test_chosen_split_matches_one_process_fp32(runs, name):
    steps, _, _, layers, prec = LAYOUTS[name]
    got, ref = rows(runs["root"] / name / "full"), rows(runs["root"] / reference(steps, layers, prec))
    assert_matches_one_process(name, got, ref, runs["first"][0][name]["weights"],
                               runs["single"][steps, layers, prec].model)


def test_the_stages_hold_the_chosen_blocks(runs):
    """Ranks 0, 1 are stage 0 and ranks 2, 3 stage 1 (pp 2 x dp 2); interleaved pp 2 x tp 2: ranks
    0, 1 hold virtual stages 0 and 2, ranks 2, 3 stages 1 and 3."""
    got = {n: [r[n]["blocks"] for r in runs["first"]] for n in LAYOUTS}
    assert got["split-1-3"] == [[0], [0], [1, 2, 3], [1, 2, 3]]
    assert got["balanced"] == [[0], [0], [1, 2], [1, 2]]  # even would be [0, 1] | [2]
    assert got["interleaved-tp2-bf16"] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert {tuple(r["balanced"]["split"]) for r in runs["first"]} == {(1, 2)}
    assert {tuple(r["interleaved-tp2-bf16"]["split"]) for r in runs["first"]} == {(1, 1, 1, 1)}


def test_interleaved_tp_bf16_matches_one_process_under_the_same_autocast(runs):
    name = "interleaved-tp2-bf16"
    steps, _, _, layers, prec = LAYOUTS[name]
    got, ref = rows(runs["root"] / name / "full"), rows(runs["root"] / reference(steps, layers, prec))
    rel = rel_diffs([r["loss"] for r in got], [r["loss"] for r in ref])
    assert max(rel) <= BF16_LOSS_RTOL, f"bf16 per-step losses differ from one process by {max(rel):.2e}: {rel}"
    rel_g = rel_diffs([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
    assert max(rel_g) <= BF16_GRAD_NORM_RTOL, f"bf16 gradient norms differ by {max(rel_g):.2e}: {rel_g}"
    # autocast reached torch's stages: the last virtual stage (pipeline rank 1 = ranks 2, 3) computes bf16 logits
    assert [r[name]["logits_dtype"] for r in runs["first"]] == [None, None, "torch.bfloat16", "torch.bfloat16"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_split_and_schedule_keeps_one_host_read_per_step(runs, name):
    """A chosen split or torch's interleaved schedule with our autocast, loss and scale hooks adds
    no host read to the stabilizer's one per step (the loss stays on the device; the scale is the
    scaler's tensor). Every step from 2 on but the one after the save, on every rank."""
    steps = LAYOUTS[name][0]
    assert runs["reads"][name] == [one_read_per_step(steps)] * 4, runs["reads"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_is_bit_exact(runs, name):
    steps = LAYOUTS[name][0]
    start = steps - RESUME_TAIL
    assert_resumed_bit_exact(name, runs["first"][0][name], runs["second"][0][name], start, steps,
                             runs["root"] / name)


# ------------------------------------------------------------------ the split, pure
BLOOM_176B = ModelShape(70, 14336, 112, 250880, 2048, learned_pos_emb=False)  # ALiBi: no position table


def test_balanced_split_shortens_the_end_stages_like_real_runs():
    bloom = stage_split(BLOOM_176B, 12, split="balanced")
    assert bloom == [5] + [6] * 10 + [5]  # BLOOM-176B's published partition
    llama = stage_split(ModelShape.preset("llama3-405b"), 16, split="balanced")
    assert llama == [7] + [8] * 14 + [7]  # Llama 3 405B: one layer off the first and the last stage
    first, last = end_weights(BLOOM_176B)
    assert 1.4 < first < 1.5 and 1.4 < last < 1.5  # a 250k x 14336 table weighs ~1.46 blocks
    even = stage_split(BLOOM_176B, 12)
    assert even == [6] * 10 + [5] * 2
    assert max(split_loads(bloom, first, last)) < max(split_loads(even, first, last))


def test_balanced_split_is_optimal_by_brute_force():
    from itertools import combinations

    shape = ModelShape(7, 64, 4, 4096, 64)  # a large vocabulary: both ends weigh several blocks
    first, last = end_weights(shape)
    for stages in (2, 3, 4):
        got = stage_split(shape, stages, split="balanced")
        best = min(max(split_loads([b - a for a, b in zip((0,) + cut, cut + (7,))], first, last))
                   for cut in combinations(range(1, 7), stages - 1))
        assert max(split_loads(got, first, last)) == best and sum(got) == 7 and min(got) >= 1


def test_split_for_a_trainer_config_and_its_virtual_stages():
    from course_lib.trainer.config import build_model_config

    c = cfg(train__strategy="ddp", model__n_layers=4, parallel__pp=2, parallel__pp_split=[1, 3])
    assert c["parallel"]["pp_split"] == [1, 3]
    assert split_for_config(c, build_model_config(c)) == [1, 3]
    c = cfg(train__strategy="ddp", model__n_layers=6, parallel__pp=2, parallel__pp_schedule="interleaved",
            parallel__virtual_stages=2, parallel__pp_split=[1, 2, 2, 1])
    assert split_for_config(c, build_model_config(c)) == [1, 2, 2, 1]
    c = cfg(train__strategy="ddp", model__n_layers=3, parallel__pp=2, parallel__pp_split="balanced")
    assert split_for_config(c, build_model_config(c)) == [1, 2]
    assert cfg()["parallel"]["pp_split"] == "even"
    assert train_config.parse_override("parallel.pp_split=[1, 3]") == ("parallel", "pp_split", [1, 3])
    lay = mesh_layout(4, pp=2, tp=2)  # the drawing follows the split, virtual stages included
    text = lay.draw(lay.describe(balance=[1, 2, 2, 1]))
    assert "rank 0: stages 0, 2: embeddings, block 0, blocks 3-4" in text, text
    assert "rank 3: stages 1, 3: blocks 1-2, block 5, final norm, head, loss" in text, text


@pytest.mark.parametrize("sets, match", [
    ({"parallel__pp_split": [1, 2]}, r"parallel.pp_split = \[1, 2\]: split must sum to n_layers = 4.*accepted: "
                                     r"'even', 'balanced' or 2 ints >= 1"),
    ({"parallel__pp_split": [0, 4]}, r"parallel.pp_split = \[0, 4\]: split\[0\] must be an int >= 1"),
    ({"parallel__pp_split": [1, 3]}, None),  # accepted: the control
    ({"parallel__pp_split": [1, 1, 2]}, r"split must have one entry per stage \(pp \* virtual_stages = 2\)"),
    ({"parallel__pp_split": [2, 2], "parallel__pp_schedule": "interleaved", "parallel__virtual_stages": 2},
     r"one entry per stage \(pp \* virtual_stages = 4\).*parallel.pp x parallel.virtual_stages = 2 x 2"),
    ({"parallel__pp_split": "uneven"}, r"parallel.pp_split must be one of even, balanced or an array of ints"),
    ({"parallel__pp_split": [1.5, 2.5]}, r"parallel.pp_split must be one of even, balanced or an array of ints"),
    ({"parallel__pp_split": [True, 3]}, r"parallel.pp_split must be one of even, balanced or an array of ints"),
    ({"parallel__pp_split": []}, r"parallel.pp_split must be one of even, balanced or an array of ints"),
    # what still cannot run with the interleaved schedule: compile (torch calls its stage modules)
    ({"parallel__pp_schedule": "interleaved", "train__compile": True},
     r"train.compile = true does not apply to parallel.pp_schedule = 'interleaved'"),
    ({"parallel__pp_schedule": "interleaved", "train__grad_accum": 5},
     r"train.grad_accum \(5\) must be a multiple of max\(1, grad_accum // parallel.pp\) = 2"),
])
def test_split_and_interleaved_keys_are_checked_before_any_file(tmp_path, sets, match):
    base = {"train__strategy": "ddp", "model__n_layers": 4, "parallel__pp": 2}
    if match is None:
        cfg(**base, **sets)  # no error
        return
    with pytest.raises(train_config.ConfigError, match=match):
        train(cfg(**{**base, **sets}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_interleaved_with_tp_and_low_precision_is_accepted():
    for prec in ("bf16", "fp16"):
        c = cfg(train__strategy="ddp", model__n_layers=4, parallel__pp=2, parallel__tp=2, train__precision=prec,
                parallel__pp_schedule="interleaved", parallel__virtual_stages=2)
        assert c["parallel"]["pp_schedule"] == "interleaved" and c["train"]["precision"] == prec


@pytest.mark.slow
def test_interleaved_tp_fp16_scales_the_loss_like_one_process(tmp_path):
    """fp16 (autocast + GradScaler on the CPU, about 8x slower than bf16, hence ``slow``): the
    interleaved pp 2 x tp 2 run multiplies each micro-batch loss by the scale inside torch's
    schedule and the trainer unscales the gradients; losses and norms track one process under the
    same fp16 autocast and loss scale (tolerances as for bf16: fp16 has more mantissa bits, 11, but
    the same split-rounding argument), and the logged loss scale is the scaler's."""
    steps, layers = 3, 4
    sets = dict(train__max_steps=steps, model__n_layers=layers, train__precision="fp16")
    single = tmp_path / "single"
    train(cfg(train__micro_batch=MB, **sets), single)
    c = cfg(train__micro_batch=MB, train__strategy="ddp", parallel__pp=2, parallel__tp=2,
            parallel__pp_schedule="interleaved", parallel__virtual_stages=2, **sets)
    run_ranks(fns.train_layouts, 4, [(c, str(tmp_path / "il"), False)], timeout=900)
    got, ref = rows(tmp_path / "il"), rows(single)
    assert max(rel_diffs([r["loss"] for r in got], [r["loss"] for r in ref])) <= BF16_LOSS_RTOL
    assert max(rel_diffs([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])) <= BF16_GRAD_NORM_RTOL
    assert [r["loss_scale"] for r in got] == [r["loss_scale"] for r in ref] and got[0]["loss_scale"] > 1
