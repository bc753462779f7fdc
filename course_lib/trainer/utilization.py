"""Machine utilization next to tokens/s and MFU: a background sampler whose averages become
columns of the trainer's ``metrics.jsonl``.

A daemon thread wakes every ``train.util_sample_s`` seconds (0 = off) and reads, without touching
any tensor (so the training step gains no device synchronisation):

* this process through ``psutil``: CPU use and resident memory;
* the whole machine's CPU use;
* on a GPU run, the rank's GPU through NVML (``pynvml``, package ``nvidia-ml-py``, imported only
  then): the fraction of the last sample period in which a kernel was running, and memory used.

Each metrics row gets the aggregate of the samples taken since the previous row (the columns are
absent from a row when no sample fell in its window: with steps shorter than the interval, about
one row per interval carries them). Columns and units:

==================  ==========================================================================
``cpu_util_pct``    this process's CPU time over the window, % of ONE core (200 = two busy cores)
``sys_cpu_pct``     the whole machine's CPU use, % of all its cores (0-100)
``rss_gib``         this process's resident memory, GiB (2**30 bytes), the largest sample
``gpu_util_pct``    NVML GPU utilization, % of time a kernel ran (0-100), mean of the samples
``gpu_mem_gib``     memory used on this rank's GPU by every process, GiB, the largest sample
==================  ==========================================================================

Only the rank that writes metrics.jsonl (rank 0) samples; the numbers are that rank's.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

from course_lib.validate import check_number

GIB = 2**30


class _Off:
    """What the trainer holds when sampling is off."""

    def columns(self) -> dict:
        return {}

    def stop(self) -> None:
        pass


def start(cfg: dict, info: Any, device: Any):
    """A running :class:`UtilizationSampler` on the metrics-writing rank when
    ``train.util_sample_s`` > 0, else a no-op object with the same ``columns()`` / ``stop()``."""
    interval = cfg["train"]["util_sample_s"]
    if interval <= 0 or info.rank != 0:
        return _Off()
    return UtilizationSampler(interval, device).start()


def _nvml_handle(device: Any):
    """The NVML handle of ``device`` (a torch CUDA device), found by UUID because NVML numbers the
    GPUs physically while CUDA_VISIBLE_DEVICES renumbers them; None (with a warning) when
    nvidia-ml-py is missing or NVML cannot start."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as exc:  # no package, no driver, MIG slice without its own handle...
        warnings.warn(f"GPU utilization not sampled ({type(exc).__name__}: {exc}); install nvidia-ml-py",
                      RuntimeWarning, stacklevel=3)
        return None


class UtilizationSampler:
    """Samples every ``interval_s`` seconds (> 0) on a daemon thread. ``device``: a torch device;
    a CUDA one adds the GPU columns. :meth:`columns` hands out (and forgets) the aggregate of the
    samples taken since its last call; :meth:`stop` ends the thread (idempotent)."""

    def __init__(self, interval_s: float, device: Any = None):
        check_number("interval_s", interval_s, 0, lo_open=True)
        import psutil

        self.interval_s = float(interval_s)
        self._proc = psutil.Process()
        self._psutil = psutil
        self._gpu = _nvml_handle(device) if getattr(device, "type", None) == "cuda" else None
        self._samples: list[dict] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="utilization-sampler", daemon=True)

    def start(self) -> "UtilizationSampler":
        self._thread.start()
        return self

    def sample(self) -> dict:
        """One reading now (host calls only): cpu_util_pct, sys_cpu_pct, rss_bytes and, on a GPU,
        gpu_util_pct and gpu_mem_bytes."""
        s = {"cpu_util_pct": self._proc.cpu_percent(None), "sys_cpu_pct": self._psutil.cpu_percent(None),
             "rss_bytes": self._proc.memory_info().rss}
        if self._gpu is not None:
            import pynvml

            s["gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu)
            s["gpu_mem_bytes"] = pynvml.nvmlDeviceGetMemoryInfo(self._gpu).used
        return s

    def _run(self) -> None:
        # Both CPU counters measure "since the previous call"; the first call only sets the
        # starting point. It must be made on this thread: psutil keeps the machine's last
        # reading per calling thread.
        self._proc.cpu_percent(None)
        self._psutil.cpu_percent(None)
        while not self._stopping.wait(self.interval_s):
            try:
                s = self.sample()
            except Exception:  # the process is going away (psutil.NoSuchProcess...): stop quietly
                return
            with self._lock:
                self._samples.append(s)

    def columns(self) -> dict:
        """The metrics columns for the samples since the previous call ({} when there were none):
        means of the utilizations (%), largest memory (GiB)."""
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return {}
        out = {"cpu_util_pct": _mean(samples, "cpu_util_pct"), "sys_cpu_pct": _mean(samples, "sys_cpu_pct"),
               "rss_gib": max(s["rss_bytes"] for s in samples) / GIB}
        if "gpu_util_pct" in samples[0]:
            out["gpu_util_pct"] = _mean(samples, "gpu_util_pct")
            out["gpu_mem_gib"] = max(s["gpu_mem_bytes"] for s in samples) / GIB
        return out

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.interval_s + 1)


def _mean(samples: list[dict], key: str) -> float:
    return sum(s[key] for s in samples) / len(samples)
