"""The strategy interface: how one training step spreads over ranks.

The trainer (:mod:`course_lib.train`) calls only the methods of :class:`Strategy`, in this order::

    strategy.setup(model, make_optimizer)       # wrap/shard the model, THEN build the optimizer
    stream = BatchStream(..., rank=strategy.dp_rank, world_size=strategy.dp_size)
    loop:
        local = strategy.forward_backward(batches, autocast=..., on_loss=..., backward=...)
        mean = strategy.global_mean(local)      # equal on every rank: every rank decides alike
        decision = stabilizer.after_backward(strategy.model, mean, ..., reduce_sq=strategy.reduce_grad_sq)
        strategy.optimizer_step(policy, lr_factor=..., found_inf=...)  or  strategy.skip_step(policy)
        strategy.zero_grad()
    checkpoints = strategy.checkpointer(root, ...)   # full state on a writer, or sharded on all ranks

Each parallel form is one module that subclasses :class:`Strategy` and overrides what it changes:

* data parallel (torch DDP, hand-made DDP): :meth:`wrap`, :meth:`no_sync`, :meth:`global_mean`;
* FSDP / ZeRO-3: :meth:`setup` shards before the optimizer exists; ``checkpoint_format = "sharded"``;
  hand-sharded gradients report their norms through :meth:`reduce_grad_sq`;
* DeepSpeed: :meth:`setup` gets the engine's own optimizer; :meth:`optimizer_step` calls the engine;
* tensor/pipeline parallel: :attr:`dp_rank`/:attr:`dp_size` are the data-parallel coordinates only
  (TP and PP peers share a batch), and pipeline schedules override :meth:`forward_backward`.

Strategies are registered by name in :mod:`course_lib.parallel.registry` (torch-free, so the config
validator can list them). ``Single`` lives here: it is the reference every other one must equal.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.ranks.launch import DistInfo


class Strategy:
    """One process, no communication: the reference implementation of every method.

    ``info``: where this process sits (:class:`~course_lib.parallel.ranks.launch.DistInfo`);
    ``device``: where the model computes; ``cfg``: the validated trainer config
    (:mod:`course_lib.trainer.config`; strategies read their ``[parallel]`` keys from it, None
    means the defaults). After :meth:`setup`: ``model`` is the plain module (its
    parameter names are the checkpoint's), ``module`` is what forward is called on (the wrapper),
    ``optimizer`` the optimizer over the (possibly sharded) parameters."""

    name = "single"
    #: "full": a writer rank saves the whole state (replicated weights). "sharded": every rank
    #: saves its shards through DCP (``course_lib.checkpoint.dcp``), no rank gathers the model.
    checkpoint_format = "full"
    #: The formats ``checkpoint.format`` may pick for this strategy ("auto" means the one above).
    checkpoint_formats: tuple[str, ...] = ("full", "sharded")

    #: False when an engine keeps the gradients out of ``p.grad`` (DeepSpeed ZeRO): the
    #: stabilizer then judges the loss only and the engine clips.
    grads_visible = True

    def __init__(self, info: DistInfo, device: torch.device, cfg: dict | None = None):
        from course_lib.validate import defaults

        self.info, self.device = info, torch.device(device)
        self.cfg = cfg if cfg is not None else defaults()
        self.model: nn.Module | None = None
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ where this rank sits
    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (picks its share of each batch)."""
        return self.info.rank

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (each sees a different micro-batch)."""
        return self.info.world_size

    @property
    def is_writer(self) -> bool:
        """The rank that writes full checkpoints, metrics and events (global rank 0)."""
        return self.info.rank == 0

    # ------------------------------------------------------------------ building
    def setup(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
        """Wrap ``model`` (already on :attr:`device`) and build the optimizer, in the order the
        strategy needs: sharding strategies must shard before the optimizer sees the parameters.
        ``make_optimizer(module)`` builds it from a module's parameters."""
        self.model = model
        self.module = self.wrap(model)
        self.optimizer = make_optimizer(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module forward is called on (the model itself here)."""
        return model

    # ------------------------------------------------------------------ one step
    def no_sync(self):
        """Context for micro-batches that must not communicate gradients yet (nothing here)."""
        return contextlib.nullcontext()

    def forward_backward(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                         autocast: Callable[[], Any], on_loss: Callable[[torch.Tensor], torch.Tensor],
                         backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches; gradients are
        synchronized only with the last one. Each micro-batch's loss goes through ``on_loss``
        (the stabilizer's fault point), then ``backward(loss / k)``: the gradient of the *mean*
        over the ``k`` micro-batches, as one big batch would give. Returns this rank's mean loss
        (detached, on the device: no host read)."""
        batches = list(batches)
        k = len(batches)
        if not k:
            raise ValueError("forward_backward needs at least one micro-batch")
        total = None
        for i, (x, y) in enumerate(batches):
            with (contextlib.nullcontext() if i == k - 1 else self.no_sync()):
                with autocast():
                    # [1]: drop the logits now. Held in a variable they would live through backward:
                    # 4*b*s*V bytes in fp32 (3 GiB for GPT-2 at b=16), measured on an H100.
                    loss = self.module(x, y)[1]
                loss = on_loss(loss)
                backward(loss / k if k > 1 else loss)  # k == 1: no extra kernel (~0.1 ms a step)
            total = loss.detach().float() if total is None else total + loss.detach().float()
        return total / k if k > 1 else total

    def global_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over the data-parallel ranks, equal on every rank (the rank's
        own value here). Stays on the device: no host read."""
        return value

    #: For hand-sharded gradients: sums stacked per-tensor squared norms over the shard group on
    #: the device (see GradientMonitor.measure). None: gradients are whole (or DTensors) here.
    reduce_grad_sq: Callable[[torch.Tensor], torch.Tensor] | None = None

    def optimizer_step(self, policy: Any, *, lr_factor: float = 1.0, found_inf: bool | None = None) -> None:
        """Apply the step with the LR times ``lr_factor`` (the stabilizer's cut); ``policy`` is the
        :class:`~course_lib.precision.PrecisionPolicy` (fp16 steps through its scaler);
        ``found_inf``: the host's knowledge of inf/nan gradients (saves fp16's own host reads)."""
        from course_lib.stability import scaled_lr

        if lr_factor == 1.0:  # the usual step: no LR save/restore around it
            policy.step(self.optimizer, found_inf=found_inf)
            return
        with scaled_lr(self.optimizer, lr_factor):
            policy.step(self.optimizer, found_inf=found_inf)

    def skip_step(self, policy: Any) -> None:
        """Leave this step out (a spike or a non-finite step); fp16 still updates its scale."""
        policy.skip(self.optimizer)

    def zero_grad(self) -> None:
        """Drop the gradients (set to None: no memory held between steps)."""
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ communication for the loop
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from global rank ``src`` on every rank (picklable; the object itself here)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_to_writer(self, obj: Any) -> list | None:
        """Every rank's ``obj`` as a list indexed by global rank on the writer, None elsewhere.
        A collective: every rank must call it."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [obj]
        out = [None] * dist.get_world_size() if self.is_writer else None
        dist.gather_object(obj, out, dst=0)
        return out

    def precision_policy(self, precision: str):
        """The :class:`~course_lib.precision.PrecisionPolicy` the trainer's loop uses for
        ``train.precision`` (autocast, loss scaling). Engines that cast and scale themselves
        (DeepSpeed's bf16/fp16 sections) return an fp32 policy so nothing is done twice."""
        from course_lib.precision import make_policy

        return make_policy(precision, self.device)

    def run_files(self) -> dict[str, str]:
        """Files the writer rank puts in the run folder next to ``config.json`` (name -> text),
        e.g. DeepSpeed's generated ``ds_config.json``. Built (and validated) in :meth:`setup`."""
        return {}

    def grad_norm_after_step(self) -> float | None:
        """The gradient norm an engine measured inside its step, for strategies with
        ``grads_visible = False`` (None otherwise: the stabilizer measured it)."""
        return None

    # ------------------------------------------------------------------ checkpoints
    def full_weights(self) -> dict[str, torch.Tensor]:
        """``{name: full tensor}`` of the model's parameters and buffers in the unsharded layout
        (what a single-process model's ``state_dict`` holds), on every rank. A collective where
        the weights are sharded: every rank must call it."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self, state: Any, *, saving: bool) -> Any:
        """The :class:`~course_lib.parallel.checkpointing.TrainState` full checkpoints save and load
        through. Called on every rank before a save (``saving=True``: may communicate, e.g. to
        consolidate a sharded optimizer on the writer) and before a load. Here: ``state`` itself."""
        return state

    def checkpointer(self, root: Any, *, every_steps: int | None, keep_last: int, async_save: bool,
                     mirror: str | None, format: str = "auto"):
        """The object the trainer saves and loads through (see :mod:`course_lib.parallel.checkpointing`):
        ``format`` "full" (writer rank), "sharded" (DCP, every rank), or "auto" (this strategy's
        :attr:`checkpoint_format`)."""
        from course_lib.parallel.checkpointing import FullCheckpoints, ShardedCheckpoints

        chosen = self.checkpoint_format if format == "auto" else format
        if chosen not in self.checkpoint_formats:
            from course_lib.validate import ConfigError

            raise ConfigError(f"checkpoint.format = {format!r} does not fit train.strategy = {self.name!r}, "
                              f"whose state only saves as {' or '.join(map(repr, self.checkpoint_formats))}; "
                              f"use 'auto'")
        if chosen == "sharded":
            return ShardedCheckpoints(self, root, every_steps=every_steps, keep_last=keep_last,
                                      async_save=async_save, mirror=mirror)
        return FullCheckpoints(self, root, every_steps=every_steps, keep_last=keep_last,
                               async_save=async_save, mirror=mirror)


class Distributed(Strategy):
    """A strategy over a process group: refuses to start without one, and means the loss over
    the data-parallel ranks with an all-reduce on the device (no host read). The base of every
    multi-rank strategy."""

    #: how to start the ranks, for the error without a process group
    launch_hint = "torchrun (or course_lib.parallel.run_ranks)"

    def __init__(self, info: DistInfo, device: torch.device, cfg: dict | None = None):
        if not dist.is_initialized():
            raise RuntimeError(f"strategy {self.name!r} needs a process group: start with {self.launch_hint} "
                               "and call init_distributed() first")
        super().__init__(info, device, cfg)

    def global_mean(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)  # on the device: no host read
        return out / dist.get_world_size()


class Single(Strategy):
    """One process on one device: the reference the parallel strategies are tested against."""

    name = "single"
    # "sharded" loads an fsdp run's DCP checkpoint into one process; DCP is a collective, so it needs
    # a process group of one (torchrun --nproc-per-node 1, run_ranks): check_world refuses it without.

    def __init__(self, info: DistInfo, device: torch.device, cfg: dict | None = None):
        if info.world_size > 1:
            raise ValueError(f"{info.world_size} ranks but strategy 'single'; set train.strategy = 'ddp' "
                             "(--set train.strategy=ddp)")
        super().__init__(info, device, cfg)
