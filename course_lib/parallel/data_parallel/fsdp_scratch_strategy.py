"""The learner's ZeRO-3 in the trainer (``train.strategy = "fsdp-scratch"``).

:class:`~course_lib.parallel.SimpleFSDP` keeps 1/N of every Linear and Embedding weight per rank
(a flat, padded shard registered under the original name), gathers a layer's weights just before
it runs (forward and backward) and reduce-scatters its gradients; norms stay replicated. The
optimizer is the trainer's AdamW, grouped on the *original* shapes (decay on matrices) and then
moved to the shards by name, so every rank updates its shard exactly as one process would update
that slice. Gradient accumulation: every micro-batch reduce-scatters (ZeRO-3 must: the full
gradient is never kept), so accumulating costs one reduce-scatter per micro-batch.

Checkpoints are full (written by rank 0): the shards, and the optimizer's per-shard moments, are
gathered into the unsharded layout before a save and sliced again on load, so a checkpoint loads
on any world size and into a plain single-process model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.data_parallel.optimizer_rebuild import constructor_kwargs, groups_by_name, groups_for
from course_lib.parallel.data_parallel.simple_fsdp import SimpleFSDP
from course_lib.parallel.strategy import Distributed


class FSDPScratch(Distributed):
    """ZeRO-3 by hand behind the strategy interface (see the module docstring)."""

    name = "fsdp-scratch"
    checkpoint_formats = ("full",)  # flat padded shards are not DTensors: saved in the unsharded layout

    def setup(self, model: nn.Module, make_optimizer) -> None:
        base = make_optimizer(model)  # grouped on the original shapes
        named = groups_by_name(base, model)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(self.cfg["train"]["precision"])
        self.module = SimpleFSDP(model, compute_dtype=dtype, find_unused_parameters=False,  # no host read
                                 ignored_params=self.ignored_params())
        self.model = model  # the same tree, its weights now the shards (checkpoint names unchanged)
        self.optimizer = type(base)(groups_for(named, model), **constructor_kwargs(base))
        self._mask = None
        self.reduce_grad_sq = self._reduce_grad_sq

    def ignored_params(self) -> list[nn.Parameter]:
        """Parameters SimpleFSDP leaves out (neither broadcast, sharded nor averaged over the world):
        none here; expert parallelism's slices (expert_parallel.fsdp_scratch_in_trainer)."""
        return []

    def precision_policy(self, precision: str):
        """SimpleFSDP casts to its compute dtype itself (and keeps fp32 masters); fp16 still needs
        the trainer's loss scaling."""
        from course_lib.precision import make_policy

        return make_policy("fp16" if precision == "fp16" else "fp32", self.device)

    def forward_backward(self, batches, **step) -> torch.Tensor:
        loss = super().forward_backward(batches, **step)
        self.module.finish_gradient_synchronization()  # the replicated norms' gradients
        return loss

    def _reduce_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        # Same tensors on every rank: a shard's squared norm sums over ranks; a replicated
        # parameter's must count once (rank 0's), or the norm would be N times too big.
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self._mask is None or self._mask[0] != len(params):
            replicated = {id(p) for p in self.module._replicated}
            keep = [1.0 if self._counts_here(p, id(p) in replicated) else 0.0 for p in params]
            self._mask = (len(params), torch.tensor(keep, device=sq.device))
        out = sq * self._mask[1]
        dist.all_reduce(out)
        return out

    def _counts_here(self, p: nn.Parameter, replicated: bool) -> bool:
        """Whether this rank's squared norm of ``p`` enters the world sum: a shard's on every rank,
        a replicated tensor's on rank 0 only."""
        return not replicated or self.info.rank == 0

    def full_weights(self) -> dict[str, torch.Tensor]:
        return _FullModelView(self.module, gather=True).state_dict()

    # ---- checkpoints: gather to the unsharded layout, slice on load -----------------------------
    def checkpoint_state(self, state, *, saving: bool):
        """The :class:`TrainState` to save or load through: full-layout views of the sharded
        model and optimizer (collective when ``saving``)."""
        from dataclasses import replace

        view = _FullModelView(self.module, gather=saving)
        return replace(state, model=view, optimizer=_FullOptimizerView(self.module, self.optimizer, view,
                                                                       gather=saving))


def _shard_entries(fsdp: SimpleFSDP) -> dict[str, object]:
    """Original parameter name -> its _Shard (sharded ones; tied names share an entry)."""
    return {n: e for n, e in fsdp._entry_by_name.items() if e is not None}


