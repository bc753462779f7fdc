"""Which checkpoint a resume loads, from the local folder or the mirror: the loading rules of
``docs/CHECKPOINTS.md`` in one place, for every format.

:class:`~course_lib.checkpoint.CheckpointManager` (full checkpoints), :func:`course_lib.checkpoint.dcp.load_sharded`
(sharded, DCP) and the DeepSpeed loader (no mirror) all choose through :func:`choose`:

* newest first by save order (the manifest's ``seq``); for the same checkpoint the local copy
  first, the mirror's if the local one is corrupt (rule 1);
* a copy that fails verification is corrupt: a warning, moved aside as ``.corrupt-*`` by the
  writer (never loaded again, never counted by retention), and the next copy is tried;
* anything else (an I/O error, a checkpoint that does not fit) stops the choice: no older
  checkpoint is used (rule 2);
* checkpoints exist but none loads, or only quarantined ones are left: a refusal (rule 4); no
  local checkpoint and a mirror that cannot be listed (unreachable, or a root that does not
  exist): a refusal too, "cannot tell whether this is a fresh start";
* None only when neither tier holds anything (rule 5).

:func:`check_fresh_mirror` is the other half: a run that does not resume must not upload over a
mirror that already holds checkpoints (those of the run folder it mirrors).
"""
from __future__ import annotations

import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import io as cio
from .io import CheckpointCorruptError, CheckpointError, CheckpointLoadError
from .mirror import MirrorRootMissing


@dataclass(frozen=True)
class Chosen:
    """The checkpoint :func:`choose` settled on: its ``name``, local ``path`` (a mirror copy is
    downloaded there first), ``source`` ("local" or "mirror"), ``seq`` and what ``verify`` returned."""

    name: str
    path: Path
    source: str
    seq: int
    value: Any


def list_mirror(mirror: Any, format: str) -> tuple[dict[str, dict], BaseException | None]:
    """``({name: manifest}`` of ``format`` on ``mirror``, the listing error or None``)``; a listing
    that fails (network, a missing root) is warned about and reported, never taken for empty."""
    if mirror is None:
        return {}, None
    try:
        return {n: m for n, m in mirror.list().items() if m.get("format") == format}, None
    except Exception as e:  # noqa: BLE001 - the caller decides: a local resume may go on
        warnings.warn(f"cannot list mirror {mirror.url}: {e!r}", RuntimeWarning, stacklevel=3)
        return {}, e


def quarantine(path: Path) -> None:
    """Move a corrupt checkpoint aside as ``.corrupt-<name>-<random>``: kept for forensics, never
    loaded, never counted by retention (only the writer calls this)."""
    if Path(path).is_dir():
        os.rename(path, Path(path).with_name(f".corrupt-{Path(path).name}-{uuid.uuid4().hex[:6]}"))


