"""`course plan` (course_lib/planner): the three scenarios, the model behind the ranking, errors
that name their flag, the files a plan writes (TOML loads, DeepSpeed parses, scripts pass bash -n
and shellcheck), Young/Daly numbers, and what it says when nothing fits. Properties, never a
hard-coded layout."""
from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest

from course_lib.parallel.mesh import mesh_layout

from course_lib.trainer import config as train_config
from course_lib.estimate import (activation_bytes_first_stage, model_state_bytes, output_backward_transient_bytes,
                                 training_step_peak_bytes)
from course_lib.estimate.activations import activation_breakdown_per_layer
from course_lib.planner import (PLAN_FILES, Layout, PlanError, checkpoint_plan, evaluate, make_spec, plan,
                                write_plan, young_daly_interval_s)
from course_lib.planner.cli import main as plan_main
from course_lib.planner.costs import layer_kwargs

SCENARIO_1 = dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T")
SCENARIO_2 = dict(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
SCENARIO_3 = dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T", seq=8192)


@pytest.fixture(scope="module")
def plans():
    return {name: plan(**kw) for name, kw in (("1", SCENARIO_1), ("2", SCENARIO_2), ("3", SCENARIO_3))}


def peak_from_estimator(spec, lay: Layout) -> float:
    """The peak bytes per GPU recomputed here straight from course_lib.estimate."""
    sh = spec.shape
    states = model_state_bytes(sh.params_on_busiest_rank(tp=lay.tp, pp=lay.pp), recipe=spec.recipe,
                               zero_stage=lay.zero_stage, dp=lay.dp * lay.cp)
    acts = activation_bytes_first_stage(n_layers=sh.n_layers, pp=lay.pp, virtual_stages=lay.virtual_stages,
                                        micro_batches=lay.grad_accum, vocab_size=sh.vocab_size,
                                        **layer_kwargs(spec, lay))
    transient = output_backward_transient_bytes(seq_len=spec.seq // lay.cp, micro_batch=lay.micro_batch,
                                                vocab_size=sh.vocab_size, tp=lay.tp)
    if lay.zero_stage == 3:
        transient += 4 * sh.layer_params() / lay.tp
    if lay.recompute != "none":  # the layer being recomputed (all of it, or its attention core)
        one = activation_breakdown_per_layer(**{**layer_kwargs(spec, lay), "recompute": "none"}).components
        transient += sum(one.values()) if lay.recompute == "full" else one["attention_core"]
    # accumulation: the gradient sum is live from the second micro-batch on - whole for DDP / ZeRO-1,
    # the shard for ZeRO-2/3 (reduce-scattered every micro-batch through DeepSpeed's 5e8-element bucket)
    live = (states.grads if lay.grad_accum > 1 else 0.0)
    bucket = min(5e8, sh.params_on_busiest_rank(tp=lay.tp, pp=lay.pp)) * 2 if lay.zero_stage == 2 else 0.0
    base = training_step_peak_bytes(states, acts, transient_bytes=transient)
    return max(base.backward_start + live + bucket, base.optimizer_step)


def assert_valid_layout(p, c):
    spec, lay = p.spec, c.layout
    sh = spec.shape
    assert lay.tp * lay.pp * lay.dp * lay.cp == spec.gpus
    assert lay.tp <= spec.gpus_per_node and sh.n_heads % lay.tp == 0 and sh.kv_heads % lay.tp == 0
    assert sum(lay.blocks_per_stage(sh.n_layers)) == sh.n_layers and spec.seq % lay.cp == 0
    assert lay.split or sh.n_layers % (lay.pp * lay.virtual_stages) == 0  # uneven stages carry their split
    assert lay.virtual_stages == 1 or lay.grad_accum % lay.pp == 0  # Megatron's interleaving condition
    assert spec.global_batch == lay.dp * lay.micro_batch * lay.grad_accum
    assert c.memory_total <= spec.gpu_memory_bytes * (1 - spec.headroom)
    # The winner on paper, checked against the estimator directly (equal stages here; uneven ones:
    # tests/test_planner_layouts.py).
    if lay.split:
        return
    assert c.memory_total == pytest.approx(peak_from_estimator(spec, lay), rel=1e-9)


@pytest.mark.parametrize("name", ["1", "2", "3"])
def test_best_layout_is_valid_fits_and_matches_the_estimator(plans, name):
    p = plans[name]
    assert p.best is not None and len(p.ranked) > 1
    for c in p.runners_up(4):
        assert_valid_layout(p, c)


def test_scenario_2_keeps_tp_inside_a_node_and_beats_zero3_over_infiniband(plans):
    p = plans["2"]
    best = p.best
    assert best.layout.tp <= 8 and best.links["tp"] != "inter-node"
    # Pure ZeRO-3 over all 64 GPUs fits but moves 3x the weights per micro-batch over InfiniBand.
    z3 = [c for c in p.ranked if c.layout.zero_stage == 3 and c.layout.tp == 1 and c.layout.pp == 1
          and c.layout.cp == 1]
    assert z3 and min(c.step_s for c in z3) > 1.2 * best.step_s
    fastest_z3 = min(z3, key=lambda c: c.step_s)  # loses on traffic, or on the recomputation it needs to fit
    assert fastest_z3.time["dp_exposed"] + fastest_z3.time["recompute"] > 0.2 * best.step_s


def test_scenario_3_long_context_needs_splitting_or_recompute(plans):
    p = plans["3"]
    spec = p.spec
    # Attention scores dominate the plain layout's activations at 8K ...
    plain = Layout(tp=1, pp=1, dp=8, cp=1, zero_stage=3, recompute="none", micro_batch=1,
                   grad_accum=spec.global_batch // 8)
    parts = activation_breakdown_per_layer(**layer_kwargs(spec, plain)).components
    assert parts["attention_core"] > 0.5 * sum(parts.values())
    assert not evaluate(spec, plain).fits
    # ... so every fitting layout splits the sequence (cp, or tp with sequence parallelism) or recomputes.
    for c in p.ranked:
        lay = c.layout
        assert lay.cp > 1 or lay.sequence_parallel or lay.recompute != "none" or lay.pp > 1
    best = p.best.layout
    assert best.cp > 1 or best.sequence_parallel or best.recompute != "none"


def test_context_parallelism_is_a_long_context_tool(plans):
    """At 4K it is not searched while layouts without it fit (its chunking costs are not modelled);
    at 8K it is, and a 4K job that fits only with it still gets it."""
    import dataclasses
    import importlib

    search_mod = importlib.import_module("course_lib.planner.search")
    assert all(c.layout.cp == 1 for c in plans["1"].ranked + plans["2"].ranked)
    assert any(c.layout.cp > 1 for c in plans["3"].ranked)
    original = search_mod.evaluate
    try:  # pretend only cp > 1 layouts fit (no usable memory otherwise): the search must try them at 4K
        def only_cp_fits(spec, lay):
            c = original(spec, lay)
            return c if lay.cp > 1 else dataclasses.replace(c, usable_bytes=0.0)
        search_mod.evaluate = only_cp_fits
        p = plan(**SCENARIO_2)
        assert p.best is not None and p.best.layout.cp > 1
    finally:
        search_mod.evaluate = original


def test_ranking_is_sorted_by_the_modelled_step_time(plans):
    for p in plans.values():
        fastest = min(c.step_s for c in p.ranked)
        assert p.best.step_s <= fastest * 1.005 + 1e-12  # ties within 0.5% go to the simpler layout
        steps = [c.step_s for c in p.ranked]
        assert all(b >= a * 0.995 - 1e-12 for a, b in zip(steps, steps[1:])), "ranked out of order"


def test_ranking_responds_to_the_links():
    # Slow NVLink: tensor parallelism (and cp) become expensive, the best avoids them.
    slow = plan(**SCENARIO_1, intra_node_gbps=2.0)
    assert slow.best.layout.tp == 1 and slow.best.layout.cp == 1
    assert slow.best.time["tp"] == 0
    # Slow InfiniBand: for 70B, traffic that crosses nodes is penalised; the winner exposes little of it.
    p = plan(**SCENARIO_2, inter_node_gbps=0.5)
    assert p.best.time["dp_exposed"] <= min(c.time["dp_exposed"] for c in p.ranked) + 1e-9 or \
        p.best.step_s <= min(c.step_s for c in p.ranked) * 1.005


def test_step_time_terms_add_up_and_use_the_spec():
    spec = make_spec(**SCENARIO_2)
    lay = Layout(tp=8, pp=2, dp=4, cp=1, zero_stage=1, recompute="selective", micro_batch=1, grad_accum=256)
    c = evaluate(spec, lay)
    t = c.time
    assert t["step"] == pytest.approx((t["compute"] + t["tp"] + t["cp"] + t["pp"]) * (1 + t["bubble_fraction"])
                                      + t["dp_exposed"])
    assert t["bubble_fraction"] == pytest.approx(1 / 256)
    assert t["recompute"] > 0 and t["tp"] > 0 and t["cp"] == 0
    assert c.links["tp"] == "NVLink" and c.links["dp"] == "inter-node"
    faster = evaluate(make_spec(**SCENARIO_2, mfu=0.8), lay)
    assert faster.time["compute"] == pytest.approx(t["compute"] * 0.5 / 0.8)


def test_young_daly_numbers(plans):
    assert young_daly_interval_s(100.0, 3600.0 * 625) == pytest.approx(math.sqrt(2 * 100 * 3600 * 625))
    with pytest.raises(ValueError, match="save_cost_s"):
        young_daly_interval_s(0, 10)
    p = plans["2"]  # the layout does not depend on failures or storage: only the checkpoint plan does
    ck = checkpoint_plan(make_spec(**SCENARIO_2, mtbf_hours=4000, storage_gbps=5), p.best)
    assert ck.mtbf_job_h == pytest.approx(4000 / 8)
    assert ck.save_cost_s == pytest.approx(ck.checkpoint_bytes / 5e9)
    assert ck.checkpoint_bytes == pytest.approx(p.spec.shape.num_params() * 14)  # 2 + 4 + 8 bytes
    assert ck.interval_s == pytest.approx(math.sqrt(2 * ck.save_cost_s * 500 * 3600))
    assert abs(ck.save_every_steps * p.best.step_s - ck.interval_s) <= p.best.step_s / 2 + 1e-9
    assert ck.sharded


@pytest.mark.parametrize("argv, flag", [
    (["--gpu", "b300"], "--gpu"),
    (["--gpus", "60"], "--gpus"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "-5"], "--tokens"),
    (["--tokens", "lots"], "--tokens"),
    (["--model", "llama9-1t"], "--model"),
    (["--seq", "0"], "--seq"),
    (["--seq", "-1"], "--seq"),
    (["--headroom", "1.5"], "--headroom"),
    (["--mfu", "0"], "--mfu"),
    (["--interconnect", "carrier-pigeon"], "--interconnect"),
    (["--global-batch-tokens", "10"], "--global-batch-tokens"),
    (["--mtbf-hours", "0"], "--mtbf-hours"),
    (["--gpus-per-node", "0"], "--gpus-per-node"),
])
def test_bad_input_names_the_flag_and_writes_nothing(argv, flag, tmp_path, capsys):
    base = {"--model": "llama2-7b", "--gpu": "a100-80gb", "--gpus": "8", "--tokens": "1T"}
    merged = dict(base)
    merged.update(dict(zip(argv[::2], argv[1::2])))
    out = tmp_path / "plan"
    args = [x for kv in merged.items() for x in kv] + ["--out", str(out)]
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert f"course plan: {flag}:" in err
    assert not out.exists()


def test_unknown_gpu_lists_names_and_explicit_numbers_work():
    with pytest.raises(PlanError, match="a100-80gb.*--gpu-memory-gib"):
        make_spec(model="llama2-7b", gpu="mystery", gpus=8, tokens=1e9)
    spec = make_spec(model="llama2-7b", gpu="mystery", gpus=8, tokens=1e9, gpu_memory_gib=96, gpu_tflops=400)
    assert spec.gpu_memory_bytes == 96 * 2**30 and spec.gpu_peak_flops == 400e12


def test_nothing_fits_says_how_many_gpus_would(tmp_path, capsys):
    kw = dict(model="llama2-70b", gpu="a100-40gb", gpus=8, gpus_per_node=8, tokens="2T")
    p = plan(**kw)
    assert p.best is None and p.closest_misses
    more = [a for a in p.advice if a.startswith("more GPUs")]
    assert more
    n = int(more[0].split(":")[1].split()[0])
    assert n > 8 and plan(**{**kw, "gpus": n}).best is not None  # the advice holds
    assert plan(**{**kw, "gpus": n - 8}).best is None            # and is the smallest whole-node count
    assert any(a.startswith("offload") for a in p.advice)
    rc = plan_main(["--model", "llama2-70b", "--gpu", "a100-40gb", "--gpus", "8", "--tokens", "2T",
                    "--out", str(tmp_path)])
    assert rc == 1 and "nothing fits" in capsys.readouterr().out
    assert "Nothing fits" in (tmp_path / "plan.md").read_text()


@pytest.fixture(scope="module")
def written(tmp_path_factory, plans):
    out = tmp_path_factory.mktemp("plan70b")
    (out / "notes.txt").write_text("mine")          # not the planner's: must survive
    (out / "train.toml").write_text("stale = 1\n")  # the planner's: must be replaced
    write_plan(plans["2"], out)
    return out


def test_files_written_and_other_files_kept(written):
    names = {p.name for p in written.iterdir()}
    # tp/pp: no DeepSpeed file - the kit's DeepSpeed strategy runs data parallelism only
    assert set(PLAN_FILES) - {"ds_config.json", "launch_deepspeed.sh", "hostfile"} <= names and "notes.txt" in names
    assert not names & {"ds_config.json", "launch_deepspeed.sh", "hostfile"}
    assert "runs data parallelism only" in (written / "plan.md").read_text()
    assert (written / "notes.txt").read_text() == "mine"
    assert not [n for n in names if n.startswith(".")], "temporary files left behind"


def test_trainer_toml_loads_and_carries_the_layout(written, plans):
    cfg = train_config.load(written / "train.toml")
    best = plans["2"].best.layout
    par = cfg["parallel"]
    assert (par["tp"], par["pp"]) == (best.tp, best.pp)
    assert par["dp"] * par["tp"] * par["pp"] * par["cp"] == 64
    assert cfg["train"]["strategy"] == ("ddp", "zero1", "zero2", "zero2")[best.zero_stage]  # ZeRO under tp/pp
    assert cfg["train"]["micro_batch"] * cfg["train"]["grad_accum"] * par["dp"] == 1024
    assert cfg["model"]["n_layers"] == 80 and cfg["model"]["n_kv_heads"] == 8
    assert "teaching" in (written / "train.toml").read_text()


def test_deepspeed_json_passes_deepspeeds_parser(tmp_path, plans):
    """A data-parallel plan (7B on one node) gets DeepSpeed's config, checked by DeepSpeed's parser
    for the ranks it will start on."""
    pytest.importorskip("deepspeed")
    from course_lib.parallel.deepspeed.config import validate_ds_config

    p7 = plans["1"]
    write_plan(p7, tmp_path)
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    best = p7.best.layout
    assert best.tp * best.pp * best.cp == 1 and (tmp_path / "launch_deepspeed.sh").is_file()
    assert ds["zero_optimization"]["stage"] == best.zero_stage
    validate_ds_config(ds, world_size=best.dp)
    fsdp = json.loads((tmp_path / "fsdp_settings.json").read_text())
    assert fsdp["device_mesh"]["tp"] == best.tp and isinstance(fsdp["applies"], bool)


def test_budget_is_consistent(written, plans):
    b = json.loads((written / "budget.json").read_text())
    p = plans["2"]
    assert b["days"] == pytest.approx(2e12 / b["tokens_per_s"] / 86400)
    assert b["gpu_hours"] == pytest.approx(b["days"] * 24 * 64)
    mem = b["memory_gib_per_gpu"]
    assert mem["peak"] * 2**30 == pytest.approx(p.best.memory_total)
    assert mem["peak"] + mem["headroom_reserved"] <= mem["device"] + 1e-9
    assert b["slurm"]["nodes"] == 8 and b["slurm"]["gpus_per_node"] == 8
    md = (written / "plan.md").read_text()
    for word in ("Young/Daly", "--resume auto", "checkpoint.mirror", "Why:", "GPU-hours"):
        assert word in md


def test_scripts_parse_and_pass_shellcheck(written):
    scripts = [written / n for n in ("launch_torchrun.sh", "launch_accelerate.sh", "job.sbatch")]
    for s in scripts:
        res = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert "--resume auto" in s.read_text() or "'--resume' 'auto'" in s.read_text() or "auto" in s.read_text()
    assert "--nodes=8" in (written / "job.sbatch").read_text()
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed; bash -n passed")
    res = subprocess.run(["shellcheck", "-s", "bash", *map(str, scripts)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_cli_prints_the_table(capsys):
    assert plan_main(["--model", "llama2-7b", "--gpu", "a100-80gb", "--gpus", "8", "--tokens", "1T"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "reason" in out and "tokens/s" in out


@pytest.mark.parametrize("kw", [SCENARIO_1, SCENARIO_3, {**SCENARIO_2, "attention": "flash", "gpu": "h100"}],
                         ids=["7b-1node", "7b-8k", "70b-h100-flash"])
def test_every_scenarios_files_load(kw, tmp_path, plans):
    from course_lib.planner import plan_files

    shared = {id(SCENARIO_1): "1", id(SCENARIO_3): "3"}  # searched once for the module
    p = plans[shared[id(kw)]] if id(kw) in shared else plan(**kw)
    files = plan_files(p, tmp_path)  # validates the DeepSpeed JSON with DeepSpeed's parser
    (tmp_path / "train.toml").write_text(files["train.toml"])
    cfg = train_config.load(tmp_path / "train.toml")
    best = p.best.layout
    par = cfg["parallel"]
    mp = par["tp"] * par["pp"] * par["cp"]
    ranks = par["dp"] or kw["gpus"] // mp
    assert ranks * mp == kw["gpus"]
    mesh_layout(kw["gpus"], tp=par["tp"], pp=par["pp"], cp=par["cp"], dp=par["dp"])  # the trainer's world check
    assert ranks * cfg["train"]["micro_batch"] * cfg["train"]["grad_accum"] == p.spec.global_batch
    assert cfg["model"]["checkpointing"] == best.recompute  # the trainer recomputes under tp too
    if best.pp == 1:  # context parallelism runs as such (not folded into dp) where the trainer composes it
        assert par["cp"] == best.cp
    assert ("ds_config.json" in files) == (best.tp * best.pp * best.cp == 1)


def test_course_cli_has_plan(capsys):
    from course_lib.cli import main

    assert main(["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--tokens", "1T",
                 "--top", "2"]) == 0
    assert "best:" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# exercise 12's judge (course_lib/planner/exercise.py)
# --------------------------------------------------------------------------------------------

def test_exercise_review_explains_what_is_wrong():
    from course_lib.planner.exercise import check_layout, review, scenario

    spec = scenario("7b-one-node")
    base = dict(tp=1, pp=1, dp=8, zero_stage=3, recompute="none", micro_batch=1,
                why="shard all model state over the node with FSDP")
    assert "crosses the node boundary" in review(spec, dict(base, tp=16, dp=1))["verdict"]
    assert "must divide" in review(spec, dict(base, tp=3, dp=1))["verdict"] or \
        "tp x pp x dp" in review(spec, dict(base, tp=3, dp=1))["verdict"]
    assert "not a multiple of dp x micro_batch" in review(spec, dict(base, dp=8, micro_batch=3))["verdict"]
    verdict = review(spec, dict(base, zero_stage=0))["verdict"]
    assert verdict.startswith("does not fit") and "optimizer states" in verdict and "ZeRO-1" in verdict
    assert review(spec, base)["fits"]
    check_layout(spec, base)  # the planner's own choice passes
    with pytest.raises(Exception, match="justification"):
        check_layout(spec, dict(base, why=""))
    with pytest.raises(Exception, match="slower than the best"):
        check_layout(scenario("70b-8-nodes"), dict(tp=1, pp=1, dp=64, zero_stage=3, recompute="full",
                                                   micro_batch=1, why="shard everything over all GPUs"))


def test_exercise_chooser_runs_with_the_planner_switched_off():
    from course_lib.kit.checks import CheckFailed
    from course_lib.planner.exercise import check_chooser, scenario

    def cheat(spec):
        return plan(**SCENARIO_1).best  # calls the planner's search

    with pytest.raises(CheckFailed, match="switched off"):
        check_chooser(cheat, {"7b": scenario("7b-one-node")})

    def illegal(spec):
        return dict(tp=16, pp=1, dp=1, zero_stage=0, recompute="none", micro_batch=1)

    with pytest.raises(CheckFailed, match="node boundary"):
        check_chooser(illegal, {"7b": scenario("7b-one-node")})
    from course_lib.planner import search as planner_search_fn  # the function is restored afterwards
    assert planner_search_fn(make_spec(**SCENARIO_1)).best is not None


def test_mirror_goes_into_the_toml(tmp_path, plans):
    from course_lib.planner import plan_files

    # full checkpoints (zero1 under tp/pp) and fsdp's sharded (DCP) ones are both mirrored: the
    # TOML sets checkpoint.mirror and validates (only DeepSpeed's shards are not mirrored)
    for scenario, mirrored in (("2", True), ("1", True)):
        files = plan_files(plans[scenario], tmp_path, mirror="file:///tmp/mirror", validate_ds=False)
        (tmp_path / "train.toml").write_text(files["train.toml"])
        cfg = train_config.load(tmp_path / "train.toml")  # validates: the plan starts as written
        assert cfg["checkpoint"]["mirror"] == ("file:///tmp/mirror" if mirrored else ""), scenario
        assert "file:///tmp/mirror" in files["train.toml"], scenario
