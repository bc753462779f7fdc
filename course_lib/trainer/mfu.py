"""MFU for the trainer: a robust measured CPU peak, and a guard that never reports MFU above 100%.

MFU divides the model FLOP/s a run achieved by a peak. On a GPU the peak is a datasheet number;
on a CPU it is a measurement, and a peak measured while another process holds the cores is too
low, so every MFU divided by it is too high: lab 14 printed 343% and the bf16 README example 608%.
The defences:

- ``trainer.cpu_peak``: the peak ``course doctor --measure-peak`` measured once on a quiet machine
  and stamped into the venv (the trainer's first choice; a busy machine can only make a new
  measurement slower, and a stamp keeps the fastest).
- ``robust_cpu_peak_flops`` (here): the start-up fallback without a stamp. It times several sizes
  in interleaved passes and keeps the best timing of all: a busy moment then costs one pass of one
  size, not the figure.
- ``MfuGuard`` turns achieved FLOP/s into MFU and, the first time a step would exceed 100%,
  declares the peak unreliable: that row and every later one log MFU as ``None`` and one warning
  names the fix. A ceiling the run beat is not a ceiling, so the values under 100% it would still
  produce are not trusted either.
"""
from __future__ import annotations

import warnings

import torch

# Sizes the trainer's CPU peak is measured at, by torch's thread count. With several threads, 768
# and up are where the arithmetic peak shows on the course machines (smaller ones time thread
# start-up: at 2 threads 128 gave 44-80 GFLOP/s against 136-141 at 768-1024). One thread has no
# start-up to hide, and its peak shows by 256 (71-73 GFLOP/s at 256, 51-69 at 1024): the ranks the
# kit starts run one thread each, and the smaller pair costs each of them 0.24 s of start-up, not 0.47.
# Two sizes, so one size's unlucky packing or cache behaviour does not decide the figure.
CPU_PEAK_SIZES = (768, 1024)
CPU_PEAK_SIZES_ONE_THREAD = (256, 512)
# bf16/fp16 matmuls on a CPU without native support are emulated at ~1-2 GFLOP/s (measured here,
# one thread: 1.9 at 128, 1.3 at 256, 1.2 at 512): one 1024 matmul takes 2 s, and six timings of it
# cost 30 s of start-up. Half-precision peaks are taken at sizes whose timings stay well under a
# second (one thread: 0.35 s in all, against 1.6 s at 256 and 512); where such a peak is too low,
# the guard below catches the MFU it would produce.
CPU_PEAK_SIZES_HALF = (256, 512)
CPU_PEAK_SIZES_HALF_ONE_THREAD = (128, 256)
CPU_PEAK_PASSES = 3


def cpu_peak_sizes(dtype: torch.dtype, threads: int) -> tuple[int, ...]:
    """Matrix sizes (n of an n x n matmul) that show this CPU's peak for ``dtype`` on ``threads``
    threads (the constants above say why)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if dtype == torch.float32:
        return CPU_PEAK_SIZES_ONE_THREAD if threads == 1 else CPU_PEAK_SIZES
    return CPU_PEAK_SIZES_HALF_ONE_THREAD if threads == 1 else CPU_PEAK_SIZES_HALF


def robust_cpu_peak_flops(dtype: torch.dtype = torch.float32, *, sizes: tuple[int, ...] | None = None,
                          passes: int = CPU_PEAK_PASSES, min_seconds: float = 0.03) -> float:
    """This CPU's matmul peak in FLOP/s (per process, on torch's current thread count).

    ``passes`` interleaved passes over ``sizes`` (default ``cpu_peak_sizes`` for ``dtype`` and
    torch's thread count; each size timed once per pass, for at least ``min_seconds``
    seconds), and the best of all the timings: other processes only ever slow a timing down, so
    the fastest is the closest to the chip's peak. About ``passes * len(sizes) * min_seconds``
    seconds plus one warm-up matmul per timing (on the course machine, one thread: 0.24 s in fp32,
    0.33 s in bf16; two threads: 0.4 s in fp32).
    """
    from course_lib.measure import cpu_matmul_peak_flops

    if sizes is None:
        sizes = cpu_peak_sizes(dtype, torch.get_num_threads())
    best = 0.0
    for _ in range(passes):
        for n in sizes:
            best = max(best, cpu_matmul_peak_flops(n, dtype=dtype, repeats=1,
                                                   min_seconds=min_seconds).flops_per_second)
    return best


class MfuGuard:
    """MFU (a fraction) from achieved FLOP/s (all ranks together) against ``peak_per_device``
    (FLOP/s) times ``devices``.

    ``peak_per_device`` 0 means unknown: every MFU is ``None``. ``configured`` says whether the peak
    came from ``train.peak_flops`` (the warning then says to raise it) or was looked up/measured
    (the warning says to set it). ``source`` (``trainer.cpu_peak.Peak.source``: "stamp",
    "start-up", "datasheet", ...) lets the warning name the measurement it distrusts. ``warn``
    False keeps non-writer ranks quiet.
    """

    def __init__(self, peak_per_device: float, devices: int = 1, *, configured: bool, warn: bool = True,
                 source: str = ""):
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        if peak_per_device < 0:
            raise ValueError(f"peak_per_device must be >= 0 FLOP/s, got {peak_per_device}")
        self.peak_per_device = float(peak_per_device)
        self.peak_flops = self.peak_per_device * devices  # FLOP/s, all devices together
        self.configured = configured
        self.source = "config" if configured else source
        self.warn = warn
        self.unreliable = False

    def mfu(self, achieved_flops: float) -> float | None:
        """``achieved_flops / peak_flops``, or ``None`` when the peak is unknown or unreliable.

        The first value above 1.0 marks the peak unreliable (one ``RuntimeWarning``); from then on
        every call returns ``None``."""
        if not self.peak_flops or self.unreliable:
            return None
        value = achieved_flops / self.peak_flops
        if value <= 1.0:
            return value
        self.unreliable = True
        if self.warn:
            warnings.warn(self._message(value), RuntimeWarning, stacklevel=2)
        return None

    def _message(self, value: float) -> str:
        source = {"config": "the configured train.peak_flops",
                  "stamp": "the peak stamped by `course doctor --measure-peak` (measured while the machine "
                           "was busy?)",
                  "datasheet": "the datasheet peak"}.get(
            self.source, "the peak measured at start-up (too low on a busy machine)")
        fix = ("raise train.peak_flops to this device's real peak" if self.configured
               else "run `course doctor --measure-peak` on a quiet machine, or set train.peak_flops (FLOP/s "
                    "per device) to a peak measured on an idle machine, e.g. lab 02's figure")
        return (f"MFU would be {value:.0%}, above 100%: {source} of {self.peak_per_device:.3g} FLOP/s per "
                f"device is unreliable, so MFU is logged as absent (null) from here on; {fix}.")


def model_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of TinyGPT ``model`` at ``seq_len`` tokens of context (PaLM's
    6N + attention count, forward and backward): what MFU multiplies tokens/s by. N counts the
    parameters a token passes through (with experts: k of E, not all of them)."""
    from course_lib.estimate.flops import palm_flops_per_token

    mcfg = model.cfg
    return palm_flops_per_token(model.num_active_params(), n_layers=mcfg.n_layers, n_heads=mcfg.n_heads,
                                head_dim=mcfg.head_dim, seq_len=seq_len)
