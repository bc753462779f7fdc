"""Expert parallelism with the from-scratch ZeRO-1 / ZeRO-2 (``parallel.ep > 1``, ``train.strategy``
"zero1" / "zero2").

The layout is :mod:`.in_trainer`'s (world = ep x expert-dp, each rank holds E / ep experts of every
MoE layer, tokens through all-to-all). The optimizer is two :class:`~course_lib.parallel.ShardedOptimizer`
behind one (:class:`ExpertShardedOptimizer`):

* the **dense** weights (everything but the expert slices) sharded over every rank, as plain ZeRO:
  their local gradients reduce-scattered over the world and divided by the world size;
* the **expert** slices sharded over the expert-data-parallel group (the ranks holding the same
  slice): their gradients reduce-scattered over that group and divided by the *world* size
  (``gradient_divide_factor``), because the combine's backward has already summed the tokens of
  the EP group: one process's gradient of the mean loss is the EDP group's sum / world, as in
  :class:`~.in_trainer.ExpertParallelDDP`. An EDP group of one rank (world = ep) has nothing to
  shard over: each rank then keeps its slices' optimizer state whole and only divides.

ZeRO-1 keeps every gradient buffer (the unowned ones zeroed), ZeRO-2 frees them. The stabilizer's
norm needs nothing new: Zero1's all-reduce of the per-tensor squares over the world adds, for an
expert tensor, the owner's slice norm within each EDP group (zeros elsewhere) over the EP group,
i.e. every expert exactly once; Zero2's total sums every rank's owned squares, each dense tensor
and each expert slice owned once. (Under zero2 the *per-tensor* norm a rank reports for an expert
weight is its slice's: the per-tensor rows are the owner's view, as ZeRO-2's are.)

Full checkpoints are in the one-process layout: the weights through :func:`.shard.gather_experts`,
the optimizer consolidated per part (dense on rank 0, each slice on its EDP group's first rank, which
are ranks 0..ep-1) and the expert moments all-gathered over EP group 0, so a file resumes at another
EP size, under ``ddp``/``fsdp`` EP, or in one process; loading slices a full state again.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.data_parallel.naive_ddp import broadcast_from_first_rank
from course_lib.parallel.data_parallel.optimizer_rebuild import constructor_kwargs
from course_lib.parallel.data_parallel.zero import ShardedOptimizer
from course_lib.parallel.data_parallel.zero_strategy import Zero1, Zero2
from course_lib.parallel.expert_parallel.group import EPGroup, make_ep_group
from course_lib.parallel.expert_parallel.in_trainer import _FullModelView, _gather, _slice
from course_lib.parallel.expert_parallel.shard import gather_experts, is_expert, shard_experts

_OPTIONS_SKIPPED = ("params", "param_names")


class ExpertShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (``zero2=False``) or ZeRO-2 over an expert-parallel model (see the module docstring).

    ``params``: the trainer optimizer's groups (the expert slices among them, marked by
    :func:`.shard.is_expert`); ``optimizer_cls`` and ``kwargs`` as :class:`ShardedOptimizer`'s.
    :attr:`param_groups` hold every parameter with the full options (lr schedulers write here; they
    are handed to both parts at each step). Collectives: :meth:`reduce_gradients`, :meth:`step`,
    :meth:`consolidate_state_dict`, on every rank together."""

    def __init__(self, params, optimizer_cls: type, ep: EPGroup, *, zero2: bool, **kwargs):
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)
        super().__init__(params, dict(probe.defaults))
        self.ep, self._cls, self._zero2 = ep, optimizer_cls, zero2
        self._world = dist.get_world_size()
        split = lambda expert: [{**{k: v for k, v in g.items() if k not in _OPTIONS_SKIPPED},  # noqa: E731
                                 "params": [p for p in g["params"] if is_expert(p) == expert]}
                                for g in self.param_groups]
        self.dense = ShardedOptimizer(split(False), optimizer_cls, reduce_scatter_grads=zero2,
                                      find_unused_parameters=False, **kwargs)
        if ep.edp_group is not None:
            self.experts = ShardedOptimizer(split(True), optimizer_cls, reduce_scatter_grads=zero2,
                                            process_group=ep.edp_group, find_unused_parameters=False,
                                            gradient_divide_factor=self._world, **kwargs)
        else:  # one rank per slice: nothing to shard over
            self.experts = optimizer_cls(split(True), **kwargs)
        self._consolidated: dict | None = None
        self.state = _JoinedState(self)  # this rank's shards of both parts (memory census, measure)

    def _parts(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.dense, self.experts

    def _flat(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def reduce_gradients(self, free_unowned: bool | None = None) -> None:
        """Reduce-scatter this step's local gradients (a collective): dense over the world, the
        expert slices over the expert-DP group; see :meth:`ShardedOptimizer.reduce_gradients`."""
        free = self._zero2 if free_unowned is None else free_unowned
        self.dense.reduce_gradients(free_unowned=free)
        if isinstance(self.experts, ShardedOptimizer):
            self.experts.reduce_gradients(free_unowned=free)
            return
        for g in self.experts.param_groups:  # world = ep: the EP group's sum is already in p.grad
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.div_(self._world)

    def step(self, closure=None):
        """Hand the options on, step both parts (each broadcasts its owners' new values)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts():
            for group, local in zip(self.param_groups, part.param_groups):
                for key, value in group.items():
                    if key not in _OPTIONS_SKIPPED:
                        local[key] = value
        self.dense.step()
        self.experts.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (both parts)."""
        for part in self._parts():
            part.zero_grad(set_to_none=set_to_none)

    # ---- checkpoints: the one-process layout ------------------------------------------------
    def consolidate_state_dict(self) -> None:
        """Collective: the one-process optimizer state (every expert's moments whole) on global
        rank 0, returned there by :meth:`state_dict`."""
        rank = dist.get_rank()
        self.dense.consolidate_state_dict(to=0)
        dense = self.dense.state_dict() if rank == 0 else None
        experts = None
        if isinstance(self.experts, ShardedOptimizer):
            self.experts.consolidate_state_dict(to=0)  # to each EDP group's first rank: ranks 0..ep-1
            if rank < self.ep.size:
                experts = self.experts.state_dict()
        else:
            experts = self.experts.state_dict()
        if rank < self.ep.size and self.ep.size > 1:  # EP group 0: the slices, gathered in expert order
            device = self._flat()[0].device  # nccl gathers device tensors
            experts = {**experts, "state": {
                i: {k: (_gather(v.to(device), self.ep).cpu() if torch.is_tensor(v) and v.dim() > 0 else v)
                    for k, v in st.items()} for i, st in sorted(experts["state"].items())}}
        if rank != 0:
            self._consolidated = None
            return
        flat = self._flat()
        index = {id(p): i for i, p in enumerate(flat)}
        state = {}
        for part, sd in ((self.dense, dense), (self.experts, experts)):
            params = [p for g in part.param_groups for p in g["params"]]
            for j, st in sd["state"].items():
                state[index[id(params[j])]] = st
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}

    def state_dict(self) -> dict:
        """The one-process state, on rank 0 after :meth:`consolidate_state_dict` (a RuntimeError
        elsewhere: each rank holds only its shards)."""
        if self._consolidated is None:
            raise RuntimeError("ExpertShardedOptimizer.state_dict: call consolidate_state_dict() on every rank "
                               "first; the one-process state is then on rank 0")
        out, self._consolidated = self._consolidated, None
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a one-process optimizer state on every rank: options for every parameter, the dense
        state to the world's shards, this EP rank's block of each expert's moments to its EDP shard."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(live["params"]) for g, live in zip(groups, self.param_groups)):
            raise ValueError("state_dict does not match this optimizer's parameter groups (count or sizes)")
        saved = state_dict.get("state", {})
        parts = {False: {"param_groups": [], "state": {}}, True: {"param_groups": [], "state": {}}}
        count = {False: 0, True: 0}
        for g, live in zip(groups, self.param_groups):
            opts = {k: v for k, v in g.items() if k not in _OPTIONS_SKIPPED}
            live.update(opts)
            ids = {False: [], True: []}
            for idx, p in zip(g["params"], live["params"]):
                expert = is_expert(p)
                n = count[expert]
                if idx in saved:
                    parts[expert]["state"][n] = {
                        k: (_slice(v, self.ep) if expert and torch.is_tensor(v) and v.dim() > 0 else v)
                        for k, v in saved[idx].items()}
                ids[expert].append(n)
                count[expert] += 1
            for expert in (False, True):
                parts[expert]["param_groups"].append({**opts, "params": ids[expert]})
        self.dense.load_state_dict(parts[False])
        self.experts.load_state_dict(parts[True])


class _JoinedState(Mapping):
    """Read-only ``{param: state}`` over both parts' local state, looked up at each access (a part's
    ``load_state_dict`` replaces its dict)."""

    def __init__(self, optimizer: ExpertShardedOptimizer):
        self._opt = optimizer

    def _maps(self):
        return self._opt.dense.state, self._opt.experts.state

    def __getitem__(self, key):
        for m in self._maps():
            if key in m:
                return m[key]
        raise KeyError(key)

    def __iter__(self):
        for m in self._maps():
            yield from m

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps())


