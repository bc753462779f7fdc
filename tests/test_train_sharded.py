"""The sharding strategies in the trainer: the same numbers as one process, bit-exact resume,
checkpoints that load on another world size and into a plain model.

zero1 / zero2 / fsdp-scratch are the course's own code (ShardedOptimizer, SimpleFSDP); fsdp is torch
FSDP2. Each runs on 2 gloo ranks with half the micro-batch, so the global batch equals the
single-process reference's. The same launch runs every data-parallel strategy through injected
non-finite steps (a NaN loss, an Inf in a gradient that one rank alone holds under ZeRO-2).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import sharded_train_rank_fns as fns
from rank_fns import several
from course_lib.trainer import config as train_config
from course_lib.parallel import run_ranks
from course_lib.train import train

TINY = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
SHARDED = ["zero1", "zero2", "fsdp-scratch", "fsdp"]
KILLED = "fsdp-killed"  # fsdp with checkpoint.async_save, SIGKILLed mid-write (the others save synchronously)
FAULT_STEPS = 7
# A NaN loss (NaN in every gradient), then an Inf in one element of a gradient ZeRO-2 leaves on
# rank 1 only (ShardedOptimizer's greedy split; checked below), then one it leaves on rank 0 only.
OWNED_BY = {4: ("blocks.1.mlp.down.weight", 1), 6: ("tok_emb.weight", 0)}
FAULTS = ["nan_loss@2", *(f"inf_grad@{step}={name}" for step, (name, _) in OWNED_BY.items())]
FAULTY = ["ddp", "zero1", "zero2", "fsdp-scratch", "fsdp"]


def cfg(**sets):
    overrides = ["train.progress=false", "train.max_steps=12", "schedule.warmup_steps=3",
                 "train.peak_flops=1e12"]  # no CPU peak measurement: not what is tested here
    overrides += [f"{k.replace('__', '.')}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
                  for k, v in sets.items()]
    return train_config.load(TINY, overrides)


def losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def max_rel(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def ws_cfg(steps, micro, strategy="fsdp"):
    """The world-size test's runs: the global batch (12) kept, a constant schedule after warm-up
    (the learning rate must not depend on where a run stops)."""
    return cfg(train__max_steps=steps, train__micro_batch=micro, train__strategy=strategy,
               schedule__kind="constant", checkpoint__async_save=False)


MIXED = {"fsdp-bf16": dict(train__strategy="fsdp", train__precision="bf16"),
         "fsdp-offload": dict(train__strategy="fsdp", parallel__cpu_offload=True),
         "fsdp-scratch-bf16": dict(train__strategy="fsdp-scratch", train__precision="bf16")}
FULL_FOR_ONE = ("zero2", "fsdp-scratch")  # scratch strategies whose full checkpoint one process resumes


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every multi-rank run of this module in three launches (a rank's first train() pays seconds
    of imports; one start per launch, not per check), and the one-process references:

    1. 2 ranks: every sharded strategy for 12 steps (fp32; equality with one process: the issue's
       50-step match runs with ``-m slow``, test_fifty_steps_match_one_process), fsdp with
       reshard_after_forward = False for 12, every data-parallel strategy through injected
       non-finite steps, the bf16/offload runs, zero2/fsdp-scratch runs whose full checkpoint one
       process resumes, per strategy 8 steps saving at 4 and 8 (the resume test's first half),
       fsdp 4 steps on the global batch (the world-size test's first run), the empty-shard
       statistics; then "fsdp-killed": fsdp with checkpoint.async_save, rank 1 SIGKILLed in the
       middle of the background write of step 8 (the launch fails there; its reports were saved
       to a file first).
    2. 3 ranks: the world-size run resumed from step 4 to 8.
    3. 2 ranks: each resume test's copy (step-8 checkpoint removed) resumed from step 4, the killed
       folder resumed as the kill left it, the world-size run shrunk back to 2 ranks (8 -> 12);
       then the resumes beside checkpoints of another format (other_format_cases).
    """
    from course_lib.parallel import RankFailedError

    root = tmp_path_factory.mktemp("sharded")
    single = {"12": train(cfg(train__micro_batch=16), root / "single-12")}
    train(cfg(train__max_steps=FAULT_STEPS, train__micro_batch=16), root / "single-faults", faults=FAULTS)
    train(ws_cfg(12, 12, "single"), root / "ws-single")

    named = {s: (cfg(train__micro_batch=8, train__strategy=s), str(root / s), False)
             for s in SHARDED}
    named["fsdp-zero2"] = (cfg(train__micro_batch=8, train__strategy="fsdp", parallel__reshard_after_forward=False),
                           str(root / "fsdp-zero2"), False)
    named.update({f"{s}-faults": (cfg(train__max_steps=FAULT_STEPS, train__micro_batch=8, train__strategy=s),
                                  str(root / f"{s}-faults"), False, FAULTS) for s in FAULTY})
    named.update({n: (cfg(train__micro_batch=8, **sets), str(root / n), False) for n, sets in MIXED.items()})
    named.update({f"{n}-full": (cfg(train__max_steps=6, train__micro_batch=8, train__strategy=n,
                                    checkpoint__async_save=False), str(root / f"{n}-full"), False)
                  for n in FULL_FOR_ONE})
    confs = {n: cfg(train__max_steps=8, train__micro_batch=8, train__strategy=n, checkpoint__save_every=4,
                    checkpoint__async_save=False) for n in SHARDED}
    rroot = root / "resume"  # the resume test's folders (and the killed one) under one root
    named.update({f"{n}-resume": (confs[n], str(rroot / n / "full"), False) for n in SHARDED})
    named["ws-two"] = (ws_cfg(4, 6), str(root / "ws" / "two"), False)
    async_conf = cfg(train__max_steps=8, train__micro_batch=8, train__strategy="fsdp", checkpoint__save_every=4,
                     checkpoint__async_save=True)
    killed, report = rroot / KILLED, root / "first-launch.pt"
    with pytest.raises(RankFailedError) as died:
        run_ranks(fns.train_many_stats_then_killed, 2, list(named.values()), str(report), async_conf, str(killed), 8,
                  timeout=900)
    first_reports, stats = torch.load(report, weights_only=False)
    first = dict(zip(named, first_reports))
    torn = sorted(p.name for p in (killed / "checkpoints").iterdir())
    torn_files = sorted(f.name for d in (killed / "checkpoints").glob(".tmp-step_000000008-*") for f in d.iterdir())

    three = root / "ws" / "three"
    shutil.copytree(root / "ws" / "two", three)  # step 4 holds rank0.pt and rank1.pt only
    grown = run_ranks(fns.train_many, 3, [(ws_cfg(8, 4), str(three), True)])[0][0]
    back = root / "ws" / "back"
    shutil.copytree(three, back)

    for n in SHARDED:
        shutil.copytree(rroot / n / "full", rroot / n / "cut")
        shutil.rmtree(sorted((rroot / n / "cut" / "checkpoints").glob("step_*"))[-1])
    runs = [(confs[n], str(rroot / n / "cut"), True) for n in SHARDED] + [(async_conf, str(killed), True)]
    runs.append((ws_cfg(12, 6), str(back), True))
    calls = [(fns.train_many, (runs,)), (fns.resume_into_other_formats, (other_format_cases(), str(root / "other-formats")))]
    third = run_ranks(several, 2, calls, timeout=600)
    second = third[0][0]
    return {"root": root, "single": single, "first": first, "stats": stats, "grown": grown,
            "shrunk": second[-1], "second": dict(zip(SHARDED + [KILLED], second[:-1])),
            "other_formats": third[0][1],
            "kill": {"rank": died.value.rank, "msg": str(died.value).splitlines()[0], "left": torn,
                     "torn_files": torn_files}}


