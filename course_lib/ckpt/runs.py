"""A run folder's checkpoints, whatever wrote them: find, describe, verify, and read the weights.

A run folder is what ``course train --out RUN`` fills: ``RUN/config.json`` (the validated trainer
config, which fixes the model's shape) and ``RUN/checkpoints/step_*`` in one of three formats
(``docs/CHECKPOINTS.md``): full (one ``model.safetensors``, dense names even for tp/pp layouts),
sharded DCP (every rank's shards), DeepSpeed (ZeRO 0-3 partitions). :func:`full_weights` turns any
of them into one plain ``{name: tensor}`` state dict of the run's TinyGPT, with the converters the
kit already has (``consolidate_sharded``: torch DCP's planner; ``deepspeed_to_state_dict``:
DeepSpeed's ``zero_to_fp32``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from course_lib.checkpoint import io as cio
from course_lib.checkpoint.io import CheckpointCorruptError, CheckpointError, CheckpointLoadError
from course_lib.parallel.resume_guard import FORMATS, MANIFEST_FORMAT

FULL, SHARDED, DEEPSPEED = MANIFEST_FORMAT["full"], MANIFEST_FORMAT["sharded"], MANIFEST_FORMAT["deepspeed"]


class CkptError(ValueError):
    """Bad input to ``course ckpt``: the message names the path, step or flag (exit code 2)."""


@dataclass
class Found:
    """One checkpoint folder: its name, path and manifest (None when the manifest is unreadable:
    damaged, ``why_unreadable`` says why; or the storage refused to read it, ``io_error`` says
    why - permissions, EIO - which is not damage: a resume refuses it instead of passing it over)."""

    name: str
    path: Path
    manifest: dict | None
    why_unreadable: str = ""
    io_error: str = ""

    @property
    def format(self) -> str:
        return self.manifest["format"] if self.manifest else "?"

    @property
    def step(self) -> int | None:
        return self.manifest.get("step") if self.manifest else None

    @property
    def order(self) -> tuple:
        """Newest last: the save sequence (the manifest's ``seq``, one order for every format of a
        folder), as a resume orders them; never the wall clock, which can step back (another node's
        clock). The save time and the name break ties (only folders written before the sequence
        was shared, or copied together by hand, have any)."""
        m = self.manifest or {}
        seq = m.get("seq", 0)
        return (seq if isinstance(seq, int) else 0, m.get("created_unix") or 0.0, self.name)


def checkpoint_root(run: str | Path) -> Path:
    """``RUN/checkpoints`` (or RUN itself when it directly holds ``step_*`` folders). CkptError
    naming RUN when it holds no checkpoint folder at all."""
    run = Path(run)
    if not run.is_dir():
        raise CkptError(f"{run}: no such run folder")
    for root in (run / "checkpoints", run):
        if cio.list_checkpoint_dirs(root):
            return root
    raise CkptError(f"{run}: no checkpoint (no step_* folder in {run / 'checkpoints'} or in {run})")


def run_config(root: Path) -> dict:
    """The trainer config of the run that owns ``root`` (its ``config.json``, one folder up when
    ``root`` is ``RUN/checkpoints``). CkptError when there is none: the model's shape is unknown."""
    for folder in (root.parent, root) if root.name == "checkpoints" else (root,):
        if (folder / "config.json").is_file():
            try:
                return json.loads((folder / "config.json").read_text())
            except ValueError as e:
                raise CkptError(f"{folder / 'config.json'}: not JSON ({e})") from None
    raise CkptError(f"{root}: no config.json beside the checkpoints (the run's trainer config fixes the model's "
                    f"shape; `course train --out RUN` writes RUN/config.json)")


def model_config(cfg: dict):
    """The ModelConfig the run trained (``trainer.config.build_model_config``)."""
    from course_lib.trainer.config import ConfigError, build_model_config

    try:
        return build_model_config(cfg)
    except (ConfigError, KeyError) as e:
        raise CkptError(f"the run's config.json does not describe a model: {e}") from None


def find_all(root: Path) -> list[Found]:
    """Every checkpoint folder under ``root``, oldest first (see :attr:`Found.order`)."""
    out = []
    for path in cio.list_checkpoint_dirs(root):
        try:
            out.append(Found(path.name, path, cio.read_manifest(path, expected_format=None)))
        except CheckpointLoadError as e:  # the storage failed (permissions, EIO): not damage
            out.append(Found(path.name, path, None, str(e), io_error=str(e)))
        except CheckpointError as e:
            out.append(Found(path.name, path, None, str(e)))
    return sorted(out, key=lambda f: f.order)


def verify(found: Found) -> str | None:
    """None when ``found`` verifies the way its loader checks it (every file's sha256, plus what
    the format parses), else why not."""
    return check(found)[1] or None


def check(found: Found) -> tuple[str | None, str]:
    """``(kind, why)``: ``(None, "")`` when ``found`` verifies the way its loader checks it;
    ``("corrupt", why)`` when its bytes fail (a resume moves it aside and falls back past it);
    ``("unreadable", why)`` when the storage refused to read it (permissions, EIO: a resume stops
    there, ``docs/CHECKPOINTS.md`` rule 2, and so does ``course ckpt``)."""
    if found.io_error:
        return "unreadable", found.io_error
    if found.manifest is None:
        return "corrupt", found.why_unreadable
    try:
        _verify_format(found)
    except CheckpointLoadError as e:
        return "unreadable", str(e)
    except CheckpointError as e:
        return "corrupt", str(e)
    return None, ""


