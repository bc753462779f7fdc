"""What a checkpoint holds besides the weights, and how it leaves and re-enters live objects.

* :func:`to_cpu_copy`: the deep copy an async save takes on the training path;
* :func:`capture_rng` / :func:`restore_rng_state`: Python, NumPy, torch CPU and CUDA generators, in
  types that ``torch.load(weights_only=True)`` accepts;
* :func:`capture_rank_state`: one rank's RNG and data position (the writer saves one per rank);
* :func:`gather_train_state` / :func:`apply_state`: optimizer, scheduler, loss scaler, data position
  and any other ``state_dict()`` object, out of and back into the live objects; a checkpoint that
  does not fit (:func:`model_mismatch`, :func:`optimizer_mismatch`) is refused before anything
  is loaded.
"""
from __future__ import annotations

import copy
import random
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .io import CheckpointLoadError


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


def capture_rank_state(data: Any = None) -> dict[str, Any]:
    """This rank's part of a checkpoint: ``{"rng": capture_rng(), "data": data.state_dict() or
    None}``, in types that ``torch.load(weights_only=True)`` accepts. The trainer gathers one per
    rank to the writer and passes the list, indexed by global rank, as ``save(rank_states=...)``."""
    return {"rng": capture_rng(), "data": state_of(data, "data")}


# Optimizer state entries that have their parameter's shape (Adam, AdamW, SGD momentum, RMSprop,
# Adadelta, Adagrad, ASGD, NAdam, RAdam, Rprop...). Others (Adafactor's factored row/column
# variances, scalars) are compared only with the live optimizer's own state when it has one.
PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                                "square_avg", "acc_delta", "grad_avg", "sum", "ax", "prev",
                                "step_size", "exp_inf"})


def _shape(t: Any) -> tuple:
    return tuple(t.shape)


def _listed(items: list[str], limit: int = 5) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def model_mismatch(model_state: dict[str, torch.Tensor], model: torch.nn.Module, strict: bool = True) -> list[str]:
    """Why ``model_state`` does not fit ``model`` (empty when it does): the first tensors whose
    shapes differ (checkpoint shape vs model shape), and with ``strict`` the missing and unexpected
    keys. Reads shapes only; nothing is copied."""
    live = model.state_dict()
    problems = []
    shapes = [f"{k}: checkpoint {_shape(model_state[k])} vs model {_shape(v)}"
              for k, v in live.items() if k in model_state and _shape(model_state[k]) != _shape(v)]
    if shapes:
        problems.append(f"tensor shapes differ ({_listed(shapes)})")
    if strict:
        missing = [k for k in live if k not in model_state]
        unexpected = [k for k in model_state if k not in live]
        if missing:
            problems.append(f"missing from the checkpoint: {_listed(missing)}")
        if unexpected:
            problems.append(f"unexpected in the checkpoint (not in the model): {_listed(unexpected)}")
    return problems


def optimizer_mismatch(saved: Any, optimizer: Any, model: Any = None) -> list[str]:
    """Why a saved ``optimizer.state_dict()`` does not fit ``optimizer`` (empty when it does, or
    when either is not the usual ``param_groups``/``state`` layout): group count and sizes, and
    state tensors whose shapes differ from their parameter's (or from the live state's)."""
    if not (isinstance(saved, dict) and isinstance(saved.get("param_groups"), list)
            and isinstance(saved.get("state"), dict) and hasattr(optimizer, "param_groups")):
        return []
    groups, live = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(live):
        return [f"optimizer: the checkpoint has {len(groups)} parameter group(s), the optimizer {len(live)}"]
    sizes = [f"group {i}: {len(g.get('params', []))} in the checkpoint vs {len(lg['params'])} in the optimizer"
             for i, (g, lg) in enumerate(zip(groups, live)) if len(g.get("params", [])) != len(lg["params"])]
    if sizes:
        return [f"optimizer parameter groups differ in size ({_listed(sizes)})"]
    names = {id(p): n for n, p in model.named_parameters()} if isinstance(model, torch.nn.Module) else {}
    live_state = getattr(optimizer, "state", {})
    shapes = []
    for g, lg in zip(groups, live):
        for idx, p in zip(g["params"], lg["params"]):
            st = saved["state"].get(idx)
            if not isinstance(st, dict):
                continue
            mine = live_state.get(p, {}) if isinstance(live_state, dict) else {}
            for key, v in st.items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                ref = mine.get(key)
                want = _shape(ref) if isinstance(ref, torch.Tensor) else (
                    _shape(p) if key in PARAM_SHAPED_STATE else None)
                if want is not None and _shape(v) != want:
                    shapes.append(f"{key} of {names.get(id(p), f'parameter {idx}')}: checkpoint {_shape(v)} vs {want}")
    return [f"optimizer state shapes differ ({_listed(shapes)})"] if shapes else []


