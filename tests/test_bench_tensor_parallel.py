"""Smoke test of benchmarks/bench_tensor_parallel.py: ``--quick`` runs end to end in a subprocess,
prints its table and the DTensor / scratch ratios, and writes JSON that parses. Timings are never
asserted (too noisy on shared CPUs, and --quick's model is too small to judge); only that every
variant ran and that DTensor and scratch started from the same loss."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_tensor_parallel.py"


@pytest.mark.timeout(120)
def test_quick_run_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for expected in ("median ms", "vs scratch", "scratch + SP", "DTensor + SP", "DTensor / scratch median step"):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["error"] is None
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"scratch", "DTensor", "scratch + SP", "DTensor + SP"}
    for name, r in rows.items():
        assert r["median_ms"] > 0 and r["steps"] == data["rounds"], r
        assert r["loss_diff_vs_scratch"] < 1e-5, r  # same model, same batch: same first loss
    assert rows["scratch"]["ratio"] == pytest.approx(1.0)
    for key in ("no_sp", "sp"):
        ratio = data["headline"][key]["ratio"]
        assert isinstance(ratio, float) and ratio > 0
