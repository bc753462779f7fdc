"""[wandb]: an offline W&B run beside metrics.jsonl whose id is checkpointed; a job SIGKILLed and
resumed appends to the same run, and wandb's own reader finds every step exactly once."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_lib import train_config
from course_lib.metrics import read_rows
from course_lib.train import train

pytest.importorskip("wandb")
from course_lib.wandb_log import read_segment, segments  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"


def test_wandb_section_is_checked_and_a_missing_package_names_the_install(monkeypatch):
    with pytest.raises(train_config.ConfigError, match="wandb.mode must be one of disabled, offline, online"):
        train_config.load(TINY, ["wandb.mode='offlne'"])
    assert train_config.load(TINY)["wandb"]["mode"] == "disabled"  # off unless asked
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(train_config.ConfigError, match=r"pip install -e '\.\[wandb\]'"):
        train_config.load(TINY, ["wandb.mode='offline'"])
    train_config.load(TINY)  # disabled: the package is not needed


@pytest.fixture
def quiet_offline(monkeypatch):
    """WANDB_* for an in-process run, restored afterwards (WandbLog sets WANDB_DIR/MODE); the wandb
    service this process started is stopped, so no later test shares the process with it."""
    for key, value in (("WANDB_SILENT", "true"), ("WANDB_MODE", "offline"), ("WANDB_DIR", "/nonexistent")):
        monkeypatch.setenv(key, value)
    yield
    import wandb

    wandb.teardown()


def _cmd(out, *extra):
    return [sys.executable, "-m", "course_lib.train", "--config", str(TINY), "--out", str(out), "--no-progress",
            "--max-steps", "12", "--save-every", "4", "--set", "schedule.warmup_steps=3",
            "--set", "train.metrics_flush_s=0", "--set", "wandb.mode='offline'", *extra]


def test_offline_run_resumed_after_sigkill_holds_every_step_exactly_once(tmp_path, quiet_offline):
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    out = tmp_path / "run"
    victim = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(read_rows(out / "metrics.jsonl")) < 6:
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert 6 <= len(read_rows(out / "metrics.jsonl")) < 12, "the run was not killed mid-way"
    # the resumed job runs in this process (one interpreter start less), with the same config
    cfg = train_config.load(TINY, ["train.max_steps=12", "checkpoint.save_every=4", "schedule.warmup_steps=3",
                                   "train.metrics_flush_s=0", "wandb.mode='offline'", "train.progress=false"])
    resumed = train(cfg, out, resume=True)
    assert resumed.resumed_from in (4, 8) and resumed.steps == 12

    newest = sorted((out / "checkpoints").glob("step_*"))[-1]
    run_id = torch.load(newest / "train_state.pt", weights_only=True)["stateful"]["wandb"]["run_id"]
    runs = sorted((out / "wandb").glob("*run-*"))
    assert segments(out, run_id) == runs and len(runs) == 2  # one folder per start of the job, both this run
    killed, resumed_rows = (read_segment(seg) for seg in runs)
    history = killed + resumed_rows
    assert [r["_step"] for r in history] == list(range(1, 13))  # every step exactly once, in order
    rows = read_rows(out / "metrics.jsonl")
    assert [r["loss"] for r in history] == [r["loss"] for r in rows]  # the same rows, bit-exact
    # wandb buffers records: a SIGKILL loses the ones not yet written (here usually all of them),
    # and the resumed job sent them again from metrics.jsonl before its own.
    print(f"the killed job's W&B file held {len(killed)} rows, the resumed job's {len(resumed_rows)}")


def test_steps_the_run_already_holds_are_not_sent_again(tmp_path, quiet_offline):
    """A job that logged steps 1-6, then was resumed from its checkpoint at step 4: the resumed job
    recomputes 5 and 6, but W&B keeps the rows it holds and gets only 7 and 8."""
    from course_lib.metrics import MetricsLog
    from course_lib.wandb_log import WandbLog

    cfg = train_config.load(TINY, ["wandb.mode='offline'"])
    first = WandbLog(cfg, tmp_path, enabled=True)
    with MetricsLog(tmp_path / "metrics.jsonl", sinks=[first]) as log:
        for step in range(1, 7):
            log.write({"step": step, "loss": 10.0 + step, "job": 1})
    again = WandbLog(cfg, tmp_path, enabled=True)
    again.load_state_dict(first.state_dict())  # what a resume from the checkpoint does
    with MetricsLog(tmp_path / "metrics.jsonl", resume_step=4, sinks=[again]) as log:
        for step in range(5, 9):
            log.write({"step": step, "loss": 10.0 + step, "job": 2})
    history = [row for seg in segments(tmp_path, first.run_id) for row in read_segment(seg)]
    assert [r["_step"] for r in history] == list(range(1, 9))
    assert [r["job"] for r in history] == [1] * 6 + [2] * 2
    # ranks other than 0 keep the run id for their checkpoints and send nothing
    other = WandbLog(cfg, tmp_path / "rank1", enabled=False)
    with MetricsLog(tmp_path / "rank1" / "metrics.jsonl", enabled=False, sinks=[other]) as log:
        log.write({"step": 1, "loss": 1.0})
    assert other.stateful() == {"wandb": other} and not (tmp_path / "rank1").exists()
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == list(range(1, 9))
