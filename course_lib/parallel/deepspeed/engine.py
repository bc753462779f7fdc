"""The DeepSpeed engine behind the strategy interface (``train.strategy = "deepspeed"``).

``parallel.zero_stage`` picks ZeRO 0-3, ``parallel.offload_optimizer``/``offload_param`` ZeRO-Offload.
The DeepSpeed config is generated from the trainer's config and checked by DeepSpeed's own parser
before anything runs (:mod:`course_lib.parallel.deepspeed.config`); the writer saves it as
``DIR/ds_config.json``.

Who does what in one step (the trainer's loop is unchanged):

* **forward/backward**: ``engine(x, y)`` then ``engine.backward(loss)`` per micro-batch. DeepSpeed
  divides each loss by ``gradient_accumulation_steps`` itself, so the gradient is the mean over the
  micro-batches exactly as :meth:`Strategy.forward_backward` makes it. The accumulation boundary is
  set explicitly (True on the last micro-batch only): ZeRO-0/1 all-reduce only then; ZeRO-2/3
  reduce-scatter into their gradient partitions on every micro-batch (that is how partitioned
  gradients accumulate; DeepSpeed refuses ``no_sync`` there).
* **gradients, clipping, the stabilizer**: ZeRO >= 1 (and any bf16/fp16 run) keeps gradients in
  DeepSpeed's buffers, not ``p.grad``: ``grads_visible = False``, the stabilizer judges the (rank-mean)
  loss only, DeepSpeed clips to ``stability.max_grad_norm`` and :meth:`grad_norm_after_step` reports
  its measured norm. ZeRO-0 in fp32 leaves the all-reduced gradients in ``p.grad`` after the boundary
  backward: the stabilizer measures and clips them as for DDP and DeepSpeed's ``gradient_clipping``
  is 0.
* **learning rate**: DeepSpeed has no scheduler here. :attr:`optimizer` is the torch optimizer
  DeepSpeed steps (the one inside its ZeRO wrapper, whose ``param_groups`` the wrapper shares), so the
  trainer's ``LambdaLR`` writes every step's LR straight into the groups ``engine.step()`` uses;
  ``lr_factor`` (the stabilizer's cut) multiplies them for one step through
  :func:`course_lib.stability.scaled_lr`.
* **skip**: a skipped step drops the accumulated gradients the way DeepSpeed's own overflow path
  does (partitions cleared, no optimizer call), so parameters, optimizer state and the next step
  are exactly as if the skipped micro-batches had never been seen.
* **checkpoints**: :class:`course_lib.parallel.deepspeed.checkpoints.DeepSpeedCheckpoints`.
* **fp8**: the FP8 Linear layers are swapped in before the engine is built and keep fp32 weights;
  DeepSpeed runs its fp32 path and :meth:`precision_policy` hands the trainer the fp8 policy (bf16
  autocast for the layers kept in high precision), as one FP8 process runs.
* **experts** (``parallel.ep > 1``): the subclass in :mod:`course_lib.parallel.deepspeed.experts`
  (the hooks :meth:`_prepare_model` and :meth:`_initialize`).
* **start**: ZeRO-0 with bf16/fp16 steps AdamW once while the engine is built; that step is undone
  (:mod:`course_lib.parallel.deepspeed.init_step`). JIT-op loads run under
  :func:`course_lib.parallel.deepspeed.op_locks.guard`: a build lock left by a killed build ends the start
  with a message naming it instead of a silent endless wait.
"""
from __future__ import annotations

import contextlib
import copy
import json
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.deepspeed.config import build_ds_config, engine_clips, validate_ds_config
from course_lib.parallel.deepspeed.init_step import undo_build_step
from course_lib.parallel.ranks.launch import DistInfo
from course_lib.parallel.strategy import Distributed
from course_lib.validate import ConfigError

#: Faults that write into ``p.grad``: meaningless when the engine keeps the gradients.
GRADIENT_FAULTS = ("grad_scale", "inf_grad")


grads_in_engine = engine_clips  # DeepSpeed keeps the gradients, so DeepSpeed clips them


def check_faults(faults: Iterable[Any], grads_visible: bool) -> None:
    """ConfigError when a gradient fault (``grad_scale``, ``inf_grad``) is asked for but the engine
    keeps the gradients (nothing could inject it). ``faults``: FaultSpec objects or strings."""
    if grads_visible:
        return
    bad = [str(f) for f in faults if str(getattr(f, "kind", str(f).partition("@")[0])) in GRADIENT_FAULTS]
    if bad:
        raise ConfigError(f"--inject-fault: {', '.join(bad)} writes into p.grad, but with train.strategy = "
                          f"'deepspeed' at this parallel.zero_stage / train.precision DeepSpeed keeps the "
                          f"gradients in its own partitions; use nan_loss or loss_shift, or "
                          f"parallel.zero_stage = 0 with train.precision = 'fp32'")


