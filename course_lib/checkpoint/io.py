"""On-disk format of a checkpoint, and the durable, atomic way to write and check one.

A checkpoint is a directory ``step_000000120`` (``step_000000120.g1`` when the same step is saved
again, e.g. after a rollback) holding:

* ``model.safetensors`` - the model weights (tied weights stored once, aliases in the manifest);
* ``train_state.pt`` - optimizer, scheduler, scaler, RNG, data position and other ``state_dict()``
  objects, read back with ``torch.load(weights_only=True)``: nothing is ever unpickled;
* ``manifest.json`` - written last: format, step, save sequence number, metrics, and the sha256 and
  size of every other file.

Atomicity: everything is written into ``.tmp-<name>-<pid>-<random>`` in the same parent, each file
is fsynced, then the directory, then it is renamed to its final name and the parent is fsynced.
A crash at any instant leaves either no final directory or a complete one. Names starting with a
dot are never checkpoints; :func:`cleanup_temp` removes the leftovers at the next start. The same
commit (:func:`commit_dir`) seals sharded checkpoints, whose files other ranks wrote.

Errors: :class:`CheckpointCorruptError` means the bytes on disk failed verification (the only case
in which a loader moves a checkpoint aside and falls back to an older one);
:class:`CheckpointLoadError` means a checkpoint exists but could not be restored for any other
reason, or that none of the existing ones could be: never a silent fresh start.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

FORMAT = "course_lib.checkpoint/1"
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
STATE = "train_state.pt"
NAME_RE = re.compile(r"^step_(\d{9})(?:\.g(\d+))?$")
TEMP_PREFIXES = (".tmp-", ".trash-", ".dl-")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or unloadable; the message names the path and the reason."""


class CheckpointCorruptError(CheckpointError):
    """Verification failed: missing or garbled manifest, a file missing, of the wrong size or
    sha256, or one that does not parse as the format says. The checkpoint is damaged; loaders
    move it aside and fall back to the previous one."""


class CheckpointLoadError(CheckpointError):
    """A resume that must not go on: a checkpoint exists but could not be restored (an I/O error,
    a model or optimizer that does not fit, a bug), or none of the existing ones could be.
    ``failures``: ``[(checkpoint name, reason)]``, newest first."""

    def __init__(self, message: str, failures: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.failures = list(failures or [])


def checkpoint_name(step: int, generation: int = 0) -> str:
    """Directory name of a checkpoint after ``step`` optimizer steps (generation > 0: a re-save)."""
    return f"step_{step:09d}" + (f".g{generation}" if generation else "")


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename or a new entry inside it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def split_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embeddings). Keep the first name of each
    shared storage, return ``(tensors, {alias: kept_name})``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model state entry {name!r} is a {type(t).__name__}, not a tensor; "
                            f"safetensors stores tensors only")
        if type(t) is not torch.Tensor and hasattr(t, "full_tensor"):
            raise TypeError(f"model state entry {name!r} is a DTensor: use the sharded path "
                            f"(course_lib.checkpoint.dcp.save_sharded) for FSDP/TP models")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.contiguous()
    return tensors, aliases


# ----------------------------------------------------------------------------- write / verify

def serialize(model_state: dict[str, torch.Tensor], train_state: dict[str, Any],
              aliases: dict[str, str] | None = None) -> tuple[dict[str, bytes], dict]:
    """Turn a CPU snapshot into file contents: ``({filename: bytes}, {"aliases": ...})``.
    ``aliases``: names already folded by :func:`split_shared` before the copy was taken."""
    from safetensors.torch import save as st_save
    tensors, found = split_shared(model_state)
    aliases = {**(aliases or {}), **found}
    files = {WEIGHTS: st_save(tensors)}
    buf = io.BytesIO()
    torch.save(train_state, buf)
    files[STATE] = buf.getvalue()
    return files, {"aliases": aliases}


