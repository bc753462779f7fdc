"""``--resume auto`` never starts over beside checkpoints it cannot read.

A run folder can hold checkpoints of another format than the one this run saves and loads: a ddp run
(full checkpoints) continued with ``train.strategy = "fsdp"`` (sharded, DCP), an fsdp run continued
with zero2, a DeepSpeed run continued with anything else. Each checkpointer lists only its own
format, so on its own it finds "nothing" and the run would start from step 0, rewrite
``metrics.jsonl`` and save a second ``step_*`` directory for every step.

:func:`resume` loads as before and then asks rank 0 to look at every checkpoint in the folder:

* none of this run's format, some of another: refused (ConfigError, exit 2) before the run writes
  anything, listing each checkpoint found (name, format, step, world size) and why it cannot be
  used. The kit has no converter that keeps a resume exact (only the weights convert:
  ``consolidate_sharded`` for DCP, ``deepspeed_to_state_dict`` for DeepSpeed; the optimizer state
  and data position would be lost), so it refuses rather than load half a state;
* one of this run's format was loaded, but a checkpoint of another format is *newer* (saved
  later: a higher save sequence ``seq``, which every format of a folder shares): refused too, since resuming the older one would silently drop the newer run's progress;
* older checkpoints of another format beside the loaded one (leftovers of an earlier run) are
  only warned about.

The run's ``checkpoint.mirror`` counts as much as its folder: after a lost disk the folder is empty
and the mirror holds the run, so its checkpoints of another format (listed by their manifests) are
judged by the same rules. A mirror that cannot be listed is left to the loaders (which refuse when
nothing local is left, and warn otherwise).

The verdict is broadcast, so every rank raises together (no rank left waiting in a collective).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

#: manifest format -> (the kit's name for it, which configurations write it)
FORMATS: dict[str, tuple[str, str]] = {
    "course_lib.checkpoint/1": ("full", "train.strategy = 'single', 'ddp', 'ddp-scratch', 'zero1', 'zero2', "
                                        "'fsdp-scratch', tp/pp layouts (checkpoint.format = 'full')"),
    "course_lib.checkpoint.dcp/1": ("sharded (DCP)", "train.strategy = 'fsdp' (checkpoint.format = 'sharded')"),
    "course_lib.checkpoint.deepspeed/1": ("deepspeed", "train.strategy = 'deepspeed' (same ZeRO stage and "
                                                       "world size)"),
}
#: manifest format -> the kit's weights-only converter (a plain state dict for a new run)
WEIGHTS_ONLY = {"course_lib.checkpoint.dcp/1": "course_lib.checkpoint.dcp.consolidate_sharded(path)",
                "course_lib.checkpoint.deepspeed/1": "course_lib.parallel.deepspeed.checkpoints."
                                                     "deepspeed_to_state_dict(path)"}
#: the checkpointer's ``format`` attribute -> the manifest format it writes
MANIFEST_FORMAT = {"full": "course_lib.checkpoint/1", "sharded": "course_lib.checkpoint.dcp/1",
                   "deepspeed": "course_lib.checkpoint.deepspeed/1"}


def _listing(root: Path) -> list[dict]:
    """Every checkpoint directory under ``root`` whose manifest reads: name, manifest format, step,
    save sequence (``seq``), world size, ZeRO stage, save time (Unix seconds). Unreadable ones are the loaders' business."""
    from course_lib.checkpoint import io as cio
    from course_lib.checkpoint.io import CheckpointError

    found = []
    for path in cio.list_checkpoint_dirs(Path(root)):
        try:
            m = cio.read_manifest(path, expected_format=None)
        except CheckpointError:
            continue
        found.append({"name": path.name, "format": m["format"], "step": m.get("step"), "seq": m.get("seq", 0),
                      "world_size": m.get("world_size"), "zero_stage": m.get("zero_stage"),
                      "created_unix": m.get("created_unix", 0.0)})
    return sorted(found, key=lambda c: c["name"])


def _mirror_listing(mirror: Any) -> list[dict]:
    """:func:`_listing` of a :class:`~course_lib.checkpoint.mirror.CheckpointMirror` (its complete
    uploads, by their manifests), each marked ``where`` = its URL; [] without a mirror or when it
    cannot be listed (the loader has already refused or warned)."""
    if mirror is None:
        return []
    try:
        held = mirror.list()
    except Exception:  # noqa: BLE001 - choose() already judged an unlistable mirror
        return []
    return sorted(({"name": n, "format": m.get("format"), "step": m.get("step"), "seq": m.get("seq", 0),
                    "world_size": m.get("world_size"), "zero_stage": m.get("zero_stage"),
                    "created_unix": m.get("created_unix", 0.0), "where": mirror.url}
                   for n, m in held.items()), key=lambda c: c["name"])


def _describe(c: dict) -> str:
    name, _ = FORMATS.get(c["format"], (f"unknown format {c['format']!r}", ""))
    extra = "".join([f", {c['world_size']} ranks" if c["world_size"] else "",
                     f", ZeRO-{c['zero_stage']}" if c["zero_stage"] is not None else "",
                     f", on the mirror {c['where']}" if c.get("where") else ""])
    return f"{c['name']}: {name}, step {c['step']}{extra}"


def _previous_strategy(root: Path) -> str | None:
    """``train.strategy`` of the run that last wrote the folder (its config.json), if readable."""
    try:
        return json.loads((Path(root).parent / "config.json").read_text())["train"]["strategy"]
    except Exception:  # noqa: BLE001 - a hint only; the listing says what matters
        return None


