"""Kill storm on sharded checkpoints: the whole torchrun tree (agent and every worker) SIGKILLed
again and again, at random moments of training and while async sharded (DCP) saves are being
written in the background; each time a fresh job resumes with ``--resume auto``. At the end every
logged loss and the final weights equal, bit for bit, those of a run never interrupted. fsdp on 2
gloo ranks and fsdp x tp (dp 2 x tp 2) on 4. Slow: ~10 restarts of each. And fsdp with a
``file://`` mirror through kills, a lost local disk, a kill in the middle of a slow upload and a
mirror outage (its root gone), each between two jobs, ending bit-exact all the same.

The runs read a tokenized file (``data.task = "tokens"``, the kit's notes as a memory-mapped uint16
file, the data engineers bring): every resume restores the sampler's position on it from the
sharded checkpoint, so a replayed or skipped batch changes a logged loss."""
from __future__ import annotations

import random
import re
import shutil
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


def _mirror_args(token_data: list[str], mirror: Path | None, steps: int = STEPS) -> list[str]:
    """fsdp on 2 ranks, a constant learning rate (a job stopped early by a smaller --max-steps
    trains its steps as the full run does), with ``mirror`` as checkpoint.mirror."""
    args = _args(["--set", "train.strategy=fsdp", "--set", "schedule.kind=constant", *token_data]
                 + (["--set", f"checkpoint.mirror='file://{mirror}'"] if mirror else []))
    args[args.index("--max-steps") + 1] = str(steps)
    return args


def _complete(mirror: Path) -> list[int]:
    """Steps of the mirror's complete copies (a manifest, the copy's commit marker)."""
    return sorted(int(p.name[5:14]) for p in mirror.glob("step_*") if (p / "manifest.json").is_file())


def _torn(mirror: Path) -> list[int]:
    """Steps of the mirror's half-uploaded copies: files, but no manifest."""
    return sorted(int(p.name[5:14]) for p in mirror.glob("step_*")
                  if not (p / "manifest.json").exists() and any(p.iterdir()))


def _newest_local(out: Path) -> int:
    return max(int(p.name[5:14]) for p in (out / "checkpoints").glob("step_*") if (p / "manifest.json").is_file())


def _kill_cycles(out: Path, args: list[str], kills: int, rng: random.Random) -> None:
    """Whole-tree SIGKILLs of ``kills`` jobs in a row (every other one during a background save)."""
    done = 0
    for cycle in range(4 * kills):
        job = rh.run_killed_whole(out, args, nproc=2, delay_s=rng.uniform(0.0, 1.5), during_save=cycle % 2 == 1)
        assert not job.hung, f"the job hung\n{job.log[-3000:]}"
        assert job.killed is not None, f"the run ended before the storm was over (exit {job.returncode})\n{job.log[-3000:]}"
        done += 1
        if done == kills:
            return


@pytest.mark.slow
def test_a_mirrored_sharded_run_survives_kills_a_lost_disk_a_torn_upload_and_an_outage(tmp_path, token_data):
    """fsdp, 2 ranks, a file:// mirror, 60 steps; between jobs: (1) 3 kills; (2) the local disk lost:
    the next job resumes from the mirror's newest complete copy; (3) a kill while a slow upload is
    half done (0.3 s per file), then the disk lost again: the next job resumes from the newest
    *complete* copy, never the torn newer one (the manifest is the commit marker), and its upload
    leaves no torn folder; (4) the mirror's root gone (an unmounted share): with local checkpoints
    a job resumes from them, warns, trains on, its uploads fail without re-creating the root; with
    the local disk lost too, the job refuses (exit 3, "cannot tell whether this is a fresh start")
    and writes nothing; (5) the share back: a job resumes from the mirror alone (its newest copy
    from before the outage), 2 more kills, then the run to the end. Every loss and the final
    weights equal a run never interrupted (and never mirrored)."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()  # the share is mounted: every job resumes (--resume auto), none creates the root
    ref_out = tmp_path / "reference"
    ref = rh.run(ref_out, _mirror_args(token_data, None), nproc=2, max_restarts=0, deadline_s=600)
    assert ref.returncode == 0, ref.log[-3000:]
    out, rng, args = tmp_path / "storm", random.Random(), _mirror_args(token_data, mirror)

    def ends_at(steps: int) -> rh.Job:  # a job that stops by itself: its summary says where it resumed from
        job = rh.run(out, _mirror_args(token_data, mirror, steps), nproc=2, max_restarts=0, deadline_s=300)
        assert job.returncode == 0, job.log[-3000:]
        return job

    _kill_cycles(out, args, 3, rng)  # (1)
    assert _complete(mirror), "no complete mirror copy after 3 kills"
    newest = _complete(mirror)[-1]
    shutil.rmtree(out / "checkpoints")  # (2) the local disk is lost
    assert ends_at(newest + 2).resumed_from() == [newest]

    job = rh.run_killed_whole(out, args, nproc=2, delay_s=0.0, during_save=False, module="slow_mirror_train",
                              env={"SLOW_MIRROR_S": "0.3"}, when=lambda: bool(_torn(mirror)))  # (3)
    assert job.killed is not None and not job.hung, job.log[-3000:]
    torn, complete = _torn(mirror), _complete(mirror)
    assert torn and complete and torn[-1] > complete[-1], (torn, complete)
    shutil.rmtree(out / "checkpoints")
    assert ends_at(complete[-1] + 2).resumed_from() == [complete[-1]]
    assert _torn(mirror) == [] and _complete(mirror)[-1] == complete[-1] + 2, (_torn(mirror), _complete(mirror))

    away = tmp_path / "mirror-away"
    mirror.rename(away)  # (4) the share unmounted
    local = _newest_local(out)
    job = ends_at(local + 2)
    assert job.resumed_from() == [local] and "cannot list mirror" in job.log, job.log[-3000:]
    assert "mirror upload of" in job.log and not mirror.exists(), job.log[-3000:]
    rows = (out / "metrics.jsonl").read_text()
    shutil.rmtree(out / "checkpoints")
    job = rh.run(out, args, nproc=2, max_restarts=0, deadline_s=300)
    assert job.returncode not in (0, None) and re.search(r"exitcode\s*:\s*3", job.log), job.log[-3000:]
    assert "cannot tell whether this is a fresh start" in job.log, job.log[-3000:]
    assert (out / "metrics.jsonl").read_text() == rows and not mirror.exists()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    away.rename(mirror)  # (5) the share is back; the local disk is still lost
    assert _complete(mirror)[-1] == complete[-1] + 2  # nothing of the outage's uploads landed anywhere
    assert ends_at(complete[-1] + 4).resumed_from() == [complete[-1] + 2]

    _kill_cycles(out, args, 2, rng)
    final = rh.run(out, args, nproc=2, max_restarts=0, deadline_s=600)
    assert final.returncode == 0, final.log[-3000:]
    assert rh.losses(out) == rh.losses(ref_out)  # steps 1..STEPS once each, the same floats
    a, b = rh.sharded_weights(out, STEPS), rh.sharded_weights(ref_out, STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

