"""Expert parallelism inside the trainer (``parallel.ep > 1``, ``train.strategy`` "ddp", "ddp-scratch"
or "fsdp"; "zero1" / "zero2" are :mod:`.zero_in_trainer`, "fsdp-scratch" :mod:`.fsdp_scratch_in_trainer`).

World = ep x expert-dp (:func:`.group.make_ep_group`: ep consecutive ranks share one set of experts).
Every rank builds the same full model (same seed), keeps its E / ep experts of every MoE layer and
routes their tokens through all-to-all (:func:`.shard.shard_experts`). Each rank reads its own data.
One process's gradient of the mean loss over the global batch is, for a non-expert weight, the mean
over every rank (plain data parallelism); for an expert weight, the sum over its expert-DP group
divided by the world size (the combine's backward has already summed the tokens of its EP group).

:class:`ExpertParallelDDP` (``ddp``): torch DDP with the expert slices *ignored* (DDP would otherwise
broadcast rank 0's experts at construction and average expert gradients over the world); after the
step's last micro-batch the expert gradients are all-reduced over the expert-DP group and divided by
the world size. The stabilizer's norm sums an expert slice's square over the EP group
(:attr:`reduce_grad_sq`). Full checkpoints in the one-process layout: experts and their AdamW
moments all-gathered over the EP group on save, sliced on load, so a file saved at ep = 2 resumes
at ep = 1, in one process, or at ep = 4, and the reverse.

:class:`ExpertParallelFSDP` (``fsdp``, torchtitan's layout): every expert weight becomes a DTensor on
an (edp, ep) device mesh, ``Shard(0)`` over ep and replicated over edp, and ``fully_shard`` on the
experts module with that mesh shards it over edp (``DataParallelMeshDims(shard="edp")``) with the
gradient divide factor set to the world size (FSDP2 would average over edp); the blocks and the root
are sharded over every rank as plain FSDP2. Every weight is then a DTensor under its one-process name
and global shape, so the stabilizer's norms complete themselves and sharded (DCP) checkpoints
reshard across EP sizes and into plain ``fsdp``.

The expert-bias update (DeepSeek-V3) needs nothing here: the router runs before the dispatch on
each rank's own tokens, and the trainer sums the loads over every rank before updating the bias.

:class:`ExpertParallelScratchDDP` (``ddp-scratch``): :class:`ExpertParallelDDP` over the kit's
ScratchDDP (BucketedDDP), the expert slices its ``ignored_params``.

With tp/pp > 1 the trainer's strategy is :class:`~course_lib.parallel.composed.model_parallel.ModelParallel`
and its experts are :mod:`course_lib.parallel.composed.experts` (folded over each pipeline stage's
dp x tp ranks, expert-tensor-parallel size 1, tp with sequence parallelism only).

DeepSpeed with experts (ZeRO 0-2) is :mod:`course_lib.parallel.deepspeed.experts`: the same slices,
reduced by DeepSpeed's engine over its own expert groups.

Not built (trainer.config refuses them with ep > 1, naming why): DeepSpeed's ZeRO-3 with experts,
ep with cp, ep with tp but no sequence parallelism (ETP = TP), sharded checkpoints under ``ddp`` /
``ddp-scratch``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.model.moe import moe_layers
from course_lib.parallel.data_parallel.fsdp2 import FSDP2
from course_lib.parallel.data_parallel.scratch_ddp import ScratchDDP
from course_lib.parallel.data_parallel.torch_ddp import TorchDDP
from course_lib.parallel.expert_parallel.group import EPGroup, make_ep_group
from course_lib.parallel.expert_parallel.shard import (gather_experts, is_expert, reduce_expert_gradients,
                                                       shard_experts)


class ExpertParallelDDP(TorchDDP):
    """torch DDP over the non-expert weights, experts sharded over ``parallel.ep`` ranks (see the
    module docstring). ``ep``: this rank's :class:`EPGroup` after :meth:`setup`."""

    name = "ddp"
    checkpoint_formats = ("full",)  # the expert slices are plain tensors: saved gathered, one-process layout

    def setup(self, model: nn.Module, make_optimizer) -> None:
        self.ep = make_ep_group(self.cfg["parallel"]["ep"])
        self.dispatchers = shard_experts(model, self.ep, log=False)  # the run's own dispatchers: idle_experts, no log
        experts = [n for n, p in model.named_parameters() if is_expert(p)]
        self._experts = [p for p in model.parameters() if is_expert(p)]  # what wrap() leaves out
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
        self.model = model
        self.module = self.wrap(model)
        self.optimizer = make_optimizer(model)
        self._mask = None
        self.reduce_grad_sq = self._reduce_grad_sq

    def forward_backward(self, batches, **step) -> torch.Tensor:
        loss = super().forward_backward(batches, **step)  # DDP averaged the rest with the last micro-batch
        self._reduce_experts()
        return loss

    def _reduce_experts(self) -> None:
        # One process's expert gradient: the sum over the expert-DP group / the world size.
        reduce_expert_gradients(self._experts, self.ep)

    def _reduce_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        # Per-tensor squared norms, in the order of the parameters with a gradient (GradientMonitor):
        # an expert slice's sums over the EP group, a replicated tensor's is already whole.
        if self.ep.group is None:
            return sq
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self._mask is None or self._mask.numel() != len(params):
            self._mask = torch.tensor([1.0 if is_expert(p) else 0.0 for p in params], device=sq.device)
        expert = sq * self._mask
        dist.all_reduce(expert, group=self.ep.group)
        return sq * (1 - self._mask) + expert

    def full_weights(self) -> dict[str, torch.Tensor]:
        return gather_experts(self.model, self.ep)

    def checkpoint_state(self, state, *, saving: bool):
        """Full-layout views of the model and optimizer (gathered over the EP group when ``saving``:
        a collective)."""
        from dataclasses import replace

        view = _FullModelView(self.model, self.ep, gather=saving)
        return replace(state, model=view, optimizer=_FullOptimizerView(self.model, self.optimizer, self.ep,
                                                                       gather=saving))