@pytest.fixture(scope="module")
def fifty_steps(launches):
    """(root, the 12-step single-process result, {strategy: rank 0's report}, per-rank stats)."""
    return launches["root"], launches["single"]["12"], launches["first"], launches["stats"]


def assert_matches_one_process(root, single, reports, name, reference="single"):
    rel = max_rel(losses(root / name), losses(root / reference))
    assert rel <= 1e-4, f"{name}: per-step losses differ from one process by up to {rel:.2e} (relative)"
    ref = {k: v.float() for k, v in single.model.state_dict().items()}
    got = reports[name]["weights"]
    assert set(got) == set(ref), f"{name}: full weights have other names than the plain model"
    # Over the whole model: a per-tensor check is ill-posed for the key bias (softmax ignores it,
    # its gradient is rounding noise that Adam normalises into steps of size lr).
    diff = torch.cat([(got[k] - ref[k]).reshape(-1) for k in ref]).norm()
    rel_w = (diff / torch.cat([ref[k].reshape(-1) for k in ref]).norm()).item()
    assert rel_w <= 1e-4, f"{name}: final weights differ from one process by {rel_w:.2e} (relative L2)"


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_strategies_match_one_process(fifty_steps, name):
    """12 steps (warm-up and the cosine decay): per-step losses and final
    weights within 1e-4 of one process. The 50-step version (drift over a longer run) is
    test_fifty_steps_match_one_process, ``-m slow``."""
    root, single, reports, _ = fifty_steps
    assert_matches_one_process(root, single, reports, name, reference="single-12")


