"""Everything the training loop (``course_lib/train.py``) calls, one module per job.

| module | job |
| --- | --- |
| ``config`` | the TOML + overrides, validated before anything runs (``load``, ``ConfigError``) |
| ``args`` | the command line, without torch (``build_parser``) |
| ``check_config`` | ``--check-config``: the layout checked for the world size a launcher set |
| ``startup`` | the start-up facts: device, process group, rank seeds, MFU's peak, stabilizer, optimizer |
| ``progress`` | what a step reports: the metrics row, the progress bar, events, the closing summary |
| ``metrics`` | ``metrics.jsonl`` (crash-safe) and TensorBoard |
| ``wandb_log`` | ``[wandb]``: one W&B run per training run, resumed with it |
| ``mfu`` | the CPU's measured matmul peak, FLOPs per token, the MFU-above-100% guard |
| ``utilization`` | CPU/GPU utilization sampled beside the steps |
| ``profiling``, ``profile_summary`` | ``--profile``: torch.profiler over chosen steps, and the trace read back |

``from course_lib.trainer import load, MetricsLog`` is what a script of one's own writes; names are
imported on first use (the config and the command line never import torch).
"""
from __future__ import annotations

import importlib

_EXPORTS = {"load": "config", "ConfigError": "config", "defaults": "config", "build_model_config": "config",
            "MetricsLog": "metrics", "read_rows": "metrics"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
