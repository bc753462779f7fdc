"""Training data: what the trainer reads, and the tool that makes a token file from text.

| module | holds |
| --- | --- |
| ``tasks`` | synthetic tasks with known structure, byte-level text, random tokens; the rank-aware resumable sampler (``ShardedSampler``, ``BatchStream``); the trainer's stream from its config |
| ``tokens`` | ``data.task = "tokens"``: a uint16/uint32 token file through a memory map, checked at config time; the end-of-run validation loss |
| ``prepare`` | ``course data prepare``: a text file -> a token file (HuggingFace ``tokenizers``, local only) |
| ``files/`` | the bundled text the ``text`` task reads by default |

``from course_lib.data import BatchStream, MarkovTask`` is what a training script writes; names are
imported on first use.
"""
from __future__ import annotations

import importlib

_EXPORTS = {name: "tasks" for name in (
    "IGNORE_INDEX", "DEFAULT_TEXT", "mix_seed", "entropy_nats", "MarkovTask", "SequenceTask", "ByteText",
    "RandomTokens", "ShardedSampler", "BatchStream", "make_dataset", "dataset_from_config", "stream_from_config")}
_EXPORTS.update(TokenFile="tokens", open_tokens="tokens")
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