def in_threads(jobs: dict[str, tuple], wait: bool = True) -> Any:
    """Run ``{key: (fn, *args)}`` in one thread each; ``{key: result}``, re-raising the first error.
    With ``wait=False`` returns a function that joins and returns that. Plain threads, not a
    ``ThreadPoolExecutor``: executors refuse work once the interpreter starts exiting, and an async
    save still finishing then must be able to complete."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(key: str, fn: Any, *args: Any) -> None:
        try:
            results[key] = fn(*args)
        except BaseException as e:  # handed to the joining thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k, *job)) for k, job in jobs.items()]
    for t in threads:
        t.start()

    def join() -> dict[str, Any]:
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return {k: results[k] for k in jobs}

    return join() if wait else join


def fresh_name(root: Path, step: int) -> str:
    """The checkpoint name for ``step`` not yet taken under ``root`` (``.g1``, ``.g2``... for a
    step saved again, e.g. after a rollback). Only the single writer calls this."""
    gen = 0
    while (Path(root) / checkpoint_name(step, gen)).exists():
        gen += 1
    return checkpoint_name(step, gen)


def new_temp_dir(root: Path, name: str) -> Path:
    """Create the private ``.tmp-<name>-<pid>-<random>`` directory a save of ``name`` writes into
    (same parent as the final name, so the commit is a rename within one filesystem)."""
    tmp = Path(root) / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _hash_and_fsync(path: Path) -> dict:
    with open(path, "rb+") as f:  # also fsync files a writer (DCP, another rank) did not fsync
        blob = f.read()
        os.fsync(f.fileno())
    return {"sha256": sha256_hex(blob), "bytes": len(blob)}


def commit_dir(tmp: Path, final: Path, manifest: dict, known: dict[str, dict] | None = None) -> Path:
    """The one commit of every checkpoint: every file in ``tmp`` is hashed and fsynced, then
    ``manifest.json`` (``manifest``, which must name its ``format``, plus ``files``: sha256 and
    size of each file) is written durably, ``tmp`` is fsynced, renamed to ``final`` (the commit
    point) and the parent is fsynced. ``known``: entries of files the caller already hashed and
    fsynced. On any failure ``tmp`` is removed and nothing appears under ``final``; raises
    FileExistsError if ``final`` exists."""
    tmp, final = Path(tmp), Path(final)
    try:
        if "format" not in manifest:
            raise ValueError("commit_dir: the manifest must name its format")
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists")
        entries = dict(known or {})
        todo = {}
        for p in sorted(tmp.iterdir()):
            if p.name == MANIFEST or p.name in entries:
                continue
            if not p.is_file() or p.is_symlink() or not safe_file_name(p.name):
                raise CheckpointError(f"{tmp}: {p.name!r} is not a plain file; a checkpoint holds files only")
            todo[p.name] = (_hash_and_fsync, p)
        entries.update(in_threads(todo))  # hashlib releases the GIL: large files hash in parallel
        full = dict(manifest, files=dict(sorted(entries.items())))
        write_durable(tmp / MANIFEST, json.dumps(full, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
        os.rename(tmp, final)  # the commit point
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_checkpoint_dir(root: Path, name: str, files: dict[str, bytes], manifest: dict,
                         format: str = FORMAT) -> Path:
    """Atomically create ``root/name`` holding ``files`` plus a manifest (``manifest`` + checksums,
    ``format``: :data:`FORMAT` unless a copy of another kind, e.g. a sharded one fetched from a
    mirror). Raises FileExistsError if ``root/name`` already exists (the caller picks a fresh name
    with :func:`fresh_name`)."""
    final = Path(root) / name
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    tmp = new_temp_dir(root, name)
    try:
        # hashlib releases the GIL on large buffers: hash in threads while the files are written.
        digests = in_threads({fname: (sha256_hex, data) for fname, data in files.items()}, wait=False)
        for fname, data in files.items():
            write_durable(tmp / fname, data)
        known = {fname: {"sha256": digest, "bytes": len(files[fname])} for fname, digest in digests().items()}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_dir(tmp, final, dict(manifest, format=format), known=known)


def safe_file_name(fname: str) -> bool:
    """A manifest entry must name a plain file inside the checkpoint (no path tricks)."""
    return bool(fname) and "/" not in fname and "\\" not in fname and fname not in (".", "..")


def read_manifest(path: Path, expected_format: str | None = FORMAT) -> dict:
    """Parse ``path/manifest.json``; raises CheckpointError when it is missing, not a manifest, or
    (unless ``expected_format`` is None) of another format (e.g. a sharded DCP checkpoint)."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: unreadable manifest ({e})") from None
    except OSError as e:  # EIO, EACCES...: the storage failed, not the checkpoint
        raise CheckpointLoadError(f"{path}: cannot read {MANIFEST} ({e})", [(path.name, str(e))]) from None
    if not isinstance(manifest, dict) or not str(manifest.get("format", "")).startswith("course_lib.checkpoint") \
            or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorruptError(f"{path}: {MANIFEST} is not a course_lib checkpoint manifest")
    if expected_format is not None and manifest["format"] != expected_format:
        raise CheckpointError(f"{path}: format {manifest['format']!r}, expected {expected_format!r}")
    return manifest


