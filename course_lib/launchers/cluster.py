"""The machines a job runs on, validated before any command is generated.

A wrong value fails here with a ValueError naming the field and its accepted range, instead of
surfacing as a SLURM rejection or a hung rendezvous an hour later on the cluster.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from course_lib.parallel.ranks.elastic_store import FRESH_STORE_ENV
from course_lib.validate import check_choice, check_int

_TIME = re.compile(r"^(\d{1,3}):([0-5]\d):([0-5]\d)$")
_HOST_PORT = re.compile(r"^[A-Za-z0-9_.${}:-]+:(\d+|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)$")
_WORD = re.compile(r"^[A-Za-z0-9_.${}-]+$")  # safe inside a shell word and a SLURM option


# torchrun restarts the whole worker group after a rank dies, and --resume auto continues from the
# newest checkpoint. Restarted gloo groups used to hang or fail in 2 of 5 tries here (torchrun keeps
# one store across restarts and the new ranks read the dead attempt's addresses); the trainer now
# joins each attempt through its own store prefix (course_lib.parallel.ranks.elastic_store): 10 of 10
# restarts on 2 CPU ranks and 5 of 5 on 4 resumed bit-exact. So CPU and GPU jobs share the default.
DEFAULT_RESTARTS = 3
# Exported before torchrun on several nodes, whose agents may count restarts differently: a fresh
# store for every attempt instead of the prefix.
FRESH_STORE_EXPORT = f"export {FRESH_STORE_ENV}=1"


@dataclass(frozen=True)
class Cluster:
    """What the scheduler gives the job.

    * ``nodes``: machines (>= 1).
    * ``gpus_per_node``: GPUs per machine; 0 means a CPU cluster (gloo, no NCCL block).
    * ``nproc_per_node``: trainer processes per machine (ranks per node); with GPUs at most
      ``gpus_per_node`` (one GPU per rank). ``None`` = ``gpus_per_node`` (or 1 on CPU).
    * ``cpus_per_task``: CPU cores SLURM gives each node's task (the one torchrun agent).
    * ``partition``: SLURM partition, or None for the cluster's default.
    * ``time_limit``: wall-clock limit "HH:MM:SS" (hours may exceed 24, e.g. "72:00:00").
    * ``master_addr``/``master_port``: the rendezvous host and TCP port (1024-65535).
    * ``rdzv_backend``: torchrun's rendezvous backend ("c10d" or "static").
    * ``rdzv_endpoint``: "HOST:PORT" for rendezvous; None = ``master_addr:master_port``.
    * ``rdzv_id``: the job id every node's agent must share.
    * ``max_restarts``: how many times torchrun restarts the whole worker group after a failure.
      ``None`` = 3, on GPUs and CPUs alike (``DEFAULT_RESTARTS``: restarted gloo groups used to
      hang here; the trainer now joins each attempt through its own store keys).
    """

    nodes: int = 1
    gpus_per_node: int = 0
    nproc_per_node: int | None = None
    cpus_per_task: int = 8
    partition: str | None = None
    time_limit: str = "01:00:00"
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "course-job"
    max_restarts: int | None = None

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, 1, 4096)
        check_int("gpus_per_node", self.gpus_per_node, 0, 64)
        if self.nproc_per_node is None:  # frozen dataclass: fill the default the sanctioned way
            object.__setattr__(self, "nproc_per_node", self.gpus_per_node or 1)
        check_int("nproc_per_node", self.nproc_per_node, 1,
                  self.gpus_per_node or 256, "gpus_per_node" if self.gpus_per_node else None)
        check_int("cpus_per_task", self.cpus_per_task, 1, 1024)
        check_int("master_port", self.master_port, 1024, 65535)
        if self.max_restarts is None:  # see DEFAULT_RESTARTS
            object.__setattr__(self, "max_restarts", DEFAULT_RESTARTS)
        check_int("max_restarts", self.max_restarts, 0, 100)
        check_choice("rdzv_backend", self.rdzv_backend, ("c10d", "static"))
        if not _TIME.match(str(self.time_limit)):
            raise ValueError(f"time_limit must be 'HH:MM:SS' (minutes and seconds 00-59), got {self.time_limit!r}")
        if self.time_limit_s == 0:
            raise ValueError("time_limit must be > 00:00:00")
        if self.partition is not None and not _WORD.match(self.partition):
            raise ValueError(f"partition must be a plain name (letters, digits, '_', '.', '-'), got {self.partition!r}")
        for name in ("master_addr", "rdzv_id"):
            if not _WORD.match(str(getattr(self, name))):
                raise ValueError(f"{name} must be a host name / id without spaces or quotes, "
                                 f"got {getattr(self, name)!r}")
        if self.rdzv_endpoint is not None and not _HOST_PORT.match(self.rdzv_endpoint):
            raise ValueError(f"rdzv_endpoint must be 'HOST:PORT', got {self.rdzv_endpoint!r}")

    @property
    def world_size(self) -> int:
        """Trainer processes in the whole job: nodes x nproc_per_node."""
        return self.nodes * self.nproc_per_node

    @property
    def time_limit_s(self) -> int:
        """``time_limit`` in seconds."""
        h, m, s = (int(x) for x in _TIME.match(self.time_limit).groups())
        return 3600 * h + 60 * m + s

    @property
    def endpoint(self) -> str:
        """The rendezvous "HOST:PORT" every node's agent connects to."""
        return self.rdzv_endpoint or f"{self.master_addr}:{self.master_port}"

    @property
    def on_gpus(self) -> bool:
        return self.gpus_per_node > 0


def restart_comment(cluster: Cluster) -> str:
    """Shell lines before torchrun about its restarts: on several nodes with restarts on, the
    export that gives every attempt a fresh store (with a comment why); otherwise ""."""
    import textwrap

    if cluster.nodes == 1 or cluster.max_restarts == 0:
        return ""
    text = (f"--max-restarts {cluster.max_restarts} on {cluster.nodes} nodes: a fresh rendezvous store for every "
            f"restart attempt, so that no rank reads a dead attempt's addresses (agents on different nodes "
            f"may count restarts differently; course_lib.parallel.ranks.elastic_store).")
    return textwrap.fill(text, 98, initial_indent="# ", subsequent_indent="# ") + "\n" + FRESH_STORE_EXPORT
