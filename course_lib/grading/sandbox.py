"""Run a list of notebook cells in a fresh, confined kernel process (the parent side).

Confinement, where the OS allows it (Linux with unprivileged user namespaces, probed once):
``unshare --user --map-root-user --net --mount --pid --fork --mount-proc --kill-child``, so the
kernel has no network (only its own loopback), cannot see or signal any process outside its PID
namespace (not the grader, not other submissions), and sees the paths in ``hide`` as empty. Always:
a memory limit (``RLIMIT_AS``, bytes) set in the kernel, a wall-time limit per cell and per run
(seconds), its own session so a timeout kills every process it started.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from course_lib.grading.record import RECORDS_FILE

UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
           "--mount-proc", "--kill-child"]
MOUNT_POINT = "/mnt"  # an existing empty-able folder where the run's work dir is shown
KERNEL_ENV = {"MPLBACKEND": "Agg", "COURSE_SMOKE": "1", "OMP_NUM_THREADS": "1",
              "PYDEVD_DISABLE_FILE_VALIDATION": "1", "TQDM_DISABLE": "1", "PYTHONHASHSEED": "0"}


@dataclass
class CellOutcome:
    """What happened to one cell: ``status`` is ok, error, timeout, crashed or not-run;
    ``seconds`` its wall time; ``record_names`` the names recorded while it ran (in order)."""

    status: str
    seconds: float = 0.0
    error_name: str = ""
    error: str = ""
    record_names: list[str] = field(default_factory=list)


@dataclass
class RunOutcome:
    """A whole run: per-cell outcomes by id, the records folder, total seconds, confinement used."""

    cells: dict[str, CellOutcome]
    records_dir: Path
    seconds: float
    sandboxed: bool
    log: Path


@lru_cache(maxsize=1)
def sandbox_available() -> bool:
    """True when namespaces, tmpfs and bind mounts work for this user (probed once, ~0.1 s)."""
    if not shutil.which("unshare") or not shutil.which("mount") or not os.path.isdir(MOUNT_POINT):
        return False
    with tempfile.TemporaryDirectory(prefix="course-probe-") as tmp:
        probe = f"mount -t tmpfs none {MOUNT_POINT} && mkdir {MOUNT_POINT}/w && mount --bind {tmp} {MOUNT_POINT}/w"
        try:
            done = subprocess.run([*UNSHARE, "sh", "-c", probe], capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


def _record_names(records_dir: Path, already: int) -> tuple[list[str], int]:
    """Names of the records written after the first ``already`` lines, and the new line count."""
    path = records_dir / RECORDS_FILE
    if not path.is_file():
        return [], already
    lines = path.read_bytes()[:64 * 2**20].split(b"\n")
    complete = lines[:-1]  # the last piece is empty or a line still being written
    names = []
    for line in complete[already:]:
        try:
            names.append(str(json.loads(line)["name"]))
        except Exception:  # noqa: BLE001 - garbage from the kernel is ignored
            continue
    return names, len(complete)


@dataclass
class Kernel:
    """A started kernel: its process (the head of its own session), the status pipe, and where
    its output goes. Made by :func:`start_kernel`, ended by :func:`stop_kernel`."""

    proc: subprocess.Popen
    status: "_StatusReader"
    sandboxed: bool
    log: Path

    def send(self, cid: str, source: str) -> bool:
        """Hand the kernel one cell to run; False when the kernel has already exited."""
        try:
            self.proc.stdin.write((json.dumps({"id": cid, "source": source}) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False


def start_kernel(workdir: Path, *, memory_bytes: int, hide: list[Path] = (), sandbox: bool | None = None) -> Kernel:
    """Start a fresh, confined kernel whose working folder is ``workdir`` (made if missing).

    ``memory_bytes``: address-space limit (0: none); ``hide``: folders it must not read;
    ``sandbox``: None means "namespaces if available". The kernel runs the cells it is sent
    (:meth:`Kernel.send`), one at a time, and reports on its status pipe."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sandboxed = sandbox_available() if sandbox is None else sandbox
    log = workdir.parent / f"{workdir.name}.log"
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "course_lib.grading.runner", "--work", str(workdir),
           "--status-fd", str(write_fd), "--memory-bytes", str(int(memory_bytes))]
    if sandboxed:
        cmd = [*UNSHARE, *cmd, "--sandboxed", "--mount-point", MOUNT_POINT]
        for path in hide:
            cmd += ["--hide", str(Path(path).resolve())]
    env = {**os.environ, **KERNEL_ENV}
    env.pop("COURSE_GRADING_RECORDS", None)
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                                pass_fds=(write_fd,), start_new_session=True, env=env,
                                cwd=str(workdir))
    os.close(write_fd)
    return Kernel(proc, _StatusReader(read_fd), sandboxed, log)


