"""Starting ranks: the one way every lab, test and script gets a process group.

Two entry points:

* :func:`init_distributed` for code started by ``torchrun`` (or plain ``python``): reads the
  environment torchrun sets, picks NCCL when CUDA is present and gloo otherwise, binds the device.
* :func:`run_ranks` for notebooks and tests: starts ``world_size`` processes on this machine,
  runs ``fn(rank, world_size, *args, **kwargs)`` in each with the process group already
  initialised, and returns the per-rank results in rank order.

Why :func:`run_ranks` is more than ``torch.multiprocessing.spawn``:

* Results travel back over a pipe *before* teardown, and each rank then leaves with ``os._exit``.
  On CPU + gloo about 1 run in 8 dies with SIGABRT *after* ``destroy_process_group`` returned
  ("terminate called without an active exception"); a result that every rank already handed back
  is never lost to that crash (see ``shared/CPU-DISTRIBUTED.md``).
* A failure in any rank is raised in the caller within a fraction of a second, naming the rank and
  carrying its traceback; the other ranks (which would otherwise wait forever in a collective)
  are killed. Timeouts and Ctrl-C in a notebook kill every child too; children also die with
  their parent (``PR_SET_PDEATHSIG`` on Linux), so nothing is left behind.
* The rendezvous store is hosted by the caller on a port the OS picks, so back-to-back calls never
  race for a port.
* Output of every rank (including C++ warnings) is relayed to the caller with a ``[rank N]``
  prefix, so prints show up in a Jupyter cell instead of the server's terminal.
* Ranks are never forked from the caller: forking a kernel that already ran torch compute hangs
  (an OpenMP barrier). They come from a *fork server*: a fresh interpreter, started on the
  first call, that imports torch once and has run no compute, so each rank starts without
  paying torch's import (~2.7 CPU-seconds a rank here). Each rank then takes the caller's
  current working directory, environment and ``sys.path``, so it behaves like a spawned one.
  ``COURSE_RANK_START=spawn`` starts every rank as a fresh interpreter instead.
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Any, Callable

from course_lib.parallel.ranks import elastic_store, entry
from course_lib.validate import check_choice, check_int, check_number


class RankFailedError(RuntimeError):
    """A rank raised an exception or died; ``.rank`` and ``.remote_traceback`` say which and why."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "", exc_type: str = ""):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type  # name of the exception class the rank raised, "" if it died
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global ``rank``, ``world_size``, ``local_rank`` on its node,
    the ``device`` it computes on and the process-group ``backend`` (None when single-process)."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device; typed loosely so this module imports without torch
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        """One line for a log: "rank 0 of 2 on gloo (cpu)", or, started without torchrun, "one
        process, no process group (not started by torchrun) on cpu" rather than a backend of None."""
        if self.backend is None:
            return f"one process, no process group (not started by torchrun) on {self.device}"
        return f"rank {self.rank} of {self.world_size} on {self.backend} ({self.device})"


# --------------------------------------------------------------------------------------------
# torchrun side
# --------------------------------------------------------------------------------------------

def default_backend(world_size_on_node: int = 1) -> str:
    """``"nccl"`` when CUDA has at least one GPU per local rank, else ``"gloo"``.

    ``COURSE_BACKEND`` in the environment overrides the choice (e.g. ``gloo`` on a GPU node to
    compare backends)."""
    override = os.environ.get("COURSE_BACKEND")
    if override:
        return override
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size_on_node \
            and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _set_threads(local_world_size: int) -> None:
    """Give each rank its share of the cores. torchrun sets OMP_NUM_THREADS=1 but spawn and the
    deepspeed launcher do not, and 2 ranks x all cores oversubscribe a laptop (4x slower here)."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> DistInfo:
    """Initialise the default process group from the environment ``torchrun`` sets.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``. ``backend`` overrides :func:`default_backend` (nccl with CUDA, gloo without).
    Sets the CUDA device to ``LOCAL_RANK`` under nccl. Without ``RANK`` in the environment (plain
    ``python script.py``) it returns a single-process :class:`DistInfo` and creates no group.
    ``timeout_s`` (seconds) bounds every collective. Calling it twice returns the same answer.
    """
    if backend is not None:
        check_choice("backend", backend, ("gloo", "nccl", "mpi", "ucc", "xccl"))
    check_number("timeout_s", timeout_s, 0, lo_open=True)  # seconds
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        _set_threads(1)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return DistInfo(0, 1, 0, device, None)

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or default_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    _set_threads(local_world)
    if not dist.is_initialized():
        # Under torchrun restarts the agent's store outlives each attempt: join through this
        # attempt's own key space, never the dead attempt's gloo addresses (see elastic_store).
        store = elastic_store.attempt_store(world_size, timedelta(seconds=timeout_s))
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                                timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world_size, local_rank, device, backend)


# --------------------------------------------------------------------------------------------
# small helpers every lab needs
# --------------------------------------------------------------------------------------------

def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def get_rank() -> int:
    """Global rank, 0 when no process group exists."""
    dist = _dist()
    return dist.get_rank() if dist else 0


def get_world_size() -> int:
    """Number of ranks, 1 when no process group exists."""
    dist = _dist()
    return dist.get_world_size() if dist else 1


def is_main() -> bool:
    """True on rank 0 (and in a single process): the rank that logs, plots and saves."""
    return get_rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed so it interleaves sensibly with other ranks."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    dist = _dist()
    if dist:
        dist.barrier()


def teardown(exit_code: int | None = None) -> None:
    """Destroy the process group, then, if ``exit_code`` is given, leave at once.

    Leaving with ``os._exit`` skips interpreter shutdown, which is where gloo's SIGABRT at exit
    happens; scripts under torchrun call ``teardown(0)`` as their last line, after writing every
    result they care about."""
    dist = _dist()
    if dist:
        dist.destroy_process_group()
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


# --------------------------------------------------------------------------------------------
# notebook / test side
# --------------------------------------------------------------------------------------------

def _check_importable(fn: Callable) -> None:
    """Spawned ranks import ``fn`` by module and name; say so plainly when they can't."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    where = f"{module}.{qualname}" if module else repr(fn)
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"run_ranks cannot start {where}: lambdas and functions defined inside other "
            "functions cannot be imported by a spawned rank. Define it at the top level of a .py "
            "module (or use one from course_lib).")
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"run_ranks cannot start {qualname!r}: it is defined in a notebook or interactive "
            "session, and spawned ranks cannot import code from there. Put the function in a .py "
            "file next to the notebook (then `from myfile import fn`) or use one from course_lib.")


