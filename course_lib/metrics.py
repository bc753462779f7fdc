"""Per-step metrics: JSON lines always (one object per optimizer step), TensorBoard when asked.

The JSONL file survives crashes: each row is one ``write`` of a complete line, and a resumed run
first rewrites the file (atomically) keeping only whole rows up to the step it resumes from, so a
torn last line or rows the crashed run wrote after its checkpoint never reach the reader twice.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """Strict JSON has no NaN/Inf: non-finite floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_rows(path: str | Path) -> list[dict]:
    """Every complete, valid row of a metrics.jsonl (a torn last line is left out)."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class MetricsLog:
    """Append-only ``metrics.jsonl`` (+ optional TensorBoard event files next to it).

    ``resume_step``: keep existing rows with ``step <= resume_step`` and drop the rest (0 or None:
    start a fresh file). ``enabled=False`` (ranks other than 0) writes nothing."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None, tensorboard: bool = False,
                 enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_rows(self.path) if resume_step and r.get("step", 0) <= resume_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (must hold ``step``); numbers also go to TensorBoard under ``train/``."""
        if not self.enabled:
            return
        row = {k: _clean(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")  # one write per line: no interleaved halves
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"train/{key}", value, row["step"])

    def close(self) -> None:
        """Flush and close (TensorBoard included)."""
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
