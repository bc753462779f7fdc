"""Second checkpoint tier: copy verified checkpoints in the background to any fsspec URL.

The usual advice, "local NVMe, then async copy to shared storage" and "cloud storage as secondary
backup": a lost node or disk must not lose the run. Works with any fsspec filesystem - ``file://``
(NFS, a second disk), ``s3://`` (with ``s3fs``; tested against a real S3 server on loopback),
``gs://``, ``memory://``...

Object stores have no atomic directory rename, so the commit point is the manifest: data files are
uploaded first, read back and compared with the local sha256s, and only then ``manifest.json`` is
written. A remote directory without a manifest (an interrupted upload) is never used and is deleted
by the next prune. Deleting goes the other way round: manifest first.

A ``file://`` root that does not exist (or is a file) is an error everywhere - listing, upload -
never an empty mirror: only a new run creates it (:meth:`CheckpointMirror.create_root`, under an
existing parent), so an unmounted share is never silently replaced by a fresh folder.
"""
from __future__ import annotations

import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Union

from course_lib.validate import check_bool, check_int, check_number

from .io import (FORMAT, MANIFEST, NAME_RE, CheckpointCorruptError, CheckpointError, read_manifest, safe_file_name,
                 sha256_hex, write_checkpoint_dir)


class MirrorRootMissing(CheckpointError):
    """The mirror's root does not exist (a ``file://`` folder that is not there - an unmounted
    share - or an object store's bucket): an error, never an empty mirror, since a resume that took
    it for one would start from step 0 beside the real checkpoints."""


#: what a prune keeps: names, or a function of the mirror's ``{name: manifest}`` listing giving them
Keep = Union[Iterable[str], Callable[[dict], Iterable[str]], None]


