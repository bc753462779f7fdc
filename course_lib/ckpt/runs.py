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
from course_lib.checkpoint.io import CheckpointError
from course_lib.parallel.resume_guard import FORMATS, MANIFEST_FORMAT

FULL, SHARDED, DEEPSPEED = MANIFEST_FORMAT["full"], MANIFEST_FORMAT["sharded"], MANIFEST_FORMAT["deepspeed"]


class CkptError(ValueError):
    """Bad input to ``course ckpt``: the message names the path, step or flag (exit code 2)."""


@dataclass
class Found:
    """One checkpoint folder: its name, path and manifest (None when the manifest is unreadable)."""

    name: str
    path: Path
    manifest: dict | None
    why_unreadable: str = ""

    @property
    def format(self) -> str:
        return self.manifest["format"] if self.manifest else "?"

    @property
    def step(self) -> int | None:
        return self.manifest.get("step") if self.manifest else None

    @property
    def order(self) -> tuple:
        """Newest last: save time (Unix s), then save sequence (formats count seq separately)."""
        m = self.manifest or {}
        return (m.get("created_unix") or 0.0, m.get("seq", 0), self.name)


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
        except CheckpointError as e:
            out.append(Found(path.name, path, None, str(e)))
    return sorted(out, key=lambda f: f.order)


def verify(found: Found) -> str | None:
    """None when ``found`` verifies the way its loader checks it (every file's sha256, plus what
    the format parses), else why not."""
    if found.manifest is None:
        return found.why_unreadable
    try:
        if found.format == FULL:
            cio.verify_dir(found.path)
        elif found.format == SHARDED:
            from course_lib.checkpoint.dcp import verify_sharded

            verify_sharded(found.path, found.manifest)
        elif found.format == DEEPSPEED:
            from course_lib.parallel.deepspeed.checkpoints import verify_deepspeed

            verify_deepspeed(found.path, found.manifest)
        else:
            return f"unknown format {found.format!r}"
    except CheckpointError as e:
        return str(e)
    return None


def pick(root: Path, step: int | None) -> tuple[Found, tuple[dict, dict] | None]:
    """The checkpoint to read: the newest one saved at ``step`` (None: the newest of all) that
    verifies, as ``(found, decoded)``. A full checkpoint is verified by reading it
    (:func:`read_full`: every file's sha256 checked on the bytes that are then decoded), so
    ``decoded`` is its ``(model tensors, train_state)`` and nothing reads it twice; for the other
    formats ``decoded`` is None. CkptError naming the step (and the steps there are), or every
    reason none verifies."""
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
            except CkptError as e:
                failures.append(f"{f.name}: {str(e).removeprefix(f'{f.path}: ')}")
                continue
        why = verify(f)
        if why is None:
            return f, None
        failures.append(f"{f.name}: {why}")
    raise CkptError(f"{root}: no checkpoint{'' if step is None else f' of step {step}'} verifies:\n  "
                    + "\n  ".join(failures))


def read_full(found: Found) -> tuple[dict, dict]:
    """``(model tensors, train_state)`` of a full-format checkpoint, read and verified once (every
    file's sha256). CkptError naming the folder when it does not verify."""
    try:
        manifest, data = cio.read_verified(found.path)
        return cio.decode(manifest, data)
    except CheckpointError as e:
        raise CkptError(f"{found.path}: {e}") from None


def full_weights(found: Found, mcfg: Any, decoded: tuple[dict, dict] | None = None) -> dict:
    """``{name: CPU tensor}`` of the whole TinyGPT ``mcfg`` from checkpoint ``found`` (any format,
    any world size; verified by :func:`pick`). The tied head appears under both names, as in
    ``TinyGPT.state_dict()``. ``decoded``: a full checkpoint's :func:`read_full`, as :func:`pick`
    returns it (required for that format: the files are read once). CkptError when the tensors do
    not fit the model (naming both shapes)."""
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

            state = deepspeed_to_state_dict(found.path)
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
