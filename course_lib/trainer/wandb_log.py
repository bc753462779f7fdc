"""Weights & Biases logging beside ``metrics.jsonl``: one W&B run per training run, resumed with it.

    [wandb]
    mode = "offline"        # "disabled" (default) | "offline" (no network: files under OUT/wandb/) | "online"
    project = "course-kit"
    name = ""               # "" = the output folder's name

Rank 0 (the writer) sends every row it writes to ``metrics.jsonl`` to the W&B run too, with the
row's ``step`` as W&B's step. The run's id is part of every checkpoint (``state_dict``), so a
resumed job calls ``wandb.init(id=..., resume="allow")`` and appends to the same run. The files
go to ``OUT/wandb/`` (``WANDB_DIR`` is the run's output folder); offline runs are uploaded later
with ``wandb sync OUT/wandb/offline-run-*``.

How every step reaches the run exactly once across kills. W&B cannot rewrite history, and a kill
costs it rows in two ways: a job killed after its newest checkpoint has already logged steps the
resumed job computes again (bit-exact: the kit's resume is deterministic), and the wandb service
buffers records, so a SIGKILL loses the ones it had not written yet (measured: after 10 steps,
the killed job's offline file held its 7-byte header only). So, before its first row, a resumed
job reads the run's earlier local segments with wandb's own reader (``wandb leet inspect
--json``, which also reads a file a kill cut off), finds the newest step W&B holds, sends the rows
``metrics.jsonl`` kept after it (those the checkpoint covers), and from then on only steps after
it. After a stability roll-back (``spike_policy = "rollback"``) the replayed steps keep their
first rows in W&B; ``metrics.jsonl`` and ``events.jsonl`` have the rest.

The package is optional (``pip install -e '.[wandb]'``); with ``mode = "disabled"`` it is never
imported and checkpoints carry no W&B state.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import string
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from course_lib.trainer.metrics import read_rows

MODES = ("disabled", "offline", "online")
INSTALL = "pip install -e '.[wandb]' (or pip install wandb)"
_SEGMENT = re.compile(r"^(?:offline-)?run-(\d{8}_\d{6})-(.+)$")  # wandb's run folder names


def missing_package_message(mode: str) -> str | None:
    """Why ``wandb.mode = mode`` cannot run here (the package is not installed), or None."""
    if mode == "disabled" or importlib.util.find_spec("wandb") is not None:
        return None
    return (f"wandb.mode = {mode!r} needs the wandb package, which is not installed: {INSTALL}; "
            f"or set wandb.mode = 'disabled'")


def new_run_id() -> str:
    """A fresh W&B run id: 8 characters of [a-z0-9], like wandb's own."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def segments(out_dir: str | Path, run_id: str) -> list[Path]:
    """The local folders of run ``run_id`` under ``out_dir/wandb`` (one per start of the job),
    oldest first."""
    found = []
    for d in (Path(out_dir) / "wandb").glob(f"*run-*-{run_id}"):
        m = _SEGMENT.match(d.name)
        if m and m.group(2) == run_id and d.is_dir():
            found.append((m.group(1), d.name, d))
    return [d for *_, d in sorted(found)]


def read_history(out_dir: str | Path, run_id: str, *, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Every history row (``wandb.log`` call) of run ``run_id`` kept under ``out_dir/wandb``, oldest
    segment first, as wandb's reader gives it (``_step`` is W&B's step). A segment cut off by a kill
    gives its complete records. RuntimeError when a segment cannot be read at all."""
    return [row for seg in segments(out_dir, run_id) for row in read_segment(seg, timeout_s=timeout_s)]


def read_segment(segment: str | Path, *, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The history rows of one run folder (``OUT/wandb/offline-run-...-ID``), read by wandb's own
    reader, ``wandb leet inspect --json`` (~2 s: it starts wandb's Go core)."""
    # WANDB_MODE=offline: reading local files needs no network, and without it the wandb CLI looks
    # up its telemetry server (seen with strace, wandb 0.31)
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(segment)],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    records = []
    for line in done.stdout.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if done.returncode != 0 and not records:
        raise RuntimeError(f"wandb leet inspect could not read {segment}: {done.stderr.strip()[-500:]}")
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


