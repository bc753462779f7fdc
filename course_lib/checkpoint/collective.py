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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from . import io as cio
from .io import CheckpointError, CheckpointLoadError


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


def agreed_choice(choose: Callable[[], tuple], what: str, root: Path, group: Any = None) -> tuple | None:
    """The checkpoint every rank of ``group`` loads: the first rank runs ``choose()`` (a
    ``(kind, name, manifest, source)`` tuple) and broadcasts it. None on every rank when there is
    nothing to load; ``CheckpointLoadError`` on every rank when the choice failed, so no rank waits
    for a choice that never comes."""
    chosen = None
    if dist.get_rank(group) == 0:
        try:
            chosen = choose()
        except BaseException as e:  # the others wait for the choice: tell them, then fail
            chosen = ("error", f"choosing a {what} checkpoint under {root} failed: {describe(e)}", [], None)
    chosen = broadcast(chosen, group)
    if chosen[0] == "none":
        return None
    if chosen[0] == "error":
        raise CheckpointLoadError(chosen[1], chosen[2])
    return chosen


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
            name = cio.fresh_name(root, step)
            tmp = cio.new_temp_dir(root, name)
            plan = ("ok", name, str(tmp), 1 + cio.last_seq(root))  # every format's: one order per folder
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
                write_errors: tuple = (Exception,), busy: Callable[[], set[str]] | None = None) -> Path:
    """Steps 3-4, collective over ``group``: every rank's ``write(tmp, prepared)``, errors
    exchanged; then rank 0's one commit (manifest, rename, fsync), re-read and only then pruning
    to ``keep_last`` (:func:`prune`: never a folder ``busy()`` names); its outcome is broadcast. Returns the final path; CheckpointError on every
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
            prune(root, plan.format, keep_last, busy)
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
                    write_errors: tuple = (Exception,), busy: Callable[[], set[str]] | None = None) -> Path:
    """Run the protocol of the module docstring on every rank of ``group``, synchronously;
    returns the final path. ``what`` names the checkpoint kind in errors ("sharded",
    "deepspeed"); ``manifest``: extra fields (metrics, ZeRO stage) next to format, step, seq,
    time and world size; ``write_errors``: the exception types ``write`` may raise that are
    reported rather than propagated (DCP's CheckpointException is a BaseException); ``busy``:
    names the prune must leave (a mirror's uploads in flight, rank 0).
    CheckpointError on every rank when any rank fails; nothing is committed then."""
    plan = begin_save(root, step, what=what, format=format, group=group)
    prepared = prepare_everywhere(plan, prepare, group)
    return finish_save(plan, prepared, write, manifest=manifest, keep_last=keep_last, group=group,
                       write_errors=write_errors, busy=busy)


def choose_newest(root: Path, format: str, verify: Callable[[Path, dict | None], dict], what: str,
                  mirror: Any = None) -> tuple:
    """Rank 0's choice of what every rank loads, by the rules of :func:`course_lib.checkpoint.tiers.choose`
    (the local folder and ``mirror``; corrupt copies moved aside): ``("ok", name, manifest, source)``,
    ``("none", None, None, None)`` when neither tier holds a checkpoint, or ``("error", message,
    failures, None)``; a tuple to broadcast, so every rank raises together."""
    from .tiers import choose

    try:
        chosen = choose(root, format, verify, what=what, mirror=mirror)
    except CheckpointLoadError as e:
        return "error", str(e), e.failures, None
    if chosen is None:
        return "none", None, None, None
    return "ok", chosen.name, chosen.value, chosen.source


_verified: dict[tuple, bool] = {}  # (path, seq, created) -> checksums matched, once per process


def _intact(path: Path, manifest: dict) -> bool:
    """Whether ``path``'s files match its manifest (checked once per process and checkpoint)."""
    key = (str(path), manifest.get("seq"), manifest.get("created_unix"))
    if key not in _verified:
        try:
            cio.read_verified(path, manifest)
            _verified[key] = True
        except CheckpointError:
            _verified[key] = False
    return _verified[key]


def prune(root: Path, format: str, keep_last: int, busy: Callable[[], set[str]] | None = None) -> list[str]:
    """Rank 0, after a commit verified: keep the ``keep_last`` newest checkpoints of ``format``
    that verify and delete older verified ones, except those ``busy()`` names (a mirror still
    uploading them: pruned at a later save). A corrupt one is neither counted nor deleted here:
    the loader quarantines it with a warning. Returns the names removed."""
    held = busy() if busy is not None else set()
    kept, removed = 0, []
    for _, name, manifest in newest_first(root, format)[0]:
        if not _intact(root / name, manifest):
            continue
        kept += 1
        if kept > keep_last and name not in held:
            cio.remove_dir(root / name)
            removed.append(name)
    return removed
