"""What a checkpoint holds besides the weights, and how it leaves and re-enters live objects.

* :func:`to_cpu_copy`: the deep copy an async save takes on the training path;
* :func:`capture_rng` / :func:`restore_rng_state`: Python, NumPy, torch CPU and CUDA generators, in
  types that ``torch.load(weights_only=True)`` accepts;
* :func:`gather_train_state` / :func:`apply_state`: optimizer, scheduler, loss scaler, data position
  and any other ``state_dict()`` object, out of and back into the live objects.
"""
from __future__ import annotations

import copy
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .io import CheckpointError


@dataclass
class LoadResult:
    """A restored checkpoint: ``step`` (optimizer steps done), ``path`` (local directory),
    ``source`` ("local" or "mirror"), ``metrics``, ``seq`` (save order), ``manifest``."""

    step: int
    path: Path
    source: str
    metrics: dict
    seq: int
    manifest: dict


def state_of(obj: Any, label: str) -> Any:
    """``obj.state_dict()``, None for None; TypeError naming ``label`` if it has none."""
    if obj is None:
        return None
    if not hasattr(obj, "state_dict"):
        raise TypeError(f"{label} must have a state_dict() method, got {type(obj).__name__}")
    return obj.state_dict()


def gather_train_state(optimizer: Any, scheduler: Any, scaler: Any, data: Any,
                       stateful: dict[str, Any]) -> dict[str, Any]:
    """Everything but the weights that a bit-exact resume needs, as live references (the caller
    copies it with :func:`to_cpu_copy`): optimizer, scheduler, loss scaler, data position, any
    other ``state_dict()`` objects, and the RNG states."""
    return {"optimizer": state_of(optimizer, "optimizer"), "scheduler": state_of(scheduler, "scheduler"),
            "scaler": state_of(scaler, "scaler"), "data": state_of(data, "data"),
            "stateful": {k: state_of(v, f"stateful[{k!r}]") for k, v in stateful.items()},
            "rng": capture_rng()}


def to_cpu_copy(obj: Any, reuse: Any = None) -> Any:
    """Deep copy of a (nested dict/list/tuple) state with every tensor copied to CPU memory.
    This is what an async save does on the training path: afterwards training may change the
    originals freely. Non-tensor leaves are deep-copied too.

    ``reuse``: an earlier copy of the same structure whose buffers nobody reads any more; tensors of
    matching shape and dtype are copied into them instead of fresh memory (allocating and faulting
    in new pages costs more than the copy itself). GPU tensors go to pinned memory with
    non-blocking copies and one synchronization at the end, not one stall per tensor."""
    pending = [False]

    def walk(o: Any, r: Any) -> Any:
        if isinstance(o, torch.Tensor):
            o = o.detach()
            if (isinstance(r, torch.Tensor) and r.device.type == "cpu" and r.shape == o.shape
                    and r.dtype == o.dtype and r.is_contiguous()):
                out = r
            elif o.device.type == "cuda":
                out = torch.empty(o.shape, dtype=o.dtype, pin_memory=True)
            elif o.device.type == "cpu":
                return o.clone(memory_format=torch.contiguous_format)
            else:
                return o.to("cpu", copy=True)
            pending[0] |= o.device.type == "cuda"
            return out.copy_(o, non_blocking=o.device.type == "cuda")
        if isinstance(o, dict):
            r = r if isinstance(r, dict) else {}
            items = ((k, walk(v, r.get(k))) for k, v in o.items())
            return OrderedDict(items) if isinstance(o, OrderedDict) else dict(items)
        if isinstance(o, (list, tuple)):
            r = r if isinstance(r, (list, tuple)) and len(r) == len(o) else [None] * len(o)
            out = [walk(v, rv) for v, rv in zip(o, r)]
            return out if isinstance(o, list) else tuple(out)
        return copy.deepcopy(o)

    out = walk(obj, reuse)
    if pending[0]:
        torch.cuda.synchronize()  # the pinned copies must land before training overwrites the source
    return out


def capture_rng() -> dict[str, Any]:
    """RNG states of Python, NumPy, torch CPU and every CUDA device (when CUDA is initialised), in
    types that ``torch.load(weights_only=True)`` accepts (numpy's array becomes a tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`. CUDA states are restored when present and CUDA is usable."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def apply_state(model_state: dict[str, torch.Tensor], train_state: dict[str, Any], model: Any,
                optimizer: Any, scheduler: Any, scaler: Any, data: Any, stateful: dict[str, Any], *,
                restore_rng: bool = True, strict: bool = True) -> None:
    """Load a decoded checkpoint into the live objects (None ones are left alone); raises
    CheckpointError when an object was passed but the checkpoint holds no state for it."""
    if model is not None:
        model.load_state_dict(model_state, strict=strict)
    for obj, key in ((optimizer, "optimizer"), (scheduler, "scheduler"), (scaler, "scaler"), (data, "data")):
        if obj is not None:
            if train_state.get(key) is None:
                raise CheckpointError(f"the checkpoint holds no {key} state but a {key} was passed")
            obj.load_state_dict(train_state[key])
    for key, obj in stateful.items():
        if key not in train_state["stateful"]:
            raise CheckpointError(f"the checkpoint holds no stateful[{key!r}]; it has {sorted(train_state['stateful'])}")
        obj.load_state_dict(train_state["stateful"][key])
    if restore_rng:
        restore_rng_state(train_state["rng"])