def choose(root: str | Path, format: str, verify: Callable[[Path, dict | None], Any], *, what: str = "checkpoint",
           mirror: Any = None, writer: bool = True, only: str | None = None) -> Chosen | None:
    """Rank 0's (or one process's) choice of the checkpoint of ``format`` to load from ``root`` and
    ``mirror`` (a :class:`~course_lib.checkpoint.mirror.CheckpointMirror` or None), by the rules of
    the module docstring. ``verify(path, manifest or None)`` checks a local copy and returns what
    the caller needs (raising CheckpointCorruptError for damage, CheckpointLoadError for anything
    that must stop the resume). ``writer``: may move corrupt copies aside and download; ``only``:
    that name or a CheckpointLoadError, never a fall-back. Returns None when there is nothing at
    all; raises CheckpointLoadError otherwise."""
    root = Path(root)
    local, damaged = cio.scan(root, format)
    remote, mirror_error = list_mirror(mirror, format)
    if only is not None:
        local = {n: m for n, m in local.items() if n == only}
        remote = {n: m for n, m in remote.items() if n == only}
        damaged = {n: r for n, r in damaged.items() if n == only}
    failures: list[tuple[str, str]] = []

    def corrupt(path: Path, name: str, source: str, reason: str) -> None:
        warnings.warn(f"{what} {name} is unusable ({source} copy): {reason}; falling back to the previous one",
                      RuntimeWarning, stacklevel=4)
        failures.append((name, f"{source}: {reason}"))
        if writer and path.parent == root:  # a local (or downloaded) copy; the mirror's stays as it is
            quarantine(path)

    for name, reason in sorted(damaged.items(), reverse=True):
        corrupt(root / name, name, "local", f"no readable manifest ({reason})")
    # Newest first; for the same checkpoint the local copy first, the mirror's if that fails.
    order = sorted([(m.get("seq", 0), n, "local") for n, m in local.items()] +
                   [(m.get("seq", 0), n, "mirror") for n, m in remote.items()],
                   key=lambda e: (-e[0], e[1], e[2] != "local"))
    for seq, name, source in order:
        path = root / name
        try:
            if source == "mirror":
                if not writer:
                    raise CheckpointLoadError(
                        f"{what} {name}: no usable local copy, only the mirror's, and a reader (writer=False) "
                        f"does not download; load it on the writer first (it downloads it), then pass "
                        f"only={name!r}", [(name, "only on the mirror")])
                if path.exists():  # a local copy we could not use is still in the way
                    raise CheckpointLoadError(f"{what} {name}: the local copy is corrupt but could not be moved "
                                              f"aside, so the mirror copy cannot be fetched",
                                              [(name, "local copy in the way")])
                try:
                    path = mirror.download(name, root)
                except CheckpointCorruptError as e:  # the copy on the mirror is damaged: nothing was written
                    corrupt(Path(mirror.url) / name, name, source, str(e))
                    continue
            value = verify(path, local.get(name) if source == "local" else None)
        except CheckpointCorruptError as e:  # damaged bytes: move aside, try the previous one
            corrupt(path, name, source, str(e))
            continue
        except CheckpointLoadError as e:
            raise CheckpointLoadError(f"cannot load {what} {name} ({source}): {e}. It was not moved aside and no "
                                      f"older checkpoint was used: fix the cause and retry",
                                      failures + [(name, str(e))]) from e
        except Exception as e:  # I/O, network, a bug: not the checkpoint's fault
            raise CheckpointLoadError(f"cannot load {what} {name} ({source}): {e!r}. It was not moved aside and "
                                      f"no older checkpoint was used: fix the cause and retry",
                                      failures + [(name, repr(e))]) from e
        return Chosen(name, path, source, seq, value)
    if only is not None:
        if failures:
            raise CheckpointLoadError(f"{what} {only} under {root} cannot be loaded: "
                                      + "; ".join(f"{n}: {r}" for n, r in failures), failures)
        raise CheckpointLoadError(f"{what} {only} not found under {root}"
                                  + (f" or on the mirror {mirror.url}" if mirror is not None else ""),
                                  [(only, "not found")])
    if failures or cio.quarantined(root):
        if not failures:
            warnings.warn(f"{root} holds only quarantined checkpoints: {cio.quarantined(root)}",
                          RuntimeWarning, stacklevel=3)
        raise cio.refusal(root, failures, what=what)
    if mirror_error is not None:
        raise CheckpointLoadError(f"no local {what} under {root}, and the mirror {mirror.url} cannot be listed "
                                  f"({mirror_error!r}): cannot tell whether this is a fresh start. Fix the mirror "
                                  f"or configure none to start over", [("mirror", repr(mirror_error))])
    return None


def check_fresh_mirror(mirror: Any) -> None:
    """Before a run that does not resume writes anything: CheckpointError when ``mirror`` already
    holds checkpoints (its uploads would replace them under the same step names) or cannot be
    listed (we cannot tell). A ``file://`` root that does not exist is created, its parent must
    exist: a fresh run starts the mirror, but never builds a path inside an unmounted share."""
    if mirror is None:
        return
    try:
        held = mirror.list()
    except MirrorRootMissing:
        mirror.create_root()
        return
    except Exception as e:  # noqa: BLE001 - unreachable: cannot tell what it holds
        raise CheckpointError(f"checkpoint.mirror {mirror.url} cannot be listed ({e!r}): a run that does not "
                              f"resume must know the mirror holds no checkpoints it would overwrite. Fix the "
                              f"mirror, or set checkpoint.mirror = '' to run without one") from e
    if held:
        names = ", ".join(sorted(held)[-5:])
        raise CheckpointError(f"checkpoint.mirror {mirror.url} already holds {len(held)} checkpoint(s) ({names}): "
                              f"a run that does not resume would overwrite them. Resume with --resume auto, or "
                              f"point checkpoint.mirror at an empty location (or clear it) to start over")

