"""The utilization sampler (course_lib.trainer.utilization): columns in metrics.jsonl, their units, no
extra host read per step, a thread that stops, config errors naming the key."""
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from host_reads import reads_per_step
from course_lib.trainer import config as train_config
from course_lib.trainer import utilization
from course_lib.trainer.metrics import read_rows
from course_lib.train import train
from course_lib.trainer.utilization import UtilizationSampler

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"
CPU_COLUMNS = {"cpu_util_pct", "sys_cpu_pct", "rss_gib"}


def cfg(*overrides):
    base = ["train.progress=false", "train.max_steps=12", "schedule.warmup_steps=2", "train.peak_flops=1e11",
            "checkpoint.async_save=false"]
    return train_config.load(TINY, base + list(overrides))


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def test_sampler_averages_the_samples_since_the_last_call_and_stops():
    sampler = UtilizationSampler(0.1).start()
    _busy(0.35)  # this thread keeps one core busy: the process's and the machine's CPU % must show it
    with sampler._lock:
        samples = list(sampler._samples)
    # every sample, the first included (psutil keeps the machine's last reading per thread: it
    # must be primed on the sampling thread, or the first reading is a meaningless 0)
    assert len(samples) >= 2 and all(s["sys_cpu_pct"] > 0 for s in samples), samples
    cols = sampler.columns()
    assert set(cols) == CPU_COLUMNS
    assert cols["cpu_util_pct"] > 20 and 0 < cols["sys_cpu_pct"] <= 100
    assert 0.01 < cols["rss_gib"] < 64  # GiB, not bytes
    assert sampler.columns() == {}  # handed out once: the next window starts empty
    sampler.stop()
    assert not sampler._thread.is_alive()
    assert not any(t.name == "utilization-sampler" for t in threading.enumerate())


def test_gpu_columns_from_nvml(monkeypatch):
    """NVML is faked (no GPU here): the GPU columns are the mean utilization and the largest memory."""
    util, used = iter([50, 70]), iter([3 * 2**30, 2 * 2**30])
    fake = types.SimpleNamespace(
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(util)),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=next(used)))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(utilization, "_nvml_handle", lambda device: "handle")
    sampler = UtilizationSampler(10.0, types.SimpleNamespace(type="cuda"))  # thread not started
    for _ in range(2):
        sampler._samples.append(sampler.sample())
    cols = sampler.columns()
    assert cols["gpu_util_pct"] == pytest.approx(60.0) and cols["gpu_mem_gib"] == pytest.approx(3.0)


def test_trainer_writes_the_columns_and_stops_the_thread(tmp_path):
    train(cfg("train.util_sample_s=0.05", "train.max_steps=20"), tmp_path / "on")
    rows = read_rows(tmp_path / "on" / "metrics.jsonl")
    with_cols = [r for r in rows if CPU_COLUMNS <= set(r)]
    assert with_cols, "no metrics row got the utilization columns"
    assert all(r["rss_gib"] > 0.01 and r["cpu_util_pct"] >= 0 for r in with_cols)
    assert all("tokens_per_s" in r and "mfu" in r for r in with_cols)  # side by side in the same rows
    assert not any(t.name == "utilization-sampler" for t in threading.enumerate())
    train(cfg("train.util_sample_s=0"), tmp_path / "off")
    assert not any(CPU_COLUMNS & set(r) for r in read_rows(tmp_path / "off" / "metrics.jsonl"))


def test_sampling_adds_no_host_read_per_step(tmp_path):
    def run(steps):
        train(cfg("train.util_sample_s=0.01", f"train.max_steps={steps}"), tmp_path / f"r{steps}")
    assert reads_per_step(run, 10) <= 1


def test_bad_values_name_the_key():
    with pytest.raises(train_config.ConfigError, match="train.util_sample_s"):
        cfg("train.util_sample_s=-1")
    with pytest.raises(ValueError, match="interval_s"):
        UtilizationSampler(0)
