"""A small job with one stalled rank, run from a notebook: :func:`run_stall_demo`.

It starts ``torchrun`` as a subprocess (a new program, never a fork of the notebook kernel) with
the kit's trainer on CPU ranks, the watchdog on, and ``stall@STEP=600:RANK``: that rank sleeps ten
minutes, its peers wait for it in the step's gradient all-reduce, and the watchdog must end the
job long before either the sleep or the process group's timeout would.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.validate import check_int, check_number
from course_lib.watch.watchdog import HANG_EXIT_CODE

STALL_SECONDS = 600  # far longer than any timeout the demo accepts: only the watchdog ends it


@dataclass
class StallReport:
    """What happened. ``stalled_rank``/``last_step``: who the watchdog named and the step its last
    heartbeat announced (None if no summary was written); ``stacks``: rank -> text of
    ``hang/rank{r}.txt``; ``seconds_to_detect``: from the start of the stall to the detection;
    ``seconds_to_abort``: from the start of the stall until the whole job had exited (both wall
    seconds on this machine); ``exit_code``: torchrun's own, which is 1 whenever a rank failed,
    whatever code the rank exited with; ``rank_exit_codes``: rank -> the code torchrun's failure
    report gives for it (a rank the watchdog ended exits with ``hang_exit_code``, 86; a rank
    torchrun had to stop shows minus its signal); ``log``: the job's output."""

    stalled_rank: int | None
    last_step: int | None
    stacks: dict[int, str] = field(repr=False)
    seconds_to_detect: float | None
    seconds_to_abort: float | None
    exit_code: int
    timeout_s: float
    out_dir: Path
    summary: dict = field(default_factory=dict, repr=False)
    log: str = field(default="", repr=False)
    hang_exit_code: int = HANG_EXIT_CODE
    rank_exit_codes: dict[int, int] = field(default_factory=dict)


# torchrun's failure report has one block per failed rank: "rank      : 1 (local_rank: 1)" then
# "exitcode  : 86 (pid: 1234)".
_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def rank_exit_codes(log: str) -> dict[int, int]:
    """Rank -> exit code, read from torchrun's failure report in ``log`` (empty when none)."""
    return {int(rank): int(code) for rank, code in _RANK_EXIT.findall(log)}


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. torchrun starts each rank in a session of its
    own, so killing torchrun's process group would leave the ranks running."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def stall_command(out_dir: Path, world_size: int, stall_rank: int, stall_step: int, timeout_s: float) -> list[str]:
    """The torchrun command line of the demo (a list of arguments)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "-m", "course_lib.train", "--out", str(out_dir), "--no-progress",
            "--max-steps", str(stall_step + 3), "--set", "train.strategy=ddp", "--set", "train.device=cpu",
            "--set", "schedule.warmup_steps=0", "--set", "train.micro_batch=4", "--set", "data.seq_len=32",
            "--set", f"train.watchdog_s={timeout_s}",
            "--inject-fault", f"stall@{stall_step}={STALL_SECONDS}:{stall_rank}"]


def run_stall_demo(world_size: int = 2, stall_rank: int = 1, timeout_s: float = 3.0, *, stall_step: int = 2,
                   out_dir: str | Path | None = None, time_limit_s: float = 60.0) -> StallReport:
    """Run the job and read what the watchdog left in ``out_dir/hang/``. ``world_size``: CPU
    ranks (2 to 4); ``stall_rank``: the rank that stalls; ``timeout_s``: ``train.watchdog_s``
    (seconds, 1 to 60); ``stall_step``: the step at which it stalls (0 to 20); ``time_limit_s``:
    the whole job is killed after this many seconds (then ``exit_code`` is -9 and the report says
    the watchdog did not act). Takes about 8 s of start-up plus ``timeout_s`` plus ~2 s."""
    check_int("world_size", world_size, 2, 4)
    check_int("stall_rank", stall_rank, 0, world_size - 1)
    check_number("timeout_s", timeout_s, 1.0, 60.0)
    check_int("stall_step", stall_step, 0, 20)
    check_number("time_limit_s", time_limit_s, timeout_s + 5, 600.0)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="stall-demo-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(stall_command(out, world_size, stall_rank, stall_step, timeout_s), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and its ranks
        log, _ = proc.communicate()
    ended = time.time()
    hang = out / "hang"
    summary = json.loads((hang / "summary.json").read_text()) if (hang / "summary.json").exists() else {}
    stalled = summary.get("stalled") or [{}]
    started = summary.get("stall_started_at", {}).get(str(stall_rank))
    stacks = {r: (hang / f"rank{r}.txt").read_text() for r in range(world_size) if (hang / f"rank{r}.txt").exists()}
    return StallReport(stalled_rank=stalled[0].get("rank"), last_step=stalled[0].get("step"), stacks=stacks,
                       seconds_to_detect=summary["detected_at"] - started if started and summary else None,
                       seconds_to_abort=ended - started if started else None, exit_code=proc.returncode,
                       timeout_s=timeout_s, out_dir=out, summary=summary, log=log,
                       rank_exit_codes=rank_exit_codes(log or ""))
