"""Lab 14 (capstone): the kit's trainer under ``torchrun``, interrupted on purpose, from a notebook.

Every job is a ``torchrun`` subprocess (a new program, never a fork of the notebook kernel), its
output in ``OUT.log`` next to the run folder. Three ways a job meets the outside world:

* :func:`run_job` - to the end (the reference);
* :func:`run_with_killed_worker` - ``SIGKILL`` to one worker mid-run (a crashed process: no handler
  runs); torchrun stops the job, and a second job continues from the newest checkpoint with
  ``--resume auto`` (what a scheduler's requeue or torchrun's ``--max-restarts`` does; lab 07 shows
  the latter);
* :func:`run_with_signal` - ``SIGUSR1`` to one worker (what a scheduler sends before the time
  limit): every rank stops at the same step with a checkpoint and exit code 75; a second job
  resumes.

:func:`launch_commands` writes the commands of the same run on 1 GPU, 8 GPUs and 2 x 8 GPUs under
SLURM with :mod:`course_lib.launchers`.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from course_lib.trainer.metrics import read_rows
from course_lib.validate import check_int, check_number
from course_lib.watch.demo import kill_tree

CONFIG = Path(__file__).resolve().parents[2] / "labs" / "configs" / "capstone-cpu.toml"


@dataclass
class Job:
    """One torchrun job: ``returncode`` (torchrun's), ``seconds`` (wall, start to exit), ``out``
    (the trainer's folder), ``log`` (torchrun's and the ranks' output), ``event`` (what was done
    to it, e.g. "SIGKILL to rank 1 after step 17"), ``event_to_exit_s`` (seconds from that event
    until the job had exited; None without an event), ``checkpoints`` (the steps in
    ``out/checkpoints`` when it had exited)."""

    returncode: int
    seconds: float
    out: Path
    log: str = field(repr=False)
    event: str = ""
    event_to_exit_s: float | None = None
    checkpoints: list[int] = field(default_factory=list)

    @property
    def resumed_from(self) -> int | None:
        """The step the (last) trainer start resumed from, read from its summary line."""
        found = re.findall(r"resumed from step (\d+)", self.log)
        return int(found[-1]) if found else None


def torchrun_command(out: str | Path, *, config: str | Path = CONFIG, nproc: int = 2, max_restarts: int = 0,
                     extra: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone ... -m course_lib.train`` (a list of args)."""
    check_int("nproc", nproc, 1, 8)
    check_int("max_restarts", max_restarts, 0, 5)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", "course_lib.train",
            "--config", str(config), "--out", str(out), "--no-progress", *extra]


def _start(cmd: list[str], log_path: Path) -> tuple[subprocess.Popen, Path, float]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as sink:  # a file, not a pipe: a full pipe would block the ranks
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log_path, time.monotonic()


def _finish(proc: subprocess.Popen, log_path: Path, started: float, out: Path, timeout_s: float,
            event: str = "", event_at: float | None = None) -> Job:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and its ranks: nothing outlives the lab
        proc.wait()
    ended = time.monotonic()
    return Job(proc.returncode, ended - started, out, log_path.read_text(), event,
               None if event_at is None else ended - event_at, checkpoint_steps(out / "checkpoints"))


def _log(out: Path, suffix: str = "") -> Path:
    """Where a job's output goes: next to its run folder, ``NAME{suffix}.log``."""
    return out.parent / f"{out.name}{suffix}.log"


def steps_logged(out: Path) -> int:
    """Rows in ``out/metrics.jsonl`` (0 before the first)."""
    path = Path(out) / "metrics.jsonl"
    return len(read_rows(path)) if path.exists() else 0


def _wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        done = steps_logged(out)
        if done >= steps:
            return done
        time.sleep(0.02)
    raise RuntimeError(f"the job ended or stalled before step {steps} (exit {proc.poll()}); see {_log(out)}")


