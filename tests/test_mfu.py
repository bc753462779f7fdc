"""MFU never above 100%: a peak the run beats is declared unreliable, MFU is logged as absent and
one warning names ``train.peak_flops``."""
import json
import warnings

import pytest

from course_lib.trainer import config as train_config
from course_lib.trainer.metrics import read_rows
from course_lib.trainer.mfu import MfuGuard, cpu_peak_sizes, robust_cpu_peak_flops
from course_lib.train import train
from pathlib import Path

TINY = Path(__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"


def test_guard_passes_fractions_and_drops_everything_after_the_first_value_above_one():
    guard = MfuGuard(100.0, 2, configured=False)
    assert guard.mfu(50.0) == pytest.approx(0.25)  # 50 / (100 x 2 devices)
    with pytest.warns(RuntimeWarning, match=r"MFU would be 150%.*train\.peak_flops") as caught:
        assert guard.mfu(300.0) is None
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning only, and later values are not trusted either
        assert guard.mfu(300.0) is None
        assert guard.mfu(10.0) is None
    assert MfuGuard(0.0, configured=False).mfu(1e9) is None  # unknown peak: n/a, no warning


def test_quiet_guard_on_non_writer_ranks():
    guard = MfuGuard(1.0, configured=True, warn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert guard.mfu(5.0) is None


def test_robust_peak_is_a_positive_flop_rate():
    peak = robust_cpu_peak_flops(sizes=(64, 128), passes=2, min_seconds=0.005)
    assert 1e6 < peak < 1e15  # FLOP/s: from a slow emulator to beyond any CPU


def test_peak_sizes_follow_the_thread_count_and_the_precision():
    """One thread has no thread start-up to time, so smaller (cheaper) matmuls show its peak;
    emulated half precision is timed smaller still."""
    import torch

    one, many = cpu_peak_sizes(torch.float32, 1), cpu_peak_sizes(torch.float32, 8)
    assert max(one) < max(many) and min(many) >= 768
    assert max(cpu_peak_sizes(torch.bfloat16, 1)) < max(one)
    assert cpu_peak_sizes(torch.bfloat16, 2) == cpu_peak_sizes(torch.float16, 16)
    with pytest.raises(ValueError, match="threads"):
        cpu_peak_sizes(torch.float32, 0)


def test_training_with_a_too_small_peak_logs_no_mfu_above_one_and_warns(tmp_path):
    # 1 FLOP/s per device: any real step beats it, so the first row already exceeds 100%.
    cfg = train_config.load(TINY, ["train.progress=false", "train.max_steps=4", "schedule.warmup_steps=1",
                                   "train.peak_flops=1.0"])
    with pytest.warns(RuntimeWarning) as caught:
        train(cfg, tmp_path)
    mfu_warnings = [w for w in caught if "MFU would be" in str(w.message)]
    assert len(mfu_warnings) == 1, [str(w.message) for w in caught]
    assert "configured train.peak_flops" in str(mfu_warnings[0].message)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert len(rows) == 4 and all("mfu" in r for r in rows)
    assert all(r["mfu"] is None for r in rows), [r["mfu"] for r in rows]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert all(json.loads(line).get("mfu") is None for line in text.splitlines())


def test_training_with_a_generous_peak_logs_mfu_fractions(tmp_path):
    cfg = train_config.load(TINY, ["train.progress=false", "train.max_steps=3", "schedule.warmup_steps=1",
                                   "train.peak_flops=1e15"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="MFU would be")
        train(cfg, tmp_path)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in rows)


def test_training_divides_by_the_stamped_peak_and_says_so(tmp_path, monkeypatch):
    """With ``course doctor --measure-peak``'s stamp the run times nothing at start-up, writes which
    peak it used to OUT/mfu_peak.json, and every MFU is tokens/s x FLOPs/token over that peak."""
    import torch

    from course_lib.trainer import cpu_peak, startup

    monkeypatch.setenv(cpu_peak.STAMP_ENV, str(tmp_path / "stamp.json"))
    threads = str(torch.get_num_threads())
    cpu_peak.write_stamp({"float32": {"1": 1e12, threads: 1e12}})
    monkeypatch.setattr(startup, "_measured_cpu_peak", lambda *a: pytest.fail("the stamp was not used"))
    cfg = train_config.load(TINY, ["train.progress=false", "train.max_steps=2", "schedule.warmup_steps=1"])
    result = train(cfg, tmp_path / "run")
    used = json.loads((tmp_path / "run" / "mfu_peak.json").read_text())
    assert used["source"] == "stamp" and used["flops"] == 1e12 and "--measure-peak" in used["detail"]
    assert result.peak.flops == 1e12
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    from course_lib.trainer.mfu import model_flops_per_token

    per_token = model_flops_per_token(result.model, cfg["data"]["seq_len"])
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 1e12)
