"""The save protocol every multi-rank checkpoint shares (DCP shards, DeepSpeed shards).

1. Rank 0 picks a fresh name and a ``.tmp-*`` directory under ``root`` and broadcasts them (or
   its error: the others are waiting).
2. Every rank does its *local* preparation (``prepare``: serialise its RNG and data position...);
   the ranks exchange errors instead of meeting at a bare barrier, so one rank's failure stops
   all of them at once and nothing is left waiting in a collective.
3. Every rank writes (``write(tmp, prepared)``: the engine's collective save plus its own files);
   errors exchanged again.
4. Rank 0 seals the directory (:func:`course_lib.checkpoint.io.commit_dir`: hash and fsync every
   file, manifest, rename, fsync), re-reads it, and only then prunes to ``keep_last``; its error,
   if any, is broadcast so every rank raises together.

The phases are separate functions (:func:`begin_save`, :func:`prepare_everywhere`,
:func:`finish_save`) so that an async save (:mod:`course_lib.checkpoint.dcp_async`) can run steps
1-2 on the training thread and steps 3-4 in a background thread, on a process group of its own.

Nothing appears under a final name unless every rank's part is in it.
"""
from __future__ import annotations

import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from . import io as cio
from .io import CheckpointCorruptError, CheckpointError, CheckpointLoadError


def broadcast(obj: Any, group: Any = None) -> Any:
    """``obj`` from the group's first rank on every rank of ``group`` (None: the world)."""
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def agree(error: str | None, group: Any = None) -> list[tuple[int, str]]:
    """Every rank's error (None when it succeeded) on every rank: ``[(rank, error)]`` of those
    that failed. Replaces a bare barrier, so one rank's failure stops all of them at once."""
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return [(r, e) for r, e in enumerate(errors) if e is not None]


def describe(e: BaseException) -> str:
    """``"TypeName: message"`` for error reports that travel between ranks."""
    return f"{type(e).__name__}: {e}"


def newest_first(root: Path, format: str) -> tuple[list[tuple[int, str, dict]], dict[str, str]]:
    """``([(seq, name, manifest)] newest first (unverified), {name: why the manifest is unreadable})``
    of the checkpoints of ``format`` under ``root``."""
    good, damaged = cio.scan(root, format)
    return sorted(((m.get("seq", 0), n, m) for n, m in good.items()), reverse=True), damaged


@dataclass(frozen=True)
class SavePlan:
    """What rank 0 decided for one save (step 1), the same on every rank: the final ``name``, the
    ``tmp`` directory every rank writes into, the ``seq`` it will carry; ``what`` names the
    checkpoint kind in errors ("sharded", "deepspeed")."""

    root: Path
    step: int
    what: str
    format: str
    name: str
    tmp: Path
    seq: int


def begin_save(root: str | Path, step: int, *, what: str, format: str, group: Any = None) -> SavePlan:
    """Step 1, collective over ``group``: rank 0 clears leftovers of interrupted saves, picks a
    fresh name and a temp directory, and broadcasts them (or its error: CheckpointError on every
    rank)."""
    root, rank = Path(root), dist.get_rank(group)
    plan: Any = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            cio.cleanup_temp(root)  # a torn save of a killed run (sync or async) goes here
            existing, _ = newest_first(root, format)
            name = cio.fresh_name(root, step)
            tmp = cio.new_temp_dir(root, name)
            plan = ("ok", name, str(tmp), 1 + max([s for s, _, _ in existing] + [0]))
        except Exception as e:  # the others wait for the plan: tell them
            plan = ("error", describe(e), None, None)
    kind, name, tmp, seq = broadcast(plan, group)
    if kind == "error":
        raise CheckpointError(f"{what} save of step {step} failed on rank 0: {name}")
    return SavePlan(root, step, what, format, name, Path(tmp), seq)


def _check(plan: SavePlan, error: str | None, group: Any) -> None:
    """Exchange every rank's error over ``group``; when any failed, rank 0 removes the temp
    directory and every rank raises the same CheckpointError naming the failed ranks."""
    failed = agree(error, group)
    if failed:
        if dist.get_rank(group) == 0:
            shutil.rmtree(plan.tmp, ignore_errors=True)
        raise CheckpointError(f"{plan.what} save of step {plan.step} failed on "
                              + "; ".join(f"rank {r}: {e}" for r, e in failed)
                              + f". Nothing was committed under {plan.root}")