class CheckpointMirror:
    """Mirror of a local checkpoint root at ``url`` (fsspec URL; ``storage_options`` go to the
    filesystem, e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``).

    ``retries``: extra attempts per upload after a failure (>= 0); ``backoff_s``: first wait between
    attempts in seconds, doubled each time; ``on_failure(attempt, exc)``: called after each failed
    attempt (logging, labs). An upload that still fails is recorded in ``failures`` and warned
    about; training goes on, since the local tier still holds the checkpoint.

    ``skip_superseded``: when uploads are slower than saves, a queued upload is skipped (listed in
    ``skipped``) once a newer checkpoint is queued behind it, so the mirror never falls ever further
    behind. Names queued or uploading are in :meth:`busy`; the manager does not prune those."""

    def __init__(self, url: str, *, retries: int = 3, backoff_s: float = 0.5,
                 storage_options: dict | None = None, skip_superseded: bool = True,
                 on_failure: Callable[[int, BaseException], None] | None = None):
        import fsspec
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty fsspec URL like 'file:///mnt/ckpt' or 's3://bucket/run', got {url!r}")
        check_int("retries", retries, 0)
        check_number("backoff_s (seconds)", backoff_s, 0)
        check_bool("skip_superseded", skip_superseded)
        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.retries, self.backoff_s, self.on_failure = retries, float(backoff_s), on_failure
        self.skip_superseded = skip_superseded
        self.failures: list[tuple[str, str]] = []  # (checkpoint name, last error)
        self.uploaded: list[str] = []
        self.skipped: list[str] = []
        self._pending: list[str] = []  # submitted, not finished; guarded by _lock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _p(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # ------------------------------------------------------------------ upload
    def submit(self, local_dir: str | Path, keep: Keep = None) -> None:
        """Upload ``local_dir`` in the background (after any earlier upload finishes, so uploads
        land in order), then delete remote checkpoints whose names are not in ``keep`` (names, or
        a function of the mirror's own ``{name: manifest}`` listing that returns them)."""
        prev, name = self._thread, Path(local_dir).name
        keep = keep if keep is None or callable(keep) else set(keep)
        with self._lock:
            self._pending.append(name)

        def job() -> None:
            try:
                if prev is not None:
                    prev.join()
                with self._lock:
                    superseded = self.skip_superseded and self._pending[-1] != name
                if superseded:
                    self.skipped.append(name)
                else:
                    self.upload(local_dir, keep)
            finally:
                with self._lock:
                    self._pending.remove(name)

        # Not a daemon: the interpreter waits for an upload in progress at exit.
        self._thread = threading.Thread(target=job, name=f"ckpt-mirror-{Path(local_dir).name}")
        self._thread.start()

    def upload(self, local_dir: str | Path, keep: Keep = None) -> bool:
        """Upload one verified local checkpoint now, with retries; then prune to ``keep`` (see
        :meth:`submit`). Returns True on success; on final failure records it, warns and returns False."""
        local_dir = Path(local_dir)
        for attempt in range(self.retries + 1):
            try:
                self._upload_once(local_dir)
                break
            except Exception as e:  # network, permissions, checksum mismatch: all worth a retry
                if self.on_failure is not None:
                    self.on_failure(attempt, e)
                if attempt == self.retries:
                    self.failures.append((local_dir.name, repr(e)))
                    warnings.warn(f"mirror upload of {local_dir.name} to {self.url} failed after "
                                  f"{attempt + 1} attempts: {e!r}; the local copy is still there", RuntimeWarning)
                    return False
                time.sleep(self.backoff_s * 2 ** attempt)
        self.uploaded.append(local_dir.name)
        if keep is not None:
            try:
                names = keep(self.list()) if callable(keep) else keep
                self.prune(set(names) | {local_dir.name})
            except Exception as e:  # a failed prune costs space, never data
                warnings.warn(f"mirror prune at {self.url} failed: {e!r}", RuntimeWarning)
        return True

    def _upload_once(self, local_dir: Path) -> None:
        manifest_bytes = (local_dir / MANIFEST).read_bytes()
        manifest = read_manifest(local_dir, expected_format=None)
        remote = self._p(local_dir.name)
        if self._local() and not self.fs.isdir(self.root):
            # An unmounted share: never build the root afresh (a resume would take that new,
            # partial folder for the mirror). A new run creates it once (create_root).
            raise MirrorRootMissing(f"mirror root {self.url} does not exist or is not a folder (an unmounted "
                                    f"share?); not uploading {local_dir.name} into a new folder there")
        if self.fs.exists(self._p(local_dir.name, MANIFEST)):
            self.fs.rm_file(self._p(local_dir.name, MANIFEST))  # a mixed old/new dir must not look complete
        self.fs.makedirs(remote, exist_ok=True)
        for fname, meta in manifest["files"].items():
            self.fs.put_file(str(local_dir / fname), f"{remote}/{fname}")
            back = self.fs.cat_file(f"{remote}/{fname}")  # compare what the remote really holds
            if len(back) != meta["bytes"] or sha256_hex(back) != meta["sha256"]:
                raise CheckpointError(f"mirror copy {remote}/{fname} does not match its local checksum")
        self.fs.pipe_file(f"{remote}/{MANIFEST}", manifest_bytes)  # the commit point
        if self.fs.cat_file(f"{remote}/{MANIFEST}") != manifest_bytes:
            raise CheckpointError(f"mirror manifest {remote}/{MANIFEST} did not read back identical")

    # ------------------------------------------------------------------ read side
    def _local(self) -> bool:
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))

    def _names(self) -> list[str]:
        self.fs.invalidate_cache()
        if self._local() and self.fs.isfile(self.root):  # fsspec lists a file as itself: never "empty"
            raise MirrorRootMissing(f"mirror root {self.url} is a file, not a folder (a mount point gone wrong?); "
                                    f"refusing to take it for an empty mirror")
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            # An object store has no folders: an unused prefix of an existing bucket is empty.
            # A local folder (or a bucket) that is not there is a missing mount or a typo.
            bucket = self.root.split("/", 1)[0]
            if self._local() or not bucket or not self.fs.exists(bucket):
                raise MirrorRootMissing(f"mirror root {self.url} does not exist (an unmounted share, a typo?); "
                                        f"refusing to take it for an empty mirror") from None
            return []
        return [n for n in (e.rstrip("/").rsplit("/", 1)[-1] for e in entries) if NAME_RE.match(n)]

    def create_root(self) -> None:
        """Create the mirror's root for a new run: a ``file://`` folder whose parent must exist
        (never a whole path inside an unmounted mount point); nothing for object stores."""
        if self._local():
            try:
                self.fs.mkdir(self.root, create_parents=False)
            except FileNotFoundError:
                raise MirrorRootMissing(f"mirror root {self.url}: its parent folder does not exist (an unmounted "
                                        f"share?); create it, or fix checkpoint.mirror") from None
            except FileExistsError:
                if not self.fs.isdir(self.root):
                    raise MirrorRootMissing(f"mirror root {self.url} is a file, not a folder; fix "
                                            f"checkpoint.mirror") from None

    def list(self) -> dict[str, dict]:
        """``{name: manifest}`` of remote checkpoints that have a parseable manifest (complete
        uploads). Checksums are checked on :meth:`download`. Raises :class:`MirrorRootMissing`
        when the root does not exist, and the filesystem's error when it cannot be listed."""
        out = {}
        for name in self._names():
            try:
                manifest = json.loads(self.fs.cat_file(self._p(name, MANIFEST)))
            except (FileNotFoundError, ValueError, OSError):
                continue
            if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
                out[name] = manifest
        return out

    def download(self, name: str, dest_root: str | Path) -> Path:
        """Fetch remote checkpoint ``name``, check every file against the remote manifest and
        write it atomically as ``dest_root/name``. Raises CheckpointCorruptError when the remote
        copy fails verification (garbled manifest, a file missing or not matching its checksum),
        CheckpointError when the mirror cannot be read (network, permissions: not corruption)."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"name must be a checkpoint name like 'step_000000100', got {name!r}")
        try:
            manifest = json.loads(self.fs.cat_file(self._p(name, MANIFEST)))
        except ValueError as e:
            raise CheckpointCorruptError(f"mirror {self.url}/{name}: garbled manifest ({e})") from None
        except (FileNotFoundError, OSError) as e:
            raise CheckpointError(f"mirror {self.url}/{name}: cannot read its manifest ({e})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise CheckpointCorruptError(f"mirror {self.url}/{name}: {MANIFEST} is not a checkpoint manifest")
        files = {}
        for fname, meta in manifest["files"].items():
            if not safe_file_name(fname) or not isinstance(meta, dict):
                raise CheckpointCorruptError(f"mirror {self.url}/{name}: unsafe file name {fname!r} in manifest")
            try:
                blob = self.fs.cat_file(self._p(name, fname))
            except FileNotFoundError as e:
                raise CheckpointCorruptError(f"mirror {self.url}/{name}: {fname} is missing ({e})") from None
            except OSError as e:
                raise CheckpointError(f"mirror {self.url}/{name}: cannot read {fname} ({e})") from None
            if len(blob) != meta.get("bytes") or sha256_hex(blob) != meta.get("sha256"):
                raise CheckpointCorruptError(f"mirror {self.url}/{name}: {fname} does not match its checksum")
            files[fname] = blob
        dest_root = Path(dest_root)
        dest_root.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in manifest.items() if k not in ("files", "format")}
        # The copy keeps its kind: a sharded (DCP) checkpoint comes back as one, not as a full one.
        return write_checkpoint_dir(dest_root, name, files, meta, format=manifest.get("format", FORMAT))

    def prune(self, keep: set[str]) -> list[str]:
        """Delete remote checkpoints (and interrupted uploads) whose names are not in ``keep``."""
        removed = []
        for name in self._names():
            if name in keep:
                continue
            if self.fs.exists(self._p(name, MANIFEST)):
                self.fs.rm_file(self._p(name, MANIFEST))  # first: never a half-deleted "complete" one
            self.fs.rm(self._p(name), recursive=True)
            removed.append(name)
        return removed

    def busy(self) -> set[str]:
        """Names of local checkpoints queued or being uploaded (must not be deleted yet)."""
        with self._lock:
            return set(self._pending)

    def wait(self) -> None:
        """Block until every submitted upload has finished (successfully or not)."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Wait for the uploads in flight."""
        self.wait()

    def __repr__(self) -> str:
        return f"CheckpointMirror({self.url!r})"


