"""``course ckpt consolidate --with-optimizer``: the AdamW state of one checkpoint, whole, by name.

The file it writes (``FILE.optim.pt``) holds torch's own *name-keyed* optimizer state dict, the
one ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(..., full_state_dict=True)``
returns and ``set_optimizer_state_dict`` loads into a plain single-process model::

    {"state": {"blocks.0.attn.q_proj.weight": {"step": t, "exp_avg": t, "exp_avg_sq": t}, ...},
     "param_groups": [{"lr": ..., "betas": ..., "weight_decay": ..., "params": [names]}, ...]}

Every tensor is full (no shard) and on the CPU, and the file loads with ``weights_only=True``.
A tied head has one entry, under ``tok_emb.weight`` (``named_parameters`` lists a shared matrix
once).

Where it comes from, by format:

* sharded (DCP: fsdp, fsdp x tp/cp): the ``optim`` half of the checkpoint is already name-keyed
  (the trainer saved it with ``get_state_dict``); DCP's planner stitches every rank's shards.
* full (single, ddp, the scratch forms, the composed tp/pp layouts): ``train_state.pt`` holds the
  dense model's AdamW state keyed by position; the positions are the order of
  ``TinyGPT.param_groups`` (what the trainer built the optimizer from), so they map to names.
* DeepSpeed: its ZeRO optimizer keeps flat fp32 partitions that only DeepSpeed's own converter
  (``deepspeed.checkpoint.ds_to_universal``) splits back into parameters; refused, naming it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from course_lib.ckpt.runs import DEEPSPEED, FULL, SHARDED, CkptError, Found


def _sharded(path: Path) -> dict:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from course_lib.checkpoint.dcp_trust import RestrictedFileSystemReader, SafeLoadPlanner

    class _OptimOnly(_EmptyStateDictLoadPlanner):
        load_bytes = SafeLoadPlanner.load_bytes  # non-tensor items: weights_only, never pickle

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=RestrictedFileSystemReader(str(path)),
                     planner=_OptimOnly(keys={"optim"}), no_dist=True)
    optim = state.get("optim")
    if not isinstance(optim, dict) or not optim.get("state"):
        raise CkptError(f"{path}: the checkpoint holds no optimizer state (saved without an optimizer)")
    return {"state": optim["state"], "param_groups": optim["param_groups"]}


def _dense_names(mcfg, weight_decay: float) -> list[str]:
    """Parameter names in the order the trainer gave them to AdamW (``TinyGPT.param_groups``)."""
    from course_lib.model import TinyGPT

    with torch.device("meta"):  # names and order only: no memory
        model = TinyGPT(mcfg)
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in model.param_groups(weight_decay) for p in g["params"]]


def _full(found: Found, mcfg, cfg: dict, train_state: dict) -> dict:
    saved = train_state.get("optimizer")
    if not isinstance(saved, dict) or not saved.get("state"):
        raise CkptError(f"{found.path}: the checkpoint holds no optimizer state (saved without an optimizer)")
    names = _dense_names(mcfg, cfg["optim"]["weight_decay"])
    positions = [i for g in saved["param_groups"] for i in g["params"]]
    if sorted(positions) != list(range(len(names))):
        raise CkptError(f"{found.path}: its optimizer state covers {len(positions)} parameters in "
                        f"{len(saved['param_groups'])} groups, the run's model has {len(names)}; it was not "
                        f"saved in the dense model's order (a strategy whose optimizer state only its own "
                        f"loader reads)")
    state = {names[int(i)]: dict(moments) for i, moments in saved["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]}
              for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def optimizer_state(found: Found, mcfg, cfg: dict, train_state: dict | None = None) -> dict:
    """The name-keyed, full, CPU AdamW state dict of checkpoint ``found`` (see the module doc).
    ``train_state``: a full checkpoint's, as ``runs.pick`` read it (required for that format: the
    files are read once). CkptError for a DeepSpeed checkpoint or one saved without an optimizer,
    naming it."""
    if found.format == SHARDED:
        out = _sharded(found.path)
    elif found.format == FULL:
        if train_state is None:
            raise ValueError(f"{found.path}: a full checkpoint's train_state is required (runs.pick returns it)")
        out = _full(found, mcfg, cfg, train_state)
    elif found.format == DEEPSPEED:
        raise CkptError(f"{found.path}: --with-optimizer reads full and sharded checkpoints; DeepSpeed's ZeRO "
                        f"optimizer state is flat fp32 partitions that DeepSpeed's own converter splits by "
                        f"parameter (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                        f"{found.path} ...); the weights alone consolidate without --with-optimizer")
    else:
        raise CkptError(f"{found.path}: unknown checkpoint format {found.format!r}")
    _check_names(found, out["state"], mcfg)
    return {"state": {k: {m: v.detach().cpu().contiguous() if torch.is_tensor(v) else v for m, v in d.items()}
                      for k, d in out["state"].items()},
            "param_groups": out["param_groups"]}


def _check_names(found: Found, state: dict, mcfg) -> None:
    """Every entry names a parameter of the run's model with its shape (a moment is shaped like its
    parameter; ``step`` is a scalar)."""
    from course_lib.model.hf_map import tinygpt_shapes

    shapes = tinygpt_shapes(mcfg)
    for name, moments in state.items():
        if name not in shapes:
            raise CkptError(f"{found.path}: optimizer state for {name!r}, which the run's model does not have")
        for key, value in moments.items():
            if torch.is_tensor(value) and value.dim() and tuple(value.shape) != shapes[name]:
                raise CkptError(f"{found.path}: optimizer {key} of {name} has shape {tuple(value.shape)}, "
                                f"the parameter has {shapes[name]}")