def manifest_unreadable(path: Path) -> bool:
    """A checkpoint-named directory whose manifest is missing or garbled (not merely of another
    format, such as a sharded checkpoint). Only damage makes one: names are committed by rename.
    Raises CheckpointLoadError when the storage fails to read it (that is not damage)."""
    try:
        read_manifest(path, expected_format=None)
        return False
    except CheckpointCorruptError:
        return True


def scan(root: Path, fmt: str) -> tuple[dict[str, dict], dict[str, str]]:
    """Checkpoint directories under ``root``: ``({name: manifest}`` of format ``fmt`` (unverified),
    ``{name: reason}`` of those whose manifest is missing or garbled``)``. Directories of another
    format (a sharded checkpoint next to plain ones) are in neither. Raises CheckpointLoadError
    when a manifest cannot be read for a reason other than damage."""
    good, damaged = {}, {}
    for p in list_checkpoint_dirs(root):
        try:
            manifest = read_manifest(p, expected_format=None)
        except CheckpointCorruptError as e:
            damaged[p.name] = str(e)
            continue
        if manifest["format"] == fmt:
            good[p.name] = manifest
    return good, damaged


def last_seq(root: Path) -> int:
    """The highest save sequence number (``seq``) among the checkpoints under ``root`` of *every*
    format (0 when there are none). A new checkpoint takes ``last_seq + 1`` whatever its format,
    so the manifest's ``seq`` orders every checkpoint of a folder: a resume, ``course ckpt`` and
    the other-format check all go by it, never by the wall clock (which can step back). Manifests
    that cannot be read count as 0: they are the loaders' business."""
    seqs = [0]
    for p in list_checkpoint_dirs(Path(root)):
        try:
            seq = read_manifest(p, expected_format=None).get("seq", 0)
        except CheckpointError:
            continue
        seqs.append(seq if isinstance(seq, int) else 0)
    return max(seqs)


def quarantined(root: Path) -> list[str]:
    """Names of checkpoints moved aside as corrupt (``.corrupt-*``) under ``root``."""
    if not Path(root).is_dir():
        return []
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".corrupt-"))


def refusal(root: Path, failures: list[tuple[str, str]], what: str = "checkpoint") -> CheckpointLoadError:
    """The error for a root that holds checkpoints (or quarantined ones) but none that loads:
    lists each and why, and says what to do. Resuming must never quietly start from step 0."""
    aside = quarantined(root)
    if failures:
        lines = "\n".join(f"  - {name}: {reason}" for name, reason in failures)
        earlier = f"Moved aside as corrupt (by this attempt or an earlier one): {', '.join(aside)}.\n" if aside else ""
        msg = (f"no {what} under {root} could be loaded; every one failed verification:\n{lines}\n{earlier}"
               f"They were moved aside as .corrupt-* where this process is the writer. Restore a good "
               f"copy (e.g. from the mirror or a backup) to resume, or move them away / use a fresh "
               f"output folder to start over.")
    else:
        msg = (f"{root} holds no loadable {what}, only ones quarantined as corrupt by an earlier attempt "
               f"({', '.join(aside)}); refusing to start from step 0 silently. Restore a good copy to "
               f"resume, or move the .corrupt-* directories away or use a fresh output folder to start over.")
    return CheckpointLoadError(msg, failures)