def check_apart(mirror: Any, root: str | Path) -> None:
    """ValueError when ``mirror`` (a URL or a :class:`CheckpointMirror`) is a local folder that is
    the checkpoint folder ``root``, inside it, or above it: an upload would first delete the
    manifest it is about to copy onto itself (losing the checkpoint), and the mirror's prune would
    delete the run's own folders. Paths are compared after resolving symlinks and ``..``; object
    stores (``s3://``, ``memory://``...) never overlap a local folder. Nothing is read or written."""
    m = as_mirror(mirror)
    if m is None or not m._local():
        return
    there, here = Path(os.path.realpath(m.root)), Path(os.path.realpath(root))
    if there == here:
        how = "is"
    elif here in there.parents:
        how = "is inside"
    elif there in here.parents:
        how = "is a folder above"
    else:
        return
    raise ValueError(f"checkpoint.mirror {m.url} {how} the run's own checkpoint folder {here}: each upload would "
                     f"copy a checkpoint onto itself (deleting it) and the mirror's retention would prune the "
                     f"run's folders. Point checkpoint.mirror at a folder outside {here} (another disk or share)")


def as_mirror(mirror: Any) -> CheckpointMirror | None:
    """Accept None, a URL string or a :class:`CheckpointMirror`."""
    if mirror is None or isinstance(mirror, CheckpointMirror):
        return mirror
    if isinstance(mirror, str):
        return CheckpointMirror(mirror)
    raise TypeError(f"mirror must be None, an fsspec URL or a CheckpointMirror, got {type(mirror).__name__}")
