"""Every ``train.strategy`` x ``checkpoint.format`` either works or is a config error naming both
keys, raised by config validation (so ``--check-config`` catches it) before anything is written.
``single`` with ``checkpoint.format = "sharded"`` used to pass validation, train every step and
then die at the first save ("AsyncShardedSaver needs an initialised process group"): it now needs
a process group of one, and is refused at start-up (and by ``--check-config``) without one."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

import rank_fns
from course_lib.parallel import run_ranks
from course_lib.parallel.registry import CHECKPOINT_FORMATS, STRATEGIES
from course_lib.train import main, train
from course_lib.trainer import config as train_config

TINY = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
FORMATS = ("auto", "full", "sharded")


def cfg(strategy, fmt, steps=2, **sets):
    return train_config.load(TINY, [
        "train.progress=false", f"train.max_steps={steps}", "train.micro_batch=4", f"train.strategy={strategy}",
        f"checkpoint.format={fmt}", "checkpoint.save_every=1", "checkpoint.keep_last=1", "schedule.kind=constant",
        "schedule.warmup_steps=1", "train.peak_flops=1e12", *(f"{k}={json.dumps(v)}" for k, v in sets.items())])


def accepted(strategy, fmt):
    return fmt == "auto" or fmt in CHECKPOINT_FORMATS[strategy][0]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_pair_is_accepted_or_refused_by_validation_naming_both_keys(strategy):
    assert set(CHECKPOINT_FORMATS) == set(STRATEGIES)
    module, cls, _ = STRATEGIES[strategy]
    klass = getattr(importlib.import_module(module), cls)  # what its checkpointer() will accept
    for fmt in FORMATS:
        chosen = klass.checkpoint_format if fmt == "auto" else fmt
        assert (chosen in klass.checkpoint_formats) == accepted(strategy, fmt), (strategy, fmt)
        if accepted(strategy, fmt):
            cfg(strategy, fmt)
            continue
        with pytest.raises(train_config.ConfigError) as info:
            cfg(strategy, fmt)
        text = str(info.value)
        assert f"checkpoint.format = {fmt!r}" in text and f"train.strategy = {strategy!r}" in text, text
        assert "'auto'" in text, text  # the accepted values


def test_single_with_sharded_checkpoints_is_refused_before_training_and_by_check_config(tmp_path, capsys):
    """Without a process group (one loads an fsdp run's DCP checkpoint into one process under
    torchrun --nproc-per-node 1: test_train_fsdp_tp does)."""
    with pytest.raises(train_config.ConfigError, match="checkpoint.format = 'sharded' with "
                                                       "train.strategy = 'single' needs a process group"):
        train(cfg("single", "sharded"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    argv = ["--config", str(TINY), "--set", "train.strategy=single", "--set", "checkpoint.format=sharded",
            "--out", str(tmp_path / "run")]
    assert main(argv + ["--check-config"]) == 2
    assert "train.strategy = 'single'" in capsys.readouterr().err
    assert main(argv) == 2 and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_every_accepted_pair_saves_and_resumes_on_two_ranks(tmp_path):
    """The data-parallel strategies (deepspeed and single have their own tests) with each format
    they accept: 2 steps saved, then resumed to 3, in one launch."""
    pairs = [(s, f) for s in STRATEGIES if s not in ("single", "deepspeed") for f in ("full", "sharded")
             if accepted(s, f)]
    calls = []
    for s, f in pairs:
        out = str(tmp_path / f"{s}-{f}")
        calls += [(rank_fns.train_rank_digest, (cfg(s, f, steps=2), out)),
                  (rank_fns.resume_rank_digest, (cfg(s, f, steps=3), out))]
    per_rank = run_ranks(rank_fns.several, 2, calls, timeout=600)
    for i, (s, f) in enumerate(pairs):
        first, resumed = per_rank[0][2 * i], per_rank[0][2 * i + 1]
        assert first["steps"] == 2 and (resumed["resumed_from"], resumed["steps"]) == (2, 3), (s, f)
        manifest = json.loads((tmp_path / f"{s}-{f}" / "checkpoints" / "step_000000003" / "manifest.json").read_text())
        assert manifest["format"] == {"full": "course_lib.checkpoint/1",
                                      "sharded": "course_lib.checkpoint.dcp/1"}[f], (s, f)