def worker_pid(agent_pid: int, rank: int) -> int:
    """The pid of the torchrun worker whose ``RANK`` is ``rank`` (a child of the agent)."""
    import psutil

    for child in psutil.Process(agent_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "course_lib.train" in " ".join(child.cmdline()):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise RuntimeError(f"no worker with RANK={rank} under torchrun pid {agent_pid}")


def run_job(out: str | Path, *, extra: Sequence[str] = (), nproc: int = 2, timeout_s: float = 600) -> Job:
    """Run the capstone job to its end."""
    out = Path(out)
    proc, log, t0 = _start(torchrun_command(out, nproc=nproc, extra=extra), _log(out))
    return _finish(proc, log, t0, out, timeout_s)


def run_with_killed_worker(out: str | Path, kill_after: int, *, rank: int = 1, extra: Sequence[str] = (),
                           nproc: int = 2, timeout_s: float = 600) -> tuple[Job, Job]:
    """SIGKILL rank ``rank`` once ``kill_after`` steps are logged (no handler runs: a crash); torchrun
    stops the other rank and fails. A second job resumes from the newest checkpoint
    (``--resume auto``). Returns ``(crashed, resumed)``."""
    return _interrupt_then_resume(Path(out), kill_after, signal.SIGKILL, rank, extra, nproc, timeout_s)


def run_with_signal(out: str | Path, signal_after: int, *, sig: int = signal.SIGUSR1, rank: int = 1,
                    extra: Sequence[str] = (), nproc: int = 2, timeout_s: float = 600) -> tuple[Job, Job]:
    """Send ``sig`` to rank ``rank`` once ``signal_after`` steps are logged; the job checkpoints
    and exits (75 per rank). Then a second job resumes it (``--resume auto``) to the end.
    Returns ``(stopped, resumed)``."""
    return _interrupt_then_resume(Path(out), signal_after, sig, rank, extra, nproc, timeout_s)


def _interrupt_then_resume(out: Path, after: int, sig: int, rank: int, extra: Sequence[str], nproc: int,
                           timeout_s: float) -> tuple[Job, Job]:
    check_int("after", after, 1)
    check_int("rank", rank, 0, nproc - 1)
    check_number("timeout_s", timeout_s, 1.0)
    proc, log, t0 = _start(torchrun_command(out, nproc=nproc, extra=extra), _log(out))
    at = _wait_for_steps(proc, out, after, timeout_s)
    sent = time.monotonic()
    os.kill(worker_pid(proc.pid, rank), sig)
    first = _finish(proc, log, t0, out, timeout_s, f"{signal.Signals(sig).name} to rank {rank} after step {at}", sent)
    # the same folder: the checkpoints are there, and metrics.jsonl continues from the resumed step
    proc, log2, t1 = _start(torchrun_command(out, nproc=nproc, extra=[*extra, "--resume", "auto"]),
                            _log(out, "-resume"))
    return first, _finish(proc, log2, t1, out, timeout_s)


def losses(out: str | Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of every row of ``out/metrics.jsonl``."""
    return [(r["step"], r["loss"]) for r in read_rows(Path(out) / "metrics.jsonl")]


def checkpoint_steps(folder: str | Path) -> list[int]:
    """Steps of the ``step_*`` checkpoint folders in ``folder`` (sorted; [] when none)."""
    from course_lib.checkpoint.io import NAME_RE  # step_000000012 (and .gN for a re-saved step)

    folder = Path(folder)
    found = [NAME_RE.match(p.name) for p in folder.iterdir()] if folder.exists() else []
    return sorted({int(m.group(1)) for m in found if m})


def launch_commands(config: str = "labs/configs/capstone-cpu.toml", out: str = "runs/capstone",
                    overrides: Sequence[str] = ("train.device=cuda", "train.precision=bf16")) -> dict[str, str]:
    """The same run on GPUs, as text: ``"1 GPU"`` and ``"8 GPUs"`` (torchrun on one node) and
    ``"2 x 8 GPUs (SLURM)"`` (the sbatch script), generated by :mod:`course_lib.launchers`."""
    from course_lib.launchers.cluster import Cluster
    from course_lib.launchers.commands import shell_join, torchrun_single_node
    from course_lib.launchers.slurm import sbatch_script

    overrides = list(overrides)
    return {
        "1 GPU": shell_join(torchrun_single_node(config, overrides, Cluster(gpus_per_node=1), out)),
        "8 GPUs": shell_join(torchrun_single_node(config, overrides, Cluster(gpus_per_node=8), out)),
        "2 x 8 GPUs (SLURM)": sbatch_script(config, overrides,
                                            Cluster(nodes=2, gpus_per_node=8, cpus_per_task=64, partition="gpu",
                                                    time_limit="04:00:00"), out),
    }
