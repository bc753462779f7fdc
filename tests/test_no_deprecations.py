"""No FutureWarning/DeprecationWarning from the kit's own code under the pinned torch.

A learner's test suite that runs with ``-W error::FutureWarning`` must not fail on the kit: the
trainer's main paths run here with those warnings as errors whenever the code that made the
deprecated call is a ``course_lib`` module (see ``deprecation_rank_fns``: torch's decorators sit
between the caller and the warning, so the caller is found on the stack rather than by
``-W ...:module``). One process for the single-process paths, one 2-rank launch for the
distributed ones; 2-4 steps each, the tiny config.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import deprecation_rank_fns as fns
from course_lib.trainer import config as train_config
from course_lib.parallel import run_ranks
from course_lib.train import train

TINY = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
STEPS = 2


def cfg(*sets: str, steps: int = STEPS):
    base = ["train.progress=false", f"train.max_steps={steps}", "schedule.warmup_steps=1",
            "train.peak_flops=1e12", "train.util_sample_s=0", "model.n_layers=2"]
    return train_config.load(TINY, base + list(sets))


def test_the_filter_can_fail(tmp_path):
    """The filter catches a deprecated torch call made from a course_lib module (so a clean run
    below means something) and lets the same call from elsewhere pass: the old SimpleFSDP call,
    ``all_gather_into_tensor`` (it warns before it needs a process group)."""
    import types

    code = ("import torch, torch.distributed as dist\n"
            "def call():\n    dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))\n")
    for name, raises in (("course_lib._deprecation_probe", True), ("learner_code", False)):
        mod = types.ModuleType(name)
        exec(compile(code, str(tmp_path / f"{name}.py"), "exec"), mod.__dict__)
        with warnings.catch_warnings():
            found = fns.kit_warnings_are_errors()
            with pytest.raises(fns.KitDeprecation if raises else ValueError) as err:
                mod.call()  # no process group: a ValueError once the warning has passed
        assert isinstance(err.value, fns.KitDeprecation) == raises, (name, err.value)
        assert bool(found) == raises, (name, found)


def test_single_process_paths_warn_nothing_of_ours(tmp_path):
    """single: fp32 with a checkpoint, TensorBoard metrics and the profiler; bf16; a resume."""
    runs = [
        (cfg("checkpoint.save_every=2", "train.tensorboard=true", "profile.enabled=true", "profile.wait=0",
             "profile.warmup=1", "profile.active=1", steps=3), tmp_path / "fp32", False),
        (cfg("train.precision=bf16", "checkpoint.save_every=2"), tmp_path / "bf16", False),
        (cfg("train.precision=bf16", "checkpoint.save_every=2", steps=4), tmp_path / "bf16", True),
    ]
    with warnings.catch_warnings():
        found = fns.kit_warnings_are_errors()
        for c, out, resume in runs:
            result = train(c, out, resume=resume)
            assert result.steps > 0, out
    assert not found, found


def test_distributed_paths_warn_nothing_of_ours(tmp_path):
    """One 2-rank launch, one run per family of collectives the kit calls itself: its bucketed
    DDP (all-reduce), ZeRO-2 (reduce-scatter, bf16), SimpleFSDP (all-gather + reduce-scatter, a
    full checkpoint), tensor parallelism with SP (the autograd collectives), context parallelism
    under ZeRO-1 (ring sends, the model-parallel data-parallel sync) and FSDP2 under TP (DTensor,
    a sharded checkpoint). torch DDP, plain FSDP2 and the pipeline's point-to-point sends add no
    call of the kit's that these do not make."""
    layouts = {
        "ddp-scratch": ["train.strategy=ddp-scratch"],
        "zero2": ["train.strategy=zero2", "train.precision=bf16"],
        "fsdp-scratch": ["train.strategy=fsdp-scratch", "checkpoint.save_every=2"],
        "tp2": ["train.strategy=ddp", "parallel.tp=2", "parallel.sequence_parallel=true"],
        "cp2": ["train.strategy=zero1", "parallel.cp=2"],
        "fsdp-tp2": ["train.strategy=fsdp", "parallel.tp=2", "checkpoint.save_every=2",
                     'checkpoint.format="sharded"'],
    }
    runs = [(cfg("train.micro_batch=8", *sets), str(tmp_path / name)) for name, sets in layouts.items()]
    (steps, found, seconds), (_, found1, _) = run_ranks(fns.train_each, 2, runs, timeout=600)
    print("seconds per layout:", dict(zip(layouts, seconds)))
    assert not found and not found1, found + found1
    assert steps == [STEPS] * len(runs), dict(zip(layouts, steps))
    assert json.loads((tmp_path / "fsdp-tp2" / "metrics.jsonl").read_text().splitlines()[-1])["step"] >= 1