def apply_state(model_state: dict[str, torch.Tensor], train_state: dict[str, Any], model: Any,
                optimizer: Any, scheduler: Any, scaler: Any, data: Any, stateful: dict[str, Any], *,
                restore_rng: bool = True, strict: bool = True, rank: int = 0,
                label: str = "the checkpoint") -> None:
    """Load a decoded checkpoint into the live objects (None ones are left alone).

    First everything is checked - model keys and shapes, the optimizer's groups and state shapes,
    that the checkpoint holds a state for every object passed - and only then is anything loaded,
    so a checkpoint that does not fit raises CheckpointLoadError (naming ``label``) with every
    live object untouched. ``rank``: with per-rank states in the checkpoint (``rank_states``),
    this rank's RNG and data position are restored; a rank beyond those saved (the world grew)
    gets rank 0's data position and keeps its RNG, with a warning."""
    problems: list[str] = []
    if model is not None:
        problems += model_mismatch(model_state, model, strict)
    if optimizer is not None and train_state.get("optimizer") is not None:
        problems += optimizer_mismatch(train_state["optimizer"], optimizer, model)
    rng_state, data_state, note = train_state.get("rng"), train_state.get("data"), None
    rank_states = train_state.get("rank_states")
    if rank_states:
        if rank < len(rank_states):
            mine = rank_states[rank]
            rng_state = mine.get("rng")
            data_state = mine["data"] if mine.get("data") is not None else data_state
        else:
            rng_state = None
            first = rank_states[0].get("data")
            data_state = first if first is not None else data_state
            note = (f"checkpoint {label} holds per-rank state for {len(rank_states)} rank(s); rank {rank} "
                    f"has none (the world grew): its data position comes from rank 0 and its RNG is left as it is")
    wanted = {"optimizer": train_state.get("optimizer"), "scheduler": train_state.get("scheduler"),
              "scaler": train_state.get("scaler"), "data": data_state}
    for obj, key in ((optimizer, "optimizer"), (scheduler, "scheduler"), (scaler, "scaler"), (data, "data")):
        if obj is not None and wanted[key] is None:
            problems.append(f"it holds no {key} state but a {key} was passed")
    saved_stateful = train_state.get("stateful") or {}
    missing = [k for k in stateful if k not in saved_stateful]
    if missing:
        problems.append(f"it holds no stateful{missing}; it has {sorted(saved_stateful)}")
    if restore_rng and rng_state is None and note is None:
        problems.append("it holds no RNG state (pass restore_rng=False to keep the current one)")
    if problems:
        raise CheckpointLoadError(f"checkpoint {label} does not fit the objects passed to load(); nothing "
                                  f"was loaded: " + "; ".join(problems), [(label, "; ".join(problems))])
    if note is not None:
        warnings.warn(note, RuntimeWarning, stacklevel=3)
    what = "model"
    try:
        if model is not None:
            model.load_state_dict(model_state, strict=strict)
        for obj, key in ((optimizer, "optimizer"), (scheduler, "scheduler"), (scaler, "scaler"), (data, "data")):
            if obj is not None:
                what = key
                obj.load_state_dict(wanted[key])
        for key, obj in stateful.items():
            what = f"stateful[{key!r}]"
            obj.load_state_dict(saved_stateful[key])
        if restore_rng and rng_state is not None:
            what = "RNG"
            restore_rng_state(rng_state)
    except Exception as e:  # not corruption: the bytes verified; the live object refused them
        raise CheckpointLoadError(f"checkpoint {label}: restoring the {what} state failed: {e!r}. The checkpoint "
                                  f"itself verified; the objects loaded before the {what} now hold its state",
                                  [(label, repr(e))]) from e