class DeepSpeedStrategy(Distributed):
    """DeepSpeed ZeRO 0-3 (optional CPU offload) on the default process group; checkpoints: every
    rank writes its shards with ``engine.save_checkpoint`` (see the module docstring)."""

    name = "deepspeed"
    checkpoint_format = "deepspeed"
    checkpoint_formats = ("deepspeed",)  # its own partitioned files; checkpoint.format = "auto" only

    launch_hint = "torchrun, the deepspeed launcher (or course_lib.parallel.run_ranks)"

    def __init__(self, info: DistInfo, device: torch.device, cfg: dict | None = None):
        super().__init__(info, device, cfg)
        self.stage = self.cfg["parallel"]["zero_stage"]
        self.grads_visible = not grads_in_engine(self.cfg)
        # Built now (fp16 on a CPU is a ConfigError before anything is written), parsed in setup().
        self.ds_config = build_ds_config(self.cfg, world_size=info.world_size, device=self.device)
        self.engine: Any = None
        self._last_norm: float | None = None

    # ------------------------------------------------------------------ building
    def setup(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
        """Parse the DeepSpeed config, then ``deepspeed.initialize`` on the existing process group
        (DeepSpeed's ``init_distributed`` adopts it). The optimizer is DeepSpeed's, from the config's
        ``optimizer`` section (DeepSpeedCPUAdam under ZeRO-Offload, torch AdamW otherwise), over the
        parameter groups of ``make_optimizer(model)``: the trainer's grouping (no decay on norms and
        biases) and hyper-parameters are kept, and checked against the config."""
        import deepspeed

        from course_lib.parallel.deepspeed.op_locks import guard

        # Both load JIT ops (shm_comm, cpu_adam): a lock left by a killed build fails with a message
        # naming it (course_lib/parallel/deepspeed/op_locks.py) instead of waiting forever.
        with guard():
            # Adopts the process group the trainer made (gloo on CPU, nccl on GPUs): no second init.
            deepspeed.init_distributed(dist_backend=dist.get_backend())
            validate_ds_config(self.ds_config, world_size=self.info.world_size)

            self._prepare_model(model)  # expert parallelism keeps this rank's experts here
            groups = self._param_groups(model, make_optimizer)
            engine = self._initialize(model, groups)
        undo_build_step(engine)  # ZeRO-0 with bf16/fp16: the wrapper stepped AdamW once while being built
        self.model, self.module, self.engine = model, engine, engine
        self.optimizer = self._stepped_optimizer(engine)

    def _prepare_model(self, model: nn.Module) -> None:
        """What a subclass does to the model after DeepSpeed's process groups exist and before the
        engine is built (nothing here; :mod:`course_lib.parallel.deepspeed.experts` shards the experts)."""

    def _initialize(self, model: nn.Module, groups: list[dict]) -> Any:
        """``deepspeed.initialize`` over ``groups``; returns the engine."""
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                               config=copy.deepcopy(self.ds_config))
        return engine

    def _param_groups(self, model: nn.Module, make_optimizer: Callable) -> list[dict]:
        reference = make_optimizer(model)
        params = self.ds_config["optimizer"]["params"]
        wanted = {"lr": params["lr"], "betas": tuple(params["betas"]), "eps": params["eps"]}
        for i, g in enumerate(reference.param_groups):
            got = {"lr": g.get("lr"), "betas": tuple(g.get("betas", ())), "eps": g.get("eps")}
            if got != wanted:
                raise ValueError(f"deepspeed strategy: the trainer's optimizer group {i} has {got}, the "
                                 f"DeepSpeed config {wanted}; they are built from the same [optim] keys")
        groups = [{"params": list(g["params"]), "weight_decay": g["weight_decay"]} for g in reference.param_groups]
        del reference  # it never steps: DeepSpeed builds its own over these groups
        return groups

    @staticmethod
    def _stepped_optimizer(engine: Any) -> torch.optim.Optimizer:
        """The torch optimizer whose ``param_groups`` DeepSpeed's step reads (ZeRO wrappers and the
        bf16 optimizer proxy ``param_groups`` to the one they wrap)."""
        opt = engine.optimizer
        for candidate in (opt, getattr(opt, "optimizer", None)):
            if isinstance(candidate, torch.optim.Optimizer):
                return candidate
        raise TypeError(f"cannot find the torch optimizer inside DeepSpeed's {type(opt).__name__}")

    # ------------------------------------------------------------------ one step
    def forward_backward(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                         autocast: Callable[[], Any], on_loss: Callable[[torch.Tensor], torch.Tensor],
                         backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Engine forward, ``on_loss``, ``engine.backward`` per micro-batch (``backward``, the
        precision policy's, is not used: DeepSpeed scales and divides by the accumulation itself)."""
        batches = list(batches)
        k = len(batches)
        if not k:
            raise ValueError("forward_backward needs at least one micro-batch")
        if k != self.engine.gradient_accumulation_steps():
            raise ValueError(f"{k} micro-batches but DeepSpeed's gradient_accumulation_steps is "
                             f"{self.engine.gradient_accumulation_steps()} (train.grad_accum)")
        total = None
        for i, (x, y) in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(i == k - 1)
            with autocast():
                loss = self.engine(x, y)[1]  # the logits are not kept through backward
            loss = on_loss(loss)
            self.engine.backward(loss)  # backward(loss / k), inside DeepSpeed
            total = loss.detach().float() if total is None else total + loss.detach().float()
        return total / k if k > 1 else total

    def optimizer_step(self, policy: Any, *, lr_factor: float = 1.0, found_inf: bool | None = None) -> None:
        """``engine.step()`` with every group's LR times ``lr_factor`` for this step."""
        from course_lib.stability import scaled_lr

        if found_inf:  # only an fp16 policy reports it, and DeepSpeed's policy here is fp32
            self.skip_step(policy)
            return
        with (scaled_lr(self.optimizer, lr_factor) if lr_factor != 1.0 else contextlib.nullcontext()):
            self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self._last_norm = float(norm) if norm is not None else None

    def skip_step(self, policy: Any) -> None:
        """Drop this step's gradients without touching parameters or optimizer state, the way
        DeepSpeed's own overflow path does."""
        opt = self.engine.optimizer
        self._last_norm = None
        if self.stage == 3:
            opt._pre_step()
            opt._partition_all_parameters()
            opt._overflow_clean_up(opt.loss_scale)
        elif self.stage in (1, 2):
            from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

            opt.micro_step_id = INITIAL_MICRO_STEP_ID
            opt.zero_grad(set_to_none=True)
            if hasattr(opt, "_release_preflattened_grad_buffers"):
                opt._release_preflattened_grad_buffers()
            if opt.cpu_offload:
                opt.reset_cpu_buffers()
            else:
                for key in list(opt.averaged_gradients.keys()):
                    opt.averaged_gradients[key] = None
                    opt.all_grad_tensors[key] = None
        else:
            if hasattr(opt, "clear_hp_grads"):  # bf16 optimizer: fp32 accumulators
                opt.clear_hp_grads()
            self.engine.zero_grad()
            opt.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # ------------------------------------------------------------------ what the trainer reads
    def precision_policy(self, precision: str):
        """fp32 for fp32/bf16/fp16 (the ``bf16``/``fp16`` sections make DeepSpeed cast and scale
        itself); for fp8 the fp8 policy, whose bf16 autocast the layers kept in high precision run
        under in one FP8 process too (the FP8 layers quantize themselves; no loss scaling)."""
        from course_lib.precision import make_policy

        return make_policy("fp8" if precision == "fp8" else "fp32", self.device)

    def run_files(self) -> dict[str, str]:
        return {"ds_config.json": json.dumps(self.ds_config, indent=2) + "\n"}

    def grad_norm_after_step(self) -> float | None:
        """DeepSpeed's global gradient norm (before its clipping) of the last applied step."""
        return None if self.grads_visible else self._last_norm

    def check_faults(self, faults: Iterable[Any]) -> None:
        """ConfigError for gradient faults this configuration cannot inject (see :func:`check_faults`)."""
        check_faults(faults, self.grads_visible)

    # ------------------------------------------------------------------ checkpoints
    def checkpointer(self, root: Any, *, every_steps: int | None, keep_last: int, async_save: bool,
                     mirror: str | None, format: str = "auto"):
        from course_lib.parallel.deepspeed.checkpoints import DeepSpeedCheckpoints

        if format not in ("auto", "deepspeed"):
            raise ConfigError(f"checkpoint.format = {format!r} cannot hold DeepSpeed's partitioned optimizer "
                              f"state; use 'auto' with train.strategy = 'deepspeed' (convert a checkpoint "
                              f"to a plain state dict with deepspeed_to_state_dict)")
        return DeepSpeedCheckpoints(self, root, every_steps=every_steps, keep_last=keep_last,
                                    async_save=async_save, mirror=mirror)