class _FullModelView(nn.Module):
    """An nn.Module whose ``state_dict`` is the full, unsharded one (gathered once, at construction,
    when ``gather``) and whose ``load_state_dict`` takes a full one and keeps this rank's slices."""

    def __init__(self, fsdp: SimpleFSDP, gather: bool):
        super().__init__()
        object.__setattr__(self, "_fsdp", fsdp)  # not a submodule: state_dict is ours alone
        self._full = None
        if gather:
            full = fsdp.gather_full_params()
            sd = fsdp.module.state_dict()
            self._full = {k: (full[k] if k in full else v) for k, v in sd.items()}

    def state_dict(self, *args, **kwargs):
        if self._full is not None:
            return dict(self._full)
        # Shapes only (load checks them): the full shape of every sharded tensor, no data moved.
        sd = self._fsdp.module.state_dict()
        entries = _shard_entries(self._fsdp)
        return {k: (torch.empty(entries[k].shape, dtype=v.dtype, device="meta") if k in entries else v)
                for k, v in sd.items()}

    def load_state_dict(self, state_dict, strict: bool = True):
        entries = _shard_entries(self._fsdp)
        sliced = {}
        for k, v in state_dict.items():
            e = entries.get(k)
            sliced[k] = _slice_for_rank(v, e, self._fsdp) if e is not None else v
        return self._fsdp.module.load_state_dict(sliced, strict=strict)

    def named_parameters(self, *args, **kwargs):  # names for messages (optimizer_mismatch)
        return self._fsdp.module.named_parameters(*args, **kwargs)


def _slice_for_rank(full: torch.Tensor, entry, fsdp: SimpleFSDP) -> torch.Tensor:
    """This rank's padded flat slice of the full tensor ``full`` (the layout of _Shard)."""
    world, rank = fsdp.world_size, dist.get_rank(fsdp.process_group)
    per = entry.param.numel()
    flat = torch.zeros(per * world, dtype=full.dtype, device=full.device)
    flat[:entry.numel] = full.reshape(-1)
    return flat[rank * per:(rank + 1) * per].clone()


class _FullOptimizerView:
    """The optimizer seen in the unsharded layout: ``state_dict`` gathers each parameter's
    shard-shaped state (Adam's moments) into the full shape; ``load_state_dict`` slices it."""

    def __init__(self, fsdp: SimpleFSDP, optimizer: torch.optim.Optimizer, model_view: _FullModelView,
                 gather: bool):
        self._fsdp, self._opt = fsdp, optimizer
        by_id = self._shard_of()
        # Full-shape stand-ins (no data) so a loaded state is checked against the full layout.
        self.param_groups = [{**g, "params": [torch.empty(by_id[id(p)].shape, dtype=p.dtype, device="meta")
                                              if id(p) in by_id else p for p in g["params"]]}
                             for g in optimizer.param_groups]
        self.state = {}  # shapes are checked against the full layout, not the shards
        self._full = self._gather() if gather else None

    def _shard_of(self) -> dict[int, object]:
        return {id(e.param): e for e in self._fsdp._shards.values()}

    def _gather(self) -> dict:
        sd = self._opt.state_dict()
        sd["state"] = dict(sd["state"])
        by_id = self._shard_of()
        params = [p for g in self._opt.param_groups for p in g["params"]]
        world, pg = self._fsdp.world_size, self._fsdp.process_group
        for idx, p in enumerate(params):
            e, st = by_id.get(id(p)), sd["state"].get(idx)
            if e is None:
                continue
            st = dict(st) if st is not None else {}  # state_dict() shares the live dicts: copy
            sd["state"][idx] = st
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                # every rank has the same keys (same steps taken): the collectives stay aligned
                if key in st:
                    v = st[key]
                    out = torch.empty(v.numel() * world, dtype=v.dtype, device=v.device)
                    dist.all_gather_single(out, v.contiguous(), group=pg)
                    st[key] = out[:e.numel].view(e.shape).clone()
        return sd

    def state_dict(self) -> dict:
        if self._full is None:
            raise RuntimeError("the optimizer view was built for loading; build it with gather=True to save")
        return self._full

    def load_state_dict(self, state_dict: dict) -> None:
        by_id = self._shard_of()
        params = [p for g in self._opt.param_groups for p in g["params"]]
        sliced = {"param_groups": state_dict["param_groups"], "state": {}}
        for idx, st in state_dict["state"].items():
            e = by_id.get(id(params[idx])) if idx < len(params) else None
            sliced["state"][idx] = {k: (_slice_for_rank(v, e, self._fsdp) if e is not None and torch.is_tensor(v)
                                        and v.dim() > 0 else v) for k, v in st.items()}
        self._opt.load_state_dict(sliced)