class ExpertParallelScratchDDP(ExpertParallelDDP, ScratchDDP):
    """:class:`ExpertParallelDDP` with the from-scratch :class:`ScratchDDP` (BucketedDDP) in place of
    torch DDP (``train.strategy = "ddp-scratch"``): the expert slices are BucketedDDP's
    ``ignored_params`` (neither broadcast nor bucketed over the world); its forward_backward finishes
    the dense buckets' sync, then :class:`ExpertParallelDDP`'s reduces the experts over expert-DP."""

    name = "ddp-scratch"

    def ignored_params(self) -> list[nn.Parameter]:
        """The expert slices (set by setup before the model is wrapped)."""
        return self._experts


def _expert_names(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if is_expert(p)}


def _slice(full: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """This EP rank's block of experts (dim 0) of a full [E, ...] tensor."""
    per = full.shape[0] // ep.size
    return full[ep.rank * per:(ep.rank + 1) * per].clone()


def _gather(t: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """The full [E, ...] tensor from every EP rank's [E / ep, ...] slice (a collective)."""
    parts = [torch.empty_like(t) for _ in range(ep.size)]
    dist.all_gather(parts, t.contiguous(), group=ep.group)
    return torch.cat(parts)


class _FullModelView(nn.Module):
    """``state_dict``: the one-process state dict (gathered at construction when ``gather``, else
    full-shaped meta tensors for the loader's shape check); ``load_state_dict``: keeps this rank's
    experts of a full one."""

    def __init__(self, model: nn.Module, ep: EPGroup, gather: bool):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: state_dict is ours alone
        object.__setattr__(self, "_ep", ep)
        self._full = gather_experts(model, ep) if gather else None

    def state_dict(self, *args, **kwargs):
        if self._full is not None:
            return dict(self._full)
        experts = _expert_names(self._model)
        return {k: (torch.empty((v.shape[0] * self._ep.size, *v.shape[1:]), dtype=v.dtype, device="meta")
                    if k in experts else v) for k, v in self._model.state_dict().items()}

    def load_state_dict(self, state_dict, strict: bool = True):
        experts = _expert_names(self._model)
        return self._model.load_state_dict({k: (_slice(v, self._ep) if k in experts else v)
                                            for k, v in state_dict.items()}, strict=strict)

    def named_parameters(self, *args, **kwargs):  # names for the loader's messages
        return self._model.named_parameters(*args, **kwargs)


class _FullOptimizerView:
    """The optimizer in the one-process layout: an expert's AdamW moments gathered over the EP
    group (``state_dict``), sliced again on ``load_state_dict``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ep: EPGroup, gather: bool):
        self._opt, self._ep = optimizer, ep
        self._experts = {id(p) for p in _expert_names(model).values()}
        full = lambda p: torch.empty((p.shape[0] * ep.size, *p.shape[1:]), dtype=p.dtype, device="meta")  # noqa: E731
        self.param_groups = [{**g, "params": [full(p) if id(p) in self._experts else p for p in g["params"]]}
                             for g in optimizer.param_groups]
        self.state = {}  # shapes are checked against the full layout, not the slices
        self._full = self._gather() if gather else None

    def _params(self) -> list:
        return [p for g in self._opt.param_groups for p in g["params"]]

    def _gather(self) -> dict:
        sd = self._opt.state_dict()
        sd["state"] = dict(sd["state"])
        for idx, p in enumerate(self._params()):
            st = sd["state"].get(idx)
            if id(p) not in self._experts or st is None:
                continue  # every rank has the same keys (same steps taken): the collectives stay aligned
            sd["state"][idx] = {k: (_gather(v, self._ep) if torch.is_tensor(v) and v.dim() > 0 else v)
                                for k, v in st.items()}
        return sd

    def state_dict(self) -> dict:
        if self._full is None:
            raise RuntimeError("the optimizer view was built for loading; build it with gather=True to save")
        return self._full

    def load_state_dict(self, state_dict: dict) -> None:
        params = self._params()
        sliced = {"param_groups": state_dict["param_groups"], "state": {}}
        for idx, st in state_dict["state"].items():
            expert = idx < len(params) and id(params[idx]) in self._experts
            sliced["state"][idx] = {k: (_slice(v, self._ep) if expert and torch.is_tensor(v) and v.dim() > 0 else v)
                                    for k, v in st.items()}
        self._opt.load_state_dict(sliced)


_MESHES: dict = {}


class ExpertParallelFSDP(FSDP2):
    """FSDP2 with experts: every expert weight a DTensor on an (edp, ep) mesh, Shard(0) over ep
    (each EP rank its block of experts), sharded again by FSDP2 over edp; every other weight sharded
    over the world, block by block (see the module docstring)."""

    name = "fsdp"

    def setup(self, model: nn.Module, make_optimizer) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
        from torch.distributed.tensor import DTensor, Replicate, Shard

        world, ep = self.info.world_size, self.cfg["parallel"]["ep"]
        self.ep = make_ep_group(ep)
        self.dispatchers = shard_experts(model, self.ep, log=False)
        # One mesh per layout per process: FSDP2 keeps the first (edp, ep) mesh it saw and refuses
        # DTensors on an equal but new one (a second trainer run in the same process, e.g. a resume).
        key = (self.device.type, world // ep, ep)
        if key not in _MESHES:
            _MESHES[key] = init_device_mesh(self.device.type, key[1:], mesh_dim_names=("edp", "ep"))
        mesh = _MESHES[key]
        options = self._fsdp_options()
        for m in moe_layers(model):
            m.experts.local_count = m.experts.n_local
            for name in ("gate", "up", "down"):
                local = getattr(m.experts, name)
                p = nn.Parameter(DTensor.from_local(local.detach(), mesh, [Replicate(), Shard(0)], run_check=False))
                p.is_expert = True
                setattr(m.experts, name, p)
            fully_shard(m.experts, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="edp"),
                        **{k: v for k, v in options.items() if k != "mesh"})
            # FSDP2 averages over edp; one process's gradient is the sum over the world / world
            m.experts.set_gradient_divide_factor(float(world))
            if dist.get_backend() == "gloo" and world > ep:
                # A custom factor is NCCL's PREMUL_SUM, which gloo lacks: sum, then FSDP divides. Not
                # over an edp group of 1: torch 2.13 then divides twice (its no-collective path divides too).
                m.experts.set_force_sum_reduction_for_comms(True)
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        self.model = self.module = model
        self.optimizer = make_optimizer(model)