def stop_kernel(kernel: Kernel, grace_s: float = 0.0) -> None:
    """End ``kernel`` and everything it started: close its input, wait up to ``grace_s`` seconds,
    then SIGKILL its whole session (in a sandbox, the PID namespace goes with it)."""
    _stop(kernel.proc, grace_s)
    kernel.status.close()


def run_cells(cells: list[tuple[str, str]], workdir: Path, *, cell_timeout: float,
              notebook_timeout: float, memory_bytes: int, hide: list[Path] = (),
              sandbox: bool | None = None) -> RunOutcome:
    """Run ``cells`` (id, source) in order in a fresh kernel whose working folder is ``workdir``.

    ``cell_timeout``/``notebook_timeout`` are seconds, ``memory_bytes`` the address-space limit
    (0: none), ``hide`` folders the kernel must not read, ``sandbox`` None means "if available".
    Never raises for anything the kernel does: a crash, hang or exit ends the run and every cell
    not finished is reported as crashed / timeout / not-run."""
    workdir = Path(workdir)
    records_dir = workdir / "records"
    outcomes = {cid: CellOutcome("not-run") for cid, _ in cells}
    start = time.monotonic()
    kernel = start_kernel(workdir, memory_bytes=memory_bytes, hide=hide, sandbox=sandbox)
    proc, status = kernel.proc, kernel.status
    seen_records = 0
    try:
        for cid, source in cells:
            t0 = time.monotonic()
            deadline = min(t0 + cell_timeout, start + notebook_timeout)
            if not kernel.send(cid, source):
                outcomes[cid] = CellOutcome("crashed", 0.0, "KernelDied", "the kernel had exited")
                break
            end = status.wait_for_end(cid, deadline)
            outcome = outcomes[cid] = _outcome(end, time.monotonic() - t0, proc, cell_timeout, status.eof)
            outcome.record_names, seen_records = _record_names(records_dir, seen_records)
            if outcome.status in ("timeout", "crashed"):
                break
    finally:
        # after a timeout the kernel is busy: kill at once; otherwise let it leave on its own first
        stop_kernel(kernel, grace_s=0 if any(o.status == "timeout" for o in outcomes.values()) else 5)
    return RunOutcome(outcomes, records_dir, time.monotonic() - start, kernel.sandboxed, kernel.log)


def _outcome(end: dict | None, seconds: float, proc: subprocess.Popen, cell_timeout: float,
             eof: bool) -> CellOutcome:
    if end is None:
        if not eof:
            return CellOutcome("timeout", seconds, "Timeout",
                               f"the cell was still running after {seconds:.0f} s (limit {cell_timeout:g} s "
                               "per cell, and a limit for the whole notebook)")
        try:  # the status pipe closed: the kernel is exiting or gone
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = 0
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return CellOutcome("crashed", seconds, "KernelDied",
                           f"the kernel died during this cell ({how}; a memory limit or os._exit ends it)")
    if end.get("ok") is True:
        return CellOutcome("ok", seconds)
    return CellOutcome("error", seconds, str(end.get("error_name", "Error"))[:80],
                       str(end.get("error", ""))[:2000])


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """Close the kernel's input, give it ``grace_s`` seconds, then kill its whole session."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class _StatusReader:
    """Reads JSON-line events from the kernel's status pipe, with deadlines."""

    def __init__(self, fd: int):
        self.fd, self.buffer, self.eof = fd, b"", False

    def wait_for_end(self, cid: str, deadline: float) -> dict | None:
        """The ``end`` event of cell ``cid``, or None at EOF (kernel died) or at ``deadline``."""
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("event") == "end" and event.get("id") == cid:
                    return event
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    self.eof = True
                self.buffer = (self.buffer + chunk)[-2**20:]

    def close(self) -> None:
        os.close(self.fd)
