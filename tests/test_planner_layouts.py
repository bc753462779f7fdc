"""`course plan` layouts as real runs have them (issue 21): uneven pipeline stages (the busiest rank
sets memory and time), interleaved 1F1B (bubble (pp-1)/(m v), v times the stage-to-stage sends),
`--layout` scoring, and a global batch that is never changed silently. Pure Python, no ranks."""
from __future__ import annotations

import dataclasses

import pytest

from course_lib.trainer import config as train_config
from course_lib.estimate import (ModelShape, activation_bytes_first_stage, bubble_fraction, model_flops_per_iteration)
from course_lib.estimate.activations import activation_bytes_per_layer
from course_lib.estimate.stage_split import stage_split
from course_lib.planner import Layout, PlanError, evaluate, make_spec, plan, score_layout
from course_lib.planner.checkpoint_plan import checkpoint_plan
from course_lib.planner.cli import main as plan_main
from course_lib.planner.configs import trainer_toml
from course_lib.planner.costs import layer_kwargs
from course_lib.planner.search import layouts
from course_lib.planner.stages import balanced_counts, in_flight_layers

BLOOM = ModelShape(70, 14336, 112, 250880, 2048, tied_embeddings=True, learned_pos_emb=False, bias=True,
                   mlp="gelu", norm="layernorm")
BLOOM_SHAPE = {f.name: getattr(BLOOM, f.name) for f in dataclasses.fields(BLOOM)}
BLOOM_JOB = dict(gpu="a100-80gb", gpus=384, gpus_per_node=8, tokens="366B", global_batch_tokens=2048 * 2048,
                 shape_overrides=BLOOM_SHAPE)
SEVEN_B = dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T")


@pytest.fixture(scope="module")
def bloom_spec():
    return make_spec(**BLOOM_JOB)


@pytest.mark.parametrize("name, stages", [("bloom", 12), ("bloom", 5), ("llama3-405b", 16), ("llama2-70b", 6),
                                          ("gpt3-175b", 7), ("llama2-7b", 3)])
def test_fast_balanced_split_is_stage_splits_balanced(name, stages):
    from course_lib.estimate import PRESETS

    sh = BLOOM if name == "bloom" else PRESETS[name]
    assert balanced_counts(sh, stages, sh.seq_len) == tuple(stage_split(sh, stages, 1, "balanced"))


def _loads(spec, counts, pp):
    """Forward FLOPs per pipeline rank, from estimate.flops (independent of planner.stages)."""
    sh = spec.shape
    one = dataclasses.replace(sh, n_layers=1)
    block = model_flops_per_iteration(one, batch=1, seq_len=spec.seq) / 3 - 2 * spec.seq * sh.d_model * sh.vocab_size
    loads = [0.0] * pp
    for i, n in enumerate(counts):
        loads[i % pp] += n * block
    loads[(len(counts) - 1) % pp] += 2 * spec.seq * sh.d_model * sh.vocab_size
    return loads


def test_uneven_stages_busiest_rank_sets_time_and_memory(bloom_spec):
    spec = bloom_spec
    base = Layout(4, 12, 8, 1, 1, "full", 2, 128)
    balanced = evaluate(spec, dataclasses.replace(base, split=(5,) + (6,) * 10 + (5,)))
    lopsided = evaluate(spec, dataclasses.replace(base, split=(7,) + (6,) * 10 + (3,)))
    ideal = model_flops_per_iteration(spec.shape, batch=spec.global_batch, seq_len=spec.seq, recompute="full") \
        / (spec.gpus * spec.gpu_peak_flops * spec.mfu)
    for c in (balanced, lopsided):
        loads = _loads(spec, c.stage_blocks, 12)
        assert c.time["compute"] == pytest.approx(ideal * max(loads) * 12 / sum(loads), rel=1e-9)
        # memory: the largest rank's parameters and the largest rank's activations (1F1B: pp - r in flight)
        per_layer = activation_bytes_per_layer(**layer_kwargs(spec, c.layout))
        acts = max(per_layer * n * min(12 - r, 128) for r, n in enumerate(c.stage_blocks))
        assert c.memory["activations"] == pytest.approx(acts, rel=1e-9)
        params = max(spec.shape.params_on_rank(tp=4, pp=12, stage=r, blocks=n) for r, n in enumerate(c.stage_blocks))
        assert c.memory["params"] == pytest.approx(params * 2, rel=1e-9)  # bf16 weights
    assert lopsided.step_s > balanced.step_s and lopsided.memory_total > balanced.memory_total


