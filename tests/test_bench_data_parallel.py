"""Smoke test of benchmarks/bench_data_parallel.py: ``--quick`` runs end to end in a subprocess,
prints its table and headline, and writes JSON that parses. Timings are never asserted (too noisy
on shared CPUs, and --quick's model is too small to judge); only that every part ran."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_data_parallel.py"


@pytest.mark.timeout(170)
def test_quick_run_prints_table_and_writes_json(tmp_path):
    from course_lib.parallel.deepspeed.ops import build

    build()  # cached by ./kit setup; otherwise built here once, not inside the ranks' timeouts
    out = tmp_path / "dp.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=160)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for expected in ("median ms", "vs DDP", "torch DDP", "NaiveDDP", "BucketedDDP 25 MB",
                     "FSDP2 reshard_after_forward=True", "SimpleFSDP", "DeepSpeed", "headline:"):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    data = json.loads(out.read_text())
    assert data["quick"] is True
    assert data["headline"]["name"] == "BucketedDDP 25 MB"
    ratio = data["headline"]["ratio"]
    assert isinstance(ratio, float) and ratio > 0
    rows = {r["name"]: r for r in data["ddp_phase"]["rows"]}
    assert rows["torch DDP"]["ratio"] == pytest.approx(1.0)
    for name in ("NaiveDDP", "BucketedDDP 25 MB", "BucketedDDP one bucket", "SimpleFSDP (from scratch)"):
        assert rows[name]["error"] is None and rows[name]["median_ms"] > 0, rows[name]
    # DeepSpeed rows are either measured or carry the reason they could not be
    ds = data["deepspeed_phase"]
    assert ds["rows"] or ds["error"]
    for r in ds["rows"]:
        assert r["error"] or r["median_ms"] > 0
