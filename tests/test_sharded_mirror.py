"""``checkpoint.mirror`` for sharded (DCP) checkpoints: fsdp on 2 ranks with async saves copies
every checkpoint (every rank's shards and per-rank files, then the manifest as commit marker) to
a second tier; after the local folder is wiped, ``--resume auto`` continues from the mirror alone,
on 2 ranks and on 3, with the losses of one process on the same global batch. And the rules of
docs/CHECKPOINTS.md that full checkpoints keep hold for sharded ones (issue 36): the mirror's copy
of a corrupt newest, a refusal when the mirror cannot be listed (an outage, a missing root) and
nothing is local, no prune of a folder still uploading, no fresh run over a mirror's checkpoints;
on fsdp and on the composed layouts (fsdp x tp, fsdp x cp: dp 1 x 2 here, dp 2 x 2 on 4 ranks in
the slow tier). A lost disk never starts fresh beside the mirror's checkpoints of another format
(either way round), and the full tier refuses through the trainer as the sharded one does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import sharded_mirror_rank_fns as fns
from course_lib.trainer import config as train_config
from course_lib.checkpoint.dcp import DCP_FORMAT
import rank_fns
from course_lib.parallel import run_ranks
from course_lib.train import train

TINY = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
GLOBAL_BATCH = 12  # 2 ranks x 6, 3 ranks x 4, one process x 12


def cfg(steps, micro, strategy="fsdp", mirror="", save_every=2, sets=()):
    return train_config.load(TINY, [
        "train.progress=false", f"train.max_steps={steps}", f"train.micro_batch={micro}",
        f"train.strategy={strategy}", "schedule.kind=constant", "schedule.warmup_steps=1",
        "train.peak_flops=1e12", f"checkpoint.save_every={save_every}", "checkpoint.keep_last=2",
        "checkpoint.async_save=true", f"checkpoint.mirror={json.dumps(mirror)}", *sets])


#: the composed sharded layouts on 2 ranks (dp 1: the smallest legal mesh of each) and on 4 (dp 2, slow)
LAYOUTS = {"fsdp-tp": ["parallel.tp=2"], "fsdp-cp": ["parallel.cp=2"]}


def layout_cfgs(root, sets):
    """``sharded_mirror_rank_fns.layout_tiers``'s configs (a save every step, the fewest steps that
    show the rules): mirror ``root/m``, one whose mirror root is missing."""
    m = f"file://{root / 'm'}"
    return {"2": cfg(2, 6, mirror=m, save_every=1, sets=sets), "3": cfg(3, 6, mirror=m, save_every=1, sets=sets),
            "4": cfg(4, 6, mirror=m, save_every=1, sets=sets),
            "missing": cfg(4, 6, mirror=f"file://{root / 'unmounted' / 'm'}", save_every=1, sets=sets)}


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())}


def max_rel(got: dict, ref: dict) -> float:
    return max(abs(v - ref[k]) / abs(ref[k]) for k, v in got.items())


@pytest.fixture(scope="module")
def tier_runs(tmp_path_factory):
    """One 2-rank launch: ``sharded_mirror_rank_fns.tier_rules`` (a run, its mirror, corrupt and
    lost copies), ``slow_mirror`` (a save every step, 0.3 s per uploaded file), ``layout_tiers``
    for fsdp x tp and fsdp x cp (dp 1 x tp 2, dp 1 x cp 2) and ``foreign_on_mirror`` (ddp's full
    checkpoints on the mirror, the disk lost, an fsdp resume). Per rank: the outcomes in that order."""
    root = tmp_path_factory.mktemp("tiers")
    m1 = f"file://{root / 'm1'}"
    cfgs = {"6": cfg(6, 6, mirror=m1), "8": cfg(8, 6, mirror=m1), "10": cfg(10, 6, mirror=m1),
            "missing": cfg(10, 6, mirror=f"file://{root / 'unmounted' / 'm1'}")}
    slow = (cfg(6, 6, mirror=f"file://{root / 'm2'}", save_every=1), str(root / "slow"), str(root / "m2"), 0.3)
    for name in [*LAYOUTS, "foreign"]:
        (root / name).mkdir()  # each mirror's parent: a fresh run creates the root under it
    layouts = [(fns.layout_tiers, (layout_cfgs(root / name, sets), str(root / name))) for name, sets in LAYOUTS.items()]
    m3 = f"file://{root / 'foreign' / 'm'}"
    foreign = (cfg(2, 6, "ddp", mirror=m3), cfg(4, 6, mirror=m3), str(root / "foreign"))
    return root, run_ranks(rank_fns.several, 2, [(fns.tier_rules, (cfgs, str(root))), (fns.slow_mirror, slow),
                                                 *layouts, (fns.foreign_on_mirror, foreign)], timeout=600)


def test_a_corrupt_newest_sharded_checkpoint_resumes_from_the_mirror_copy_and_is_quarantined(tier_runs):
    """One byte flipped in the newest local shard (step 6): the mirror's intact step 6 is used,
    not the older local step 4, and the corrupt folder is moved aside, so keep_last = 2 keeps the
    good steps 6 and 8 (it used to count the corrupt one and prune the good step 4)."""
    _, per_rank = tier_runs
    for tiers, *_ in per_rank:
        assert tiers["first"] == 6 and tiers["corrupt_newest"] == ("ok", (6, 8)), tiers["corrupt_newest"]
    # rank 0 uploads (rank 1 may list before rank 0's last upload is done)
    assert per_rank[0][0]["mirror_after_first"] == ["step_000000004", "step_000000006"]
    assert per_rank[0][0]["local_after_corrupt"] == [".corrupt-step_000000006", "step_000000006", "step_000000008"]


def test_lost_local_folder_and_an_unlistable_mirror_refuse_instead_of_starting_fresh(tier_runs):
    """The local folder lost and the mirror down (listing raises) or its file:// root missing (an
    unmounted share): CheckpointLoadError (exit 3) on every rank, metrics.jsonl untouched; once the
    mirror is back the run resumes from its step 8."""
    _, per_rank = tier_runs
    for tiers, *_ in per_rank:
        kind, msg = tiers["outage"]
        assert kind == "CheckpointLoadError" and "cannot tell whether this is a fresh start" in msg, tiers["outage"]
        assert "network is unreachable" in msg
        kind, msg = tiers["missing_root"]
        assert kind == "CheckpointLoadError" and "does not exist" in msg and "unmounted" in msg, tiers["missing_root"]
        assert tiers["rows_after_outage"] == tiers["rows_after_missing"] == list(range(1, 9))
        assert tiers["back"] == ("ok", (8, 10)), tiers["back"]


def test_a_fresh_run_never_uploads_over_a_mirror_that_holds_checkpoints(tier_runs):
    """A run without --resume whose mirror already holds checkpoints (here: another run folder's)
    is a config error before anything is written, not a run whose uploads replace step 2, 4..."""
    _, per_rank = tier_runs
    for tiers, *_ in per_rank:
        kind, msg = tiers["fresh_over_mirror"]
        assert kind == "ConfigError" and "already holds 2 checkpoint(s)" in msg and "--resume auto" in msg, msg
        assert tiers["other_exists"] is False


@pytest.mark.parametrize("index, layout", [(2, "fsdp-tp"), (3, "fsdp-cp")])
def test_composed_layouts_keep_the_tier_rules(tier_runs, index, layout):
    """fsdp x tp and fsdp x cp (dp 1 x 2 on 2 ranks; dp 2 x 2 on 4 in the slow tier): a byte flipped
    in the newest local shard (step 2) resumes from the mirror's intact step 2, not the local step
    1, the corrupt folder is quarantined and keep_last = 2 keeps the good steps 2 and 3; the local
    folder lost and the mirror down or its root missing: CheckpointLoadError on every rank,
    metrics.jsonl untouched."""
    _, per_rank = tier_runs
    for results in per_rank:
        check_layout(results[index], layout)


def check_layout(got, layout):
    assert got["first"] == 2 and got["corrupt_newest"] == ("ok", (2, 3)), (layout, got["corrupt_newest"])
    assert got["local_after_corrupt"] == [".corrupt-step_000000002", "step_000000002", "step_000000003"], \
        (layout, got["local_after_corrupt"])
    kind, msg = got["outage"]
    assert kind == "CheckpointLoadError" and "cannot tell whether this is a fresh start" in msg, (layout, msg)
    kind, msg = got["missing_root"]
    assert kind == "CheckpointLoadError" and "does not exist" in msg and "unmounted" in msg, (layout, msg)
    assert got["rows_after_refusals"] == [1, 2, 3], (layout, got["rows_after_refusals"])


@pytest.mark.slow
def test_composed_layouts_on_four_ranks_keep_the_tier_rules(tmp_path):
    """The same rules for fsdp x tp and fsdp x cp with dp 2 x 2 on 4 ranks (one launch): FSDP2
    shards every TP (or CP) group's weights once more over the dp ranks."""
    calls = []
    for name, sets in LAYOUTS.items():
        (tmp_path / name).mkdir()
        calls.append((fns.layout_tiers, (layout_cfgs(tmp_path / name, sets), str(tmp_path / name))))
    for results in run_ranks(rank_fns.several, 4, calls, timeout=600):
        for got, layout in zip(results, LAYOUTS):
            check_layout(got, layout)


def test_a_lost_disk_never_starts_fresh_beside_the_mirrors_checkpoints_of_another_format(tier_runs, tmp_path):
    """The local folder lost, the mirror holding the run in another format: ``--resume auto`` is a
    ConfigError naming the mirror's checkpoints, nothing written, the mirror untouched (it used to
    look at the local folder only, start from step 0 and upload over the mirror's step names).
    ddp's full checkpoints resumed by fsdp (2 ranks, in the launch), and fsdp's sharded ones
    (``tier_rules``' mirror, copied) resumed by ``single`` (full) in this process."""
    import shutil

    root, per_rank = tier_runs
    for results in per_rank:
        got = results[4]
        kind, msg = got["resume"]
        assert kind == "ConfigError", got["resume"]
        assert "holds no" not in msg and "hold no sharded (DCP) checkpoint" in msg and "full, step 2" in msg, msg
        assert f"on the mirror file://{root / 'foreign' / 'm'}" in msg, msg
        assert got["rows"] == [1, 2] and got["mirror_after"] == got["mirror_before"] == \
            {"step_000000002": "course_lib.checkpoint/1"}, got
    mirror = tmp_path / "m1"
    shutil.copytree(root / "m1", mirror)
    held = sorted(p.name for p in mirror.iterdir())
    with pytest.raises(train_config.ConfigError, match=r"hold no full checkpoint(.|\n)*sharded \(DCP\), step 10, "
                                                       r"2 ranks, on the mirror"):
        train(cfg(12, GLOBAL_BATCH, "single", mirror=f"file://{mirror}"), tmp_path / "single", resume=True)
    assert not (tmp_path / "single").exists() or not any((tmp_path / "single").rglob("*.json*"))
    assert sorted(p.name for p in mirror.iterdir()) == held


def test_the_full_tier_refuses_through_the_trainer_as_the_sharded_one_does(tier_runs, tmp_path):
    """The same two refusals on the full tier's path (``single``, one process): a fresh run whose
    mirror already holds checkpoints, a resume with nothing local and a file:// mirror root that
    does not exist (an unmounted share), and a fresh run whose root's parent is missing: each an
    error before anything is written, never an empty mirror."""
    import shutil

    from course_lib.checkpoint import CheckpointLoadError

    root, _ = tier_runs
    mirror = tmp_path / "m1"
    shutil.copytree(root / "m1", mirror)
    held = sorted(p.name for p in mirror.iterdir())
    with pytest.raises(train_config.ConfigError, match=r"already holds 2 checkpoint\(s\).*--resume auto"):
        train(cfg(4, GLOBAL_BATCH, "single", mirror=f"file://{mirror}"), tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists() and sorted(p.name for p in mirror.iterdir()) == held
    gone = f"file://{tmp_path / 'unmounted' / 'm1'}"
    with pytest.raises(CheckpointLoadError, match="does not exist.*cannot tell whether this is a fresh start"):
        train(cfg(4, GLOBAL_BATCH, "single", mirror=gone), tmp_path / "resumed", resume=True)
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()
    with pytest.raises(train_config.ConfigError, match="parent folder does not exist"):
        train(cfg(4, GLOBAL_BATCH, "single", mirror=gone), tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "unmounted").exists()


def test_the_sharded_prune_leaves_a_folder_the_mirror_is_still_uploading(tier_runs):
    """save_every = 1, keep_last = 2, 0.3 s per uploaded file (5 files a checkpoint): no upload fails (a pruned folder used to
    fail with FileNotFoundError, leaving partial copies), every mirror folder is complete, the
    mirror holds the last step, and the local folder ends with keep_last."""
    root, per_rank = tier_runs
    slow = per_rank[0][1]
    assert slow["failed"] == [], slow["failed"]
    assert slow["mirror"] and all(slow["mirror"].values()), slow["mirror"]
    assert "step_000000006" in slow["mirror"] and len(slow["mirror"]) <= 2, slow["mirror"]
    assert slow["local"] == ["step_000000005", "step_000000006"], slow["local"]


def test_the_sharded_mirror_prune_counts_and_deletes_its_own_format_only():
    """``dcp_mirror.mirror_keep``: keep_last newest sharded copies by save order, every copy of
    another format kept (the full tier's ``CheckpointManager._mirror_keep`` does the same:
    test_the_mirror_prune_leaves_checkpoints_of_another_format)."""
    from course_lib.checkpoint.dcp_mirror import mirror_keep

    listing = {"step_000000004": {"format": DCP_FORMAT, "seq": 3}, "step_000000002": {"format": DCP_FORMAT, "seq": 4},
               "step_000000006": {"format": DCP_FORMAT, "seq": 2}, "step_000000001": {"format": "course_lib.checkpoint/1"}}
    assert mirror_keep(2)(listing) == {"step_000000004", "step_000000002", "step_000000001"}


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