def _free_store(world_size: int, timeout_s: float):
    """Host the rendezvous TCPStore in the caller on a port the OS picks (no port races)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size + 1, True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class _OutputRelay:
    """Streams each rank's captured stdout/stderr file to the caller, a line at a time."""

    def __init__(self, paths: list[str], enabled: bool):
        self.paths, self.enabled = paths, enabled
        self.offsets = [0] * len(paths)
        self.partial = [""] * len(paths)
        self.tails: list[list[str]] = [[] for _ in paths]

    def pump(self, final: bool = False) -> None:
        for r, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            self.offsets[r] += len(chunk)
            text = self.partial[r] + chunk.decode("utf-8", errors="replace")
            lines = text.split("\n")
            self.partial[r] = "" if final else lines.pop()
            for line in lines:
                if final and not line:
                    continue
                self.tails[r] = (self.tails[r] + [line])[-20:]
                if self.enabled:
                    print(f"[rank {r}] {line}", flush=True)

    def tail(self, rank: int) -> str:
        return "\n".join(self.tails[rank])


RANK_START_METHODS = ("forkserver", "spawn")
# What the fork server imports once, so that no rank pays for it: torch and its distributed
# packages only (none runs compute or starts a thread on import). Measured on 2 cores: a 4-rank
# launch that imports FSDP2, DTensor TP, pipelining and DCP took 3.8 s with torch alone
# preloaded, 0.3 s with these. course_lib and the user's modules are imported fresh after the
# fork, so an edited one is never stale.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                      "torch.distributed.pipelining", "torch.distributed.checkpoint")
# For ranks that use only torch.distributed's collectives (the exercises' checks): the four packages
# above double the server's start (3.2 -> 6.5 CPU-seconds here), which such ranks never repay.
COLLECTIVES_PRELOAD = ("torch", "torch.distributed")


