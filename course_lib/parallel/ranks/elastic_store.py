"""The store a torchrun-restarted worker group must join through: one key space per attempt.

Why this exists (measured on the course machine, torch 2.13, 2 gloo ranks, ``--max-restarts 3``):
torchrun's agent hosts ONE TCPStore for its workers and keeps it across restarts (the "shared
rendezvous TCP store", ``TORCHELASTIC_USE_AGENT_STORE=True``; ``MASTER_PORT`` is the same in every
attempt). ``init_process_group("env://")`` writes gloo's per-rank listening addresses into that
store under fixed names (``default_pg/0//cpu//0/0``, ``.../0/1``) and never deletes them, and
torch's own env:// handler assumes "a new TCPStore for every retry" and adds no per-attempt
prefix. A restarted rank that reads its peer's key before the new peer has overwritten it gets the
*dead* previous attempt's address: it connects to a closed port ("Connection refused", the attempt
fails and burns a restart) or both ranks wait in ``gloo::Pair::waitUntilConnected`` until the
process-group timeout (the "hang"). A probe listing the store's keys at each worker's start saw
those two keys from attempt 0 in attempts 1, 2 and 3.

The fix: when the agent's store is shared and every rank belongs to this one agent (one node),
join through ``PrefixStore("course/attempt/N/")`` where N is ``TORCHELASTIC_RESTART_COUNT``: every
worker of a single agent gets the same N, and each attempt writes and reads only its own keys.
Across several agents (nodes) restart counts may differ (an agent restarted because another node
failed does not count a restart), so there the launch scripts set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` instead: torchrun then starts a fresh store on a fresh
port for every attempt (:data:`FRESH_STORE_ENV`).
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

# Exported by the kit's multi-node launch scripts: a fresh worker store for every restart.
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def shares_agent_store(env: dict | None = None) -> bool:
    """True when this worker was started by a torchrun agent that keeps one store across restarts."""
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RESTART_COUNT" in env


def single_agent(env: dict | None = None) -> bool:
    """True when one torchrun agent started every rank (one node): its workers share a restart count."""
    env = os.environ if env is None else env
    if "GROUP_WORLD_SIZE" in env:  # number of agents (nodes) in the rendezvous
        return int(env["GROUP_WORLD_SIZE"]) == 1
    return int(env.get("LOCAL_WORLD_SIZE", -1)) == int(env.get("WORLD_SIZE", -2))


def attempt_prefix(env: dict | None = None) -> str:
    """The key prefix of this restart attempt, e.g. ``course/attempt/2/``."""
    env = os.environ if env is None else env
    return f"course/attempt/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def attempt_store(world_size: int, timeout: timedelta) -> Any:
    """A client of the agent's shared store seen through this attempt's prefix, to pass as
    ``init_process_group(store=...)``; None when the default env:// start is safe (not under
    torchrun, a fresh store per attempt, or several agents whose restart counts may differ)."""
    if not (shares_agent_store() and single_agent()):
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(attempt_prefix(), store)
