"""What the kit writes and reads keeps its promises about the run folder (issue 44):

* a run without ``--resume`` into a folder holding checkpoints is refused before anything is written
  (exit 2, naming ``--resume auto`` and a new ``--out``): retention would prune the earlier run's
  checkpoints and ``metrics.jsonl`` would be rewritten (full, in one process; fsdp + sharded, 2 ranks);
* a ``checkpoint.mirror`` that is the checkpoint folder, inside it or above it is refused before
  anything is written (both formats);
* one order everywhere: the manifest's save sequence, which every format of a folder shares
  (``course ckpt`` after a clock step back, and resume_guard's "saved after");
* ``course ckpt consolidate`` names the newer checkpoints it passed over, and stops at one it
  cannot read (not damage), like ``--resume auto``;
* ``course ckpt list`` says what a resume does (a torn manifest: refused, exit 3);
* a run begun from ``model.init_from`` resumes without its source, and its summary names it;
* a DeepSpeed folder is read with ``weights_only=True``: a planted payload runs nothing.

Everything runs in this process except one 2-rank launch (fsdp, sharded checkpoints).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import run_folder_rank_fns as fns
from course_lib import cli
from course_lib.checkpoint import io as cio
from course_lib.parallel import run_ranks
from course_lib.train import main as train_main
from course_lib.trainer import config as train_config

TINY = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
BASE = ["--config", str(TINY), "--no-progress", "--set", "train.peak_flops=1e12", "--set", "schedule.warmup_steps=1",
        "--set", "checkpoint.async_save=false", "--set", "checkpoint.keep_last=2", "--set", "train.micro_batch=8"]


def run(out, steps=4, *extra):
    """``course train`` in this process: ``steps`` steps saving every 2, keep_last 2."""
    return train_main([*BASE, "--out", str(out), "--max-steps", str(steps), "--save-every", "2", *extra])


def ckpt(*argv) -> int:
    return cli.main(["ckpt", *map(str, argv)])


def snapshot(out: Path):
    """Every file under ``out`` with its bytes: what a refused run must leave exactly as it was."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run (4 steps, checkpoints at 2 and 4), copied by each test that changes it."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert run(out) == 0
    return out


# ---------------------------------------------------------------------------- 1. the run folder

