"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), for FSDP / TP models.

Every rank writes only its own shards (``dcp.save``), so no rank ever gathers the full model. The
state dicts come from ``get_state_dict`` and go back through ``set_state_dict``, which handle
FSDP2 DTensors, FSDP1 and plain replicated modules alike, and DCP reshards on load when the
world size changed.

The same guarantees as :class:`~course_lib.checkpoint.CheckpointManager`, collectively:

1. rank 0 picks a fresh name and a ``.tmp-*`` directory on the shared filesystem and broadcasts
   them;
2. every rank takes its state dicts and serializes ``rank{r}.pt`` (its RNG states and the
   ``per_rank`` objects' state, e.g. its data position); the ranks exchange their errors;
3. all ranks ``dcp.save`` into the temp directory and write their ``rank{r}.pt``; the ranks
   exchange their errors again (an ``all_gather_object``, not a bare barrier: a rank that failed
   makes every rank raise at once, naming it, instead of leaving rank 0 waiting for the timeout);
4. rank 0 seals the directory with the one commit of :func:`course_lib.checkpoint.io.commit_dir`
   (hash and fsync every file, ``manifest.json``, rename, fsync), re-reads it, prunes to
   ``keep_last`` and broadcasts the outcome.

:func:`save_sharded` runs all of this on the calling thread; :mod:`course_lib.checkpoint.dcp_async`
runs steps 1-2 there on a staged copy and steps 3-4 in the background.

Loading (:func:`load_sharded`): rank 0 picks the newest checkpoint that verifies (checksums, the
``.metadata`` through the restricted unpickler, every ``rank{r}.pt`` through
``torch.load(weights_only=True)``), falling back past corrupt ones with a warning; every rank then
loads exactly that one. Nothing on disk is unpickled freely: ``.metadata`` goes through
the restricted unpickler of :mod:`course_lib.checkpoint.dcp_trust` (DCP's own reader uses plain
``pickle.load``), and the non-tensor entries of the ``.distcp`` shards with
``torch.load(weights_only=True)`` instead of DCP's default ``weights_only=False``.
"""
from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib.validate import check_bool, check_int

from . import io as cio
from .collective import agree, agreed_choice, broadcast, choose_newest, collective_save, describe, newest_first
from .io import CheckpointCorruptError, CheckpointLoadError
from .dcp_trust import RestrictedFileSystemReader, SafeLoadPlanner, read_metadata_file
from .state import LoadResult, capture_rng, restore_rng_state

DCP_FORMAT = "course_lib.checkpoint.dcp/1"
METADATA = ".metadata"

# ----------------------------------------------------------------------------- helpers

def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _sharded_dirs(root: Path) -> tuple[list[tuple[int, str, dict]], dict[str, str]]:
    """``([(seq, name, manifest)] newest first (unverified), {name: why the manifest is unreadable})``
    of the sharded checkpoints under ``root``."""
    return newest_first(root, DCP_FORMAT)


_broadcast, _agree, _describe = broadcast, agree, describe  # used by the loader below


def dcp_exceptions() -> tuple:
    """The exception types a DCP call may raise (its CheckpointException is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass
    return (Exception, CheckpointException)


# ----------------------------------------------------------------------------- save

def prepare_rank_state(model: torch.nn.Module, optimizer: Any, rank: int, *,
                       shared: dict[str, Any] | None, per_rank: dict[str, Any] | None) -> tuple:
    """Local only (no collective): ``(model state dict, optimizer state dict, rank{r}.pt bytes)``.
    The state dicts hold the live tensors (DTensor shards under FSDP2); the bytes (this rank's
    RNG, ``per_rank`` objects' state, rank 0's ``shared`` state) are a copy taken now."""
    from torch.distributed.checkpoint import state_dict as sd

    model_sd, optim_sd = sd.get_state_dict(model, optimizer if optimizer is not None else [])
    buf = io.BytesIO()
    torch.save({"rng": capture_rng(),
                "per_rank": {k: v.state_dict() for k, v in (per_rank or {}).items()},
                "shared": {k: v.state_dict() for k, v in (shared or {}).items()} if rank == 0 else {}}, buf)
    return model_sd, optim_sd, buf.getvalue()


def write_rank_state(tmp: Path, prepared: tuple, rank: int, process_group: Any = None) -> None:
    """Collective over ``process_group``: ``dcp.save`` of the prepared state dicts into ``tmp``,
    then this rank's ``rank{r}.pt``. DCP exchanges its own errors between ranks: a failure inside
    it raises on every rank."""
    from torch.distributed.checkpoint import save as dcp_save

    model_sd, optim_sd, mine = prepared
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), process_group=process_group)
    cio.write_durable(tmp / _rank_file(rank), mine)


