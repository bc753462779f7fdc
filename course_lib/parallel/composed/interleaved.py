"""``parallel.pp_schedule = "interleaved"`` in the trainer: torch's ``ScheduleInterleaved1F1B`` over
this rank's virtual stages, dense or tensor-parallel, under the trainer's autocast and loss scaling.

Torch's schedule runs every forward and backward itself, so the trainer's hooks cannot wrap the
calls the way :func:`~.stage.run_pipeline` does. They are injected instead:

* **autocast** - each stage module torch calls is a :class:`AutocastStage`: it runs our stage's
  forward inside the trainer's ``autocast()`` (the context is handed in per step) and casts what
  it sends on to the parameters' dtype, so the wire carries one dtype whatever autocast computed
  (torch's shape inference sees the same wrapper on its first step, so the buffers it allocates
  match). Backward runs outside autocast, as for every other path (autograd replays the dtypes of
  the forward).
* **the loss and loss scaling** - the last stage's loss is :class:`TrainerLoss`, the function
  torch calls per micro-batch: cross-entropy in float32 (vocab-parallel over the tp group when
  tp > 1), the stabilizer's ``on_loss``, divided by the micro-batch count, then multiplied by the
  fp16 loss scale (``scaler.scale``) - exactly what the trainer's ``backward`` hook does before
  ``.backward()`` in the 1F1B path. Gradients then arrive scaled on every stage and the trainer
  unscales them (``policy.unscale_``) as for 1F1B; the ranks without the last stage create the
  scale tensor first (the one they divide by is the same factor).
* **TP** - with tp > 1 the virtual stages are cut out of the tensor-parallel model
  (:class:`~.stage.TPPipelineStage`, as 1F1B does), so inside a stage the blocks
  all-reduce over the tp group. Both tp ranks of a pipeline rank run the same schedule, so their
  collectives line up (torch's first-step shape inference included: it runs real forwards and an
  input-gradient backward on stand-in tensors, on both tp ranks alike).

:class:`HeldStages` is the module the trainer sees: the rank's stages under the dense names (its
optimizer, gradient norm and checkpoints read it); :func:`run_interleaved` is one step.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from course_lib.parallel.pipeline.stages import PipelineStage


class AutocastStage(nn.Module):
    """What torch's ``PipelineStage`` calls: ``stage`` (a :class:`PipelineStage`) under the trainer's
    autocast, its hidden-state output cast to ``wire_dtype``. ``autocast`` is a zero-argument
    callable returning a context manager, set per step (default: none)."""

    def __init__(self, stage: PipelineStage, wire_dtype: torch.dtype):
        super().__init__()
        self.stage, self.wire_dtype = stage, wire_dtype
        self.autocast: Callable[[], Any] = contextlib.nullcontext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            out = self.stage(x)
        # The last stage's logits go to the loss, on this rank: keep autocast's dtype (the loss
        # computes in float32); a hidden state goes on the wire in one dtype.
        return out if self.stage.is_last else out.to(self.wire_dtype)


class HeldStages(nn.Module):
    """The virtual stages one pipeline rank runs under the interleaved schedule (stages r, r + pp,
    ... of ``pp * virtual_stages``), seen as one module under the dense names: the embeddings if it
    holds the first stage, the blocks of all its stages, the final norm and head if it holds the
    last. ``stages``: our stage modules (dense or TP); ``torch_stages``: torch's wrappers of them,
    in the same order. The trainer's optimizer, gradient norm and checkpoints read this module;
    torch's schedule runs ``torch_stages``."""

    def __init__(self, stages: list[PipelineStage], torch_stages, pp_ranks: list[int], tp_group=None):
        super().__init__()
        object.__setattr__(self, "stage_modules", list(stages))  # not submodules: same params
        object.__setattr__(self, "torch_stages", list(torch_stages))
        self.cfg, self.pp_ranks, self.tp_group = stages[0].cfg, list(pp_ranks), tp_group
        self.n_stages = stages[0].pp
        first = [s for s in stages if s.is_first]
        last = [s for s in stages if s.is_last]
        self.is_first, self.is_last = bool(first), bool(last)
        if first:
            self.tok_emb, self.pos_emb = first[0].tok_emb, first[0].pos_emb
            self.drop = getattr(first[0], "drop", None)  # TP stages have none (dropout 0 under TP)
        self.blocks = nn.ModuleDict({k: b for s in stages for k, b in s.blocks.items()})
        if last:
            self.norm_f, self.lm_head = last[0].norm_f, last[0].lm_head
        # The first stage lives on pipeline rank 0 and the last on rank pp - 1 (stage i on i % pp).
        self.tied = self.cfg.tie_embeddings and len(pp_ranks) > 1 and (self.is_first or self.is_last)

    @property
    def tied_param(self):
        if not self.tied:
            return None
        return self.tok_emb.weight if self.is_first else self.lm_head.weight

    def sync_tied(self) -> None:
        """Add the tied table's two gradient parts on the first and last stage's ranks (with TP:
        each tp rank adds its own vocabulary shard's parts, with its peer of the same tp rank)."""
        from course_lib.parallel.pipeline.schedules import sync_tied_grads

        ranks = [self.pp_ranks[s % len(self.pp_ranks)] for s in range(self.n_stages)]  # global rank per stage
        for st in self.stage_modules:
            sync_tied_grads(st, ranks)