def prepare_everywhere(plan: SavePlan, prepare: Callable[[], Any], group: Any = None) -> Any:
    """Step 2, collective over ``group``: ``prepare()`` on every rank (local work only: no
    collective may run inside it, or a failing rank would leave the others waiting), then the
    errors are exchanged. Returns this rank's prepared value."""
    error, prepared = None, None
    try:
        prepared = prepare()
    except Exception as e:
        error = describe(e)
    _check(plan, error, group)
    return prepared


def finish_save(plan: SavePlan, prepared: Any, write: Callable[[Path, Any], None], *,
                manifest: dict[str, Any], keep_last: int, group: Any = None,
                write_errors: tuple = (Exception,)) -> Path:
    """Steps 3-4, collective over ``group``: every rank's ``write(tmp, prepared)``, errors
    exchanged; then rank 0's one commit (manifest, rename, fsync), re-read and only then pruning
    to ``keep_last``; its outcome is broadcast. Returns the final path; CheckpointError on every
    rank when any rank failed (nothing committed). Every collective here runs on ``group`` only:
    an async save runs this in a background thread on a group of its own."""
    error = None
    try:
        write(plan.tmp, prepared)
    except write_errors as e:
        error = describe(e)
    _check(plan, error, group)  # the commit below happens only once EVERY rank's files are written
    error = None
    root = plan.root
    if dist.get_rank(group) == 0:
        try:
            sealed = {"format": plan.format, "step": plan.step, "seq": plan.seq, "created_unix": time.time(),
                      "world_size": dist.get_world_size(group), **manifest}
            final = cio.commit_dir(plan.tmp, root / plan.name, sealed)  # removes tmp if it fails
            cio.read_verified(final)  # re-read before pruning anything older
            for _, old, _ in newest_first(root, plan.format)[0][keep_last:]:
                cio.remove_dir(root / old)
        except BaseException as e:  # every rank must hear of it, then fail together
            shutil.rmtree(plan.tmp, ignore_errors=True)
            error = describe(e)
    error = broadcast(error, group)
    if error is not None:
        raise CheckpointError(f"{plan.what} save of step {plan.step} failed on rank 0: {error}")
    return root / plan.name


def collective_save(root: str | Path, step: int, *, what: str, format: str,
                    prepare: Callable[[], Any], write: Callable[[Path, Any], None],
                    manifest: dict[str, Any], keep_last: int, group: Any = None,
                    write_errors: tuple = (Exception,)) -> Path:
    """Run the protocol of the module docstring on every rank of ``group``, synchronously;
    returns the final path. ``what`` names the checkpoint kind in errors ("sharded",
    "deepspeed"); ``manifest``: extra fields (metrics, ZeRO stage) next to format, step, seq,
    time and world size; ``write_errors``: the exception types ``write`` may raise that are
    reported rather than propagated (DCP's CheckpointException is a BaseException).
    CheckpointError on every rank when any rank fails; nothing is committed then."""
    plan = begin_save(root, step, what=what, format=format, group=group)
    prepared = prepare_everywhere(plan, prepare, group)
    return finish_save(plan, prepared, write, manifest=manifest, keep_last=keep_last, group=group,
                       write_errors=write_errors)


def choose_newest(root: Path, format: str, verify: Callable[[Path, dict], dict], what: str) -> tuple:
    """Rank 0's choice of what every rank loads: ``("ok", name, manifest)``, ``("none", None, None)``
    when there is no checkpoint at all, or ``("error", message, failures)``. Newest first: a
    checkpoint whose ``verify(path, manifest)`` raises CheckpointCorruptError is passed over with a
    warning (fall back); CheckpointLoadError stops the choice (an older checkpoint would silently
    lose progress); checkpoints that exist while none loads is a refusal listing each."""
    candidates, damaged = newest_first(root, format)
    failures = []
    for name, reason in sorted(damaged.items(), reverse=True):
        warnings.warn(f"{what} {name} is unusable: no readable manifest ({reason}); falling "
                      f"back to the previous one", RuntimeWarning, stacklevel=3)
        failures.append((name, f"no readable manifest ({reason})"))
    for _, name, manifest in candidates:
        try:
            return "ok", name, verify(root / name, manifest)
        except CheckpointCorruptError as e:
            warnings.warn(f"{what} {name} is unusable: {e}; falling back to the previous one",
                          RuntimeWarning, stacklevel=3)
            failures.append((name, str(e)))
        except CheckpointLoadError as e:
            return "error", (f"cannot load {what} {name}: {e}. No older checkpoint was used: fix "
                             f"the cause and retry"), failures + [(name, str(e))]
    if failures or cio.quarantined(root):
        err = cio.refusal(root, failures, what=what)
        return "error", str(err), err.failures
    return "none", None, None
