"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), for FSDP / TP models.

Every rank writes only its own shards (``dcp.save``), so no rank ever gathers the full model. The
state dicts come from ``get_state_dict`` and go back through ``set_state_dict``, which handle
FSDP2 DTensors, FSDP1 and plain replicated modules alike, and DCP reshards on load when the
world size changed.

The same guarantees as :class:`~course_lib.checkpoint.CheckpointManager`, collectively:

1. rank 0 picks the name and a ``.tmp-*`` directory on the shared filesystem and broadcasts them;
2. all ranks ``dcp.save`` into it, and each writes ``rank{r}.pt`` (its RNG states and the
   ``per_rank`` objects' state, e.g. its data position) with fsync;
3. after a barrier rank 0 fsyncs every file, writes ``manifest.json`` with the sha256 of each file,
   renames the directory into place, prunes to ``keep_last`` and the ranks meet at a barrier again.

A crash before the rename leaves only a temp directory (removed by the next save); loading picks
the newest directory whose checksums verify, skipping corrupt ones with a warning.
"""
from __future__ import annotations

import io
import json
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import io as cio
from .state import LoadResult, capture_rng, restore_rng_state

DCP_FORMAT = "course_lib.checkpoint.dcp/1"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _sharded_dirs(root: Path) -> list[tuple[int, str, dict]]:
    """(seq, name, manifest) of sharded checkpoints under ``root``, newest first (unverified)."""
    out = []
    for p in cio.list_checkpoint_dirs(root):
        try:
            m = cio.read_manifest(p, expected_format=DCP_FORMAT)
        except cio.CheckpointError:
            continue
        out.append((m.get("seq", 0), p.name, m))
    return sorted(out, reverse=True)


def _broadcast(obj: Any, group: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def save_sharded(root: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: Any = None, *,
                 shared: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
                 metrics: dict | None = None, keep_last: int = 3, process_group: Any = None) -> Path:
    """Collective: save a sharded checkpoint after ``step`` optimizer steps into ``root`` (a
    directory every rank can see). ``shared``: state_dict-able objects equal on all ranks (the
    scheduler), saved once by rank 0; ``per_rank``: objects whose state differs per rank (data
    position); ``keep_last`` >= 1 sharded checkpoints are kept. Returns the final path."""
    if not dist.is_initialized():
        raise RuntimeError("save_sharded needs an initialised process group (course_lib.parallel.launch)")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root, rank = Path(root), dist.get_rank(process_group)
    plan = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        cio.cleanup_temp(root)
        existing = _sharded_dirs(root)
        gen = 0
        while (root / cio.checkpoint_name(step, gen)).exists():
            gen += 1
        name = cio.checkpoint_name(step, gen)
        tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        plan = (name, str(tmp), 1 + max([s for s, _, _ in existing] + [0]))
    name, tmp, seq = _broadcast(plan, process_group)
    tmp = Path(tmp)
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), process_group=process_group)
    buf = io.BytesIO()
    torch.save({"rng": capture_rng(),
                "per_rank": {k: v.state_dict() for k, v in (per_rank or {}).items()},
                "shared": {k: v.state_dict() for k, v in (shared or {}).items()} if rank == 0 else {}}, buf)
    cio.write_durable(tmp / _rank_file(rank), buf.getvalue())
    dist.barrier(group=process_group)
    error = None
    if rank == 0:
        try:
            files = {}
            for f in sorted(tmp.iterdir()):
                blob = f.read_bytes()
                with open(f, "rb+") as fh:  # DCP's writer may not fsync; make every shard durable
                    os.fsync(fh.fileno())
                files[f.name] = {"sha256": cio.sha256_hex(blob), "bytes": len(blob)}
            manifest = {"format": DCP_FORMAT, "step": step, "seq": seq, "created_unix": time.time(),
                        "world_size": dist.get_world_size(process_group), "metrics": dict(metrics or {}),
                        "files": files}
            cio.write_durable(tmp / cio.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            cio.fsync_dir(tmp)
            os.rename(tmp, root / name)  # the commit point
            cio.fsync_dir(root)
            cio.read_verified(root / name)  # re-read before pruning anything older
            for _, old, _ in _sharded_dirs(root)[keep_last:]:
                cio.remove_dir(root / old)
        except BaseException as e:  # every rank must leave the barrier below, then fail together
            error = repr(e)
    error = _broadcast(error, process_group)
    if error is not None:
        raise cio.CheckpointError(f"sharded save of step {step} failed on rank 0: {error}")
    return root / name


def load_sharded(root: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None, *,
                 shared: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
                 restore_rng: bool = True, process_group: Any = None) -> LoadResult | None:
    """Collective: restore the newest sharded checkpoint under ``root`` whose checksums verify
    (rank 0 checks, falling back past corrupt ones with a warning). Returns None on every rank when
    there is none. With a different world size, model and optimizer are resharded by DCP; per-rank
    state is restored only for ranks that saved one."""
    if not dist.is_initialized():
        raise RuntimeError("load_sharded needs an initialised process group (course_lib.parallel.launch)")
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root, rank = Path(root), dist.get_rank(process_group)
    chosen = None
    if rank == 0:
        for seq, name, manifest in _sharded_dirs(root):
            try:
                cio.read_verified(root / name, manifest)
            except cio.CheckpointError as e:
                warnings.warn(f"sharded checkpoint {name} is unusable: {e}; falling back to the previous one",
                              RuntimeWarning)
                continue
            chosen = (name, manifest)
            break
    chosen = _broadcast(chosen, process_group)
    if chosen is None:
        return None
    name, manifest = chosen
    path = root / name
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, checkpoint_id=str(path), process_group=process_group)
    set_state_dict(model, optimizer if optimizer is not None else [],
                   model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra_shared = torch.load(path / _rank_file(0), weights_only=True)["shared"]
    for key, obj in (shared or {}).items():
        obj.load_state_dict(extra_shared[key])
    own = path / _rank_file(rank)
    if own.exists():
        mine = torch.load(own, weights_only=True)
        for key, obj in (per_rank or {}).items():
            obj.load_state_dict(mine["per_rank"][key])
        if restore_rng:
            restore_rng_state(mine["rng"])
    elif per_rank:
        warnings.warn(f"{path} has no state for rank {rank} (saved with world size "
                      f"{manifest.get('world_size')}); its per-rank objects keep their current state", RuntimeWarning)
    return LoadResult(manifest["step"], path, "local", manifest.get("metrics", {}), manifest.get("seq", 0), manifest)
