"""Expert parallelism through DeepSpeed's own MoE machinery (``parallel.ep > 1`` with
``train.strategy = "deepspeed"``, ZeRO stage 0, 1 or 2).

The model is the kit's: each rank keeps E / ep experts of every MoE layer and routes their tokens
through the kit's all-to-all (:func:`course_lib.parallel.expert_parallel.shard.shard_experts`),
exactly as under ``ddp`` or ``zero1``. What changes is who reduces the expert gradients: DeepSpeed's
engine, with its own expert groups.

* **Groups.** DeepSpeed's ``groups._create_expert_and_data_parallel(ep)`` builds the expert-parallel
  groups (ep consecutive ranks) and the expert-data-parallel groups (ranks ep apart) under the
  name ``ep_size_<ep>``: the layout of :func:`course_lib.parallel.expert_parallel.group.make_ep_group`
  (checked rank by rank here). The kit's dispatcher runs its all-to-all over DeepSpeed's EP group.
* **Expert parameters.** DeepSpeed calls a parameter an expert's when ``param.allreduce`` is False;
  ``param.group_name`` names its groups. The kit's expert slices get both, so the engine splits them
  into their own optimizer groups (``'moe': True``), ZeRO-1/2 partitions those over the
  expert-data-parallel group instead of the world, and the gradient reduction (ZeRO-0's
  ``_reduce_expert_gradients``, ZeRO-1/2's bucket reduce) sums them over expert-DP only.
* **The engine's switch.** DeepSpeed turns all of that on only when it finds one of its own MoE
  classes in the model (``engine.has_moe_layers``), and the kit's MoE layer is not one:
  :class:`_KitMoEEngine` sets the switch for a model with marked expert slices, before the engine
  builds its optimizer. It is the engine ``deepspeed.initialize`` builds while :func:`_engine_class`
  is in force; the strategy checks afterwards that it was.
* **Gradient scale.** One process's gradient of the mean loss is, for an expert weight, the sum
  over its expert-DP group divided by the *world* size: the combine's backward has already summed
  the tokens of the EP group (see :mod:`course_lib.parallel.expert_parallel.in_trainer`). DeepSpeed
  0.19 divides by the same number (ZeRO-0: ``dp_world_size`` "to maintain the gradients value
  unaffected by ep_size"; ZeRO-1/2: the whole bucket by the data-parallel world before the reduce),
  so no factor is added here; tests/deepspeed_rank_fns.py holds the expert gradients to one
  process's, which a divide by the expert-DP size instead would break.
* **Gradient norm.** ZeRO-0 in fp32 leaves the reduced gradients in ``p.grad``: the stabilizer's
  norm sums an expert slice's square over the EP group (:meth:`ExpertParallelDeepSpeed._reduce_grad_sq`,
  as under ``ddp``). ZeRO-1/2 clip inside DeepSpeed, whose norm sums every rank's partition over the
  world (each expert slice once per EP rank, each partition once per expert-DP rank).
* **Checkpoints.** ``engine.save_checkpoint`` writes the optimizer state (ZeRO: each rank's
  partitions, expert groups included; ZeRO-0: one file per EP rank) but its model file holds rank
  0's module only, and DeepSpeed's per-expert files are written for its own MoE classes only. So
  each rank's expert slices also go into the kit's ``rank{R}.pt`` and are put back after
  ``engine.load_checkpoint``: a resume at the same ep is bit-exact. Another ep is refused (the
  partitions of the expert groups follow the expert-DP groups), and
  :func:`course_lib.parallel.deepspeed.checkpoints.deepspeed_to_state_dict` joins the slices into
  the one-process layout (weights only).

Not here (trainer.config refuses them, naming why): ZeRO-3 (DeepSpeed partitions expert parameters
at stage 3 only for its own AutoEP layers and stops with "MoE not supported with Stage 3" for any
other MoE), ZeRO-Offload (its CPU gradient buffers were not tried with the expert groups). Nor is
the kit's MoE layer put inside DeepSpeed's ``deepspeed.moe.layer.MoE``: the router, capacity and
dispatch stay the kit's.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.model.moe import moe_layers
from course_lib.parallel.deepspeed.engine import DeepSpeedStrategy
from course_lib.parallel.expert_parallel.group import EPGroup
from course_lib.parallel.expert_parallel.in_trainer import ExpertParallelDDP
from course_lib.parallel.expert_parallel.shard import gather_experts, is_expert, shard_experts


def group_name(ep: int) -> str:
    """DeepSpeed's name of the expert groups of size ``ep`` (``param.group_name`` of an expert)."""
    return f"ep_size_{ep}"


