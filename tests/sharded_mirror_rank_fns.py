"""Rank functions for tests/test_sharded_mirror.py (importable: run_ranks starts fresh processes)."""
from __future__ import annotations


def train_wipe_resume(rank, world_size, first_cfg, second_cfg, out_dir):
    """Train with ``first_cfg``, wipe the local checkpoint folder (a lost disk: only the mirror
    keeps the run), then ``--resume auto`` with ``second_cfg``. Returns, per run, the steps and
    where it resumed from; rank 0 also what the folder held just before the resume."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.train import train

    first = train(first_cfg, out_dir)
    dist.barrier()
    ckpts = Path(out_dir) / "checkpoints"
    if rank == 0:
        shutil.rmtree(ckpts)
    dist.barrier()
    left = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    second = train(second_cfg, out_dir, resume=True)
    return {"first": (first.steps, first.resumed_from), "second": (second.steps, second.resumed_from),
            "left_before_resume": left}


def resume_only(rank, world_size, cfg, out_dir):
    """``--resume auto`` into an empty folder: whatever it resumes from came from the mirror."""
    from course_lib.train import train

    result = train(cfg, out_dir, resume=True)
    return result.steps, result.resumed_from


def _outcome(fn, *args, **kwargs):
    """``("ok", (resumed_from, steps))`` of a train() call, or ``(exception type name, message)``:
    every rank raises together."""
    try:
        result = fn(*args, **kwargs)
        return "ok", (result.resumed_from, result.steps)
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return type(e).__name__, str(e)


def _rows(out_dir):
    import json
    from pathlib import Path

    return [json.loads(line)["step"] for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def _ckpts(folder):
    from pathlib import Path

    folder = Path(folder)
    return sorted(p.name.split("-")[0] + "-" + p.name.split("-")[1] if p.name.startswith(".corrupt-") else p.name
                  for p in folder.iterdir()) if folder.is_dir() else []


def tier_rules(rank, world_size, cfgs, root):
    """The rules full checkpoints keep, on fsdp's sharded ones, one launch (rank 0 damages files,
    every rank trains). ``cfgs``: ``{"6"|"8"|"10": cfg with the file:// mirror root/m1, "missing":
    cfg of 10 steps whose file:// mirror root does not exist}``. Returns what each step saw."""
    from pathlib import Path

    from course_lib.train import train

    run, mirror = Path(root) / "run", Path(root) / "m1"
    out = {"first": train(cfgs["6"], run).steps}
    out["mirror_after_first"] = _ckpts(mirror)
    # a fresh run into another folder with the same mirror would upload over its step names
    out["fresh_over_mirror"] = _outcome(train, cfgs["6"], Path(root) / "other")
    out["other_exists"] = (Path(root) / "other").exists()
    out.update(_corrupt_newest_then_lose_the_disk(rank, run, "step_000000006", cfgs["8"], cfgs["10"]))
    out["rows_after_outage"] = _rows(run)
    out["missing_root"] = _outcome(train, cfgs["missing"], run, resume=True)  # an unmounted share
    out["rows_after_missing"] = _rows(run)
    out["back"] = _outcome(train, cfgs["10"], run, resume=True)  # the mirror is back: nothing was lost
    return out


def slow_mirror(rank, world_size, cfg, out_dir, mirror_dir, seconds):
    """fsdp saving every step to a mirror that needs ``seconds`` per file (a slow link, rank 0's
    uploads): the prune must leave folders still uploading. Returns the upload failures warned
    about (rank 0), the mirror's folders and whether each is complete, and the local folder."""
    import warnings
    from pathlib import Path

    from course_lib.checkpoint.mirror import CheckpointMirror
    from course_lib.train import train
    from slow_mirror_train import slow_uploads

    upload = CheckpointMirror._upload_once
    slow_uploads(seconds)  # every file crosses the slow link
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(cfg, out_dir)
    finally:
        CheckpointMirror._upload_once = upload
    mirror_dir = Path(mirror_dir)
    return {"failed": [str(w.message) for w in caught if "mirror upload" in str(w.message)],
            "mirror": {p.name: (p / "manifest.json").exists() for p in mirror_dir.iterdir()},
            "local": _ckpts(Path(out_dir) / "checkpoints")}


def _corrupt_newest_then_lose_the_disk(rank, run, newest, corrupt_cfg, outage_cfg) -> dict:
    """Two tier rules in a row, every rank training: one byte of ``newest``'s first local shard
    flips (rank 0; the mirror's copy is intact) and the run resumes with ``corrupt_cfg``; then the
    local folder is lost and the mirror cannot be listed (an S3 outage) while it resumes with
    ``outage_cfg``. Returns both outcomes and the local checkpoints after the first."""
    import shutil

    import torch.distributed as dist

    from course_lib.checkpoint.mirror import CheckpointMirror
    from course_lib.train import train

    ckpts = run / "checkpoints"
    dist.barrier()
    if rank == 0:
        _flip_newest_shard(ckpts, newest)
    dist.barrier()
    out = {"corrupt_newest": _outcome(train, corrupt_cfg, run, resume=True), "local_after_corrupt": _ckpts(ckpts)}
    dist.barrier()
    if rank == 0:  # the local disk is lost...
        shutil.rmtree(ckpts)
    dist.barrier()
    real_list = CheckpointMirror.list

    def outage(self):  # ...and the mirror cannot be listed
        raise OSError("network is unreachable")

    CheckpointMirror.list = outage
    try:
        out["outage"] = _outcome(train, outage_cfg, run, resume=True)
    finally:
        CheckpointMirror.list = real_list
    return out


def _flip_newest_shard(ckpts, name):
    """One byte of ``name``'s first ``.distcp`` shard flipped (rank 0; the mirror's copy stays intact)."""
    shard = sorted((ckpts / name).glob("*.distcp"))[0]
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))