def read_verified(path: Path, manifest: dict | None = None) -> tuple[dict, dict[str, bytes]]:
    """Read every file listed in the manifest and check size and sha256. Returns
    ``(manifest, {filename: bytes})``; raises CheckpointError naming the first mismatch."""
    manifest = manifest or read_manifest(path, expected_format=None)
    for fname, meta in manifest["files"].items():
        if not safe_file_name(fname) or not isinstance(meta, dict):
            raise CheckpointCorruptError(f"{path}: manifest lists an unsafe file name or entry {fname!r}")

    def one(fname: str, meta: dict) -> bytes:
        try:
            blob = (path / fname).read_bytes()
        except (FileNotFoundError, IsADirectoryError) as e:
            raise CheckpointCorruptError(f"{path}: {fname} is missing ({e})") from None
        except OSError as e:  # the storage failed; the checkpoint may well be fine
            raise CheckpointLoadError(f"{path}: cannot read {fname} ({e})", [(path.name, str(e))]) from None
        if len(blob) != meta.get("bytes") or sha256_hex(blob) != meta.get("sha256"):
            raise CheckpointCorruptError(f"{path}: {fname} does not match its checksum (corrupt or truncated)")
        return blob

    return manifest, in_threads({f: (one, f, meta) for f, meta in manifest["files"].items()})


def decode(manifest: dict, data: dict[str, bytes]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Deserialize verified bytes into CPU objects: ``(model_state, train_state)``. Only
    safetensors and ``torch.load(weights_only=True)`` are used, so a forged file cannot run code.
    Anything that does not parse as the format says raises CheckpointCorruptError."""
    from safetensors.torch import load as st_load
    try:
        tensors = st_load(data[WEIGHTS]) if WEIGHTS in data else {}
        aliases = manifest.get("aliases", {})
        if not isinstance(aliases, dict):
            raise ValueError("the manifest's aliases are not a mapping")
        for alias, kept in aliases.items():
            if kept not in tensors:
                raise ValueError(f"alias {alias!r} points at {kept!r}, which is not stored")
            tensors[alias] = tensors[kept]
        train_state = torch.load(io.BytesIO(data[STATE]), map_location="cpu", weights_only=True) \
            if STATE in data else {}
        if not isinstance(train_state, dict):
            raise ValueError(f"{STATE} holds a {type(train_state).__name__}, not a dict")
    except MemoryError:
        raise
    except Exception as e:  # verified bytes that do not parse (or a forged file weights_only refused)
        raise CheckpointCorruptError(f"checksums match but the state does not parse: {e}") from e
    return tensors, train_state


def verify_dir(path: Path, deep: bool = True) -> dict:
    """Check a checkpoint directory: every file re-read and its checksum compared; with ``deep``
    also that both files parse the way :func:`decode` will read them (the safetensors header and
    every alias; the ``weights_only`` unpickling of the train state, memory-mapped so no tensor
    data is copied). Returns the manifest; raises CheckpointError otherwise."""
    manifest, data = read_verified(path)
    del data  # the bytes matched; parse from the file without holding a second copy
    if deep and WEIGHTS in manifest["files"]:
        from safetensors import safe_open
        try:
            with safe_open(str(path / WEIGHTS), framework="pt") as f:
                names = set(f.keys())
            missing = [a for a, kept in manifest.get("aliases", {}).items() if kept not in names]
            if missing:
                raise CheckpointCorruptError(f"aliases {missing} point at tensors that are not stored")
            torch.load(path / STATE, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # a state that cannot be loaded must not count as a checkpoint
            raise CheckpointCorruptError(f"{path}: checksums match but the state does not load: {e}") from e
    return manifest


def list_checkpoint_dirs(root: Path) -> list[Path]:
    """Directories under ``root`` whose names are checkpoint names (temp dirs never match)."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if NAME_RE.match(p.name) and p.is_dir()]


def cleanup_temp(root: Path) -> list[str]:
    """Remove leftovers of interrupted saves, prunes and downloads (``.tmp-*``, ``.trash-*``,
    ``.dl-*``) under ``root``; returns their names. Call only from the single writer process."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TEMP_PREFIXES):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p.name)
    return removed


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted one under its real name:
    rename to ``.trash-*`` first (atomic), then delete."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)
