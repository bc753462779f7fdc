"""Smoke test of benchmarks/bench_pipeline.py: ``--quick`` runs end to end in a subprocess, prints
its table, and writes JSON that parses. Timings are never asserted (too noisy on shared CPUs);
the activation-memory ratios are exact counts, so the 1F1B-vs-GPipe one is checked."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_pipeline.py"
NAMES = ("torch GPipe", "torch 1F1B", "torch interleaved v=2", "scratch GPipe", "scratch 1F1B")


@pytest.mark.timeout(120)
def test_quick_run_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "pp.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for expected in ("median ms", "act. peak", "bubble est", "1F1B / GPipe activation peak per rank", *NAMES):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["ranks"] == 2 and data["micro"] == [4]
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == set(NAMES)
    for name, r in rows.items():
        assert r["error"] is None, (name, r["error"])
        assert r["median_ms"] > 0 and r["steps"] == data["rounds"]
        assert len(r["peak_saved_bytes"]) == 2 and min(r["peak_saved_bytes"]) > 0
    assert rows["torch GPipe"]["time_ratio"] == pytest.approx(1.0)
    # GPipe holds every micro-batch; both ways of counting agree on it
    assert rows["torch GPipe"]["peak_saved_bytes"] == rows["scratch GPipe"]["peak_saved_bytes"]
    assert rows["scratch 1F1B"]["peak_in_flight"] == [2, 1]
    assert rows["torch 1F1B"]["memory_ratio"] < 0.6  # m = 4 on 2 ranks: at most 2 of 4 in flight
    assert rows["torch interleaved v=2"]["bubble_estimate"] == pytest.approx(rows["torch 1F1B"]["bubble_estimate"] / 2)