def save_sharded(root: str | Path, step: int, model: torch.nn.Module, optimizer: Any = None, *,
                 shared: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
                 metrics: dict | None = None, keep_last: int = 3, process_group: Any = None,
                 busy: Any = None) -> Path:
    """Collective: save a sharded checkpoint after ``step`` optimizer steps into ``root`` (a
    directory every rank can see). ``shared``: state_dict-able objects equal on all ranks (the
    scheduler), saved once by rank 0; ``per_rank``: objects whose state differs per rank (data
    position); ``keep_last`` >= 1 sharded checkpoints are kept (never one ``busy()`` names, rank
    0: a mirror still uploading it). Returns the final path.
    Synchronous: training waits for the commit (:class:`course_lib.checkpoint.dcp_async.AsyncShardedSaver`
    overlaps the write with training).

    A failure on any rank raises CheckpointError on every rank, naming the rank(s) that failed,
    as soon as the ranks next exchange their status; nothing appears under a final name."""
    if not dist.is_initialized():
        raise RuntimeError("save_sharded needs an initialised process group (course_lib.parallel.ranks.launch)")
    check_int("step", step, 0)
    check_int("keep_last", keep_last, 1)
    rank = dist.get_rank(process_group)
    return collective_save(
        root, step, what="sharded", format=DCP_FORMAT,
        prepare=lambda: prepare_rank_state(model, optimizer, rank, shared=shared, per_rank=per_rank),
        write=lambda tmp, prepared: write_rank_state(tmp, prepared, rank, process_group),
        manifest={"metrics": dict(metrics or {})}, keep_last=keep_last, group=process_group,
        write_errors=dcp_exceptions(), busy=busy)


# ----------------------------------------------------------------------------- load

