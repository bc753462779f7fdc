"""ZeRO-1 / ZeRO-2 as the data-parallel dimension under tensor and pipeline parallelism, in the
trainer (course_lib/parallel/composed/dp.py), and DeepSpeed's honest refusal of layouts it
does not run.

On 4 gloo ranks, in one launch: zero1 x pp (2 x 2, 1F1B) and zero2 x tp (2 x 2) train 30 steps in
fp32 on the same global batch as one process (each dp replica reads half of the reference's
micro-batch); per-step losses and gradient norms must equal one process within 1e-4 relative,
the final weights too. Then the model-state census of one step of each layout, per rank, must
equal ``course_lib.estimate.model_state_bytes`` for the parameters that rank holds
(``ModelShape.params_on_rank``), to the byte. Both layouts run through injected faults (4 steps):
a NaN loss, and an Inf in the gradient of a parameter that only some ranks hold (one pipeline
stage; some dp ranges): every rank skips those steps, as one process. Last, both runs resume from
their step-26 checkpoint (dense layout, the optimizer state gathered from the dp shards): weights
``torch.equal`` and losses ``==`` to the uninterrupted runs. The fresh runs also count the host
reads of every step (but the first and the one after a save), on every rank (one: the stabilizer's).
"""
from __future__ import annotations

import pytest

import zero_mp_rank_fns as fns
from course_lib.trainer import config as train_config
from course_lib.estimate import model_state_bytes
from course_lib.measure import tinygpt_shape
from course_lib.parallel import run_ranks
from course_lib.parallel.registry import MODEL_PARALLEL_DP
from course_lib.train import train
from layout_checks import (assert_matches_one_process, assert_resumed_bit_exact, max_rel, one_read_per_step,
                           resume_save_every, rows, tiny_cfg)

MB, ACCUM, STEPS = 8, 2, 30
EVERY = resume_save_every(STEPS)  # saves at 26 and 30: the resume runs the last RESUME_TAIL steps
FAULT_STEPS, INF_STEP, INF_PARAM = 4, 3, "blocks.1.mlp.down.weight"  # on the second pipeline stage only
FAULTS = ["nan_loss@1", f"inf_grad@{INF_STEP}={INF_PARAM}"]

# name -> (train.strategy, [parallel] settings, zero stage)
LAYOUTS = {
    "zero1-pp2-dp2-1f1b": ("zero1", {"pp": 2, "pp_schedule": "1f1b"}, 1),
    "zero2-tp2-dp2": ("zero2", {"tp": 2}, 2),
}


def cfg(**sets):
    return tiny_cfg(ACCUM, ("model.n_layers=2",), **sets)


