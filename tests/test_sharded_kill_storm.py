"""Kill storm on sharded checkpoints: the whole torchrun tree (agent and every worker) SIGKILLed
again and again, at random moments of training and while async sharded (DCP) saves are being
written in the background; each time a fresh job resumes with ``--resume auto``. At the end every
logged loss and the final weights equal, bit for bit, those of a run never interrupted. fsdp on 2
gloo ranks and fsdp x tp (dp 2 x tp 2) on 4. Slow: ~10 restarts of each.

The runs read a tokenized file (``data.task = "tokens"``, the kit's notes as a memory-mapped uint16
file, the data engineers bring): every resume restores the sampler's position on it from the
sharded checkpoint, so a replayed or skipped batch changes a logged loss."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import restart_harness as rh  # noqa: E402

import torch  # noqa: E402

STEPS, SAVE_EVERY, KILLS = 60, 2, 10


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> list[str]:
    """The trainer's overrides that make it read the notes as a flat uint16 token file."""
    from test_token_data import notes_as_tokens

    path = tmp_path_factory.mktemp("tokens") / "notes.bin"
    notes_as_tokens(path)
    return ["--set", "data.task='tokens'", "--set", f"data.path='{path}'", "--set", "data.vocab_size=256"]


def _args(strategy_sets: list[str]) -> list[str]:
    return ["--config", "labs/configs/tiny-cpu.toml", "--no-progress", "--max-steps", str(STEPS),
            "--save-every", str(SAVE_EVERY), "--resume", "auto", "--set", "train.device=cpu",
            "--set", "schedule.warmup_steps=2", "--set", "train.metrics_flush_s=0",
            "--set", "checkpoint.async_save=true", "--set", "checkpoint.keep_last=2", *strategy_sets]


@pytest.mark.slow
@pytest.mark.parametrize("name,nproc,sets", [
    ("fsdp", 2, ["--set", "train.strategy=fsdp"]),
    ("fsdp-tp", 4, ["--set", "train.strategy=fsdp", "--set", "parallel.tp=2"]),
])
def test_sharded_kill_storm_is_bit_exact(tmp_path, token_data, name, nproc, sets):
    args = _args(sets + token_data)
    ref_out = tmp_path / "reference"
    ref = rh.run(ref_out, args, nproc=nproc, max_restarts=0, deadline_s=600)
    assert ref.returncode == 0, ref.log[-3000:]
    out, rng, events = tmp_path / "storm", random.Random(), []
    for cycle in range(4 * KILLS):
        kills = sum(e.killed is not None for e in events)
        if kills >= KILLS:
            break
        job = rh.run_killed_whole(out, args, nproc=nproc, delay_s=rng.uniform(0.0, 1.5),
                                  during_save=cycle % 2 == 1)
        events.append(job)
        assert not job.hung, f"cycle {cycle}: the job hung\n{job.log[-3000:]}"
        if job.killed is None:
            assert job.returncode == 0, job.log[-3000:]
            break
    kills = [e for e in events if e.killed is not None]
    print(f"\n{name}: {len(kills)} whole-tree SIGKILLs ({sum('during a save' in e.log for e in kills)} during a "
          f"background save), rows at each kill: {[e.killed[1] for e in kills]}")
    assert len(kills) >= KILLS, f"only {len(kills)} kills before the run finished"
    if events[-1].killed is not None:  # the storm is over: let the run finish
        final = rh.run(out, args, nproc=nproc, max_restarts=0, deadline_s=600)
        assert final.returncode == 0, final.log[-3000:]
    assert rh.losses(out) == rh.losses(ref_out)  # steps 1..STEPS once each, the same floats
    a, b = rh.sharded_weights(out, STEPS), rh.sharded_weights(ref_out, STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
