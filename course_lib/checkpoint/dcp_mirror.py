"""``checkpoint.mirror`` for sharded (DCP) checkpoints: the same second tier as full checkpoints.

A sharded checkpoint is one directory on storage every rank sees: each rank writes its own
``.distcp`` shard and ``rank{r}.pt`` into it, and rank 0 seals the whole directory with one
manifest listing every rank's files (:mod:`course_lib.checkpoint.collective`). So the mirror needs
no per-rank protocol: after the commit, rank 0 hands the sealed directory to
:class:`~course_lib.checkpoint.mirror.CheckpointMirror`, which uploads every file in the manifest
(every rank's shards), reads each back against its sha256, and only then writes the manifest,
the one commit marker of the copy. The upload runs in the mirror's own background thread: a
synchronous save returns after the local commit; an async save's background thread submits the
upload right after its commit.

Resuming: before the ranks choose a checkpoint, rank 0 fetches the mirror's newest sharded
checkpoint (by save order) when the local folder has none as new, verified file by file, into the
local folder under its own name and kind; :func:`course_lib.checkpoint.dcp.load_sharded` then loads
it like any local one, on the same or another world size (DCP reshards).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from .collective import newest_first
from .dcp import DCP_FORMAT
from .io import CheckpointError
from .mirror import CheckpointMirror


def mirror_keep(keep_last: int) -> Callable[[dict], set[str]]:
    """The mirror's retention rule, applied to its own ``{name: manifest}`` listing after each
    upload: the ``keep_last`` newest sharded checkpoints by save order, and every checkpoint of
    another kind (not this run's to prune). Its own listing, not the local set: after a resume
    from the mirror the local folder holds fewer checkpoints than the mirror should keep."""
    def keep(remote: dict[str, dict]) -> set[str]:
        mine = sorted((m.get("seq", 0), n) for n, m in remote.items() if m.get("format") == DCP_FORMAT)
        return {n for _, n in mine[-keep_last:]} | {n for n, m in remote.items() if m.get("format") != DCP_FORMAT}
    return keep


def fetch_newer(mirror: CheckpointMirror, root: Path) -> str | None:
    """Rank 0, before a resume: download the mirror's newest sharded checkpoint into ``root`` when
    no local one is as new (by save order), falling back to older copies that fail verification.
    Returns the name fetched, or None. Never raises: an unreachable or corrupt mirror is warned
    about and the local folder decides (the loader refuses or starts fresh by its own rules)."""
    try:
        remote = {n: m for n, m in mirror.list().items() if m.get("format") == DCP_FORMAT}
    except Exception as e:  # noqa: BLE001 - an unreachable mirror must not stop a local resume
        warnings.warn(f"cannot list mirror {mirror.url}: {e!r}; resuming from the local folder only", RuntimeWarning)
        return None
    local = newest_first(Path(root), DCP_FORMAT)[0]
    newest_local = max((seq for seq, _, _ in local), default=-1)
    local_names = {name for _, name, _ in local}
    for seq, name in sorted(((m.get("seq", 0), n) for n, m in remote.items()), reverse=True):
        if seq <= newest_local or name in local_names:
            return None
        try:
            mirror.download(name, root)
            return name
        except FileExistsError:  # a leftover under that name that does not verify: leave it to the loader
            return None
        except CheckpointError as e:
            warnings.warn(f"mirror copy {mirror.url}/{name} cannot be used ({e}); trying an older one",
                          RuntimeWarning)
    return None
