"""Tensor and pipeline parallelism composed with data parallelism, in the trainer.

Every layout runs on 4 gloo ranks and trains the tiny config (fp32) on the same global batch as
one process: each data-parallel replica reads ``micro_batch`` sequences per micro-batch, TP and PP
peers read the same ones, so ``micro_batch * dp`` equals the reference's micro-batch and the
``train.grad_accum`` micro-batches are the pipeline's. Per-step losses and gradient norms must
equal one process within 1e-4 relative over 8 steps (tp2 x dp2, pp2 x dp2 with 1F1B and with
GPipe, tp2 x pp2, sequence parallelism, the interleaved schedule), the final weights too, and every
layout resumes bit-exact from its checkpoint 4 steps before the end, which is written in the dense
layout (so one process can load it). The 30-step matches of issue 20 run on the composed layouts
that carry these forms: tp 2 x dp 2 in tests/test_train_recompute_tp.py (selective recompute) and
test_train_zero_model_parallel.py (zero2 x tp), 1F1B pp 2 x dp 2 in test_train_pipeline_layouts.py
(the explicit split) and test_train_zero_model_parallel.py (zero1 x pp).

One launch of 4 ranks (starting ranks and each process's first train() are the slow part): the
world-size refusals, the fresh runs (tp2 x pp2's counting its host reads per step), then every
resume. pp2 x dp2 1F1B (even split) is proven by the layouts named above and runs only
with ``-m slow``.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import model_parallel_rank_fns as fns
from course_lib.trainer import config as train_config
from course_lib.parallel import run_ranks
from course_lib.parallel.mesh import MeshLayout, mesh_layout
from course_lib.train import train
from layout_checks import (RESUME_TAIL, assert_matches_one_process, assert_resumed_bit_exact, one_read_per_step,
                           resume_save_every, rows, tiny_cfg)

MB, ACCUM = 8, 2  # the reference: 8 sequences per micro-batch, 2 micro-batches per step

# name -> (steps, [parallel] settings, micro_batch per data-parallel replica, model.n_layers)
LAYOUTS = {
    "tp2-dp2": (8, {"tp": 2}, MB // 2, 2),
    "pp2-dp2-1f1b": (8, {"pp": 2, "pp_schedule": "1f1b"}, MB // 2, 2),
    "pp2-dp2-gpipe": (8, {"pp": 2, "pp_schedule": "gpipe"}, MB // 2, 2),
    "tp2-pp2": (8, {"tp": 2, "pp": 2}, MB, 2),
    "tp2-dp2-sp": (8, {"tp": 2, "sequence_parallel": True}, MB // 2, 2),
    # torch's ScheduleInterleaved1F1B: 2 virtual stages per rank need 4 blocks
    "pp2-dp2-interleaved": (8, {"pp": 2, "pp_schedule": "interleaved", "virtual_stages": 2}, MB // 2, 4),
}
# pp 2 x dp 2 with 1F1B and the even split is the pipeline_layouts explicit split (pp 2 x dp 2, 1F1B,
# ddp, 30 steps) with another split, and zero1 x pp (1F1B, even split, 30 steps) with another dp:
# default runs prove it twice over, so it runs only with -m slow (test_slow_layouts_match_and_resume).
SLOW = ["pp2-dp2-1f1b"]
DEFAULT = [n for n in LAYOUTS if n not in SLOW]
REFERENCES = sorted({(LAYOUTS[n][0], LAYOUTS[n][3]) for n in DEFAULT})  # (steps, n_layers)


every = resume_save_every  # the resume starts RESUME_TAIL steps before the end


def cfg(**sets):
    return tiny_cfg(ACCUM, **sets)


def layout_cfg(name):
    steps, par, mb, layers = LAYOUTS[name]
    sets = {f"parallel__{k}": v for k, v in par.items()}
    return cfg(train__max_steps=steps, train__micro_batch=mb, train__strategy="ddp", model__n_layers=layers,
               checkpoint__save_every=every(steps), **sets)


def reference(steps, layers):
    return f"single-{steps}-{layers}"


REFUSED_AT_START = [  # the world size is known only when the ranks start: checked before any file
    ("dp-tp-pp-not-4", {"parallel__dp": 2, "parallel__tp": 2, "parallel__pp": 2}),
    ("dp3-pp2-on-4", {"parallel__pp": 2, "parallel__dp": 3}),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_parallel")
    single = {key: train(cfg(train__max_steps=key[0], train__micro_batch=MB, model__n_layers=key[1]),
                         root / reference(*key)) for key in REFERENCES}
    refusals = [(n, cfg(train__micro_batch=4, train__strategy="ddp", **sets)) for n, sets in REFUSED_AT_START]
    jobs = [(layout_cfg(n), str(root / n)) for n in DEFAULT]
    mesh_cfg = cfg(train__micro_batch=4, train__strategy="ddp", parallel__tp=2, parallel__pp=2)
    # the fresh runs (tp2 x pp2's counting host reads), then each resume from the checkpoint before the last
    out = run_ranks(fns.refusals_then_train, 4, refusals, str(root / "refused"), jobs, mesh_cfg,
                    [DEFAULT.index("tp2-pp2")], timeout=600)
    return {"root": root, "single": single, "refusals": [r["refusals"] for r in out],
            "first": dict(zip(DEFAULT, out[0]["first"])), "second": dict(zip(DEFAULT, out[0]["second"])),
            "coords": [dict(zip(DEFAULT, r["first"])) for r in out], "mesh": [r["mesh"] for r in out],
            "reads": [r["reads"][DEFAULT.index("tp2-pp2")] for r in out]}


def check_layout_matches_one_process(name, root, first, single_model):
    steps, _, _, layers = LAYOUTS[name]
    got, ref = rows(root / name / "full"), rows(root / reference(steps, layers))
    # The stabilizer's norm counts each logical parameter once (shards summed over tp, replicas
    # and the tied head copy once, every stage): it equals one process's, and so does clipping.
    assert_matches_one_process(name, got, ref, first["weights"], single_model)


@pytest.mark.parametrize("name", DEFAULT)
def test_layout_matches_one_process(runs, name):
    steps, _, _, layers = LAYOUTS[name]
    check_layout_matches_one_process(name, runs["root"], runs["first"][name], runs["single"][steps, layers].model)


@pytest.mark.parametrize("name", DEFAULT)
def test_resume_is_bit_exact(runs, name):
    steps = LAYOUTS[name][0]
    start = steps - RESUME_TAIL
    assert_resumed_bit_exact(name, runs["first"][name], runs["second"][name], start, steps, runs["root"] / name)


@pytest.mark.slow
def test_slow_layouts_match_and_resume(tmp_path):
    """The SLOW layouts, in a launch of their own: the same match with one process and the same
    bit-exact resume as the default ones."""
    refs = {}
    for name in SLOW:
        steps, _, _, layers = LAYOUTS[name]
        refs[name] = train(cfg(train__max_steps=steps, train__micro_batch=MB, model__n_layers=layers),
                           tmp_path / reference(steps, layers))
    out = run_ranks(fns.train_then_resume, 4, [(layout_cfg(n), str(tmp_path / n)) for n in SLOW], timeout=600)
    for i, name in enumerate(SLOW):
        first, second = out[0]["first"][i], out[0]["second"][i]
        check_layout_matches_one_process(name, tmp_path, first, refs[name].model)
        steps = LAYOUTS[name][0]
        assert_resumed_bit_exact(name, first, second, steps - RESUME_TAIL, steps, tmp_path / name)


def test_rank_layout_is_tp_innermost(runs):
    coords = [r["tp2-pp2"]["coords"] for r in runs["coords"]]
    assert coords == [{"pp": 0, "dp": 0, "cp": 0, "tp": 0}, {"pp": 0, "dp": 0, "cp": 0, "tp": 1},
                      {"pp": 1, "dp": 0, "cp": 0, "tp": 0}, {"pp": 1, "dp": 0, "cp": 0, "tp": 1}]
    assert [r["tp2-dp2"]["coords"]["dp"] for r in runs["coords"]] == [0, 0, 1, 1]


def test_a_mesh_built_outside_is_the_one_the_strategy_uses(runs):
    """tp 2 x pp 2 on 4 ranks: TP peers are adjacent ranks, a pipeline runs across ranks 0 -> 2."""
    for rank, got in enumerate(runs["mesh"]):
        assert got["kept"] and got["dp"] == (0, 1)
        assert got["ranks"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["ranks"]["pp"] == [rank % 2, rank % 2 + 2]
        assert got["ranks"]["mp"] == [0, 1, 2, 3] and got["ranks"]["dp"] == [rank]


def test_tokens_per_second_count_the_global_batch_once(runs):
    """TP/PP peers share a batch: a step is micro_batch * grad_accum * seq_len * dp tokens."""
    for row in rows(runs["root"] / "tp2-dp2" / "full"):
        assert row["tokens_per_s"] * row["step_seconds"] == pytest.approx(4 * ACCUM * 64 * 2, rel=1e-9)


@pytest.mark.filterwarnings("ignore:resuming with a different schedule")
def test_checkpoint_loads_in_one_process(runs, tmp_path):
    """The tp2 x pp2 checkpoint holds the dense names, shapes and AdamW state: one process loads
    exactly the gathered weights, then trains on from it."""
    src = runs["root"] / "tp2-pp2" / "full"
    out = tmp_path / "single"
    shutil.copytree(src, out)
    loaded = train(cfg(train__max_steps=8, train__micro_batch=MB), out, resume=True)
    assert loaded.resumed_from == 8 and loaded.steps == 8
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, runs["first"]["tp2-pp2"]["weights"][k]), f"{k} differs in one process"
    on = train(cfg(train__max_steps=10, train__micro_batch=MB), out, resume=True)
    assert on.resumed_from == 8 and on.steps == 10
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows(out))


def test_world_size_is_checked_when_the_ranks_start(runs):
    for rank_out in runs["refusals"]:
        for name, (message, exists) in rank_out.items():
            assert message and "4 ranks started" in message and "parallel.dp" in message, (name, message)
            assert not exists, f"{name}: the run folder was created before the refusal"


@pytest.mark.parametrize("sets, match", [
    ({"parallel__tp": 3, "train__strategy": "ddp"}, r"parallel.tp = 3 must divide model.n_heads \(4\)"),
    ({"parallel__tp": 4, "train__strategy": "ddp", "model__preset": "llama-tiny"},
     r"parallel.tp = 4 must divide model.n_kv_heads \(2\)"),
    ({"parallel__tp": 2, "train__strategy": "ddp", "data__vocab_size": 63},
     r"parallel.tp = 2 must divide model.vocab_size \(63\)"),
    ({"parallel__pp": 3, "train__strategy": "ddp"}, r"parallel.pp = 3 stages, but model.n_layers = 2"),
    ({"parallel__pp": 2, "parallel__virtual_stages": 2}, r"parallel.virtual_stages = 2 needs parallel.pp_schedule"),
    ({"parallel__sequence_parallel": True}, r"parallel.sequence_parallel = true needs parallel.tp > 1"),
    ({"parallel__tp": 2, "train__strategy": "deepspeed"}, r"parallel.tp = 2 does not compose with train.strategy = 'deepspeed'"),
    ({"parallel__tp": 2}, r"parallel.tp = 2 does not compose with train.strategy = 'single'.*one of 'ddp', 'zero1', 'zero2', 'fsdp'"),
    ({"parallel__pp": 2, "train__strategy": "fsdp"}, r"train.strategy = 'fsdp' with parallel.pp = 2 is not supported"),
    ({"parallel__pp": 2, "train__strategy": "ddp", "parallel__pp_schedule": "interleaved", "train__compile": True},
     r"train.compile = true does not apply to parallel.pp_schedule = 'interleaved'"),
    ({"parallel__pp": 2, "train__strategy": "ddp", "checkpoint__format": "sharded"}, r"checkpoint.format = 'sharded'"),
    ({"parallel__tp": 2, "train__strategy": "ddp", "model__dropout": 0.1}, r"parallel.tp = 2 needs model.dropout = 0"),
    ({"parallel__pp": 2, "train__strategy": "ddp", "parallel__pp_schedule": "interleaved", "train__grad_accum": 5},
     r"train.grad_accum \(5\) must be a multiple of max\(1, grad_accum // parallel.pp\) = 2"),
    ({"parallel__pp": 2, "parallel__virtual_stages": 2, "parallel__pp_schedule": "interleaved", "train__strategy": "ddp"},
     r"parallel.pp x parallel.virtual_stages = 2 x 2 = 4 stages, but model.n_layers = 2"),
    ({"parallel__pp_schedule": "interleaved", "parallel__virtual_stages": 2}, r"'interleaved' needs parallel.pp > 1"),
    ({"parallel__tp": 0}, r"parallel.tp must be >= 1"),
    ({"parallel__pp_schedule": "zb"}, r"parallel.pp_schedule must be one of 1f1b, gpipe, interleaved"),
    ({"parallel__dp": 2}, r"parallel.dp = 2 is read with parallel.tp or parallel.pp > 1 only"),
])
def test_bad_combinations_are_refused_before_any_file(tmp_path, sets, match):
    with pytest.raises(train_config.ConfigError, match=match):
        train(cfg(**sets), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_mesh_layout_and_drawing():
    lay = mesh_layout(8, tp=2, pp=2)
    assert lay == MeshLayout(dp=2, tp=2, pp=2)
    assert [lay.rank_of(**lay.coords_of(r)) for r in range(8)] == list(range(8))
    assert lay.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # TP peers adjacent
    assert lay.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # stages furthest apart
    assert lay.group_ranks("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # one data-parallel replica each
    text = lay.draw(lay.describe(n_layers=2, n_heads=4, vocab_size=64))
    assert "pp1 dp1" in text and "rank 5: stage 1: block 1, final norm, head, loss; tp shard 1/2 (heads 2-3, " \
        "vocab 32-63); batch share 0/2" in text, text
    with pytest.raises(ValueError, match="dp\\*tp\\*pp\\*cp = 1\\*2\\*2\\*1 = 4 must equal the world size 8"):
        mesh_layout(8, tp=2, pp=2, dp=1)
    with pytest.raises(ValueError, match="not a multiple of tp\\*pp\\*cp"):
        mesh_layout(6, tp=4)


def test_tp_and_pp_keep_one_host_read_per_step(runs):
    """tp2 x pp2 on 4 ranks: the vocab-parallel loss and the pipeline add no host read to the
    stabilizer's one per step (the targets' range is checked once, at start-up, not per micro-batch).
    Counted step by step in the fresh run: every step from 2 on but the one after its save
    (model_parallel_rank_fns.train_counting_reads)."""
    steps = LAYOUTS["tp2-pp2"][0]
    assert runs["reads"] == [one_read_per_step(steps)] * 4, runs["reads"]
