"""Strategy names -> implementations, without importing torch (the config validator lists them).

A new parallel form adds one line here and one module that subclasses
:class:`course_lib.parallel.strategy.Strategy`.
"""
from __future__ import annotations

import importlib
from typing import Any

STRATEGIES: dict[str, tuple[str, str, str]] = {  # name -> (module, class, one-line description)
    "single": ("course_lib.parallel.strategy", "Single", "one process, the reference"),
    "ddp": ("course_lib.parallel.data_parallel.torch_ddp", "TorchDDP",
            "torch DistributedDataParallel: replicated weights, bucketed gradient all-reduce"),
    "ddp-scratch": ("course_lib.parallel.data_parallel.scratch_ddp", "ScratchDDP",
                    "the from-scratch BucketedDDP in place of torch DDP: the same numbers"),
}


def strategy_names() -> tuple[str, ...]:
    """The names ``train.strategy`` accepts."""
    return tuple(STRATEGIES)


def make_strategy(name: str, info: Any, device: Any):
    """Build the strategy called ``name`` for this rank (``info``: DistInfo, ``device``: where
    the model computes). ValueError naming the accepted names otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {name!r}")
    module, cls, _ = STRATEGIES[name]
    return getattr(importlib.import_module(module), cls)(info, device)