class WandbLog:
    """The ``[wandb]`` section as a row sink for :class:`course_lib.trainer.metrics.MetricsLog` (``open``,
    ``write``, ``close``) and a checkpointed object (``state_dict``: the run id). ``enabled``: this
    rank writes (rank 0); the others keep the id only. The W&B run starts at ``open`` and ends at
    ``close``; opened again, it appends to the same run."""

    def __init__(self, cfg: dict, out_dir: str | Path, *, enabled: bool):
        section = cfg["wandb"]
        self.mode, self.out_dir = section["mode"], Path(out_dir)
        self.project = section["project"]
        self.name = section["name"] or self.out_dir.resolve().name
        self.enabled = enabled and self.mode != "disabled"
        self.run_id = new_run_id()  # replaced by the checkpoint's on resume (load_state_dict)
        self._config, self._run = cfg, None
        self._logged_through: int | None = None  # newest step the W&B run holds (read once per process)

    def stateful(self) -> dict[str, "WandbLog"]:
        """What the trainer checkpoints: ``{"wandb": self}``, or nothing when W&B is off."""
        return {"wandb": self} if self.mode != "disabled" else {}

    def state_dict(self) -> dict:
        """The run id (plain str: checkpoints load with ``weights_only=True``)."""
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved run (called when a checkpoint is restored, before any row)."""
        self.close()
        self.run_id = str(state["run_id"])
        self._logged_through = None

    def open(self, resume_step: int | None = None) -> None:
        """Start (or resume) the W&B run, once ``metrics.jsonl`` holds the rows up to ``resume_step``
        (MetricsLog calls it when it opens, so wandb's start-up is not timed as a training step),
        and send the rows of it the run lacks (see the module docstring). Idempotent."""
        if not self.enabled or self._run is not None:
            return
        for row in self._start():
            self._log(row)

    def _start(self) -> list[dict]:
        backlog = []
        if self._logged_through is None:
            try:
                steps = [int(r["_step"]) for r in read_history(self.out_dir, self.run_id) if "_step" in r]
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                warnings.warn(f"[wandb] could not read the earlier segments of run {self.run_id} ({exc}); rows "
                              f"after the resumed checkpoint may appear twice in W&B", RuntimeWarning, stacklevel=3)
                steps = []
            self._logged_through = max(steps, default=0)
            backlog = [r for r in read_rows(self.out_dir / "metrics.jsonl")
                       if r.get("step", 0) > self._logged_through]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        os.environ["WANDB_DIR"] = str(self.out_dir)  # its files live with the run, not in the cwd
        if self.mode == "offline":
            # Before wandb sets itself up: its process-wide settings come from the environment, and
            # with them not offline, wandb 0.31 exports usage telemetry over HTTPS even from an
            # offline run (seen: a DNS lookup of api.forge.coreweave.com at exit). With this, strace
            # of a whole offline training run shows no AF_INET connect (tests/test_wandb_log.py).
            os.environ["WANDB_MODE"] = "offline"
        import wandb

        # console="off": the trainer's progress bar and rank output stay untouched;
        # x_disable_stats: no system-metrics sampler thread beside the training loop.
        settings = wandb.Settings(mode=self.mode, console="off", x_disable_stats=True, reinit="finish_previous")
        self._run = wandb.init(project=self.project, name=self.name, id=self.run_id, resume="allow",
                               dir=str(self.out_dir), config=self._config, settings=settings)
        return backlog

    def write(self, row: dict[str, Any]) -> None:
        """Send one metrics row (must hold ``step``) unless the run already holds that step."""
        if not self.enabled:
            return
        self.open()  # normally done already, by MetricsLog
        if int(row["step"]) > self._logged_through:  # else the run holds this step from before a resume
            self._log(row)

    def _log(self, row: dict[str, Any]) -> None:
        self._run.log(dict(row), step=int(row["step"]))
        self._logged_through = int(row["step"])

    def close(self) -> None:
        """Finish the W&B run (its files complete); idempotent."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()