def verdict(root: str | Path, own_format: str, strategy: str, loaded: Any,
            mirror: Any = None) -> tuple[str, str] | None:
    """Rank 0's judgement of ``root`` (and of ``mirror``, the run's CheckpointMirror or None)
    after a resume attempt: None (fine), ``("warn", text)`` or ``("refuse", text)``.
    ``own_format``: the checkpointer's format ("full", "sharded", "deepspeed"); ``strategy``:
    ``train.strategy``; ``loaded``: the LoadResult, or None."""
    mine = MANIFEST_FORMAT.get(own_format, own_format)
    local = _listing(Path(root))
    here = {(c["name"], c["format"]) for c in local}  # a checkpoint on both tiers is listed once
    found = local + [c for c in _mirror_listing(mirror) if (c["name"], c["format"]) not in here]
    foreign = [c for c in found if c["format"] != mine]
    if not foreign:
        return None
    where = f"{root}" + (f" and the mirror {mirror.url}" if mirror is not None else "")
    own_name = FORMATS.get(mine, (own_format, ""))[0]
    kinds = sorted({c["format"] for c in foreign})
    lines = "\n".join(f"  - {_describe(c)}" for c in foreign)
    before = _previous_strategy(root)
    by = f" (the run in this folder used train.strategy = {before!r})" if before else ""
    weights = [WEIGHTS_ONLY[k] for k in kinds if k in WEIGHTS_ONLY]
    how = ("Resume with the configuration that wrote them" + by + ": "
           + "; ".join(f"{FORMATS[k][0]} checkpoints load with {FORMATS[k][1]}" for k in kinds if k in FORMATS)
           + f". train.strategy = {strategy!r} saves and loads {own_name} checkpoints only, and the kit has no "
             f"conversion into them that keeps the optimizer state and data position"
           + (f" (the weights alone convert, for a new run: {', '.join(weights)})" if weights else "")
           + ". To start over, use a fresh --out folder or move the checkpoints away"
           + (" (and point checkpoint.mirror at an empty location)." if mirror is not None else "."))
    if loaded is None:
        return "refuse", (f"--resume auto: {where} hold{'' if mirror is not None else 's'} no {own_name} "
                          f"checkpoint that train.strategy = "
                          f"{strategy!r} can resume from, only checkpoints of another format:\n{lines}\n"
                          f"Refusing to start from step 0 beside them (metrics.jsonl and the step folders"
                          f"{', on the mirror too,' if mirror is not None else ''} would be overwritten); nothing "
                          f"was written. {how}")
    if any(_saved_after(c, loaded.manifest or {}) for c in foreign):
        return "refuse", (f"--resume auto: {where} hold{'' if mirror is not None else 's'} checkpoints of "
                          f"another format saved after the "
                          f"{own_name} checkpoint {loaded.path.name} (step {loaded.step}) this run would resume "
                          f"from:\n{lines}\nResuming the older one would silently drop their progress; nothing "
                          f"was written. {how}")
    return "warn", (f"{where}: resumed from {loaded.path.name}; older checkpoints of another format lie beside "
                    f"it and are ignored:\n{lines}")


def _saved_after(c: dict, mine: dict) -> bool:
    """Whether checkpoint ``c`` (a listing entry) was saved after the manifest ``mine``: by the save
    sequence, which every format of a folder shares (``checkpoint.io.last_seq``), never by the wall
    clock (another node's, or one stepped back). Equal sequence numbers come only from folders
    written before the sequence was shared (or copied together by hand); the save times decide
    those."""
    theirs, own = c.get("seq") or 0, mine.get("seq") or 0
    if theirs != own:
        return theirs > own
    return (c.get("created_unix") or 0.0) > (mine.get("created_unix") or 0.0)


def resume(checkpoints: Any, state: Any, strategy_name: str) -> Any:
    """Collective: ``checkpoints.load(state)`` (the newest checkpoint of this run's format, or None),
    then rank 0's :func:`verdict` on the folder and the mirror, broadcast: ConfigError on every rank
    when they hold checkpoints this run cannot use in place of a resume. Returns the LoadResult."""
    from course_lib.checkpoint import CheckpointLoadError
    from course_lib.validate import ConfigError

    loaded = checkpoints.load(state)
    strategy = checkpoints.strategy
    root = getattr(checkpoints, "root", None) or checkpoints.manager.root
    # rank 0's mirror (ShardedCheckpoints.mirror, or the full tier's CheckpointManager.mirror)
    mirror = getattr(checkpoints, "mirror", None) or getattr(getattr(checkpoints, "manager", None), "mirror", None)
    judged = None
    if strategy.info.rank == 0:
        try:
            judged = verdict(root, checkpoints.format, strategy_name, loaded, mirror=mirror)
        except Exception as exc:  # noqa: BLE001 - the others wait for the verdict: tell them
            judged = ("error", f"cannot list the checkpoints under {root}: {type(exc).__name__}: {exc}")
    judged = strategy.broadcast_object(judged)
    if judged is None:
        return loaded
    kind, text = judged
    if kind == "refuse":
        raise ConfigError(text)
    if kind == "error":  # the storage, not the configuration
        raise CheckpointLoadError(text, [(str(root), text)])
    if strategy.is_writer:
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    return loaded