class TrainerLoss:
    """The loss torch's schedule calls per micro-batch on the last stage (see the module
    docstring): float32 cross-entropy per scored token (vocab-parallel when ``tp_group`` is
    given), through ``on_loss``, divided by ``m`` so the gradients accumulate to the step's mean
    (``scale_grads=False``: nothing rescales afterwards), times the fp16 loss scale when a
    ``scaler`` is set. ``seen`` keeps each micro-batch's unscaled loss (detached)."""

    def __init__(self, m: int, tp_group=None):
        self.m, self.tp_group = m, tp_group
        self.on_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        self.scaler = None
        self.seen: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            from course_lib.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

            loss = vocab_parallel_cross_entropy(logits, targets, self.tp_group, check_targets=False)
        else:
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                                     targets.reshape(-1), ignore_index=-100)
        loss = self.on_loss(loss)
        self.seen.append(loss.detach().float())
        loss = loss / self.m if self.m > 1 else loss
        return self.scaler.scale(loss) if self.scaler is not None else loss


def build_held_stages(model, pp_rank: int, pp: int, virtual_stages: int, counts: list[int], *, pp_group,
                      pp_ranks: list[int], device, tp_model=None, tp_group=None) -> HeldStages:
    """This pipeline rank's virtual stages (``counts``: blocks per stage, ``pp * virtual_stages``
    entries) cut from the dense ``model`` - or, when given, from ``tp_model`` (its TP copy) - and
    wrapped for torch's schedule. ``pp_group``/``pp_ranks``: this pipeline's group and its global
    ranks; ``tp_group``: the tensor-parallel group (None when tp = 1)."""
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from course_lib.parallel.composed.stage import TPPipelineStage

    n_stages = pp * virtual_stages
    if len(counts) != n_stages:
        raise ValueError(f"counts must have pp * virtual_stages = {n_stages} entries, got {counts}")
    wire = next(model.parameters()).dtype
    if tp_model is not None:
        stages = [TPPipelineStage(tp_model, s, n_stages, counts) for s in range(pp_rank, n_stages, pp)]
    else:
        stages = [PipelineStage(model, s, n_stages, counts) for s in range(pp_rank, n_stages, pp)]
    torch_stages = [TorchStage(AutocastStage(st, wire), st.stage, n_stages, torch.device(device), group=pp_group)
                    for st in stages]
    return HeldStages(stages, torch_stages, pp_ranks, tp_group)


def run_interleaved(held: HeldStages, batches, *, autocast, on_loss, scaler=None) -> torch.Tensor | None:
    """One step's micro-batches through torch's ``ScheduleInterleaved1F1B`` (the schedule object is
    kept while the micro-batch count stays the same: a new one re-runs torch's shape inference).
    ``autocast``/``on_loss``: the trainer's hooks; ``scaler``: the fp16 GradScaler or None.
    Gradients land in ``.grad`` (scaled by the loss scale under fp16). Returns the mean unscaled
    loss on the rank holding the last stage (on the device), else None."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    k = len(batches)
    cached = getattr(held, "_schedule", None)
    if cached is None or cached[0] != k:
        loss_fn = TrainerLoss(k, held.tp_group)
        cached = (k, ScheduleInterleaved1F1B(held.torch_stages, n_microbatches=k, loss_fn=loss_fn,
                                             scale_grads=False), loss_fn)
        object.__setattr__(held, "_schedule", cached)
    _, sched, loss_fn = cached
    loss_fn.on_loss, loss_fn.scaler, loss_fn.seen = on_loss, scaler, []
    for st in held.torch_stages:
        st.submod.autocast = autocast
    x = torch.cat([b[0] for b in batches])  # torch splits it back into the same k micro-batches
    y = torch.cat([b[1] for b in batches])
    sched.step(*((x,) if held.is_first else ()), target=y if held.is_last else None,
               losses=[] if held.is_last else None, return_outputs=False)
    if not held.is_last:
        return None
    # The last k calls are the micro-batches: on its first step torch's shape inference calls the
    # loss once more, before them, on uninitialised stand-in tensors.
    total = torch.stack(loss_fn.seen[-k:]).sum()
    return total / k if k > 1 else total