def verify_sharded(path: Path, manifest: dict | None = None) -> dict:
    """Everything rank 0 checks before the ranks load ``path``: every file's size and sha256,
    ``.metadata`` through the restricted unpickler, each ``rank{r}.pt`` through
    ``torch.load(weights_only=True)``. Returns the manifest; CheckpointCorruptError otherwise
    (CheckpointLoadError when the storage fails to read)."""
    manifest, blobs = cio.read_verified(path, manifest)
    del blobs
    if METADATA not in manifest["files"]:
        raise CheckpointCorruptError(f"{path}: the manifest lists no {METADATA}")
    read_metadata_file(path / METADATA)
    for fname in manifest["files"]:
        if fname.startswith("rank") and fname.endswith(".pt"):
            try:
                state = torch.load(path / fname, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise CheckpointCorruptError(f"{path}: {fname} does not load with weights_only=True ({e})") from e
            if not isinstance(state, dict) or "rng" not in state:
                raise CheckpointCorruptError(f"{path}: {fname} is not a per-rank state")
    return manifest


def _choose(root: Path, mirror: Any = None) -> tuple:
    """Rank 0's choice from the local folder and ``mirror`` (see
    :func:`course_lib.checkpoint.collective.choose_newest`)."""
    return choose_newest(root, DCP_FORMAT, verify_sharded, "sharded checkpoint", mirror)


def _model_mismatch(path: Path, model_sd: dict, strict: bool) -> list[str]:
    """Compare the model's state dict (global shapes) with the checkpoint's metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = read_metadata_file(path / METADATA).state_dict_metadata
    problems, shapes = [], []
    for k, v in model_sd.items():
        meta = saved.get(f"model.{k}")
        if isinstance(meta, TensorStorageMetadata) and isinstance(v, torch.Tensor) and tuple(meta.size) != tuple(v.shape):
            shapes.append(f"{k}: checkpoint {tuple(meta.size)} vs model {tuple(v.shape)}")
    if shapes:
        problems.append(f"tensor shapes differ ({', '.join(shapes[:5])}{' ...' if len(shapes) > 5 else ''})")
    if strict:
        missing = [k for k in model_sd if f"model.{k}" not in saved]
        unexpected = [k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):] not in model_sd]
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(missing[:5])}")
        if unexpected:
            problems.append(f"unexpected in the checkpoint: {', '.join(unexpected[:5])}")
    return problems


def load_sharded(root: str | Path, model: torch.nn.Module, optimizer: Any = None, *,
                 shared: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
                 restore_rng: bool = True, strict: bool = True, process_group: Any = None,
                 mirror: Any = None) -> LoadResult | None:
    """Collective: restore the newest sharded checkpoint under ``root`` or on ``mirror`` (rank 0's
    :class:`~course_lib.checkpoint.mirror.CheckpointMirror`, None elsewhere) that verifies, on
    every rank. Rank 0 chooses by the rules of :mod:`course_lib.checkpoint.tiers`: newest first,
    the mirror's copy of a corrupt local one before an older checkpoint, corrupt copies moved
    aside with a warning, a mirror-only one downloaded into ``root`` first. With a different world
    size, model and optimizer are resharded by DCP; a rank that saved no per-rank state (the world
    grew) takes rank 0's (the data position, which counts the global stream) and keeps its RNG.

    Returns None on every rank only when there is no sharded checkpoint in either tier. Raises
    CheckpointLoadError on every rank when checkpoints exist but none verifies (listing each), when
    the local folder holds none and the mirror cannot be listed, when the chosen one cannot be
    read, or when the model does not fit it (refused by name before any weight is touched)."""
    if not dist.is_initialized():
        raise RuntimeError("load_sharded needs an initialised process group (course_lib.parallel.ranks.launch)")
    check_bool("restore_rng", restore_rng)
    check_bool("strict", strict)
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root, rank = Path(root), dist.get_rank(process_group)
    chosen = agreed_choice(lambda: _choose(root, mirror), "sharded", root, process_group)
    if chosen is None:
        return None
    kind, name, manifest, source = chosen
    path = root / name
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    problems = _model_mismatch(path, model_sd, strict)
    if problems:
        raise CheckpointLoadError(f"sharded checkpoint {name} does not fit the model; nothing was loaded: "
                                  + "; ".join(problems), [(name, "; ".join(problems))])
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp_load(state, storage_reader=RestrictedFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                 process_group=process_group)
        set_state_dict(model, optimizer if optimizer is not None else [],
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_shared = torch.load(path / _rank_file(0), map_location="cpu", weights_only=True)["shared"]
        for key, obj in (shared or {}).items():
            obj.load_state_dict(extra_shared[key])
        own = _rank_file(rank) in manifest["files"]  # sealed with the checkpoint, not whatever lies there
        if own:
            mine = torch.load(path / _rank_file(rank), map_location="cpu", weights_only=True)
        elif per_rank:
            # The world grew: this rank saved nothing. Its data position is rank 0's (a sampler's
            # position counts the global stream, so every rank's is the same; staying at batch 0
            # would replay data), as full checkpoints do; its RNG stream stays its own.
            mine = torch.load(path / _rank_file(0), map_location="cpu", weights_only=True)
            warnings.warn(f"{path} holds per-rank state for {manifest.get('world_size')} rank(s); rank {rank} "
                          f"has none (the world grew): its data position comes from rank 0 and its RNG is "
                          f"left as it is", RuntimeWarning)
        for key, obj in (per_rank or {}).items():
            obj.load_state_dict(mine["per_rank"][key])
        if restore_rng and own:
            restore_rng_state(mine["rng"])
    except dcp_exceptions() as e:
        raise CheckpointLoadError(f"cannot load sharded checkpoint {name} on rank {rank}: {_describe(e)}",
                                  [(name, _describe(e))]) from e
    return LoadResult(manifest["step"], path, source, manifest.get("metrics", {}), manifest.get("seq", 0), manifest)


def consolidate_sharded(path: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of one sharded checkpoint folder (``path``: e.g. ``.../step_00000040``)
    as one plain ``{name: full tensor}`` dict on the CPU, ready for a single-process model's
    ``load_state_dict``: every rank's shards stitched together, whatever the world size that
    saved them. Needs no process group. Verifies the checkpoint first (CheckpointCorruptError
    otherwise); metadata goes through the same restricted unpickler as :func:`load_sharded`."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from course_lib.checkpoint.dcp_trust import RestrictedFileSystemReader, SafeLoadPlanner

    path = Path(path)
    verify_sharded(path)

    class _ModelOnly(_EmptyStateDictLoadPlanner):
        load_bytes = SafeLoadPlanner.load_bytes  # non-tensor items: weights_only, never pickle

    # The private loader, as torch's own dcp_to_torch_save does: the public load() fills a copy of
    # the dict it is given, and an empty dict is exactly what this planner needs.
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=RestrictedFileSystemReader(str(path)),
                     planner=_ModelOnly(keys={"model"}), no_dist=True)
    if isinstance(state.get("model"), dict):  # nested, as saved
        return dict(state["model"])
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}  # flat keys
