"""Tensor, pipeline and context parallelism composed with data parallelism, behind the strategy interface.

Chosen by :func:`~course_lib.parallel.registry.make_strategy` (so by the trainer) when
``parallel.tp * parallel.pp * parallel.cp > 1``, with ``train.strategy = "ddp"`` naming the data-parallel
dimension; ``dp = world_size / (tp * pp * cp)`` (or ``parallel.dp``, which must then fit exactly). The ranks form a
:mod:`~course_lib.parallel.mesh` (tp innermost, pp outermost) and each rank holds:

* **TP** (``parallel.tp``): :func:`~course_lib.parallel.tensor_parallel.tp_tinygpt` on its tp
  group - its heads, MLP columns and vocabulary rows (``parallel.sequence_parallel``: the residual
  stream split along the sequence between the TP regions);
* **PP** (``parallel.pp``): its pipeline stage (a contiguous run of blocks, embeddings on the
  first, head and loss on the last); the step's ``train.grad_accum`` micro-batches are the
  pipeline's micro-batches, run in the order of ``parallel.pp_schedule``: "gpipe" | "1f1b" by
  our runner (:mod:`.stage`), "interleaved" by torch's
  ``ScheduleInterleaved1F1B`` over ``parallel.virtual_stages`` stages per rank
  (:mod:`.interleaved`: dense or TP stages, under the trainer's autocast and fp16
  loss scaling). ``parallel.pp_split`` chooses the blocks per stage
  (:func:`course_lib.estimate.stage_split.split_for_config`: even, balanced or explicit);
* **CP** (``parallel.cp``, with dp and tp; not with pp): the same weights as its cp peers, and
  of every sequence of the micro-batch its zig-zag chunk (pieces r and 2cp-1-r of 2cp): ring
  attention over the cp group inside every attention module, the true positions of its tokens for
  the position table / RoPE rows (:mod:`.context_parallel.in_trainer`);
* **DP** (``train.strategy``: "ddp", "zero1", "zero2"): :mod:`.dp` - after the
  last micro-batch the gradients are averaged over the ranks holding the same weights (the mesh's
  ``dp_cp`` group): "ddp" all-reduces them, flattened; "zero1"/"zero2" reduce-scatter them into
  equal flat ranges, step the optimizer on this rank's range only and all-gather the updated
  weights (ZeRO-2 keeps only its range of gradient).

* **EP** (``parallel.ep``, an MoE model; not with cp, not with the interleaved schedule):
  :mod:`.experts` - each stage's MoE layers keep E / ep experts on this rank, the EP group folded
  over the stage's dp x tp ranks (tp only with sequence parallelism: each tp rank routes its own
  tokens, :mod:`~course_lib.parallel.expert_parallel.sequence_split`); expert gradients summed over
  the expert-data-parallel group and divided by dp, the dense ones as below. A stage's MoE
  balancing loss joins the loss (last stage) or the backward (:func:`.stage.run_pipeline`), and
  the loss logged is summed over the pipeline.

TP, PP and CP peers read the *same* batch: :attr:`dp_rank`/:attr:`dp_size` are the data-parallel
coordinates only, so the global batch is ``micro_batch * grad_accum * dp`` sequences a step, as
for plain DDP on ``dp`` ranks (cp ranks split its tokens, not its sequences).

Every rank builds the whole dense model with the trainer's seed and cuts its part out of it: the
shards start bit-equal to one process, which is what the tests compare against. The price is the
dense model's memory on every rank while it lives (the trainer keeps it; under PP the stage shares
its modules, under TP the shards are copies) - fine for the course's models; a 70B model would be
built per stage on the meta device and loaded from a checkpoint instead.

``train.compile`` compiles what forward is called on (``module``): the TP model, or this rank's
stage, which our pipeline runner calls (torch's interleaved schedule calls its own stage modules,
so trainer.config refuses compile there). ``optim.fused`` is kept: the optimizer is re-created with the
trainer's class and options.

After backward, in this order: sequence-parallel partial gradients are summed over tp; every
gradient is averaged over dp; the tied embedding / LM head copies on the first and last stage add
their parts (both get bit-identical sums, so the copies never drift). The stabilizer's norm
(:meth:`reduce_grad_sq`) counts every logical parameter once. Checkpoints are full, in the dense
model's names and layout (:mod:`.checkpoint`): one process can resume them, and
so can any other tp x pp x dp layout of the same model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.data_parallel.optimizer_rebuild import constructor_kwargs, groups_by_name
from course_lib.parallel.strategy import Distributed


def _config_error(message: str):
    from course_lib.validate import ConfigError

    return ConfigError(message)


class ModelParallel(Distributed):
    """DP x TP x PP by hand (see the module docstring). ``mesh``: the rank layout and its groups
    (:class:`~course_lib.parallel.mesh.ProcessMesh`): pass one built with
    :func:`~course_lib.parallel.mesh.build_mesh` (its sizes must match ``[parallel]``), or leave it
    None and the strategy builds it from ``[parallel]`` (the trainer's way). There is no global
    mesh: whoever needs the groups asks this object (``strategy.mesh``)."""

    name = "ddp+tp/pp"  # per instance: "<train.strategy>+tp/pp"
    checkpoint_format = "full"
    checkpoint_formats = ("full",)  # shards in the dense layout; DCP would need DTensors

    def __init__(self, info, device, cfg=None, mesh=None):
        super().__init__(info, device, cfg)
        from course_lib.parallel.mesh import build_mesh, mesh_layout

        par = self.cfg["parallel"]
        self.tp, self.pp, self.cp = par["tp"], par["pp"], par["cp"]
        self.sequence_parallel, self.schedule = par["sequence_parallel"], par["pp_schedule"]
        if self.cp > 1 and self.pp > 1:  # trainer.config refuses it first; a direct caller gets the same words
            raise _config_error(f"parallel.cp = {self.cp} with parallel.pp = {self.pp} is not built: context "
                                f"parallelism runs with parallel.tp and data parallelism; set parallel.pp = 1")
        self.virtual_stages = par["virtual_stages"]
        try:
            layout = mesh_layout(info.world_size, tp=self.tp, pp=self.pp, cp=self.cp, dp=par["dp"])
        except ValueError as exc:
            raise _config_error(f"parallel.dp/tp/pp/cp do not fit the {info.world_size} ranks started: {exc} "
                                f"(parallel.dp = 0 takes what is left)") from None
        if mesh is not None and mesh.layout != layout:
            raise _config_error(f"the mesh passed ({mesh.layout}) does not match [parallel] ({layout})")
        self.mesh = mesh if mesh is not None else build_mesh(layout)  # collective: every rank, every group
        c = self.mesh.coords
        self.pp_rank, self.tp_rank, self.cp_rank = c["pp"], c["tp"], c["cp"]
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.tp_group, self.dp_group, self.mp_group = (self.mesh.groups[d] for d in ("tp", "dp", "mp"))
        # The ranks holding the same weights (dp x cp): gradients are averaged over them.
        self.grad_group, self.grad_size = self.mesh.groups["dp_cp"], self.mesh.layout.dp * self.cp
        self._policy = None
        self.ep = par["ep"]
        self.experts = None  # StageExperts when the model has MoE layers (setup)
        self.dp_mode_name = self.cfg["train"]["strategy"]
        self.name = f"{self.dp_mode_name}+tp/pp"

    # ------------------------------------------------------------------ where this rank sits
    @property
    def dp_rank(self) -> int:
        return self.mesh.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.mesh.layout.dp

    # ------------------------------------------------------------------ building
    def setup(self, model: nn.Module, make_optimizer) -> None:
        """Cut this rank's part out of the dense ``model`` (built with the same seed on every rank),
        then build the trainer's optimizer over it: same class, options and groups as one process
        would use (decay decided on the dense shapes), restricted to the parameters held here."""
        from course_lib.model import TinyGPT
        from course_lib.parallel.composed.checkpoint import DenseLayout

        if not isinstance(model, TinyGPT):
            raise TypeError(f"tensor/pipeline parallelism cuts a course_lib.model.TinyGPT, got {type(model).__name__}")
        base = make_optimizer(model)  # on the dense model: grouping by the dense shapes
        named_groups = groups_by_name(base, model)
        self.layout = DenseLayout(model, named_groups)
        local = model
        if self.tp > 1:
            from course_lib.parallel.tensor_parallel.gpt import tp_tinygpt

            try:
                local = tp_tinygpt(model, self.tp_group, self.sequence_parallel)
                local.check_targets = False  # data checked at start-up: no host read per micro-batch
            except ValueError as exc:  # trainer.config checks these first; say which key anyway
                raise _config_error(f"parallel.tp = {self.tp}: {exc}") from None
        if self.pp > 1:  # blocks per stage: parallel.pp_split (course_lib.estimate.stage_split)
            from course_lib.estimate.stage_split import split_for_config

            self.split = split_for_config(self.cfg, model.cfg)
        if self.pp > 1 and self.schedule == "interleaved":  # torch's schedule, our stages (dense or TP)
            from course_lib.parallel.composed.interleaved import build_held_stages

            local = build_held_stages(model, self.pp_rank, self.pp, self.virtual_stages, self.split,
                                      pp_group=self.mesh.groups["pp"], pp_ranks=self.mesh.ranks["pp"],
                                      device=self.device, tp_model=local if self.tp > 1 else None,
                                      tp_group=self.tp_group if self.tp > 1 else None)
        elif self.pp > 1:
            if self.tp > 1:
                from course_lib.parallel.composed.stage import TPPipelineStage

                local = TPPipelineStage(local, self.pp_rank, self.pp, self.split)
            else:
                from course_lib.parallel.pipeline.stages import build_stage

                local = build_stage(model, self.pp_rank, self.pp, self.split)
        self.model = self.module = local
        if model.cfg.moe_experts is not None:  # experts over parallel.ep ranks of this stage (.experts)
            from course_lib.parallel.composed.experts import StageExperts

            self.experts = StageExperts(self.mesh, local, self.ep)
            self.dispatchers = self.experts.dispatchers
            self.layout.ep = self.experts.ep
        if self.cp > 1:  # ring attention in every attention module; forward takes the full batch
            from course_lib.parallel.context_parallel.in_trainer import apply_context_parallel

            from course_lib.precision.fp8_linear import set_token_group

            self.module = apply_context_parallel(local, self.mesh.groups["cp"], self.cp, self.cp_rank)
            # train.precision = "fp8" (kit): scales spanning the tokens take the amax over the cp group
            set_token_group(local, self.mesh.groups["cp"])
        self.layout.bind(local)
        from course_lib.parallel.composed.dp import make_dp_mode

        self.dp = make_dp_mode(self.dp_mode_name, self)
        self.optimizer = self.dp.setup(local, self.layout.local_groups(named_groups), type(base),
                                       constructor_kwargs(base))
        self.reduce_grad_sq = self.dp.reduce_grad_sq

    def precision_policy(self, precision: str):
        self._policy = super().precision_policy(precision)
        return self._policy

    # ------------------------------------------------------------------ one step
    def forward_backward(self, batches, *, autocast, on_loss, backward) -> torch.Tensor:
        batches = list(batches)
        if not batches:
            raise ValueError("forward_backward needs at least one micro-batch")
        if self.pp == 1:  # the usual micro-batch loop; TPTinyGPT returns (logits, loss)
            local = super().forward_backward(batches, autocast=autocast, on_loss=on_loss, backward=backward)
        elif self.schedule == "interleaved":  # torch runs forward and backward; our hooks inside
            from course_lib.parallel.composed.interleaved import run_interleaved

            local = run_interleaved(self.model, batches, autocast=autocast, on_loss=on_loss,
                                    scaler=self._scaler_on_every_stage())
            local = local if local is not None else torch.zeros((), device=self.device)
        else:
            local = self._pipeline(batches, autocast, on_loss, backward)
        self._finish_gradients()
        return local

    def _scaler_on_every_stage(self):
        """The fp16 GradScaler (None otherwise), its scale tensor created on every stage."""
        scaler = self._policy.scaler if self._policy is not None else None
        if scaler is not None and not self.is_last and scaler._scale is None:
            # fp16: only the last stage scales a loss, but every stage unscales its gradients
            # (scaled by the same factor on the way back); this creates the scale tensor here.
            scaler.scale(torch.ones((), device=self.device))
        return scaler

    def _pipeline(self, batches, autocast, on_loss, backward):
        from course_lib.parallel.composed.stage import run_pipeline

        scaler = self._scaler_on_every_stage()
        mb, T = batches[0][0].shape
        act_shape = (mb, T // self.tp if self.sequence_parallel else T, self.model.cfg.d_model)
        dtype = next(self.model.parameters()).dtype
        loss = run_pipeline(self.model, batches, schedule=self.schedule, ranks=self.mesh.ranks["pp"],
                            act_shape=act_shape, act_dtype=dtype, device=self.device, autocast=autocast,
                            on_loss=on_loss, backward=backward, forward=self.module,
                            loss_scale=scaler._scale if scaler is not None else None)
        loss = loss.clone() if loss is not None else torch.zeros((), device=self.device)
        if self.experts is not None:
            # The last stage's loss holds its own MoE layers' balancing losses; the other stages
            # returned theirs: the sum over the pipeline is the loss one process logs.
            dist.all_reduce(loss, group=self.mesh.groups["pp"])
        return loss

    @torch.no_grad()
    def _finish_gradients(self) -> None:
        """SP partial sums (tp), then the data-parallel mode (dp_cp), which also calls the tied
        copies' sum (pp) where its layout needs it."""
        if self.sequence_parallel:
            from course_lib.parallel.tensor_parallel.blocks import sync_sequence_parallel_grads

            sync_sequence_parallel_grads(self.model, self.tp_group)
        self.dp.finish_gradients(self._sync_tied)

    def _sync_tied(self) -> None:
        if self.pp > 1 and self.model.tied:
            from course_lib.parallel.pipeline.schedules import sync_tied_grads

            if self.schedule == "interleaved":
                self.model.sync_tied()  # each of this rank's virtual stages that holds a copy
            else:
                sync_tied_grads(self.model, self.mesh.ranks["pp"])

    @property
    def grads_module(self) -> nn.Module:
        """What the stabilizer measures and clips: the local module, or under ZeRO this rank's
        range of the gradients (:mod:`.dp`)."""
        return self.dp.grads_module

    def optimizer_step(self, policy, *, lr_factor: float = 1.0, found_inf: bool | None = None) -> None:
        super().optimizer_step(policy, lr_factor=lr_factor, found_inf=found_inf)
        if not found_inf:
            self.dp.after_step()  # ZeRO: every rank's updated range into the weights

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    def global_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The loss over the dp replicas, equal on every rank: only the last stage computed it
        (and every tp rank of it the same number), so one rank per replica contributes - under
        context parallelism one per (replica, cp rank), each its share (in_trainer.loss_share)."""
        owner = self.is_last and self.tp_rank == 0
        out = value.detach().float().clone() if owner else torch.zeros((), device=self.device)
        dist.all_reduce(out)  # over the world: every rank gets the sum over the replicas
        return out / self.grad_size

    def expert_load_reduce(self, load: torch.Tensor) -> None:
        """Sum a layer's expert loads over the ranks that route its tokens (this pipeline stage's;
        the trainer's DeepSeek-V3 bias update calls it), in place."""
        self.experts.reduce_load(load)

    # ------------------------------------------------------------------ checkpoints
    def full_weights(self) -> dict[str, torch.Tensor]:
        """The dense model's state dict on every rank (gathered to rank 0, then broadcast)."""
        full = self.layout.gather_model(self.mesh)
        return self.broadcast_object(full)

    def checkpoint_state(self, state, *, saving: bool):
        """Full-layout views of the local model and optimizer (collective when ``saving``): the
        writer saves the dense names and shapes, every rank slices its part on load."""
        from dataclasses import replace

        from course_lib.parallel.composed.checkpoint import FullModelView, FullOptimizerView

        local_optimizer = self.dp.optimizer_view(saving)  # ZeRO: gathers the dp shards (collective)
        model, optim = self.layout.gather(self.mesh, local_optimizer) if saving else (None, None)
        return replace(state, model=FullModelView(self.layout, self.mesh, model),
                       optimizer=FullOptimizerView(self.layout, self.mesh, local_optimizer, optim))