@pytest.mark.slow
def test_fifty_steps_match_one_process(tmp_path):
    """Issue's loss match: every sharded strategy 50 steps on 2 ranks, in a launch of its own,
    within 1e-4 of one process (losses and final weights)."""
    single = train(cfg(train__max_steps=50, train__micro_batch=16), tmp_path / "single")
    runs = [(cfg(train__max_steps=50, train__micro_batch=8, train__strategy=s), str(tmp_path / s), False)
            for s in SHARDED]
    reports = dict(zip(SHARDED, run_ranks(fns.train_many, 2, runs, timeout=900)[0]))
    for name in SHARDED:
        assert_matches_one_process(tmp_path, single, reports, name)


def test_fsdp_without_resharding_after_forward_matches_one_process(launches):
    """fsdp with reshard_after_forward = False (ZeRO-2-like: parameters stay gathered until the
    backward): a variant of fsdp's match above, 12 steps against the 12-step reference."""
    assert_matches_one_process(launches["root"], launches["single"]["12"], launches["first"], "fsdp-zero2",
                               reference="single-12")


def bundle(out, step, rank):
    """The non-finite step's diagnostic bundle one rank wrote (None: that rank wrote none)."""
    path = Path(out) / "diagnostics" / f"nonfinite_step{step:09d}_rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("name", FAULTY)
