"""Checkpointing across ranks: who writes, and how every rank agrees on what to load.

Two ways, chosen by the strategy (``Strategy.checkpoint_format``) or by ``checkpoint.format``:

* :class:`FullCheckpoints` - replicated weights (single, DDP): the writer rank (0) saves the whole
  state through :class:`~course_lib.checkpoint.CheckpointManager` (atomic, async, verified,
  mirrored). Per-rank state (RNG, data position) is gathered from every rank first, so each rank
  gets its own back on resume.
* :class:`ShardedCheckpoints` - sharded weights (FSDP, TP): every rank writes its own shards through
  DCP (:mod:`course_lib.checkpoint.dcp`); nobody gathers the full model.

Agreement: a resume or a roll-back must bring every rank to the *same* checkpoint. Rank 0 finishes
any save in flight, picks the newest checkpoint that verifies (falling back past corrupt ones) and
broadcasts its name; the other ranks load exactly that one. Without this, a rank that listed the
folder while rank 0's async save was still being written would load an older step, and the ranks
would wait on each other forever. A load that fails on rank 0 fails on every rank at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn


@dataclass
class TrainState:
    """The live objects a checkpoint captures: ``model`` (plain module, checkpoint names),
    ``optimizer``, ``scheduler``, ``scaler`` (the precision policy), ``data`` (the batch stream:
    its position), ``stateful`` (other ``state_dict()`` objects, e.g. the stabilizer)."""

    model: nn.Module
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    data: Any = None
    stateful: dict[str, Any] = field(default_factory=dict)


class FullCheckpoints:
    """The whole state on the writer rank (see the module docstring). ``every_steps``: save when
    ``step % every_steps == 0`` (None: only when asked); ``keep_last`` newest kept; ``async_save``:
    write in a background thread after a CPU copy; ``mirror``: fsspec URL of a second tier."""

    format = "full"

    def __init__(self, strategy: Any, root: str | Path, *, every_steps: int | None, keep_last: int,
                 async_save: bool, mirror: str | None):
        from course_lib.checkpoint import CheckpointManager

        self.strategy = strategy
        self.manager = CheckpointManager(root, every_steps=every_steps, keep_last=keep_last,
                                         async_save=async_save, mirror=mirror or None,
                                         writer=strategy.is_writer)

    def should_save(self, step: int) -> bool:
        """Whether the step policy saves after ``step`` optimizer steps (same answer on every rank)."""
        return self.manager.should_save(step)

    def save(self, step: int, state: TrainState, metrics: dict) -> None:
        """Collective: gather every rank's RNG and data position, then the writer saves."""
        from course_lib.checkpoint.state import capture_rank_state

        state = self.strategy.checkpoint_state(state, saving=True)  # collective: gather shards to the writer
        ranks = self.strategy.gather_to_writer(capture_rank_state(state.data))
        if self.strategy.is_writer:
            self.manager.save(step, model=state.model, optimizer=state.optimizer, scheduler=state.scheduler,
                              scaler=state.scaler, data=state.data, stateful=state.stateful,
                              metrics=metrics, rank_states=ranks)

    def load(self, state: TrainState, *, restore_data: bool = True):
        """Collective: restore the checkpoint rank 0 picks on every rank; ``restore_data=False``
        keeps the data position (a roll-back must not replay the batches that caused it).
        Returns the :class:`~course_lib.checkpoint.LoadResult`, or None when there is no
        checkpoint at all; raises CheckpointLoadError (on every rank) when none can be loaded."""
        from course_lib.checkpoint import CheckpointLoadError

        s = self.strategy
        state = s.checkpoint_state(state, saving=False)  # full-layout views where weights are sharded
        objects = dict(model=state.model, optimizer=state.optimizer, scheduler=state.scheduler,
                       scaler=state.scaler, data=state.data if restore_data else None,
                       stateful=state.stateful)
        if s.is_writer:
            try:
                result = self.manager.load(**objects, rank=0)
            except BaseException as exc:  # the others are waiting for the name: tell them, then fail
                s.broadcast_object(("error", f"{type(exc).__name__}: {exc}"))
                raise
            s.broadcast_object(("ok", result.path.name) if result is not None else ("none", None))
            return result
        kind, name = s.broadcast_object(None)
        if kind == "error":
            raise CheckpointLoadError(f"rank 0 could not load a checkpoint, so neither can rank "
                                      f"{s.info.rank}: {name}")
        if kind == "none":
            return None
        return self.manager.load(**objects, rank=s.info.rank, only=name)

    def flush(self) -> None:
        """Wait for the save in flight (raises its error, if any)."""
        self.manager.wait(mirror=False)

    def close(self) -> None:
        """Finish the last save and its upload: the last checkpoint is never lost."""
        self.manager.close()


