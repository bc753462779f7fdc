"""``checkpoint.mirror`` for sharded (DCP) checkpoints: fsdp on 2 ranks with async saves copies
every checkpoint (every rank's shards and per-rank files, then the manifest as commit marker) to
a second tier; after the local folder is wiped, ``--resume auto`` continues from the mirror alone,
on 2 ranks and on 3, with the losses of one process on the same global batch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import sharded_mirror_rank_fns as fns
from course_lib.trainer import config as train_config
from course_lib.checkpoint.dcp import DCP_FORMAT
from course_lib.parallel import run_ranks
from course_lib.train import train

TINY = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
GLOBAL_BATCH = 12  # 2 ranks x 6, 3 ranks x 4, one process x 12


def cfg(steps, micro, strategy="fsdp", mirror=""):
    return train_config.load(TINY, [
        "train.progress=false", f"train.max_steps={steps}", f"train.micro_batch={micro}",
        f"train.strategy={strategy}", "schedule.kind=constant", "schedule.warmup_steps=2",
        "train.peak_flops=1e12", "checkpoint.save_every=2", "checkpoint.keep_last=2",
        "checkpoint.async_save=true", f"checkpoint.mirror={json.dumps(mirror)}"])


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())}


def max_rel(got: dict, ref: dict) -> float:
    return max(abs(v - ref[k]) / abs(ref[k]) for k, v in got.items())


def test_sharded_checkpoints_resume_from_the_mirror_alone_on_the_same_and_another_world_size(tmp_path):
    single = tmp_path / "single"
    train(cfg(8, GLOBAL_BATCH, "single"), single)
    ref = losses(single)
    mirror_dir = tmp_path / "mirror"
    url = f"file://{mirror_dir}"

    two = tmp_path / "two"
    [report, _] = run_ranks(fns.train_wipe_resume, 2, cfg(4, 6, mirror=url), cfg(6, 6, mirror=url), str(two))
    assert report["first"] == (4, 0) and report["left_before_resume"] == []
    assert report["second"] == (6, 4), report  # step 4 came back from the mirror
    got = losses(two)
    assert sorted(got) == list(range(1, 7))
    rel = max_rel(got, ref)
    assert rel <= 1e-4, f"2 ranks, resumed from the mirror: losses differ from one process by {rel:.2e}"

    # The mirror holds keep_last = 2 of its own, each complete: every rank's files, sealed last.
    names = sorted(p.name for p in mirror_dir.iterdir())
    assert names == ["step_000000004", "step_000000006"], names
    for name in names:
        manifest = json.loads((mirror_dir / name / "manifest.json").read_text())
        assert manifest["format"] == DCP_FORMAT and manifest["world_size"] == 2
        files = set(manifest["files"])
        assert {"rank0.pt", "rank1.pt", ".metadata"} <= files and sum(f.endswith(".distcp") for f in files) == 2
        assert files == {p.name for p in (mirror_dir / name).iterdir()} - {"manifest.json"}

    three = tmp_path / "three"  # another world size, an empty folder: the mirror alone
    [(steps, resumed), *_] = run_ranks(fns.resume_only, 3, cfg(8, 4, mirror=url), str(three))
    assert (steps, resumed) == (8, 6)
    got = losses(three)
    assert sorted(got) == [7, 8]
    rel = max_rel(got, ref)
    assert rel <= 1e-4, f"2 -> 3 ranks from the mirror: losses differ from one process by {rel:.2e}"
    assert sorted(p.name for p in mirror_dir.iterdir()) == ["step_000000006", "step_000000008"]