class _FullShardedView:
    """The optimizer as the checkpoint loader sees it: the one-process parameter shapes (an expert
    slice as its full [E, ...] meta tensor) for the shape check, no live state, and the optimizer's
    own one-process ``state_dict`` / ``load_state_dict``."""

    def __init__(self, optimizer: ExpertShardedOptimizer):
        self._opt = optimizer
        size = optimizer.ep.size
        full = lambda p: torch.empty((p.shape[0] * size, *p.shape[1:]), dtype=p.dtype, device="meta")  # noqa: E731
        self.param_groups = [{**g, "params": [full(p) if is_expert(p) else p for p in g["params"]]}
                             for g in optimizer.param_groups]
        self.state = {}

    def state_dict(self) -> dict:
        """The consolidated one-process state (rank 0)."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep this rank's shards of a one-process state."""
        self._opt.load_state_dict(state_dict)


class ExpertParallelZero1(Zero1):
    """ZeRO-1 with expert parallelism: dense optimizer state sharded over the world, expert slices'
    over the expert-DP group (see the module docstring)."""

    name = "zero1"

    def setup(self, model: nn.Module, make_optimizer) -> None:
        self.ep = make_ep_group(self.cfg["parallel"]["ep"])
        broadcast_from_first_rank(model, None)  # one full model everywhere, then each rank keeps its experts
        self.dispatchers = shard_experts(model, self.ep, log=False)
        self.model = self.module = model
        base = make_optimizer(model)  # the trainer's optimizer, only to copy its groups and options
        self.optimizer = ExpertShardedOptimizer([dict(g) for g in base.param_groups], type(base), self.ep,
                                                zero2=self.free_unowned_grads, **constructor_kwargs(base))
        self.reduce_grad_sq = self._reduce_grad_sq

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The one-process state dict on every rank (experts gathered over the EP group: a collective)."""
        return gather_experts(self.model, self.ep)

    def checkpoint_state(self, state, *, saving: bool):
        """One-process views of the model and optimizer (consolidated and gathered when ``saving``:
        a collective)."""
        if saving:
            self.optimizer.consolidate_state_dict()
        return replace(state, model=_FullModelView(self.model, self.ep, gather=saving),
                       optimizer=_FullShardedView(self.optimizer))


class ExpertParallelZero2(ExpertParallelZero1):
    """ZeRO-2 with expert parallelism: as :class:`ExpertParallelZero1`, each rank keeping only the
    gradients it owns (its norm reduction is ZeRO-2's)."""

    name = "zero2"
    free_unowned_grads = True
    _reduce_grad_sq = Zero2._reduce_grad_sq
