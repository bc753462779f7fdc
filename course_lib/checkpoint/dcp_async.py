"""Async sharded checkpoints: training goes on while every rank's shards are written.

:class:`AsyncShardedSaver` runs the protocol of :mod:`course_lib.checkpoint.collective` in two
halves:

* **on the training thread** (what the step waits for): finish the previous save (its error, if
  any, is raised here on every rank); rank 0 picks the name and the temp directory; every rank
  takes its state dicts and **stages** them, a private CPU copy of every tensor it will write
  (:func:`stage`), and serializes its ``rank{r}.pt`` bytes; the ranks exchange errors. After
  this the live weights and optimizer state may change: nothing written later reads them.
* **in a background thread**: ``dcp.save`` of the staged copy, this rank's ``rank{r}.pt``, the
  exchange of write errors (every rank's files are on disk or nobody commits), rank 0's one
  commit (manifest, rename, fsync), re-read, pruning to ``keep_last``, and the outcome broadcast
  to every rank. :meth:`~AsyncShardedSaver.wait` (the next save, a roll-back's load, ``close()``
  at the end of the run) joins it and raises its error.

**Why the background thread has a process group of its own.** The write half is collective (DCP
plans and its metadata are gathered; the errors and the commit's outcome are exchanged), while
the training thread keeps running collectives of its own (FSDP all-gathers, reduce-scatters, the
loss all-reduce) on the default group. Two threads issuing collectives on one group interleave
them in a different order on different ranks: wrong data or a hang. So the saver creates one
gloo group (every rank of the save's group, created collectively on the training thread at the
first save) and the background thread uses *only* that group; and at most one save is in flight
(the next waits), so no two threads ever share it. Gloo, not NCCL: the staged tensors live in
CPU memory, and a CPU group is what DCP's object collectives need. The alternative, deferring
the agreement and the commit to the next call on the training thread, would leave a fully
written checkpoint uncommitted until the next save: a kill in between would lose it.

A kill at any moment of the background write leaves only a ``.tmp-*`` directory: the previous
committed checkpoint stays the newest one a resume finds, and rank 0 removes the leftover at the
next save (:func:`course_lib.checkpoint.collective.begin_save`).
"""
from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from course_lib.validate import check_int

from .collective import begin_save, finish_save, prepare_everywhere
from .dcp import DCP_FORMAT, dcp_exceptions, prepare_rank_state, write_rank_state


@torch.no_grad()
def stage(tree: Any, _memo: dict | None = None) -> Any:
    """A copy of the nested state dict ``tree`` that training cannot change: every tensor copied
    into new CPU memory now (a DTensor keeps its mesh, placements and global shape around its
    copied local shard; tensors that share one object stay shared), containers rebuilt, other
    values deep-copied (optimizer hyper-parameters the scheduler edits in place). Costs one
    memcpy of this rank's shards (bytes: its share of weights plus optimizer state)."""
    from torch.distributed.tensor import DTensor

    memo = {} if _memo is None else _memo
    if isinstance(tree, torch.Tensor):
        if id(tree) in memo:
            return memo[id(tree)]
        if isinstance(tree, DTensor):
            local = tree.to_local()
            copied = torch.empty_like(local, device="cpu").copy_(local)  # copy_: no host read API
            if tree.device_mesh.device_type == "cpu":
                out = DTensor.from_local(copied, tree.device_mesh, tree.placements, run_check=False,
                                         shape=tree.shape, stride=tree.stride())
            else:  # from_local would move the copy back to the device; keep it in CPU memory
                out = DTensor(copied, tree._spec, requires_grad=False)  # as torch's own CPU staging does
        else:
            out = torch.empty_like(tree, device="cpu").copy_(tree)
        memo[id(tree)] = out
        return out
    if isinstance(tree, dict):  # a plain dict: DCP reads any mapping, and defaultdict(...) takes no pairs
        return {k: stage(v, memo) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(stage(v, memo) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(stage(v, memo) for v in tree)
    return copy.deepcopy(tree)


class AsyncShardedSaver:
    """Sharded (DCP) saves that return once the state is staged (see the module docstring).
    ``process_group``: the ranks that save (None: the world; the background group spans the
    same ranks, and every rank of the world must make the first save, which creates it).

    One saver per run; call :meth:`close` (or :meth:`wait`) before the process exits: the
    background thread is a daemon, so a process that dies without it leaves only a temp dir."""

    def __init__(self, process_group: Any = None):
        self.process_group = process_group
        self._background_group: Any = None  # created at the first save (a collective)
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}

    @property
    def in_flight(self) -> bool:
        """Whether a save's background write or commit is still running on this rank."""
        return self._thread is not None and self._thread.is_alive()

    def _group(self) -> Any:
        if self._background_group is None:
            ranks = None if self.process_group is None else dist.get_process_group_ranks(self.process_group)
            self._background_group = dist.new_group(ranks=ranks, backend="gloo")
        return self._background_group

    def save(self, root: str | Path, step: int, model: torch.nn.Module, optimizer: Any = None, *,
             shared: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
             metrics: dict | None = None, keep_last: int = 3,
             on_commit: Callable[[Path], None] | None = None, busy: Callable[[], set] | None = None) -> None:
        """Collective: start saving a sharded checkpoint after ``step`` optimizer steps into
        ``root`` (arguments as :func:`course_lib.checkpoint.dcp.save_sharded`). Returns once
        every rank has staged its copy; the write and the commit go on in the background.
        ``on_commit(path)``: called in the background thread, on every rank, right after the
        commit (e.g. rank 0 hands the checkpoint to a mirror); its error fails the save.
        ``busy()``: names the prune after the commit must leave (rank 0: uploads in flight).
        First waits for the previous save (raising its CheckpointError on every rank). A
        failure before staging completes raises CheckpointError here, on every rank."""
        if not dist.is_initialized():
            raise RuntimeError("AsyncShardedSaver needs an initialised process group (course_lib.parallel.ranks.launch)")
        check_int("step", step, 0)
        check_int("keep_last", keep_last, 1)
        self.wait()
        group = self._group()
        pg = self.process_group
        rank = dist.get_rank(pg)
        plan = begin_save(root, step, what="sharded", format=DCP_FORMAT, group=pg)

        def prepare():  # local only; the staged copy is what makes the rest safe to overlap
            model_sd, optim_sd, mine = prepare_rank_state(model, optimizer, rank, shared=shared, per_rank=per_rank)
            return stage(model_sd), stage(optim_sd), mine

        prepared = prepare_everywhere(plan, prepare, pg)
        outcome: dict[str, Any] = {}

        def background() -> None:
            try:
                outcome["path"] = finish_save(
                    plan, prepared, lambda tmp, p: write_rank_state(tmp, p, rank, group),
                    manifest={"metrics": dict(metrics or {})}, keep_last=keep_last, group=group,
                    write_errors=dcp_exceptions(), busy=busy)
                if on_commit is not None:
                    on_commit(outcome["path"])
            except BaseException as e:  # handed to the training thread by wait()
                outcome["error"] = e

        self._outcome = outcome
        # daemon: a process that dies or exits without close() must not hang on a peer that is
        # gone; the save is then simply not committed (its temp dir is cleared at the next save)
        self._thread = threading.Thread(target=background, name=f"dcp-async-save-step{step}", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the save in flight is committed; returns its final path (None when no
        save was made since the last wait). Raises the save's CheckpointError (the same on every
        rank: the ranks agreed on it in the background)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, outcome, self._outcome = None, self._outcome, {}
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("path")

    def close(self) -> None:
        """Finish the last save (the last checkpoint is never lost); raises its error."""
        self.wait()
