"""CheckpointManager: atomic, verified, async checkpoints with retention and a mirror tier.

What common tutorial code gets wrong and this fixes: ``torch.save`` straight to the final name (a crash
leaves a torn "latest"); retention that deletes old files *before* the new one is known good;
``torch.load`` that unpickles whatever is on disk; no way back from a corrupt file.

Here (format and atomic write in :mod:`course_lib.checkpoint.io`):

* ``save`` copies the whole resume state to CPU on the training path (the only stall of an async
  save), then a background thread serializes it, writes it atomically, re-reads it and checks the
  checksums and that it deserializes, and only then prunes older checkpoints and hands it to the
  mirror (:mod:`course_lib.checkpoint.mirror`);
* retention keeps the last ``keep_last`` (by save order) plus the ``keep_best`` best by a metric;
* ``load`` takes the newest checkpoint of either tier that verifies; a corrupt one is moved aside
  (``.corrupt-*``) with a warning and the previous one is used. Anything else that stops a load
  (an I/O error, a model of another shape, a bug) raises CheckpointLoadError without touching
  the checkpoint or falling back, and so does a root whose checkpoints are all corrupt: a resume
  never silently starts from step 0 (rules in ``docs/CHECKPOINTS.md``).

"Newest" is the save sequence number in the manifest, not the step: after a rollback, the re-saved
step 110 is newer than the abandoned step 150. A checkpoint named for step ``s`` holds the state
after ``s`` optimizer steps; resume continues with step ``s``. One writer per directory (rank 0);
the time-based policy reads the clock, so distributed trainers broadcast rank 0's decision.
"""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from course_lib.validate import check_bool, check_choice, check_int, check_number

from . import io as cio
from .io import CheckpointCorruptError, CheckpointError, CheckpointLoadError  # noqa: F401  (re-exported)
from .mirror import CheckpointMirror, as_mirror, check_apart
from .state import LoadResult, apply_state, gather_train_state, to_cpu_copy
from .tiers import choose, quarantine


