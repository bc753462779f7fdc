"""A watchdog thread on every rank: notice a silent rank, dump every rank's stacks, abort the job.

Without it a rank stuck in a collective (its peer died in a sleep, a dead-locked data loader, a
stuck filesystem) holds the whole job until the process group's timeout (30 minutes by default
for NCCL) and then dies with a message that does not say which rank was the culprit.

Each rank runs :class:`Watchdog`, which every ``poll_s`` seconds publishes its own rank's
heartbeat and reads all of them (:mod:`course_lib.watch.heartbeat`) in one store round trip and notes, on its own monotonic clock,
when each rank's value last changed. Once a rank is silent for more than ``timeout_s`` the job is
hung, and the culprit is the rank furthest behind in (step, collectives issued), see
:meth:`StaleTracker.blame`. Then:

1. the first rank to notice wins an atomic ``store.add`` vote and publishes a report naming the
   stalled rank(s) and their last step; every other watchdog sees the report at its next poll;
2. every rank writes ``OUT/hang/rank{r}.txt``: the Python stack of every thread, from
   ``faulthandler`` (it reads the frames without needing the training thread's cooperation, so a
   rank blocked in a C++ collective or a ``sleep`` is dumped too) and then a formatted copy;
3. the winner waits up to ``grace_s`` for all dumps, writes ``OUT/hang/summary.json`` and
   ``summary.txt``, and every rank leaves with ``os._exit(HANG_EXIT_CODE)``.

The job therefore ends at most ``timeout_s + 2 * poll_s + grace_s`` after the stalled rank's last
beat, whatever the collective timeout.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from course_lib.validate import check_int, check_number
from course_lib.watch.heartbeat import DONE, Heartbeat, key_prefix, own_connection, parse_beat, read_beats

HANG_EXIT_CODE = 86  # every rank of a job aborted by the watchdog exits with this code


class StaleTracker:
    """Pure bookkeeping (no threads, no store): when did each rank's heartbeat (``"STEP:SEQ"``)
    last change, on the caller's clock. ``started``: when the watch began, the reference for
    ranks not yet seen."""

    def __init__(self, world_size: int, timeout_s: float, started: float):
        check_int("world_size", world_size, 1)
        check_number("timeout_s", timeout_s, 0.0, lo_open=True)
        self.world_size, self.timeout_s = world_size, timeout_s
        self.value: dict[int, str | None] = {r: None for r in range(world_size)}
        self.changed = {r: started for r in range(world_size)}

    def update(self, beats: dict[int, str], now: float) -> list[dict]:
        """Feed one reading (``rank -> value``) taken at ``now`` (seconds). Empty while every
        rank changed its value within ``timeout_s``; otherwise :meth:`blame`."""
        for rank, value in beats.items():
            if value != self.value[rank]:
                self.value[rank], self.changed[rank] = value, now
        silent = [r for r in range(self.world_size)
                  if self.value[r] != DONE and now - self.changed[r] > self.timeout_s]
        return self.blame(now) if silent else []

    def blame(self, now: float) -> list[dict]:
        """The culprits of a hang, as ``{"rank", "step" (None: never beat), "seq", "silent_s"}``:
        the unfinished ranks furthest behind in ``(step, collectives issued)``. Peers waiting
        inside a collective have issued it; the culprit has not. When no rank is behind (one
        rank, or all stuck at the same point) every silent rank is named."""
        live = [r for r in range(self.world_size) if self.value[r] != DONE]
        progress = {r: parse_beat(self.value[r]) if self.value[r] is not None else (-1, -1) for r in live}
        low = min(progress.values())
        behind = [r for r in live if progress[r] == low]
        if len(behind) == len(live):
            behind = [r for r in live if now - self.changed[r] > self.timeout_s]
        return [{"rank": r, "step": None if progress[r][0] < 0 else progress[r][0],
                 "seq": None if progress[r][1] < 0 else progress[r][1],
                 "silent_s": round(now - self.changed[r], 3)} for r in behind]


def dump_stacks(path: Path, header: str) -> None:
    """Write every thread's Python stack to ``path``: ``header``, the raw ``faulthandler`` dump
    (safe even when the main thread is inside C++), then a formatted copy naming the threads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(path, "w") as f:
        f.write(header.rstrip() + "\n\n== faulthandler (all threads, most recent call first) ==\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write("\n== formatted (oldest call first) ==\n")
        for ident, frame in sys._current_frames().items():
            f.write(f"\nThread {names.get(ident, '?')} ({ident}):\n")
            f.write("".join(traceback.format_stack(frame)))


class Watchdog:
    """The background thread of one rank (see the module docstring). ``store``: the process
    group's store (a second connection is opened for the thread); ``heartbeat``: this rank's
    :class:`Heartbeat` (created here when None; the loop calls ``watchdog.heartbeat.beat(step)``);
    ``out_dir``: where ``hang/``
    goes; ``timeout_s`` (seconds, > 0); ``poll_s`` (seconds between readings, default
    ``min(1, timeout_s / 5)``); ``grace_s`` (seconds the ranks wait for each other's dumps);
    ``exit_fn``: how the rank leaves (``os._exit``; tests pass a recorder)."""

    def __init__(self, store: Any, rank: int, world_size: int, out_dir: str | Path, timeout_s: float, *,
                 poll_s: float | None = None, grace_s: float = 3.0, heartbeat: Heartbeat | None = None,
                 exit_fn: Callable[[int], None] = os._exit):
        check_int("rank", rank, 0, world_size - 1)
        check_number("timeout_s", timeout_s, 0.0, lo_open=True)
        check_number("grace_s", grace_s, 0.0)
        self.poll_s = min(1.0, timeout_s / 5) if poll_s is None else check_number("poll_s", poll_s, 0.0, lo_open=True)
        self.store, self.rank, self.world_size = own_connection(store), rank, world_size
        self.out_dir, self.timeout_s, self.grace_s, self.exit_fn = Path(out_dir), timeout_s, grace_s, exit_fn
        self.heartbeat = heartbeat or Heartbeat(rank)
        self.report: dict | None = None  # set when a hang was handled (tests read it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"course-watchdog-{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watch (training finished: this rank publishes DONE, so its peers stop expecting
        beats from it); returns once the thread has left."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 1)
        try:
            self.heartbeat.publish(self.store, DONE)
        except Exception:  # the store host is gone at shutdown: nobody is left to tell
            pass

    # ---------------------------------------------------------------- the thread
    def _key(self, name: str) -> str:
        return f"{key_prefix()}hang/{name}"

    def _run(self) -> None:
        tracker = StaleTracker(self.world_size, self.timeout_s, time.monotonic())
        while not self._stop.wait(self.poll_s):
            try:
                if self.store.check([self._key("report")]):
                    return self._handle(json.loads(self.store.get(self._key("report"))))
                self.heartbeat.publish(self.store)
                stalled = tracker.update(read_beats(self.store, self.world_size), time.monotonic())
                if stalled:
                    return self._handle(self._elect(stalled, tracker))
            except Exception as exc:  # the store went away (a rank hosting it died): still dump, then go
                if self._stop.is_set():
                    return
                return self._handle({"stalled": [], "detected_by": self.rank, "error": repr(exc)}, store_ok=False)

    def _elect(self, stalled: list[dict], tracker: StaleTracker) -> dict:
        """The first watchdog to notice publishes the report; the others adopt it."""
        stall_at = {}
        for s in stalled:  # when an injected stall began (course_lib.watch.stall), for the report
            key = f"{key_prefix()}stall/{s['rank']}"
            if self.store.check([key]):
                stall_at[s["rank"]] = float(self.store.get(key))
        mine = {"stalled": stalled, "detected_by": self.rank, "detected_at": time.time(),
                "timeout_s": self.timeout_s, "beats": {str(r): v for r, v in tracker.value.items()},
                "stall_started_at": {str(r): t for r, t in stall_at.items()}}
        if self.store.add(self._key("votes"), 1) == 1:
            self.store.set(self._key("report"), json.dumps(mine))
            return mine
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if self.store.check([self._key("report")]):
                return json.loads(self.store.get(self._key("report")))
            time.sleep(0.05)
        return mine

    def _handle(self, report: dict, store_ok: bool = True) -> None:
        """Dump this rank's stacks, wait (bounded) for the others, summarise (winner), leave."""
        self.report = report
        names = ", ".join(f"rank {s['rank']} (last heartbeat: step {s['step']}, {s['seq']} collectives, "
                          f"silent {s['silent_s']:.1f} s)"
                          for s in report.get("stalled", [])) or "unknown (the store was lost)"
        header = (f"rank {self.rank} of {self.world_size}: watchdog abort, timeout {self.timeout_s} s\n"
                  f"stalled: {names}; detected by rank {report.get('detected_by')}")
        dump_stacks(self.out_dir / "hang" / f"rank{self.rank}.txt", header)
        dumped = 1
        if store_ok:
            try:
                dumped = self.store.add(self._key("dumped"), 1)
                deadline = time.monotonic() + self.grace_s
                while dumped < self.world_size and time.monotonic() < deadline:
                    time.sleep(0.05)
                    dumped = self.store.add(self._key("dumped"), 0)
            except Exception:  # the store host left first: our own dump is on disk, that is enough
                pass
        if report.get("detected_by") == self.rank:
            summary = {**report, "ranks_dumped": dumped, "world_size": self.world_size,
                       "aborted_at": time.time(), "exit_code": HANG_EXIT_CODE}
            (self.out_dir / "hang" / "summary.json").write_text(json.dumps(summary, indent=2))
            (self.out_dir / "hang" / "summary.txt").write_text(
                f"{header}\n{dumped} of {self.world_size} ranks dumped their stacks to hang/rank*.txt; "
                f"every rank exits with code {HANG_EXIT_CODE}\n")
        print(f"[rank {self.rank}] watchdog: {names}; stacks in {self.out_dir / 'hang'}; "
              f"aborting (exit {HANG_EXIT_CODE})", file=sys.stderr, flush=True)
        self.exit_fn(HANG_EXIT_CODE)