def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_and_nothing_changes(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    before = snapshot(out)
    capsys.readouterr()
    assert run(out, 6) == 2
    err = capsys.readouterr().err
    assert "--resume auto" in err and "new --out" in err and "step_000000004" in err, err
    assert snapshot(out) == before, "the refused run changed the folder"
    assert run(out, 6, "--resume", "auto") == 0  # the way it names works
    assert "resumed from step 4" in capsys.readouterr().out


# ---------------------------------------------------------------------------- 2. the mirror

@pytest.mark.parametrize("where", ["same", "inside", "above", "symlink"])
def test_a_mirror_overlapping_the_checkpoint_folder_is_refused_before_anything_is_written(tmp_path, capsys, where):
    out = tmp_path / "run"
    mirror = {"same": out / "checkpoints", "inside": out / "checkpoints" / "copy", "above": out,
              "symlink": tmp_path / "link"}[where]
    if where == "symlink":  # another name for the checkpoint folder
        os.symlink(out / "checkpoints", mirror)
    assert run(out, 2, "--set", f"checkpoint.mirror={json.dumps('file://' + str(mirror))}") == 2
    err = capsys.readouterr().err
    assert "checkpoint.mirror" in err and "nothing was written" in err, err
    assert not out.exists(), f"the refused run wrote {sorted(p.name for p in out.rglob('*'))}"
    from course_lib.checkpoint import CheckpointManager

    with pytest.raises(ValueError, match="checkpoint.mirror"):
        CheckpointManager(out / "checkpoints", mirror=f"file://{mirror}")
    assert not out.exists()


# ---------------------------------------------------------------------------- 1 + 2 on 2 ranks

def test_fsdp_sharded_refuses_a_second_fresh_run_and_an_overlapping_mirror_on_two_ranks(tmp_path):
    """fsdp with sharded checkpoints, one 2-rank launch: a second run without --resume into the
    folder is a ConfigError on both ranks and leaves the folder as it was; a mirror that is another
    run's checkpoint folder, or above it, is refused before that run writes anything; and a
    sharded save continues the save sequence of the folder's other formats."""
    def cfg(**sets):
        extra = [f"{k.replace('__', '.')}={json.dumps(v) if isinstance(v, str) else v}" for k, v in sets.items()]
        return train_config.load(TINY, ["train.progress=false", "train.peak_flops=1e12", "schedule.warmup_steps=1",
                                        "train.max_steps=4", "train.micro_batch=8", 'train.strategy="fsdp"',
                                        "checkpoint.save_every=2", "checkpoint.keep_last=2",
                                        "checkpoint.async_save=false", *extra])

    out, other = tmp_path / "fsdp", tmp_path / "other"
    mirrors = [("mirror-same", cfg(checkpoint__mirror=f"file://{other / 'checkpoints'}"), str(other)),
               ("mirror-above", cfg(checkpoint__mirror=f"file://{tmp_path}"), str(other))]
    reports = run_ranks(fns.refusals_on_two_ranks, 2, cfg(), str(out), mirrors, str(tmp_path / "seq"), timeout=600)
    (found, before, after, seq), (found1, *_) = reports
    assert before[1] == ["step_000000002", "step_000000004"], before[1]
    assert after == before, "the refused second run changed the folder (step folders, metrics or manifests)"
    for name, text in {**found, **{f"{k} (rank 1)": v for k, v in found1.items()}}.items():
        assert text is not None, f"{name}: the run went ahead"
    assert "--resume auto" in found["again"] and "new --out" in found["again"], found["again"]
    assert all("checkpoint.mirror" in found[n] for n in ("mirror-same", "mirror-above")), found
    assert not other.exists(), "a refused run wrote into its --out"
    assert seq == 8, f"a sharded save beside a full checkpoint of save #7 got save #{seq}: one order per folder"


# ---------------------------------------------------------------------------- 4. one order

def test_one_order_everywhere_is_the_save_sequence_not_the_clock(trained, tmp_path, capsys):
    """After a clock step back (the newest checkpoint's save time earlier than the older one's),
    ``consolidate`` without --step takes the newest by sequence; a checkpoint of another format
    with a higher sequence counts as saved after (resume_guard), whatever its clock said; and a
    new save continues the folder's one sequence across formats."""
    from course_lib.checkpoint import CheckpointManager
    from course_lib.model import TinyGPT
    from course_lib.parallel.resume_guard import verdict

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    root = out / "checkpoints"
    m2, m4 = (json.loads((root / f"step_00000000{s}" / "manifest.json").read_text()) for s in (2, 4))
    assert (m2["seq"], m4["seq"]) == (1, 2)
    m4["created_unix"] = m2["created_unix"] - 3600  # another node's clock, one hour behind
    (root / "step_000000004" / "manifest.json").write_text(json.dumps(m4))
    assert ckpt("consolidate", out, "--out", tmp_path / "w.safetensors") == 0
    assert "step_000000004 step 4" in capsys.readouterr().out
    assert json.loads((tmp_path / "w.json").read_text())["source"]["step"] == 4

    foreign = root / "step_000000006"  # "deepspeed": saved after step 4 by sequence, earlier by clock
    shutil.copytree(root / "step_000000002", foreign)
    mf = json.loads((foreign / "manifest.json").read_text())
    mf.update(format="course_lib.checkpoint.deepspeed/1", step=6, seq=3, world_size=2, zero_stage=2,
              created_unix=m2["created_unix"] - 7200)
    (foreign / "manifest.json").write_text(json.dumps(mf))
    loaded = SimpleNamespace(manifest=m4, path=root / "step_000000004", step=4)
    kind, text = verdict(root, "full", "single", loaded)
    assert kind == "refuse" and "saved after" in text and "step_000000006" in text, (kind, text)

    mgr = CheckpointManager(root, async_save=False)
    saved = mgr.save(8, model=TinyGPT(train_config.build_model_config(train_config.load(TINY))))
    assert json.loads((saved / "manifest.json").read_text())["seq"] == 4, "the sequence must continue past every format's"


# ---------------------------------------------------------------------------- 5. consolidate says what it skipped

def test_consolidate_names_a_skipped_checkpoint_and_stops_at_an_unreadable_one(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    weights = out / "checkpoints" / "step_000000004" / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-8] + bytes(8))  # the newest: damaged bytes
    capsys.readouterr()
    assert ckpt("consolidate", out, "--out", tmp_path / "a.safetensors") == 0
    captured = capsys.readouterr()
    assert "step_000000002 step 2" in captured.out
    assert "passed over step_000000004" in captured.err and "checksum" in captured.err, captured.err

    weights.write_bytes(good)  # intact again, but the storage refuses to read it (as EACCES would)
    real = Path.read_bytes

    def denied(self):
        if self == weights:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert ckpt("consolidate", out, "--out", tmp_path / "b.safetensors") == 2
    err = capsys.readouterr().err
    assert "step_000000004" in err and "Permission denied" in err and "--step" in err, err
    assert not list(tmp_path.glob("b.*")), "nothing may be written"


