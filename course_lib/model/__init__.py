"""The model: TinyGPT, one small decoder-only transformer with GPT-2 and Llama switches.

| module | holds |
| --- | --- |
| ``config`` | ``ModelConfig`` and the named presets, torch-free (config validation and ``course plan`` import no torch) |
| ``layers`` | norms, rotary positions, attention, MLPs, the transformer block |
| ``tinygpt`` | ``TinyGPT``: the blocks put together, memory strategies, initialisation |

``from course_lib.model import TinyGPT, ModelConfig`` is what a training script writes. Names are
imported on first use, so reading the config alone never imports torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"ModelConfig": "config", "PRESETS": "config", "INIT_SCHEMES": "config", "CHECKPOINTING": "config",
            "TinyGPT": "tinygpt"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
