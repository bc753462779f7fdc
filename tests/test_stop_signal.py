"""Checkpoint on a signal (course_lib.watch.stop_signal): SIGUSR1 to one torchrun worker, or SIGTERM
to the torchrun agent (which forwards it to every worker), stops both ranks at the same step with
a checkpoint and exit code 75; ``--resume auto`` then reaches the very losses of a run that was
never interrupted. Without host-read overhead: tests/test_train.py counts the trainer's host reads
per step with checkpoint_on_signal on (its default) and test_host_reads_with_the_watchdog_on here."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.watch import STOP_EXIT_CODE, StopSignal

ROOT = Path(__file__).resolve().parent.parent
STEPS = 16  # the signal goes after 3 rows and stops within a step or two: room to spare
ARGS = ["--config", "labs/configs/tiny-cpu.toml", "--no-progress", "--max-steps", str(STEPS),
        "--set", "train.strategy=ddp", "--set", "train.device=cpu", "--set", "schedule.warmup_steps=2",
        "--set", "train.metrics_flush_s=0"]


def test_handler_sets_the_flag_and_restore_puts_the_old_handler_back():
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignal().install()
    try:
        assert stop.installed and stop.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # Python runs the handler at the next bytecode boundary of the main thread
        assert stop.received == "SIGUSR1" and stop.received_at is not None
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


def _torchrun(out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.train", *ARGS, "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 90) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows]


def _worker_pid(agent_pid: int, rank: int) -> int:
    """The pid of the torchrun worker with RANK=rank (the agent's child)."""
    children = " ".join(Path(f"/proc/{agent_pid}/task/{t}/children").read_text()
                        for t in os.listdir(f"/proc/{agent_pid}/task")).split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} among {children}")


def _signal_after_rows(proc: subprocess.Popen, out: Path, rows: int, target) -> float:
    """Wait until metrics.jsonl has ``rows`` rows, send the signal (``target()``), return when."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            target()
            return time.monotonic()
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError("the run ended or stalled before the signal could be sent:\n" + _finish(proc)[-3000:])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = _torchrun(out)
    log = _finish(proc)
    assert proc.returncode == 0, log[-3000:]
    return _losses(out)


def _stopped_step(out: Path, log: str, reference, took: float, what: str) -> int:
    """The checkpoint the stop left; rows up to it match the reference bit for bit."""
    steps = sorted(int(p.name.split("_")[-1]) for p in (out / "checkpoints").glob("step_*"))
    assert steps and 3 <= steps[-1] < STEPS, (steps, log[-2000:])
    stopped_at = steps[-1]
    assert _losses(out) == reference[:stopped_at]  # every row up to the checkpoint, none after
    print(f"\n{what}: signal -> job exit {took:.2f} s, checkpoint at step {stopped_at}")
    return stopped_at


@pytest.mark.slow  # the default suite holds the same path in lab 14 section 7 (labs/14_capstone.ipynb,
# run by nbval): SIGUSR1 to one worker of a 2-rank torchrun job, the stop exit code, "stopped by a
# peer rank's signal", the checkpoint step, and a resume whose losses equal the reference's exactly
def test_sigusr1_to_one_worker_stops_both_ranks_at_one_step_and_resumes_exactly(tmp_path, reference):
    out = tmp_path / "usr1"
    proc = _torchrun(out)
    sent = _signal_after_rows(proc, out, 3, lambda: os.kill(_worker_pid(proc.pid, 1), signal.SIGUSR1))
    log = _finish(proc)
    took = time.monotonic() - sent
    assert proc.returncode != 0 and f"exitcode  : {STOP_EXIT_CODE}" in log, log[-3000:]
    assert log.count("SIGUSR1 received") == 1                 # only rank 1 got it...
    assert "stopped by a peer rank's signal" in log           # ...and rank 0 stopped with it
    stopped_at = _stopped_step(out, log, reference, took, "SIGUSR1 to rank 1")
    proc = _torchrun(out, "--resume", "auto")
    resumed_log = _finish(proc)
    assert proc.returncode == 0, resumed_log[-3000:]
    assert f"resumed from step {stopped_at}" in resumed_log
    assert _losses(out) == reference  # bit-exact: the same floats at every step, 1..STEPS


@pytest.mark.slow  # two more torchrun jobs (~20 s on 2 loaded cores)
def test_sigterm_to_the_torchrun_agent_reaches_every_worker_and_checkpoints(tmp_path, reference):
    """torchrun's agent forwards SIGTERM to its workers and waits (--shutdown-timeout, 30 s by
    default) before SIGKILL: time enough to checkpoint and leave."""
    out = tmp_path / "term"
    proc = _torchrun(out)
    sent = _signal_after_rows(proc, out, 3, lambda: proc.send_signal(signal.SIGTERM))
    log = _finish(proc)
    took = time.monotonic() - sent
    assert log.count("SIGTERM received") == 2, log[-3000:]   # the agent forwarded it to both workers
    assert "stopped by SIGTERM after step" in log
    stopped_at = _stopped_step(out, log, reference, took, "SIGTERM to torchrun")
    proc = _torchrun(out, "--resume", "auto")
    resumed_log = _finish(proc)
    assert proc.returncode == 0 and f"resumed from step {stopped_at}" in resumed_log, resumed_log[-3000:]
    assert _losses(out) == reference


def test_the_stop_vote_and_the_watchdog_add_no_host_read_per_step(tmp_path, monkeypatch):
    """The stop flag rides in the stabilizer's one read; heartbeats are host integers."""
    sys.path.insert(0, str(ROOT / "tests"))
    from host_reads import reads_per_step

    from course_lib.trainer import config as train_config
    from course_lib.train import train

    monkeypatch.setattr("course_lib.train._peak_flops", lambda cfg, device: 1e12)
    base = ["train.progress=false", "schedule.warmup_steps=1", "checkpoint.async_save=false",
            "train.watchdog_s=30", "train.checkpoint_on_signal=true"]

    def run(steps):
        cfg = train_config.load(str(ROOT / "labs/configs/tiny-cpu.toml"), base + [f"train.max_steps={steps}"])
        train(cfg, tmp_path / f"r{steps}")
    assert reads_per_step(run, 10) <= 1
