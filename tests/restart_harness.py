"""Run the kit's trainer under ``torchrun --max-restarts``, SIGKILL one worker at a chosen step, and
read back what the job left: the harness of tests/test_torchrun_restart.py.

A job that overruns its deadline is killed whole, agent and workers, and reported as hung instead of
hanging the test. "Whole" means every descendant: torchrun starts each worker in a session of its
own, so killing the agent's process group would leave the workers running (and training on)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from course_lib.watch.demo import kill_tree

ROOT = Path(__file__).resolve().parent.parent


def trainer_args(steps: int, save_every: int, *extra: str, strategy: str = "ddp") -> list[str]:
    """The trainer's arguments: tiny config, ``strategy`` (full checkpoints: ddp, zero1, zero2) on
    CPU, a metrics row written at every step (so a kill can land at any step), periodic
    checkpoints, ``--resume auto``."""
    return ["--config", "labs/configs/tiny-cpu.toml", "--no-progress", "--max-steps", str(steps),
            "--save-every", str(save_every), "--resume", "auto",
            "--set", f"train.strategy={strategy}", "--set", "train.device=cpu", "--set", "schedule.warmup_steps=2",
            "--set", "train.metrics_flush_s=0", *extra]


@dataclass
class Job:
    """What one torchrun job did: ``returncode`` (None: it overran its deadline and was killed),
    ``seconds`` (wall, start to exit), ``killed`` ((rank, rows logged) of the SIGKILL, or None),
    ``log`` (agent's and workers' output)."""

    returncode: int | None
    seconds: float
    killed: tuple[int, int] | None
    log: str

    @property
    def hung(self) -> bool:
        return self.returncode is None

    def resumed_from(self) -> list[int]:
        """The step every trainer start that got as far as its summary resumed from."""
        import re
        return [int(s) for s in re.findall(r"resumed from step (\d+)", self.log)]


def _rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def worker_pid(agent_pid: int, rank: int) -> int | None:
    """The pid of the agent's worker whose environment says ``RANK=rank`` (None if not there yet)."""
    for task in os.listdir(f"/proc/{agent_pid}/task"):
        for pid in Path(f"/proc/{agent_pid}/task/{task}/children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(pid)
    return None


def run(out: Path, args: list[str], *, nproc: int = 2, max_restarts: int = 3, kill_rank: int | None = None,
        kill_at_rows: int = 0, deadline_s: float = 120.0, env: dict | None = None,
        module: str = "course_lib.train") -> Job:
    """One ``torchrun --standalone`` job of ``python -m course_lib.train`` (or ``module``, a
    wrapper of its command line importable from tests/). With ``kill_rank``, that worker gets
    SIGKILL once ``kill_at_rows`` metrics rows exist (a crash: no handler runs). The job is killed
    whole after ``deadline_s`` seconds (then ``returncode`` is None)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", module,
           *args, "--out", str(out)]
    full_env = {**_env(module), **(env or {})}
    log_path = out.parent / f"{out.name}.log"
    start = time.monotonic()
    with open(log_path, "w") as sink:  # a file, not a pipe: a full pipe would block the ranks
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    killed = None
    try:
        while proc.poll() is None and time.monotonic() - start < deadline_s:
            if kill_rank is not None and killed is None and _rows(out) >= kill_at_rows:
                pid = worker_pid(proc.pid, kill_rank)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = (kill_rank, _rows(out))
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # the agent and every worker: nothing outlives the test
            proc.wait()
            returncode = None
        else:
            returncode = proc.returncode
    return Job(returncode, time.monotonic() - start, killed, log_path.read_text())


def losses(out: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of every row in ``out/metrics.jsonl``."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows]


def final_weights(out: Path, step: int) -> dict:
    """The model tensors of the checkpoint at ``step`` (full-format checkpoints: model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step_{step:09d}" / "model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    """Bit for bit: the same names, dtypes, shapes and values."""
    import torch

    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _saving(out: Path) -> bool:
    """Whether a sharded save is being written now (its ``.tmp-*`` folder exists)."""
    folder = out / "checkpoints"
    return folder.exists() and any(p.name.startswith(".tmp-") for p in folder.iterdir())


def _env(module: str) -> dict:
    """A job's environment: one thread per rank, unbuffered output, and tests/ importable when
    ``module`` is a test wrapper of the trainer's command line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if module != "course_lib.train":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    return env


def run_killed_whole(out: Path, args: list[str], *, nproc: int, delay_s: float, during_save: bool,
                     deadline_s: float = 180.0, when: Callable[[], bool] | None = None,
                     module: str = "course_lib.train", env: dict | None = None) -> Job:
    """One ``torchrun --max-restarts 0`` job whose whole process tree (agent and workers) gets
    SIGKILL (a lost node: nothing runs a handler) once training has logged a new row and then
    ``delay_s`` more seconds have passed, or, with ``during_save``, at the first moment after
    that when a background sharded save is being written, or, with ``when``, at the first moment
    after that when ``when()`` holds. A job that ends first is returned as it ended (``killed``
    None). ``module`` and ``env`` as for :func:`run`."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=0.2", "-m", module, *args, "--out", str(out)]
    env = {**_env(module), **(env or {})}
    log_path = out.parent / f"{out.name}.log"
    start, rows0 = time.monotonic(), _rows(out)
    with open(log_path, "a") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    killed, armed_at = None, None
    try:
        while proc.poll() is None and time.monotonic() - start < deadline_s:
            if armed_at is None and _rows(out) > rows0:
                armed_at = time.monotonic()
            if (armed_at is not None and time.monotonic() - armed_at >= delay_s and (not during_save or _saving(out))
                    and (when is None or when())):
                saving = _saving(out)
                kill_tree(proc.pid)  # a lost node: the agent and every worker at once
                killed = (-1, _rows(out))
                proc.wait()
                left = survivors(out)
                assert not left, f"processes of the killed job still run: {left}"
                return Job(-9, time.monotonic() - start, killed,
                           f"killed whole tree at row {killed[1]}{' during a save' if saving else ''}")
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
            return Job(None, time.monotonic() - start, killed, log_path.read_text())
    return Job(proc.returncode, time.monotonic() - start, killed, log_path.read_text())


def sharded_weights(out: Path, step: int) -> dict:
    """The full model weights of the sharded checkpoint at ``step``, stitched from every rank's shards."""
    from course_lib.checkpoint.dcp import consolidate_sharded

    return consolidate_sharded(out / "checkpoints" / f"step_{step:09d}")


def survivors(out: Path) -> list[int]:
    """Pids of processes still working on ``out`` (a trainer whose ``--out`` is it)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "course_lib.train" in cmd and str(out) in cmd and p.info["pid"] != os.getpid():
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.info["pid"])
            except psutil.NoSuchProcess:
                pass
    return found