class ShardedCheckpoints:
    """Every rank saves and loads its own shards through DCP (see the module docstring).
    ``async_save``: a save returns once every rank has staged a CPU copy of its shards; the write
    and the commit run in the background (:class:`~course_lib.checkpoint.dcp_async.AsyncShardedSaver`),
    and the next save, a load and :meth:`close` wait for it. ``mirror``: fsspec URL of a second
    tier; after each commit rank 0 copies the sealed checkpoint (every rank's files, then the
    manifest as commit marker) in the background (:mod:`course_lib.checkpoint.dcp_mirror`), the
    prune leaves folders still uploading, and a resume chooses across both tiers."""

    format = "sharded"

    def __init__(self, strategy: Any, root: str | Path, *, every_steps: int | None, keep_last: int,
                 async_save: bool, mirror: str | None):
        self.strategy, self.root = strategy, Path(root)
        self.every_steps, self.keep_last = every_steps, keep_last
        self.mirror = None
        if mirror:  # on every rank (no file is read): a mirror in or above root would upload onto itself
            from course_lib.checkpoint.mirror import check_apart

            check_apart(mirror, self.root)
        if mirror and strategy.info.rank == 0:  # rank 0 seals every checkpoint: it alone copies them
            from course_lib.checkpoint.mirror import as_mirror

            self.mirror = as_mirror(mirror)
        self._async = None
        if async_save:
            from course_lib.checkpoint.dcp_async import AsyncShardedSaver

            self._async = AsyncShardedSaver()

    def should_save(self, step: int) -> bool:
        """Whether the step policy saves after ``step`` optimizer steps."""
        return self.every_steps is not None and step > 0 and step % self.every_steps == 0

    def _shared(self, state: TrainState) -> dict[str, Any]:
        shared = {"scheduler": state.scheduler, "precision": state.scaler, **state.stateful}
        return {k: v for k, v in shared.items() if v is not None}

    def _committed(self, path: Path | None) -> None:
        """After a commit (on the training thread, or in an async save's background thread)."""
        if self.mirror is not None and path is not None:  # rank 0: copied in the mirror's own thread
            from course_lib.checkpoint.dcp_mirror import mirror_keep

            self.mirror.submit(path, mirror_keep(self.keep_last))

    def _busy(self) -> set[str]:
        """Folders the prune after a commit must leave: those the mirror is still uploading."""
        return self.mirror.busy() if self.mirror is not None else set()

    def save(self, step: int, state: TrainState, metrics: dict) -> None:
        """Collective: every rank writes its shards, RNG and data position (async: returns once
        they are staged; the previous async save is committed first)."""
        from course_lib.checkpoint.dcp import save_sharded

        kwargs = dict(shared=self._shared(state), per_rank={"data": state.data} if state.data is not None else {},
                      metrics=metrics, keep_last=self.keep_last, busy=self._busy)
        if self._async is not None:
            self._async.save(self.root, step, state.model, state.optimizer, on_commit=self._committed, **kwargs)
        else:
            self._committed(save_sharded(self.root, step, state.model, state.optimizer, **kwargs))

    def load(self, state: TrainState, *, restore_data: bool = True):
        """Collective: rank 0 picks the newest sharded checkpoint of either tier that verifies, by
        the rules full checkpoints follow (:mod:`course_lib.checkpoint.tiers`: the mirror's copy of
        a corrupt local one first, corrupt ones moved aside, no local checkpoint and an unlistable
        mirror refused); every rank loads its shards of it (resharded by DCP if the world size
        changed)."""
        from course_lib.checkpoint.dcp import load_sharded

        self.flush()  # a save in flight is committed first: rank 0 must be able to choose it
        if self.mirror is not None:  # rank 0 only; the others wait for its choice inside load_sharded
            self.mirror.wait()  # an upload in flight finishes before the mirror is listed
        per_rank = {"data": state.data} if restore_data and state.data is not None else {}
        return load_sharded(self.root, state.model, state.optimizer, shared=self._shared(state),
                            per_rank=per_rank, mirror=self.mirror)

    def flush(self) -> None:
        """Wait for the async save in flight to be committed (raises its error, if any)."""
        if self._async is not None:
            self._async.wait()

    def close(self) -> None:
        """Finish the last async save and its upload: the last checkpoint is never lost."""
        try:
            self.flush()
        finally:
            if self.mirror is not None:
                from course_lib.checkpoint.collective import prune
                from course_lib.checkpoint.dcp import DCP_FORMAT

                self.mirror.close()
                prune(self.root, DCP_FORMAT, self.keep_last)  # what uploads in flight kept from the prune