# ---------------------------------------------------------------------------- 6. ckpt list says what resume does

def test_ckpt_list_says_what_resume_does_for_a_torn_manifest(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(out, 2) == 0
    manifest = out / "checkpoints" / "step_000000002" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])  # torn
    capsys.readouterr()
    assert ckpt("list", out) == 1
    said = capsys.readouterr().out
    assert "would refuse (exit 3" in said and "would start from step 0" not in said, said
    assert run(out, 4, "--resume", "auto") == 3  # what the listing promised


# ---------------------------------------------------------------------------- 7. init_from, then resume

def test_a_run_begun_from_init_from_resumes_without_its_source_and_names_it(trained, tmp_path, capsys):
    src = tmp_path / "src.safetensors"
    assert ckpt("consolidate", trained, "--out", src) == 0
    out = tmp_path / "tuned"
    init = ["--set", f"model.init_from={json.dumps(str(src))}"]
    capsys.readouterr()
    assert run(out, 2, *init) == 0
    assert f"from the weights of {src}" in capsys.readouterr().out
    src.unlink()
    src.with_suffix(".json").unlink()
    assert run(out, 4, *init, "--resume", "auto") == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "resumed from step 2" in said and str(src) in said, said
    assert run(tmp_path / "fresh", 2, *init) == 2  # a fresh start still needs it
    assert "model.init_from" in capsys.readouterr().err and not (tmp_path / "fresh").exists()


# ---------------------------------------------------------------------------- 9. DeepSpeed files are not unpickled

class _Payload:
    """Unpickled with full pickle, it opens (creates) ``marker``: what a forged file could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("stage", [0, 1])
def test_a_planted_deepspeed_payload_runs_nothing(tmp_path, capsys, stage):
    """A DeepSpeed-format checkpoint whose model file pickles a call (checksums and manifest
    valid: anyone who can write a file can recompute them) is refused, exit 2, naming the trust
    flag; the call never runs. ZeRO-0 reads the model file itself, ZeRO >= 1 through DeepSpeed's
    zero_to_fp32."""
    pytest.importorskip("deepspeed")

    def blob(obj) -> bytes:
        import io

        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    (out / "checkpoints").mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(train_config.load(TINY)))
    files = {"rank0.pt": blob({"rng": {}, "per_rank": {}, "shared": {}}),
             "mp_rank_00_model_states.pt": blob({"module": _Payload(str(marker))})}
    if stage:
        files["zero_pp_rank_0_mp_rank_00_optim_states.pt"] = blob({"optimizer_state_dict": {}})
    cio.write_checkpoint_dir(out / "checkpoints", "step_000000002", files,
                             {"step": 2, "seq": 1, "world_size": 1, "zero_stage": stage, "metrics": {},
                              "created_unix": time.time()}, format="course_lib.checkpoint.deepspeed/1")
    capsys.readouterr()
    assert ckpt("consolidate", out, "--out", tmp_path / "w.safetensors") == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "the planted payload ran"
    assert "--trust-pickles" in err and "open" in err, err
    assert not list(tmp_path.glob("w.*"))
    with pytest.raises(SystemExit):
        cli.main(["ckpt", "export-hf", "--help"])
    assert "weights_only=True" in " ".join(capsys.readouterr().out.split())