def _verify_format(found: Found) -> None:
    """Raise the loader's CheckpointError when ``found`` (a readable manifest) does not verify."""
    if found.format == FULL:
        cio.verify_dir(found.path)
    elif found.format == SHARDED:
        from course_lib.checkpoint.dcp import verify_sharded

        verify_sharded(found.path, found.manifest)
    elif found.format == DEEPSPEED:
        from course_lib.parallel.deepspeed.checkpoints import verify_deepspeed

        verify_deepspeed(found.path, found.manifest)
    else:
        raise CheckpointCorruptError(f"unknown format {found.format!r}")


def pick(root: Path, step: int | None,
         skipped: list[tuple[str, str]] | None = None) -> tuple[Found, tuple[dict, dict] | None]:
    """The checkpoint to read: the newest one (by save sequence) saved at ``step`` (None: the newest
    of all) that verifies, as ``(found, decoded)``. A full checkpoint is verified by reading it
    (:func:`read_full`: every file's sha256 checked on the bytes that are then decoded), so
    ``decoded`` is its ``(model tensors, train_state)`` and nothing reads it twice; for the other
    formats ``decoded`` is None.

    A newer checkpoint whose bytes fail verification is passed over, as a resume passes over it:
    each one is appended to ``skipped`` as ``(name, why)`` for the caller to report. One the storage
    refuses to read (permissions, EIO) is not damage and is never passed over (``--resume auto``
    refuses it too): CkptError naming it. CkptError naming the step (and the steps there are),
    or every reason none verifies."""
    found = find_all(root)
    if step is not None:
        steps = sorted({f.step for f in found if f.step is not None})
        found = [f for f in found if f.step == step]
        if not found:
            raise CkptError(f"{root}: no checkpoint of step {step}; steps saved: {', '.join(map(str, steps)) or 'none'}")
    failures = []
    for f in reversed(found):
        if f.format == FULL and f.manifest is not None:
            try:
                return f, read_full(f)
            except _Corrupt as e:
                kind, why = "corrupt", str(e)
            except CheckpointLoadError as e:
                kind, why = "unreadable", str(e)
        else:
            kind, why = check(f)
            if kind is None:
                return f, None
        why = why.removeprefix(f"{f.path}: ")
        if kind == "unreadable":
            passed = f"; newer ones passed over as damaged: {', '.join(n for n, _ in failures)}" if failures else ""
            raise CkptError(f"{f.path}: cannot be read ({why}). That is the storage (permissions, an I/O error), "
                            f"not a damaged checkpoint, so it is not passed over for an older one (--resume auto "
                            f"refuses it too): fix the cause and retry, or name an older checkpoint with --step"
                            f"{passed}")
        failures.append((f.name, why))
        if skipped is not None:
            skipped.append((f.name, why))
    raise CkptError(f"{root}: no checkpoint{'' if step is None else f' of step {step}'} verifies:\n  "
                    + "\n  ".join(f"{n}: {w}" for n, w in failures))


class _Corrupt(CkptError):
    """:func:`read_full`'s error for damaged bytes (a read error stays a CheckpointLoadError)."""


def read_full(found: Found) -> tuple[dict, dict]:
    """``(model tensors, train_state)`` of a full-format checkpoint, read and verified once (every
    file's sha256). CkptError naming the folder when it does not verify; CheckpointLoadError when
    the storage refuses to read it (not damage: :func:`pick` stops there)."""
    try:
        manifest, data = cio.read_verified(found.path)
        return cio.decode(manifest, data)
    except CheckpointLoadError:
        raise
    except CheckpointError as e:
        raise _Corrupt(f"{found.path}: {e}") from None


def full_weights(found: Found, mcfg: Any, decoded: tuple[dict, dict] | None = None, *,
                 trust_pickles: bool = False) -> dict:
    """``{name: CPU tensor}`` of the whole TinyGPT ``mcfg`` from checkpoint ``found`` (any format,
    any world size; verified by :func:`pick`). The tied head appears under both names, as in
    ``TinyGPT.state_dict()``. ``decoded``: a full checkpoint's :func:`read_full`, as :func:`pick`
    returns it (required for that format: the files are read once). ``trust_pickles``: DeepSpeed's
    ``.pt`` files are unpickled in full instead of with ``weights_only=True`` and the few classes
    DeepSpeed needs (``deepspeed_to_state_dict``); only for checkpoints the user wrote. CkptError
    when the tensors do not fit the model (naming both shapes), or a DeepSpeed file asks to unpickle
    anything else without ``trust_pickles``."""
    from course_lib.model.hf_map import shape_mismatches, tinygpt_shapes

    try:
        if found.format == FULL:
            if decoded is None:
                raise ValueError(f"{found.path}: a full checkpoint's decoded read is required (pick returns it)")
            state = dict(decoded[0])
        elif found.format == SHARDED:
            from course_lib.checkpoint.dcp import consolidate_sharded

            state = consolidate_sharded(found.path)
        else:
            from course_lib.parallel.deepspeed.checkpoints import deepspeed_to_state_dict

            state = deepspeed_to_state_dict(found.path, trust_pickles=trust_pickles)
    except CheckpointError as e:
        raise CkptError(f"{found.path}: {e}") from None
    want = tinygpt_shapes(mcfg)
    if mcfg.tie_embeddings and "lm_head.weight" not in state and "tok_emb.weight" in state:
        state["lm_head.weight"] = state["tok_emb.weight"]  # one matrix: some savers keep one name
    problems = shape_mismatches({k: tuple(v.shape) for k, v in state.items()}, want, f"checkpoint {found.name}")
    if problems:
        raise CkptError(f"{found.path} does not hold the model in the run's config.json: " + "; ".join(problems))
    return {k: state[k] for k in want}


def format_name(fmt: str) -> str:
    """The kit's short name of a manifest format ("full", "sharded (DCP)", "deepspeed")."""
    return FORMATS.get(fmt, (fmt, ""))[0]