def test_even_interleaved_memory_matches_korthikanti():
    spec = make_spec(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
    for v in (1, 2, 4):
        lay = Layout(8, 4, 2, 1, 1, "selective", 1, 512, v)
        kw = layer_kwargs(spec, lay)
        want = activation_bytes_first_stage(n_layers=80, pp=4, virtual_stages=v, micro_batches=512,
                                            vocab_size=spec.shape.vocab_size, **kw)
        assert evaluate(spec, lay).memory["activations"] == pytest.approx(want, rel=1e-12)
        assert in_flight_layers(20, 4, v, 512, 0) * activation_bytes_per_layer(**kw) == pytest.approx(want, rel=1e-12)


def test_interleaving_divides_the_bubble_and_multiplies_the_sends():
    spec = make_spec(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
    one = evaluate(spec, Layout(8, 4, 2, 1, 1, "selective", 1, 512))
    for v in (2, 4, 5):
        c = evaluate(spec, Layout(8, 4, 2, 1, 1, "selective", 1, 512, v))
        assert c.time["bubble_fraction"] == pytest.approx(3 / (512 * v))
        assert c.time["bubble_fraction"] == pytest.approx(bubble_fraction(4, 512, schedule="interleaved",
                                                                          virtual_stages=v))
        assert c.time["pp"] == pytest.approx(v * one.time["pp"])
        assert c.memory["activations"] > one.memory["activations"]  # more micro-batch chunks in flight


def test_search_covers_uneven_and_interleaved_layouts_by_the_rules(bloom_spec):
    lays = layouts(bloom_spec, recomputes=("full",), micro_batches=(2,), context_parallel=(1,))
    pp12 = [lay for lay in lays if (lay.tp, lay.pp) == (4, 12) and lay.virtual_stages == 1]
    assert pp12 and all(lay.split == (5,) + (6,) * 10 + (5,) for lay in pp12)  # BLOOM's published split
    # BLOOM on 384 GPUs cannot interleave (pp carries the factor 3, the micro-batch counts are powers of 2)
    assert not [lay for lay in lays if lay.virtual_stages > 1]
    spec70 = make_spec(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
    inter = [lay for lay in layouts(spec70, recomputes=("full",), context_parallel=(1,)) if lay.virtual_stages > 1]
    assert {lay.virtual_stages for lay in inter} >= {2, 4, 8}
    for lay in inter:
        assert lay.pp > 1 and lay.grad_accum % lay.pp == 0 and lay.pp * lay.virtual_stages <= 80
        assert sum(lay.blocks_per_stage(80)) == 80 and len(lay.blocks_per_stage(80)) == lay.pp * lay.virtual_stages


def test_llama3_405b_at_16k_gpus_is_not_a_94_percent_bubble():
    p = plan(model="llama3-405b", gpu="h100", gpus=16384, tokens="15T", global_batch_tokens=2048 * 8192)
    best = p.best
    assert best.time["bubble_fraction"] < 0.5
    plain = evaluate(p.spec, dataclasses.replace(best.layout, virtual_stages=1, split=()))
    assert best.step_s <= plain.step_s


def test_score_layout_ranks_against_the_best():
    spec = make_spec(**SEVEN_B)
    p = plan(**SEVEN_B)
    s = score_layout(spec, p.best.layout, plan=p)
    assert s.rank == 1 and s.slower_than_best == pytest.approx(0)
    lay = p.best.layout
    text = f"tp{lay.tp},pp{lay.pp},dp{lay.dp},cp{lay.cp},zero{lay.zero_stage},recompute={lay.recompute},mb{lay.micro_batch}"
    assert score_layout(spec, text, plan=p).candidate.step_s == pytest.approx(p.best.step_s)
    worse = score_layout(spec, "tp8,pp1,dp1,recompute=full,mb1", plan=p)
    assert worse.candidate.fits and worse.rank > 1 and worse.slower_than_best > 0
    assert worse.rank == 1 + sum(c.step_s < worse.candidate.step_s for c in p.ranked)
    free = score_layout(spec, "tp2", plan=p)  # free fields: the fastest fitting choice with tp = 2
    assert free.candidate.layout.tp == 2 and "chosen by the scorer" in str(free)
    assert free.candidate.step_s == pytest.approx(min(c.step_s for c in p.ranked if c.layout.tp == 2), rel=0.006)


@pytest.mark.parametrize("layout", ["tp8,pp3", "tp3", "tp2,tp2", "xx4", "tp8,pp1,dp2", "pp2,zero3",
                                    "tp8,zero1", "pp2,split=10:10", "pp2,split=even,v3", "recompute=some", "tp16",
                                    "pp8,v5", "v2", ""])
def test_bad_layout_exits_2_naming_the_flag_and_writes_nothing(layout, tmp_path, capsys):
    argv = ["--model", "llama2-7b", "--gpu", "a100-80gb", "--gpus", "8", "--tokens", "1T", "--layout", layout]
    assert plan_main(argv) == 2
    assert "course plan: --layout:" in capsys.readouterr().err
    out = tmp_path / "p"
    assert plan_main(argv[:-2] + ["--layout", "tp8", "--out", str(out)]) == 2 and not out.exists()


def test_cli_layout_prints_the_breakdown(capsys):
    rc = plan_main(["--model", "llama2-70b", "--gpu", "a100-80gb", "--gpus", "64", "--tokens", "2T",
                    "--layout", "tp8,pp4,dp2,v2,zero1,recompute=selective"])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("memory per GPU (GiB)", "interleaved", "bubble", "fits: yes", "rank:", "best:", "tokens/s"):
        assert word in out, word


def test_published_batch_is_kept_and_odd_batches_are_refused(bloom_spec, tmp_path, capsys):
    assert bloom_spec.global_batch == 2048 and bloom_spec.batch_note == ""  # dp 8 divides it: not 1,920
    kw = dict(SEVEN_B, gpus=512, global_batch_tokens=1001 * 4096)  # 512 GPUs, 32 layers: every dp is even
    with pytest.raises(PlanError, match=r"^--global-batch-tokens: .*nearest that work: .*--round-batch") as err:
        make_spec(**kw)
    import re

    lo_hi = [int(x) for x in re.findall(r"\((\d+) sequences\)", str(err.value))]
    assert len(lo_hi) == 2
    assert lo_hi[0] < 1001 < lo_hi[1]
    for b in lo_hi:  # each suggestion plans
        assert plan(**dict(kw, global_batch_tokens=b * 4096)).spec.global_batch == b
    rounded = make_spec(**kw, allow_batch_rounding=True)
    assert rounded.global_batch in lo_hi and "--round-batch" in rounded.batch_note
    argv = ["--model", "llama2-7b", "--gpu", "a100-80gb", "--gpus", "512", "--tokens", "1T",
            "--global-batch-tokens", str(1001 * 4096), "--out", str(tmp_path / "p")]
    assert plan_main(argv) == 2 and "course plan: --global-batch-tokens:" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
    assert plan_main(argv + ["--round-batch"]) == 0
    assert "--round-batch" in capsys.readouterr().out


def test_uneven_interleaved_plan_writes_a_toml_the_trainer_accepts(bloom_spec, tmp_path):
    spec70 = make_spec(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
    uneven = score_layout(bloom_spec, "tp4,pp12,dp8,zero1,recompute=full,mb2,v1,split=5:6*10:5").candidate
    inter = score_layout(spec70, "tp8,pp4,dp2,v3,zero1,recompute=selective,mb1").candidate
    assert inter.layout.split  # 80 blocks on 12 stages: the balanced split
    for spec, cand in ((bloom_spec, uneven), (spec70, inter)):
        text = trainer_toml(spec, cand, checkpoint_plan(spec, cand))
        (tmp_path / "train.toml").write_text(text)
        cfg = train_config.load(tmp_path / "train.toml")
        par = cfg["parallel"]
        assert (par["pp"], par["virtual_stages"]) == (cand.layout.pp, cand.layout.virtual_stages)
        assert par["pp_schedule"] == cand.layout.schedule
        if cand.layout.split:
            assert list(par["pp_split"]) == list(cand.layout.split)


def test_multi_node_accelerate_takes_the_main_node_and_rank_from_the_job(tmp_path):
    """launch_accelerate.sh with accelerate and scontrol faked: under SLURM and with MASTER_ADDR /
    NODE_RANK it passes the job's main node and machine rank (never 127.0.0.1); without either it stops."""
    import os
    import stat
    import subprocess

    from course_lib.planner import plan_files

    files = plan_files(plan(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12), tmp_path,
                       validate_ds=False)
    script = tmp_path / "launch_accelerate.sh"
    script.write_text(files["launch_accelerate.sh"])
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("accelerate", 'echo "ARGS $*"'), ("scontrol", 'printf "gpu-a17\\ngpu-a18\\n"')):
        (fake / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (fake / name).chmod(stat.S_IRWXU)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_", "NODE_RANK"))}
    base["PATH"] = f"{fake}:{base['PATH']}"

    def run(**env):
        return subprocess.run(["bash", str(script)], env={**base, **env}, capture_output=True, text=True)

    slurm = run(SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_NODEID="3")
    assert slurm.returncode == 0, slurm.stderr
    args = slurm.stdout.split("ARGS ")[1]
    assert "--main_process_ip gpu-a17" in args and "--machine_rank 3" in args and "127.0.0.1" not in args
    manual = run(MASTER_ADDR="10.0.0.5", NODE_RANK="1")
    assert "--main_process_ip 10.0.0.5" in manual.stdout and "--machine_rank 1" in manual.stdout
    assert run().returncode != 0
