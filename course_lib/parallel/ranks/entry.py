"""What a rank started by :func:`course_lib.parallel.ranks.launch.run_ranks` runs first.

Kept in its own module, importing nothing heavy at the top, because the environment (thread
counts, rank variables) must be in place *before* the user's function is unpickled: unpickling
imports the user's module, which imports torch, which reads OMP_NUM_THREADS once. A rank from the
fork server already has torch imported (the server preloads it), so the thread count is also set
with ``torch.set_num_threads`` below; the caller's cwd, environment and ``sys.path`` replace the
server's before anything of the user's is imported.
"""
from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to join the group (ports are TCP ports, timeout in seconds)."""

    rank: int
    world_size: int
    backend: str
    store_port: int
    timeout_s: float
    threads: int
    log_path: str
    parent_pid: int
    # The caller's state at launch: a rank from the fork server would otherwise keep the
    # server's (its working directory, environment and import path when it started).
    cwd: str | None = None
    environ: dict | None = None
    sys_path: list | None = None


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the parent dies (a killed notebook kernel leaves no ranks)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == parent_pid:  # spawned (or forked by the caller): alive, and watched
            return
        # From the fork server our parent is the server, which exits when the caller dies (and
        # this signal follows). The caller may be PID 1 of a sandbox's PID namespace (the
        # grader's kernel), so ask whether it is still there rather than who adopted us.
        os.kill(parent_pid, 0)
        if os.getppid() == 1:  # the server died before prctl took effect
            os._exit(1)
    except ProcessLookupError:  # the caller is gone: nobody would read our result
        os._exit(1)
    except OSError:
        pass


def _release_fork_server() -> None:
    """A rank forked by the fork server inherits the write end of the pipe that tells the server
    its caller is alive; holding it, the ranks would keep the server alive after the caller died,
    and the server would never die to send them PR_SET_PDEATHSIG. Close it (spawned: nothing)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - the module keeps the fd on this singleton
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _take_callers_state(spec: RankSpec) -> None:
    """Working directory, environment and import path as the caller has them now."""
    if spec.cwd is not None:
        os.chdir(spec.cwd)
    if spec.environ is not None:
        os.environ.clear()
        os.environ.update(spec.environ)
    if spec.sys_path is not None:
        sys.path[:] = spec.sys_path


def _redirect_output(path: str) -> None:
    """Send fd 1 and 2 (Python prints and C++ warnings alike) to the rank's log file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def main(spec: RankSpec, payload: bytes, conn) -> None:
    """Join the group, run the user's function, hand back the result, then leave fast."""
    _release_fork_server()
    _die_with_parent(spec.parent_pid)
    _take_callers_state(spec)
    _redirect_output(spec.log_path)
    os.environ.update({
        "RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(spec.rank), "LOCAL_WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec.store_port),
        "OMP_NUM_THREADS": str(spec.threads),
    })
    code = 0
    try:
        import pickle
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec.threads)
        if spec.backend == "nccl":
            torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size + 1, False,
                              timeout=timedelta(seconds=spec.timeout_s))
        dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                                world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.timeout_s))
        fn, args, kwargs = pickle.loads(payload)
        result = fn(spec.rank, spec.world_size, *args, **kwargs)
        # Hand the result back *before* any teardown: a crash after this line cannot lose it.
        # Plain pickle bytes, not conn.send: multiprocessing's pickler sends tensors as shared-
        # memory handles, which die with this process (it leaves with os._exit right after).
        conn.send_bytes(pickle.dumps(("ok", result, "")))
        # Nobody tears down while a peer may still be inside a collective with it.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything must reach the caller
        code = 1
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())))
        except Exception:  # noqa: BLE001 - the caller then reports "died without a result"
            pass
    finally:
        try:
            conn.close()
        except OSError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter shutdown: that is where gloo's SIGABRT at exit lives.
        os._exit(code)
