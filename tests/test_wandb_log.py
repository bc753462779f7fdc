"""[wandb]: an offline W&B run beside metrics.jsonl whose id is checkpointed; a job SIGKILLed and
resumed appends to the same run, and wandb's own reader finds every step exactly once."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_lib.trainer import config as train_config
from course_lib.trainer.metrics import read_rows
from course_lib.train import train

pytest.importorskip("wandb")
from course_lib.trainer.wandb_log import read_segment, segments  # noqa: E402

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
    """An in-process offline run: WANDB_* restored afterwards (WandbLog sets WANDB_DIR/MODE; this
    leaves WANDB_MODE unset, as a user's shell would), every name lookup or connection this process
    attempts recorded and refused (offline means no network), and the wandb service stopped after."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for key in ("WANDB_MODE", "WANDB_DIR"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network access refused by the test")
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield
    import wandb

    wandb.teardown()
    assert not attempts, f"an offline run tried the network: {attempts}"


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


# Run in a fresh interpreter: wandb's usage telemetry would go out at interpreter exit, which an
# in-process test never reaches. Every name lookup or connection is refused and reported.
SKIP_SCRIPT = r"""
import socket, sys
from pathlib import Path
def refuse(*args, **kwargs):
    print("NETWORK", args[:2], flush=True)
    raise OSError("network refused by the test")
socket.getaddrinfo = socket.create_connection = refuse
from course_lib.trainer import config as train_config
from course_lib.trainer.metrics import MetricsLog
from course_lib.trainer.wandb_log import WandbLog
out = Path(sys.argv[1])
cfg = train_config.load(None, ["wandb.mode='offline'"])
first = WandbLog(cfg, out, enabled=True)  # a job that logged steps 1-6 ...
with MetricsLog(out / "metrics.jsonl", sinks=[first]) as log:
    for step in range(1, 7):
        log.write({"step": step, "loss": 10.0 + step, "job": 1})
again = WandbLog(cfg, out, enabled=True)  # ... resumed from its checkpoint at step 4
again.load_state_dict(first.state_dict())
with MetricsLog(out / "metrics.jsonl", resume_step=4, sinks=[again]) as log:
    for step in range(5, 9):
        log.write({"step": step, "loss": 10.0 + step, "job": 2})
other = WandbLog(cfg, out / "rank1", enabled=False)  # another rank: keeps the id, sends nothing
with MetricsLog(out / "rank1" / "metrics.jsonl", enabled=False, sinks=[other]) as log:
    log.write({"step": 1, "loss": 1.0})
assert other.stateful() == {"wandb": other} and not (out / "rank1").exists()
print("RUN", first.run_id, flush=True)
"""


def test_steps_the_run_already_holds_are_not_sent_again_and_offline_stays_offline(tmp_path):
    """The resumed job recomputes steps 5 and 6, but W&B keeps the rows it holds and gets only 7 and 8;
    and no lookup or connection is attempted, interpreter exit included."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # as a user's shell: no WANDB_MODE
    env.update(WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SKIP_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NETWORK" not in done.stdout, done.stdout  # wandb 0.31 tries it unless WANDB_MODE is set first
    run_id = done.stdout.split("RUN ")[1].split()[0]
    history = [row for seg in segments(tmp_path, run_id) for row in read_segment(seg)]
    assert [r["_step"] for r in history] == list(range(1, 9))
    assert [r["job"] for r in history] == [1] * 6 + [2] * 2
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == list(range(1, 9))
