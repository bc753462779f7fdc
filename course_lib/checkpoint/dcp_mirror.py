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

Pruning: rank 0 never deletes a local folder the mirror is still uploading (``CheckpointMirror.busy``,
passed as ``busy`` to the save); it goes at a later save or at ``close``.

Resuming: rank 0 chooses across the local folder and the mirror by the rules full checkpoints
follow (:func:`course_lib.checkpoint.tiers.choose`, called by
:func:`course_lib.checkpoint.dcp.load_sharded`): a mirror copy newer than every local one, or the
mirror's copy of a corrupt local one, is downloaded (verified file by file) under its own name and
kind, and DCP loads it on the same or another world size (DCP reshards).
"""
from __future__ import annotations

from typing import Callable

from .dcp import DCP_FORMAT


def mirror_keep(keep_last: int) -> Callable[[dict], set[str]]:
    """The mirror's retention rule, applied to its own ``{name: manifest}`` listing after each
    upload: the ``keep_last`` newest sharded checkpoints by save order, and every checkpoint of
    another kind (not this run's to prune). Its own listing, not the local set: after a resume
    from the mirror the local folder holds fewer checkpoints than the mirror should keep."""
    def keep(remote: dict[str, dict]) -> set[str]:
        mine = sorted((m.get("seq", 0), n) for n, m in remote.items() if m.get("format") == DCP_FORMAT)
        return {n for _, n in mine[-keep_last:]} | {n for n, m in remote.items() if m.get("format") != DCP_FORMAT}
    return keep