class CheckpointManager:
    """Checkpoints under ``root`` (a local directory, created if missing).

    Policies: ``every_steps`` (save when ``step % every_steps == 0``), ``every_seconds`` (wall
    seconds since the last save), either or both, consulted by :meth:`should_save`/:meth:`maybe_save`.
    Retention: ``keep_last`` >= 1 newest, plus ``keep_best`` best by ``metrics[best_metric]``
    (``best_mode`` "min" or "max"). ``async_save``: write in a background thread after a CPU copy.
    ``mirror``: None, an fsspec URL or a :class:`CheckpointMirror`. ``writer``: False on ranks that
    only read (no cleanup, no saves). ``reuse_buffers``: keep the CPU copy of the state between
    saves and copy the next state into it (a smaller stall, at the price of one CPU copy of the
    state held for the manager's lifetime)."""

    def __init__(self, root: str | os.PathLike, *, every_steps: int | None = None,
                 every_seconds: float | None = None, keep_last: int = 3, keep_best: int = 0,
                 best_metric: str | None = None, best_mode: str = "min", async_save: bool = True,
                 mirror: str | CheckpointMirror | None = None, writer: bool = True,
                 reuse_buffers: bool = True):
        if every_steps is not None:
            check_int("every_steps (steps; None: no step policy)", every_steps, 1)
        if every_seconds is not None:
            check_number("every_seconds (seconds; None: no time policy)", every_seconds, 0, lo_open=True)
        check_int("keep_last (a manager never keeps zero)", keep_last, 1)
        check_int("keep_best", keep_best, 0)
        if keep_best and not best_metric:
            raise ValueError("keep_best > 0 needs best_metric, the metrics key to rank checkpoints by")
        check_choice("best_mode", best_mode, ("min", "max"))
        for flag, value in (("async_save", async_save), ("writer", writer), ("reuse_buffers", reuse_buffers)):
            check_bool(flag, value)
        self.root = Path(root)
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.keep_last, self.keep_best = keep_last, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.async_save, self.writer, self.reuse_buffers = async_save, writer, reuse_buffers
        self._staging: Any = None  # CPU copy of the last saved state, reused as the next copy's buffers
        self.mirror = as_mirror(mirror)
        check_apart(self.mirror, self.root)  # a mirror in (or above) root would upload onto itself
        self._valid: dict[str, dict] = {}  # name -> manifest, checksums verified by this process
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_save_time = time.monotonic()
        self.last_stall_s = self.last_write_s = 0.0  # seconds: training-path copy / background write
        self.last_timings: dict[str, float] = {}  # seconds of the last save's background phases
        self.last_bytes = 0
        self.removed: list[str] = []  # names pruned by retention, in order (tests, labs)
        self.cleaned: list[str] = []  # leftovers of interrupted saves removed at start-up
        if self.writer:
            self.root.mkdir(parents=True, exist_ok=True)
            self.cleaned = cio.cleanup_temp(self.root)
        # Every format's checkpoints count: one save order per folder (io.last_seq).
        self._next_seq = 1 + max([cio.last_seq(self.root)] + [m.get("seq", 0) for m in self._remote().values()])

    # ------------------------------------------------------------------ discovery
    def _manifests(self) -> dict[str, dict]:
        """Manifests of local checkpoint dirs (unverified; unreadable ones left out)."""
        out = {}
        for p in cio.list_checkpoint_dirs(self.root):
            try:
                out[p.name] = cio.read_manifest(p)
            except CheckpointError:
                continue
        return out

    def _remote(self, errors: list | None = None) -> dict[str, dict]:
        if self.mirror is None:
            return {}
        try:
            return {n: m for n, m in self.mirror.list().items() if m.get("format") == cio.FORMAT}
        except Exception as e:  # an unreachable mirror must not stop a local resume
            warnings.warn(f"cannot list mirror {self.mirror.url}: {e!r}", RuntimeWarning)
            if errors is not None:
                errors.append(e)
            return {}

    def checkpoints(self) -> list[tuple[str, dict]]:
        """Local checkpoints that pass the checksum check, oldest first: ``[(name, manifest)]``.
        Checks each directory once per process."""
        self.wait(mirror=False)
        good = []
        for name, manifest in self._manifests().items():
            if name not in self._valid:
                try:
                    self._valid[name] = cio.read_verified(self.root / name, manifest)[0]
                except CheckpointError:
                    continue
            good.append((name, self._valid[name]))
        return sorted(good, key=lambda nm: nm[1].get("seq", 0))

    # ------------------------------------------------------------------ saving
    def should_save(self, step: int) -> bool:
        """True when a policy says this step (optimizer steps done) should be saved."""
        if self.every_steps is not None and step > 0 and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and time.monotonic() - self._last_save_time >= self.every_seconds

    def maybe_save(self, step: int, **state: Any) -> bool:
        """:meth:`save` if :meth:`should_save`; returns whether it saved."""
        if not self.should_save(step):
            return False
        self.save(step, **state)
        return True

    def save(self, step: int, *, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
             scaler: Any = None, data: Any = None, stateful: dict[str, Any] | None = None,
             metrics: dict[str, Any] | None = None, blocking: bool | None = None,
             rank_states: list[dict] | None = None) -> Path:
        """Checkpoint the state after ``step`` optimizer steps. ``data`` and every value of
        ``stateful`` need ``state_dict()`` (its contents: tensors and plain Python); ``metrics``:
        JSON numbers/strings. ``rank_states``: one :func:`~course_lib.checkpoint.state.capture_rank_state`
        dict per global rank (the caller gathers them to this, the single writer; the manager does no
        communication), so that each rank gets its own RNG and data position back on :meth:`load`.
        Returns the final directory path; with async saving it appears after the background write
        verified (:meth:`wait`). Raises an earlier background failure."""
        if not self.writer:
            raise RuntimeError("this CheckpointManager was created with writer=False")
        check_int("step (optimizer steps done)", step, 0)
        if rank_states is not None and not (isinstance(rank_states, (list, tuple)) and rank_states and all(
                isinstance(r, dict) and "rng" in r and "data" in r for r in rank_states)):
            raise TypeError("rank_states must be None or a non-empty list, indexed by global rank, of "
                            "capture_rank_state() dicts ({'rng': ..., 'data': ...})")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        metrics = dict(metrics or {})
        for k, v in metrics.items():
            if not isinstance(k, str) or not (isinstance(v, (str, bool)) or
                                              (isinstance(v, (int, float)) and math.isfinite(v))):
                raise ValueError(f"metrics must map str to finite numbers or strings; bad entry {k!r}: {v!r}")
        if self.keep_best and self.best_metric in metrics and isinstance(metrics[self.best_metric], str):
            raise ValueError(f"metrics[{self.best_metric!r}] must be a number to rank checkpoints")
        stateful = dict(stateful or {})
        self.wait(mirror=False)  # one save in flight at a time; raises its error, if any
        t0 = time.perf_counter()
        train_state = gather_train_state(optimizer, scheduler, scaler, data, stateful)
        if rank_states is not None:
            train_state["rank_states"] = list(rank_states)
        # Fold tied weights before copying, so they are copied (and stored) once.
        model_tensors, aliases = cio.split_shared(model.state_dict())
        staged = to_cpu_copy((model_tensors, train_state), reuse=self._staging)
        if self.reuse_buffers:
            self._staging = staged  # the next save copies into these (this one is done with them by then)
        snapshot = (*staged, aliases)
        name = cio.fresh_name(self.root, step)
        manifest = {"step": step, "seq": self._next_seq, "created_unix": time.time(), "metrics": metrics}
        self._next_seq += 1
        self._last_save_time = time.monotonic()
        self.last_stall_s = time.perf_counter() - t0
        if blocking or (blocking is None and not self.async_save):
            self._finish(name, snapshot, manifest)
            self._raise_pending()
        else:
            # Not a daemon: the interpreter waits for a write in progress rather than lose it.
            self._thread = threading.Thread(target=self._finish, args=(name, snapshot, manifest),
                                            name=f"ckpt-save-{name}")
            self._thread.start()
        return self.root / name

    def _finish(self, name: str, snapshot: tuple, manifest: dict) -> None:
        """Background half of a save: serialize, write atomically, verify, prune, mirror."""
        t0 = time.perf_counter()
        timings = self.last_timings = {}  # seconds per phase, for labs and benchmarks

        def lap(phase: str) -> None:
            timings[phase] = time.perf_counter() - t0 - sum(timings.values())

        try:
            files, extra = cio.serialize(*snapshot)
            lap("serialize")
            path = cio.write_checkpoint_dir(self.root, name, files, dict(manifest, **extra))
            lap("write")
            try:
                self._valid[name] = cio.verify_dir(path, deep=True)  # re-read from disk, checksums, loads
            except CheckpointCorruptError:
                self._quarantine(path)
                raise
            lap("verify")
            self.last_bytes = sum(len(b) for b in files.values())
            self._prune()
            lap("prune")
            if self.mirror is not None:
                # The mirror keeps keep_last of its own listing, not the local set: after a resume
                # from the mirror the disk holds fewer checkpoints than the mirror should.
                self.mirror.submit(path, self._mirror_keep)
        except BaseException as e:  # surfaced on the next save()/wait()/close()
            self._error = e
        finally:
            self.last_write_s = time.perf_counter() - t0

    def _retention(self, good: list[tuple[str, dict]]) -> set[str]:
        keep = {name for name, _ in good[-self.keep_last:]}
        if self.keep_best:
            ranked = [(m["metrics"][self.best_metric], m.get("seq", 0), name) for name, m in good
                      if isinstance(m.get("metrics", {}).get(self.best_metric), (int, float))]
            ranked.sort(key=lambda r: (r[0] if self.best_mode == "min" else -r[0], -r[1]))
            keep |= {name for _, _, name in ranked[: self.keep_best]}
        return keep

    def _mirror_keep(self, remote: dict[str, dict]) -> set[str]:
        """The retention rule applied to the mirror's own ``{name: manifest}`` listing (called by
        the mirror after each upload): its ``keep_last`` newest full checkpoints by save order,
        plus ``keep_best``, and every checkpoint of another format (not this manager's to count or
        prune, as in the local folder)."""
        mine = sorted(((n, m) for n, m in remote.items() if m.get("format") == cio.FORMAT),
                      key=lambda nm: nm[1].get("seq", 0))
        return self._retention(mine) | {n for n, m in remote.items() if m.get("format") != cio.FORMAT}

    def _prune(self) -> list[str]:
        """Delete verified checkpoints outside the retention set; called only right after a new
        checkpoint verified, so at least one valid checkpoint always remains."""
        good = [(n, m) for n, m in self._valid.items() if (self.root / n).is_dir()]
        known = {n for n, _ in good}
        for name, manifest in self._manifests().items():  # dirs from earlier runs: check them once
            if name not in known:
                try:
                    good.append((name, cio.read_verified(self.root / name, manifest)[0]))
                    self._valid[name] = good[-1][1]
                except CheckpointError:
                    pass  # not ours to judge here; load() quarantines corrupt ones with a warning
        good.sort(key=lambda nm: nm[1].get("seq", 0))
        keep = self._retention(good)
        busy = self.mirror.busy() if self.mirror is not None else set()
        for name, _ in good:
            if name not in keep and name not in busy:  # an upload still reading it: prune it next time
                cio.remove_dir(self.root / name)
                self._valid.pop(name, None)
                self.removed.append(name)
        return keep

    def _quarantine(self, path: Path) -> None:
        """Move a bad checkpoint out of the way (kept for forensics, never loaded or counted)."""
        self._valid.pop(path.name, None)
        quarantine(path)

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint save failed: {err!r}") from err

    def wait(self, mirror: bool = True) -> None:
        """Block until the save in flight (and, with ``mirror``, every upload) has finished;
        re-raise a background save failure as CheckpointError."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if mirror and self.mirror is not None:
            self.mirror.wait()
        self._raise_pending()

    def close(self) -> None:
        """Finish the last save and its upload (never drops the last checkpoint), then apply
        retention to what uploads in flight had kept from being pruned."""
        self.wait(mirror=True)
        if self.writer and self.mirror is not None and self._valid:
            self._prune()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ loading
    def load(self, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None,
             scaler: Any = None, data: Any = None, stateful: dict[str, Any] | None = None, *,
             restore_rng: bool = True, map_location: str | torch.device = "cpu",
             strict: bool = True, rank: int = 0, only: str | None = None) -> LoadResult | None:
        """Restore the newest checkpoint that verifies, from either tier (a mirror-only one is
        downloaded into ``root`` first). Objects passed as None are left alone (``data=None``: keep
        the data position, as a roll-back does).

        * A checkpoint that fails verification (manifest, sizes, sha256, parsing) is corrupt: a
          warning, moved aside as ``.corrupt-*`` (writer only), and the previous one is tried;
          a mirror copy of the same checkpoint is tried before an older one.
        * Any other failure - an I/O error, a model or optimizer that does not fit (refused by
          name before anything is loaded), a bug - raises :class:`CheckpointLoadError` at once: no
          quarantine, no fall-back to an older checkpoint (that would silently lose progress).
        * Checkpoints exist but none loads, or only quarantined ones are left: CheckpointLoadError
          listing each and why. None is returned only when there is no checkpoint at all.

        ``rank``: this process's global rank; with per-rank states saved (``save(rank_states=)``)
        it gets its own RNG and data position back. ``only``: load exactly that checkpoint name
        (ranks other than the writer load the name rank 0 chose and broadcast); if it cannot be
        loaded, CheckpointLoadError, never a fall-back. ``map_location``: device of the model
        tensors before they are copied in (the optimizer moves its state to its parameters)."""
        check_int("rank", rank, 0)
        check_bool("restore_rng", restore_rng)
        check_bool("strict", strict)
        if only is not None and not (isinstance(only, str) and cio.NAME_RE.match(only)):
            raise ValueError(f"only must be None or a checkpoint name like 'step_000000020', got {only!r}")
        self.wait(mirror=False)

        def verify(path: Path, manifest: dict | None) -> tuple:
            manifest, blobs = cio.read_verified(path, manifest)
            return (manifest, *cio.decode(manifest, blobs))  # CheckpointCorruptError if it does not parse

        chosen = choose(self.root, cio.FORMAT, verify, mirror=self.mirror, writer=self.writer, only=only)
        if chosen is None:
            return None
        name, path, seq = chosen.name, chosen.path, chosen.seq
        manifest, model_state, train_state = chosen.value
        if str(map_location) != "cpu":
            model_state = {k: v.to(map_location) for k, v in model_state.items()}
        self._valid[name] = manifest
        apply_state(model_state, train_state, model, optimizer, scheduler, scaler, data,
                    stateful or {}, restore_rng=restore_rng, strict=strict, rank=rank, label=name)
        self._next_seq = max(self._next_seq, seq + 1)
        if self.mirror is not None and self.writer and name not in self._remote():
            self.mirror.submit(path)  # a checkpoint the last run could not upload
        return LoadResult(manifest["step"], path, chosen.source, manifest.get("metrics", {}), seq, manifest)