def layout_tiers(rank, world_size, cfgs, root):
    """The two tier rules that depend on how a layout's shards are saved and loaded, for a composed
    layout (fsdp x tp, fsdp x cp), one launch: the mirror's copy of a corrupt newest (quarantined,
    not counted by keep_last), and a refusal when the local folder is lost and the mirror is down
    or its file:// root missing. ``cfgs``: ``{"2"|"3"|"4": cfg of that many steps, a save every
    step, with the file:// mirror root/m, "missing": cfg of 4 steps whose mirror root does not exist}``."""
    from pathlib import Path

    from course_lib.train import train

    run = Path(root) / "run"
    out = {"first": train(cfgs["2"], run).steps}
    out.update(_corrupt_newest_then_lose_the_disk(rank, run, "step_000000002", cfgs["3"], cfgs["4"]))
    out["missing_root"] = _outcome(train, cfgs["missing"], run, resume=True)
    out["rows_after_refusals"] = _rows(run)
    return out


def foreign_on_mirror(rank, world_size, full_cfg, sharded_cfg, root):
    """A ddp run saving full checkpoints with a mirror loses its local disk; ``--resume auto`` with
    fsdp (sharded checkpoints) and the same mirror must not take "nothing of my format" for a fresh
    start. Returns the outcome, the metrics rows after it and the mirror's ``{name: format}``."""
    import json
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.train import train

    run, mirror = Path(root) / "run", Path(root) / "m"
    train(full_cfg, run)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(run / "checkpoints")
    dist.barrier()
    before = {p.name: json.loads((p / "manifest.json").read_text())["format"] for p in sorted(mirror.iterdir())}
    got = _outcome(train, sharded_cfg, run, resume=True)
    dist.barrier()
    after = {p.name: json.loads((p / "manifest.json").read_text())["format"] for p in sorted(mirror.iterdir())}
    return {"resume": got, "rows": _rows(run), "mirror_before": before, "mirror_after": after}