def deepspeed_ep_group(ep: int) -> EPGroup:
    """This rank's :class:`EPGroup` over DeepSpeed's own expert groups for ``ep`` (a collective the
    first time: DeepSpeed creates every EP and expert-DP group; later calls reuse them). RuntimeError
    when DeepSpeed laid the ranks out otherwise than the kit's EP groups (consecutive) and expert-DP
    groups (ranks ep apart)."""
    from deepspeed.utils import groups

    world, me = dist.get_world_size(), dist.get_rank()
    if ep < 2 or world % ep:
        raise ValueError(f"parallel.ep must be >= 2 and divide the world size {world}, got {ep}")
    name = group_name(ep)
    groups._create_expert_and_data_parallel(ep)  # creates nothing when the groups already exist
    ep_ranks = list(groups._get_expert_parallel_group_ranks(name))
    edp_ranks = list(groups._get_expert_data_parallel_group_ranks(name))
    first = me - me % ep
    if ep_ranks != list(range(first, first + ep)) or edp_ranks != list(range(me % ep, world, ep)):
        raise RuntimeError(f"DeepSpeed's expert groups {name} put rank {me} with EP ranks {ep_ranks} and expert-DP "
                           f"ranks {edp_ranks}; the kit's dispatch and checkpoints assume consecutive EP groups and "
                           f"expert-DP groups of ranks ep apart")
    edp = groups._get_expert_data_parallel_group(name) if world // ep > 1 else None
    return EPGroup(groups._get_expert_parallel_group(name), me % ep, ep, edp, world // ep)


def mark_experts(model: nn.Module, ep: int) -> list[nn.Parameter]:
    """Mark every expert slice of ``model`` (after shard_experts) as a DeepSpeed expert parameter of
    the ``ep`` groups: ``allreduce = False``, ``group_name = "ep_size_<ep>"``. Returns them."""
    out = []
    for p in model.parameters():
        if is_expert(p):
            p.allreduce = False  # deepspeed.moe.utils.is_moe_param
            p.group_name = group_name(ep)
            out.append(p)
    if not out:
        raise ValueError("parallel.ep > 1 but the model has no expert slices (shard_experts first)")
    return out


def _kit_moe_engine() -> type:
    """DeepSpeedEngine with the MoE switch set for the kit's experts (built on first use: importing
    this module must not import DeepSpeed's engine before the strategy starts)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.moe.utils import is_moe_param

    class _KitMoEEngine(DeepSpeedEngine):
        """DeepSpeed's engine, told that the model has MoE layers when it has marked expert slices:
        DeepSpeed looks for its own MoE classes only, and everything else of its MoE support (optimizer
        groups, ZeRO partitions over expert-DP, gradient reduction) keys on the flag and the marks."""

        def _configure_distributed_model(self, model: nn.Module) -> None:
            if any(is_moe_param(p) for p in model.parameters()):
                # Set before the optimizer is configured (it is, later in __init__), which is what
                # reads the flag; the checkpoint code reads num_experts. No gradient factor is added:
                # DeepSpeed divides an expert's expert-DP sum by the data-parallel world size, and
                # the kit's combine backward already summed the EP group's tokens, so that quotient
                # is one process's gradient (a divide by the expert-DP size would be ep x too large;
                # tests/deepspeed_rank_fns.expert_gradients compares the values).
                self.has_moe_layers = True
                self.num_experts = [m.n_experts for m in moe_layers(model)]
            super()._configure_distributed_model(model)

    return _KitMoEEngine


@contextlib.contextmanager
def _engine_class(cls: type):
    """``deepspeed.initialize`` builds ``cls`` instead of DeepSpeedEngine while this is in force (it
    looks the class up in the ``deepspeed`` package at call time)."""
    import deepspeed

    real = deepspeed.DeepSpeedEngine
    deepspeed.DeepSpeedEngine = cls
    try:
        yield
    finally:
        deepspeed.DeepSpeedEngine = real


class _ExpertSlices:
    """This rank's expert slices as a per-rank checkpoint entry (``state_dict``/``load_state_dict``):
    DeepSpeed's model file holds rank 0's module only."""

    def __init__(self, model: nn.Module):
        self._params = {n: p for n, p in model.named_parameters() if is_expert(p)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self._params.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self._params):
            raise ValueError(f"the checkpoint's expert slices {sorted(state)} are not this model's "
                             f"{sorted(self._params)}")
        for n, p in self._params.items():
            if state[n].shape != p.shape:
                raise ValueError(f"expert slice {n}: saved {tuple(state[n].shape)}, this rank holds {tuple(p.shape)}")
            p.copy_(state[n])  # in place: ZeRO's parameters are views of its flat buffers


class ExpertParallelDeepSpeed(DeepSpeedStrategy):
    """DeepSpeed ZeRO 0-2 with the kit's experts sharded over ``parallel.ep`` ranks and reduced by
    DeepSpeed's engine over its expert-data-parallel groups (see the module docstring)."""

    name = "deepspeed"

    def _prepare_model(self, model: nn.Module) -> None:
        ep = self.cfg["parallel"]["ep"]
        self.ep = deepspeed_ep_group(ep)
        self.dispatchers = shard_experts(model, self.ep, log=False)  # the kit's all-to-all over DeepSpeed's EP group
        mark_experts(model, ep)
        self._mask = None
        if self.grads_visible:  # ZeRO-0 fp32: the stabilizer measures p.grad, expert slices summed over EP
            self.reduce_grad_sq = self._reduce_grad_sq

    _reduce_grad_sq = ExpertParallelDDP._reduce_grad_sq

    def _param_groups(self, model: nn.Module, make_optimizer) -> list[dict]:
        # DeepSpeed's split into expert groups keys each new group by its source group's name.
        return [{**g, "name": f"group{i}"} for i, g in enumerate(super()._param_groups(model, make_optimizer))]

    def _initialize(self, model: nn.Module, groups: list[dict]) -> Any:
        cls = _kit_moe_engine()
        with _engine_class(cls):
            engine = super()._initialize(model, groups)
        if not isinstance(engine, cls) or not engine.has_moe_layers:
            raise RuntimeError(f"deepspeed.initialize built a {type(engine).__name__} without MoE support; this "
                               f"DeepSpeed no longer builds its engine through deepspeed.DeepSpeedEngine, which the "
                               f"kit's expert parallelism relies on")
        return engine

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The one-process state dict on every rank (experts gathered over the EP group: a collective)."""
        return gather_experts(self.model, self.ep)

    def rank_state(self) -> dict[str, Any]:
        """Per-rank checkpoint entries besides DeepSpeed's files: this rank's expert slices."""
        return {"experts": _ExpertSlices(self.model)}