def test_injected_nonfinite_steps_are_skipped_like_one_process(fifty_steps, name):
    """Every injected step is skipped by every rank (each wrote its bundle: its verdict was
    non-finite), the others apply: per-step losses equal one process with the same faults. The
    bundles are filled from sharded gradients: DTensor statistics completed over the shards
    (fsdp), a gradient only its owner holds (zero2)."""
    root = fifty_steps[0]
    got = [json.loads(line) for line in (root / f"{name}-faults" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (root / "single-faults" / "metrics.jsonl").read_text().splitlines()]
    bad = [int(f.split("@")[1].split("=")[0]) for f in FAULTS]
    assert [r["step"] - 1 for r in got if r["nonfinite"]] == bad == [r["step"] - 1 for r in ref if r["nonfinite"]]
    assert all(r["skipped"] == r["nonfinite"] for r in got)
    assert max_rel([r["loss"] for r in got if r["loss"] is not None],
                   [r["loss"] for r in ref if r["loss"] is not None]) <= 1e-4
    for step in bad:
        for rank in (0, 1):
            assert bundle(root / f"{name}-faults", step, rank) is not None, f"{name}: rank {rank} applied step {step}"
    for step, (param, owner) in OWNED_BY.items():
        grads = [bundle(root / f"{name}-faults", step, rank)["grads"] for rank in (0, 1)]
        infs = [{n for n, g in per.items() if g["inf"]} for per in grads]
        if name == "zero2":  # only the owner holds the gradient: it alone writes (and sees) the Inf
            assert infs[owner] == {param} and param not in grads[1 - owner] and not infs[1 - owner], (step, infs)
        else:  # every rank holds (a shard of) it; fsdp's counts are over the whole tensor
            assert infs == [{param}, {param}], (name, step, infs)
            assert all(g[param]["inf"] == (2 if name == "fsdp" else 1) for g in grads), (name, step)


def test_bundle_statistics_cover_empty_fsdp_shards(fifty_steps):
    """A tensor with fewer rows than ranks leaves FSDP2 shards empty; the diagnostic bundle's
    statistics still come out, whole-tensor and equal on every rank (a DTensor max() used to
    fail on the empty rank alone and leave the other waiting in a collective)."""
    (shapes0, stats0, missing0), (shapes1, stats1, missing1) = fifty_steps[3]
    assert shapes1["0.bias"] == (0,) and shapes0["0.bias"] == (1,), "the model no longer leaves a shard empty"
    assert stats0 == stats1
    assert stats0["0.bias"]["inf"] == 1 and sum(s["inf"] + s["nan"] for s in stats0.values()) == 1
    assert all(s["max_abs_finite"] > 0 for n, s in stats0.items() if n != "0.bias")
    # an inf_grad no rank can inject fails on every rank (not a run that goes on as if it fired)
    assert missing0 and missing1 and "no rank holds gradient of a parameter named '2.weight'" in missing0


@pytest.fixture(scope="module")
def resumed(launches):
    """(root, first-launch reports by strategy, second-launch reports by strategy and KILLED, the
    kill): per strategy 8 steps saving at 4 and 8, then a copy with the step-8 checkpoint removed
    resumed from step 4; "fsdp-killed" resumed from the folder the kill left (see launches)."""
    first = {n: launches["first"][f"{n}-resume"] for n in SHARDED}
    return launches["root"] / "resume", first, launches["second"], launches["kill"]


@pytest.mark.parametrize("name", SHARDED)
def test_resume_is_bit_exact(resumed, name):
    root, first, second, _ = resumed
    assert second[name]["resumed_from"] == 4 and second[name]["steps"] == 8
    for k, v in first[name]["weights"].items():
        assert torch.equal(second[name]["weights"][k], v), f"{name}: {k} differs after resume"
    assert losses(root / name / "cut")[4:] == losses(root / name / "full")[4:]


def test_a_kill_during_the_background_write_loses_nothing_committed(resumed):
    """Rank 1 SIGKILLed while the async step-8 save was being written (every shard already on
    disk, its own rank file not): no step 8 under a final name (committing before every rank's
    files are written would have made one), the torn temp dir left; the resumed run starts from
    the step-4 checkpoint and removes the torn dir at its next save."""
    root, first, second, kill = resumed
    assert kill["rank"] == 1 and "exit code -9" in kill["msg"], kill["msg"]
    assert [n for n in kill["left"] if not n.startswith(".")] == ["step_000000004"], kill["left"]
    assert any(n.endswith(".distcp") for n in kill["torn_files"]) and "rank1.pt" not in kill["torn_files"], kill
    assert second[KILLED]["resumed_from"] == 4 and second[KILLED]["steps"] == 8
    left = sorted(p.name for p in (root / KILLED / "checkpoints").iterdir())
    assert left == ["step_000000004", "step_000000008"], left


def test_async_sharded_saves_are_bit_exact_to_sync_ones(resumed):
    """fsdp with checkpoint.async_save (the step-4 save written while steps 5-8 ran) against the
    same run saving synchronously: the step-4 checkpoints hold the same weights bit for bit, and
    the run resumed from the async one (after the kill) logs the same losses at every step and
    ends with the same weights as the uninterrupted sync run."""
    from course_lib.checkpoint.dcp import consolidate_sharded

    root, first, second, _ = resumed
    step4 = [consolidate_sharded(root / n / "checkpoints" / "step_000000004") for n in ("fsdp/full", KILLED)]
    assert step4[0].keys() == step4[1].keys() and all(torch.equal(step4[0][k], step4[1][k]) for k in step4[0])
    assert losses(root / KILLED) == losses(root / "fsdp" / "full")
    for k, v in first["fsdp"]["weights"].items():
        assert torch.equal(second[KILLED]["weights"][k], v), f"async, killed and resumed: {k} differs from the sync run"


def test_fsdp_checkpoint_moves_between_world_sizes_and_into_a_plain_model(launches):
    """FSDP2 with the global batch (12) kept throughout: 4 steps on 2 ranks (the checkpoint then
    consolidated into a plain single-process TinyGPT), resumed for 4 on 3 ranks (rank 2 saved no
    state of its own: it must take the data position the order implies, not batch 0), then for 4
    on 2 ranks again (shrunk, resharded by DCP). Every logged loss matches one process on the same
    batches; a rank that replays data is ~1e-2 off. A constant schedule after warm-up, so that the
    learning rate does not depend on where a run stops (ws_cfg; the runs are in ``launches``)."""
    from course_lib.checkpoint.dcp import consolidate_sharded
    from course_lib.model import TinyGPT

    ref = losses(launches["root"] / "ws-single")
    two, saved = launches["root"] / "ws" / "two", launches["first"]["ws-two"]
    plain = TinyGPT(train_config.build_model_config(ws_cfg(4, 6)))
    plain.load_state_dict(consolidate_sharded(two / "checkpoints" / "step_000000004"), strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved["weights"][k]), f"consolidated {k} differs from the trained weights"

    three, grown = launches["root"] / "ws" / "three", launches["grown"]
    assert grown["resumed_from"] == 4 and grown["steps"] == 8
    step8 = three / "checkpoints" / "step_000000008"
    seen = [torch.load(step8 / f"rank{r}.pt", weights_only=True)["per_rank"]["data"]["samples_seen"]
            for r in range(3)]
    assert seen == [8 * 12] * 3, f"data positions saved after step 8 (samples): {seen}, want {8 * 12} on every rank"
    rel = max_rel(losses(three), ref[:8])
    assert rel <= 1e-4, f"2 -> 3 ranks: losses differ from one process by up to {rel:.2e} (relative)"

    back, shrunk = launches["root"] / "ws" / "back", launches["shrunk"]
    assert shrunk["resumed_from"] == 8 and shrunk["steps"] == 12
    rel = max_rel(losses(back), ref)
    assert rel <= 1e-4, f"2 -> 3 -> 2 ranks: losses differ from one process by up to {rel:.2e} (relative)"


def test_full_checkpoint_of_sharded_scratch_strategies_loads_in_one_process(launches):
    """zero2 and fsdp-scratch save the unsharded layout: a single-process run resumes from it
    (the 2-rank runs of 6 steps are in ``launches``)."""
    for name in FULL_FOR_ONE:
        out = launches["root"] / f"{name}-full"
        assert launches["first"][f"{name}-full"]["steps"] == 6
        result = train(cfg(train__max_steps=8, train__micro_batch=16, checkpoint__async_save=False), out,
                       resume=True)
        assert result.resumed_from == 6 and result.steps == 8
        assert torch.isfinite(torch.tensor(losses(out))).all()


def test_mixed_precision_and_offload_track_one_process(launches):
    """fsdp with bf16 (MixedPrecisionPolicy) and with cpu_offload, fsdp-scratch with bf16
    compute: 12 steps next to the fp32 single-process curve. bf16 rounds every matmul input, so
    the bar is 2% (fp32 runs are held to 1e-4 above); offload changes where, not what, so it is
    held to the fp32 bar."""
    root = launches["root"]
    ref = losses(root / "single-12")
    assert max_rel(losses(root / "fsdp-offload"), ref) <= 1e-4
    for name in ("fsdp-bf16", "fsdp-scratch-bf16"):
        rel = max_rel(losses(root / name), ref)
        assert rel <= 0.02, f"{name}: bf16 curve off the fp32 one by {rel:.2%}"
        assert losses(root / name)[-1] < ref[0] - 0.5, f"{name}: the loss did not fall"


def test_fsdp_needs_blocks_to_shard():
    [message] = run_ranks(fns.fsdp_refuses_a_model_without_blocks, 1)
    assert message.startswith("ConfigError") and "blocks" in message and "train.strategy" in message, message


def test_a_checkpoint_format_the_strategy_cannot_hold_is_refused():
    """zero2/fsdp-scratch keep non-DTensor shards (full files only); FSDP2 keeps DTensors (DCP only):
    each asked for the other format is a config error naming both keys, before any rank starts
    (every pair: tests/test_checkpoint_formats.py)."""
    for name, fmt in (("zero2", "sharded"), ("fsdp-scratch", "sharded"), ("fsdp", "full")):
        with pytest.raises(train_config.ConfigError) as info:
            cfg(train__micro_batch=8, train__strategy=name, checkpoint__format=fmt)
        assert "checkpoint.format" in str(info.value) and repr(name) in str(info.value), (name, str(info.value))


def other_format_cases():
    """``(name, runs that fill the folder, the config resumed beside them)`` for
    ``fns.resume_into_other_formats``."""
    def c(strategy, steps=2):
        return cfg(train__max_steps=steps, train__micro_batch=8, train__strategy=strategy, schedule__warmup_steps=1,
                   checkpoint__save_every=2, checkpoint__async_save=False)

    return [("ddp-fsdp", [(c("ddp"), False)], c("fsdp", 4)),
            ("fsdp-zero2", [(c("fsdp"), False)], c("zero2", 4)),
            # a ddp run's step 4 copied beside fsdp's step 2: saved after it (a higher save sequence)
            ("newer-ddp", [(c("fsdp"), False), (c("ddp", 4), False, "copied")], c("fsdp", 6))]


def test_resume_auto_refuses_checkpoints_of_another_format(launches):
    """``--resume auto`` beside checkpoints this run's format cannot read (ddp -> fsdp: full files,
    DCP expected; fsdp -> zero2: the reverse; a newer ddp run beside older fsdp checkpoints) is a
    ConfigError naming each checkpoint and its format, raised before anything is written: no
    fresh start from step 0, metrics.jsonl and the step folders untouched (the runs are in the third
    of ``launches``). The CLI says so with exit code 2 (in one process: single beside fsdp's
    checkpoints)."""
    from course_lib.train import main

    out, tmp_path = launches["other_formats"], launches["root"] / "other-formats"
    assert set(out) == {"ddp-fsdp", "fsdp-zero2", "newer-ddp"}, out
    want = {"ddp-fsdp": ("sharded (DCP)", "full, step 2"),
            "fsdp-zero2": ("full", "sharded (DCP), step 2, 2 ranks"),
            "newer-ddp": ("saved after", "full, step 4")}
    for name, (message, before, after) in out.items():
        assert message is not None, f"{name}: resumed (or started over) beside checkpoints it cannot read"
        assert all(w in message for w in want[name]) and "step_000000002" in message, (name, message)
        assert after == before, f"{name}: the refused resume changed the folder"

    args = ["--config", str(TINY), "--out", str(tmp_path / "fsdp-zero2"), "--resume", "auto", "--no-progress",
            "--max-steps", "4", "--set", "train.micro_batch=16", "--set", "train.peak_flops=1e12",
            "--set", "schedule.warmup_steps=1"]
    assert main(args) == 2


@pytest.mark.parametrize("sets, match", [
    ({"train__strategy": "zero1"}, "needs a process group"),
    ({"train__strategy": "fsdp-scratch"}, "needs a process group"),
    ({"train__strategy": "deepspeed", "parallel__offload_param": "cpu"}, "parallel.offload_param"),
    ({"train__strategy": "deepspeed", "parallel__zero_stage": 0, "parallel__offload_optimizer": "cpu"},
     "parallel.offload_optimizer"),
    ({"parallel__zero_stage": 4}, "parallel.zero_stage"),

    ({"parallel__bucket_mb": -1}, "parallel.bucket_mb"),
    # DeepSpeed's checkpoints are not mirrored (full and sharded ones are: tests/test_sharded_mirror.py)
    ({"train__strategy": "deepspeed", "checkpoint__mirror": "file:///tmp/m"}, r"checkpoint\.mirror.*'deepspeed'"),
])
def test_bad_input_is_refused_before_any_file(tmp_path, sets, match):
    with pytest.raises(train_config.ConfigError, match=match):
        train(cfg(**sets), tmp_path / "run")
    assert not (tmp_path / "run").exists()