def _start_context(mp, preload=FORKSERVER_PRELOAD):
    """The multiprocessing context ranks start from: ``forkserver`` (default; ``preload`` imported
    in the server, see the module docstring) or ``spawn`` (``COURSE_RANK_START=spawn``: a fresh
    interpreter per rank, the slow and simplest way)."""
    method = os.environ.get("COURSE_RANK_START", "forkserver")
    check_choice("COURSE_RANK_START", method, RANK_START_METHODS)
    if method not in mp.get_all_start_methods():  # forkserver is POSIX-only
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    return ctx


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_ranks(fn: Callable, world_size: int, *args: Any, backend: str | None = None,
              timeout: float = 300.0, threads_per_rank: int | None = None,
              show_output: bool = True, exit_grace_s: float = 10.0,
              preload: tuple[str, ...] = FORKSERVER_PRELOAD, **kwargs: Any) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` fresh processes.

    Each rank starts with the default process group initialised (``backend``: gloo on CPU, nccl
    when there is a GPU per rank; override with ``backend=``) and ``OMP_NUM_THREADS`` set to its
    share of the cores (``threads_per_rank``). Returns the ``world_size`` return values in rank
    order; they must be picklable (tensors are fine: move them to CPU first).

    Raises :class:`RankFailedError` naming the first rank that raised or died, with its
    traceback, as soon as that happens; :class:`TimeoutError` after ``timeout`` seconds
    (wall-clock, whole call). In every case, Ctrl-C included, no child process survives the call.
    ``show_output`` relays each rank's prints as ``[rank N] ...`` lines. ``exit_grace_s``
    (seconds) is how long ranks get to exit after handing back their results before being
    killed; a crash at that point no longer matters and is ignored.

    ``preload``: the modules the fork server imports when this call is the one that starts it
    (:data:`COLLECTIVES_PRELOAD` for ranks that need no FSDP, TP, pipelining or DCP); a server
    already running serves every later call of the process unchanged, and ``spawn`` ignores it.

    ``fn`` must be importable by a fresh interpreter: defined at the top level of a ``.py``
    module, not in a notebook cell, not a lambda.
    """
    check_int("world_size", world_size, 1, 64)  # ranks on one machine
    check_number("timeout", timeout, 0, lo_open=True)  # seconds
    if threads_per_rank is not None:
        check_int("threads_per_rank", threads_per_rank, 1)
    _check_importable(fn)
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the same user error
        raise TypeError(f"run_ranks: fn, args and kwargs must be picklable to reach the ranks: {exc}") from exc

    import multiprocessing as mp

    backend = backend or default_backend(world_size)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = _start_context(mp, preload)
    deadline = time.monotonic() + timeout
    store = _free_store(world_size, timeout)
    logdir = tempfile.mkdtemp(prefix="course-ranks-")
    relay = _OutputRelay([os.path.join(logdir, f"rank{r}.log") for r in range(world_size)], show_output)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            spec = entry.RankSpec(rank=rank, world_size=world_size, backend=backend,
                                        store_port=store.port, timeout_s=timeout, threads=threads,
                                        log_path=relay.paths[rank], parent_pid=os.getpid(),
                                        cwd=os.getcwd(), environ=dict(os.environ), sys_path=list(sys.path))
            p = ctx.Process(target=entry.main, args=(spec, payload, send),
                            name=f"course-rank-{rank}", daemon=True)
            p.start()
            send.close()  # the child holds the only write end: EOF on our side means it is gone
            procs.append(p)
            conns.append(recv)
        return _collect(procs, conns, relay, deadline, timeout, exit_grace_s)
    finally:
        _kill_all(procs)
        relay.pump(final=True)
        for c in conns:
            c.close()
        del store
        for r in range(world_size):
            try:
                os.unlink(relay.paths[r])
            except OSError:
                pass
        try:
            os.rmdir(logdir)
        except OSError:
            pass


#: seconds a rank's "peer gone" error is held back while the rank that caused it may still report
PEER_ERROR_GRACE_S = 3.0
#: what gloo / NCCL / torch say when the other end of a collective went away (not the cause itself)
_PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "pair.cc", "Broken pipe",
                      "NCCL communicator was aborted", "remote process exited")


def _peer_loss(message: str) -> bool:
    """Whether a rank's error says only that another rank left a collective (a consequence)."""
    return any(m in message for m in _PEER_LOSS_MARKERS)


def _collect(procs, conns, relay: _OutputRelay, deadline: float, timeout: float,
             exit_grace_s: float) -> list:
    """Wait for every rank's message; fail fast on the first error or unexplained death."""
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    done = [False] * world_size
    waiting = {conns[r]: r for r in range(world_size)}
    secondary: RankFailedError | None = None  # a peer-loss error, held while the cause may still come
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0 and secondary is not None:
            raise secondary
        if left <= 0:
            relay.pump()
            missing = [r for r in range(world_size) if not done[r]]
            detail = "".join(f"\n  rank {r} last output: {relay.tail(r)[-300:]!r}" for r in missing)
            raise TimeoutError(f"run_ranks: ranks {missing} did not finish within {timeout:g} s; "
                               f"all ranks were killed.{detail}")
        ready = mp_connection.wait(list(waiting), timeout=min(0.1, left))
        relay.pump()
        for conn in ready:
            rank = waiting.pop(conn)
            try:
                kind, value, tb = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(timeout=1)
                relay.pump()
                code = procs[rank].exitcode
                raise RankFailedError(rank, f"process died without a result (exit code {code})",
                                      relay.tail(rank)) from None
            if kind == "ok":
                results[rank], done[rank] = value, True
                continue
            error = RankFailedError(rank, value, tb, exc_type=value.split(":", 1)[0])
            if not _peer_loss(value):
                raise error
            # A rank that lost its peer in a collective is usually not the cause: the peer that
            # raised first may report a moment later. Wait briefly for it, then report this one.
            if secondary is None:
                secondary, deadline = error, min(deadline, time.monotonic() + PEER_ERROR_GRACE_S)
    if secondary is not None:
        raise secondary
    # Every rank has handed back its result; give them a moment to leave on their own. A crash
    # from here on (gloo's SIGABRT at exit) cannot cost a result, so it is not an error.
    grace_end = time.monotonic() + exit_grace_s
    for p in procs:
        p.join(timeout=max(0.0, grace_end - time.monotonic()))
    return results