def layout_cfg(name, **more):
    strategy, par, _ = LAYOUTS[name]
    sets = {"train__max_steps": STEPS, "train__micro_batch": MB // 2, "train__strategy": strategy,
            "checkpoint__save_every": EVERY, **{f"parallel__{k}": v for k, v in par.items()}, **more}
    return cfg(**sets)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_model_parallel")
    single = train(cfg(train__max_steps=STEPS, train__micro_batch=MB), root / "single")
    train(cfg(train__max_steps=FAULT_STEPS, train__micro_batch=MB), root / "single-faults", faults=FAULTS)
    jobs = [(layout_cfg(n), str(root / n)) for n in LAYOUTS]
    faulty = [(layout_cfg(n, train__max_steps=FAULT_STEPS, checkpoint__save_every=0), str(root / n / "faults"),
               False, FAULTS) for n in LAYOUTS]
    out = run_ranks(fns.train_census_faults_resume, 4, jobs, [layout_cfg(n) for n in LAYOUTS], faulty, timeout=600)
    return {"root": root, "single": single, "first": dict(zip(LAYOUTS, out[0]["runs"])),
            "census": [dict(zip(LAYOUTS, r["census"])) for r in out], "second": dict(zip(LAYOUTS, out[0]["second"])),
            "host_reads": [dict(zip(LAYOUTS, r["host_reads"])) for r in out]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_layout_matches_one_process(runs, name):
    got, ref = rows(runs["root"] / name / "full"), rows(runs["root"] / "single")
    assert any(r["clipped"] for r in ref), "the reference never clips: the clipping check would prove nothing"
    # The norm counts every logical element once: each dp rank its own range, TP shards summed,
    # replicated tensors and the tied head copy once. So clipping decides alike too.
    assert_matches_one_process(name, got, ref, runs["first"][name]["weights"], runs["single"].model)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_resume_is_bit_exact(runs, name):
    assert_resumed_bit_exact(name, runs["first"][name], runs["second"][name], EVERY, STEPS,
                             runs["root"] / name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_injected_faults_reach_the_ranks_holding_the_gradient(runs, name):
    """The NaN loss and the Inf are skipped on every rank (each wrote a bundle), the losses equal
    one process with the same faults; the Inf was written by exactly the ranks holding a piece of
    that gradient (``name[a:b]``, this rank's ZeRO range of it), and some ranks hold none."""
    import json

    out = runs["root"] / name / "faults"
    got, ref = rows(out), rows(runs["root"] / "single-faults")
    assert [r["nonfinite"] for r in got] == [r["nonfinite"] for r in ref] == \
        [s in (1, INF_STEP) for s in range(FAULT_STEPS)]
    assert max_rel([r["loss"] for r in got if r["loss"] is not None], [r["loss"] for r in ref if r["loss"] is not None]) <= 1e-4
    holders = []
    for rank in range(4):
        path = out / "diagnostics" / f"nonfinite_step{INF_STEP:09d}_rank{rank}.json"
        assert path.exists(), f"{name}: rank {rank} did not judge step {INF_STEP} non-finite"
        grads = json.loads(path.read_text())["grads"]
        pieces = [n for n in grads if n.startswith(INF_PARAM + "[")]
        assert {n for n, g in grads.items() if g["inf"]} == set(pieces), (name, rank)
        holders += [rank] if pieces else []
    assert 0 < len(holders) < 4, f"{name}: the gradient should live on some ranks only, held by {holders}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_state_bytes_equal_the_estimator(runs, name):
    """Per rank: weights + gradients + Adam moments measured (storages, each once) equal
    model_state_bytes(params on that rank, fp32-adam, ZeRO stage, dp = 2) exactly."""
    _, par, stage = LAYOUTS[name]
    c = layout_cfg(name)
    shape = tinygpt_shape(train_config.build_model_config(c))
    seen = set()
    for rank, per in enumerate(runs["census"]):
        got = per[name]
        pp_rank, tp = got["coords"]["pp"], par.get("tp", 1)
        n = shape.params_on_rank(tp=tp, pp=par.get("pp", 1), stage=pp_rank, blocks=got["blocks"])
        assert got["local_elements"] == n, f"{name} rank {rank}: the shape counts {n} parameters here"
        est = model_state_bytes(n, recipe="fp32-adam", zero_stage=stage, dp=2)
        m = got["census"]
        assert (m["params"], m["grads"], m["optimizer_moments"], m["total"]) == \
            (est.params, est.grads, est.optimizer, est.total), f"{name} rank {rank}: {m} vs {est.to_dict()}"
        seen.add(m["optimizer_moments"])
        assert m["optimizer_moments"] < 8 * n, "the Adam moments are not sharded"
    if stage == 2:
        assert all(per[name]["census"]["grads"] == 4 * per[name]["local_elements"] // 2
                   for per in runs["census"]), "ZeRO-2 keeps only half of the gradients per rank"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_keeps_one_host_read_per_step(runs, name):
    """The reduce-scatter, the norm's all-reduce and the all-gather stay on the device: the
    stabilizer's verdict is still the step's only host read, on every rank (counted step by step
    in the fresh run: every step from 2 on but the one after the save at EVERY)."""
    assert [r[name] for r in runs["host_reads"]] == [one_read_per_step(STEPS)] * 4


# ---------------------------------------------------------------- refusals (no ranks started)
COMPOSING = ", ".join(repr(n) for n in MODEL_PARALLEL_DP)


@pytest.mark.parametrize("sets, match", [
    ({"parallel__tp": 2, "train__strategy": "deepspeed"}, r"parallel.tp = 2 does not compose with train.strategy = "
                                                          r"'deepspeed': the DeepSpeed engine runs here as data parallelism only"),
    ({"parallel__pp": 2, "train__strategy": "deepspeed"}, r"ZeRO stages 0-3 \(parallel.zero_stage\) with optional CPU offload"),
    ({"parallel__cp": 2, "train__strategy": "deepspeed"}, r"parallel.cp = 2 does not compose with train.strategy = 'deepspeed'"),
    ({"parallel__tp": 2, "train__strategy": "fsdp-scratch"}, r"'fsdp-scratch': the from-scratch SimpleFSDP"),
    ({"parallel__pp": 2, "train__strategy": "ddp-scratch"}, r"'ddp-scratch': the from-scratch BucketedDDP"),
    ({"parallel__tp": 2}, r"train.strategy = 'single': 'single' is one process"),
])
def test_strategies_that_do_not_compose_are_refused_before_any_file(tmp_path, sets, match):
    with pytest.raises(train_config.ConfigError, match=match) as exc:
        train(cfg(**sets), tmp_path / "run")
    assert f"train.strategy names the data-parallel dimension: one of {COMPOSING}" in str(exc.value)
    assert all(f"'{n}'" in str(exc.value) for n in ("ddp", "zero1", "zero2"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
@pytest.mark.parametrize("par", [{"parallel__tp": 2}, {"parallel__pp": 2}, {"parallel__tp": 2, "parallel__pp": 2}])
def test_zero_composes_with_tp_and_pp(strategy, par):
    c = cfg(train__strategy=strategy, **par)
    assert c["train"]["strategy"] == strategy


def test_make_strategy_refuses_a_non_composing_name_without_ranks():
    from course_lib.parallel.registry import make_strategy

    with pytest.raises(ValueError, match="does not compose with parallel.tp/pp/cp > 1; use one of ddp, zero1, zero2"):
        make_strategy("deepspeed", None, "cpu", {"parallel": {"tp": 2, "pp": 1, "cp": 1}})
