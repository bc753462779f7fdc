"""The pieces the trainer's model-parallel strategy runs on one rank: a tensor-parallel pipeline
stage, and a pipeline schedule runner that speaks the trainer's language.

* :class:`TPPipelineStage` - stage ``s`` of ``pp`` cut out of a :class:`~.tensor_parallel.TPTinyGPT`
  (tp > 1 and pp > 1 together). It *is* a :class:`~.pipeline.stages.PipelineStage` (same
  attributes, same ``forward(x, targets)`` contract, dense parameter names, so
  :func:`~.pipeline.schedules.sync_tied_grads` works on it), but its blocks are TP blocks and its
  loss is the vocab-parallel cross-entropy. Under sequence parallelism the hidden state that
  travels between stages is this rank's ``[B, T/tp, C]`` slice. Its blocks are recomputed (and
  saved tensors offloaded) as the TP model's ``model.checkpointing`` says, block numbers dense
  (``checkpoint_every = k`` checkpoints blocks 0, k, 2k, ... of the whole model, wherever they sit).
* :func:`run_pipeline` - one optimizer step's micro-batches through the stages, in the order of
  :func:`~.pipeline.schedules.stage_actions` (GPipe or 1F1B, our schedules). It differs from
  :func:`~.pipeline.schedules.run_schedule` (the lab's instrumented runner) only in what a trainer
  needs: the loss of every micro-batch goes through ``on_loss`` (the stabilizer's fault point) and
  ``backward`` (fp16 loss scaling), forward runs under ``autocast``, receive buffers live on the
  compute device, and the loss stays on the device (no host read, no timeline).

``pp_schedule = "interleaved"`` (torch's ``ScheduleInterleaved1F1B``) lives in
:mod:`.interleaved`; it cuts its virtual stages with the same classes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.pipeline.schedules import TAG_ACTIVATION, TAG_GRAD, stage_actions
from course_lib.parallel.pipeline.stages import PipelineStage, resolve_balance
from course_lib.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


class TPPipelineStage(PipelineStage):
    """Stage ``stage`` of ``pp`` of a tensor-parallel TinyGPT (see the module docstring). Shares the
    TP model's modules; the blocks each stage gets follow ``balance`` exactly as for a dense model."""

    def __init__(self, tp_model, stage: int, pp: int, balance=None):
        nn.Module.__init__(self)  # PipelineStage.__init__ wants a dense TinyGPT; same attributes below
        self.balance = resolve_balance(tp_model.cfg, pp, balance)
        if not 0 <= stage < pp:
            raise ValueError(f"stage must be in [0, pp - 1 = {pp - 1}], got {stage}")
        self.cfg, self.stage, self.pp = tp_model.cfg, stage, pp
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        start = sum(self.balance[:stage])
        self.block_ids = list(range(start, start + self.balance[stage]))
        object.__setattr__(self, "_tp", tp_model)  # not a submodule: its other stages are not ours
        if self.is_first:
            self.tok_emb, self.pos_emb = tp_model.tok_emb, tp_model.pos_emb
        self.blocks = nn.ModuleDict({str(i): tp_model.blocks[i] for i in self.block_ids})
        if self.is_last:
            self.norm_f, self.lm_head = tp_model.norm_f, tp_model.lm_head
        if tp_model.rope_cos is not None:
            self.register_buffer("rope_cos", tp_model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", tp_model.rope_sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        with self._tp.offload_context(x):  # the TP model's memory strategy, on this stage's blocks
            return self._forward(x, targets)

    def _forward(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        tp = self._tp
        split = tp.tp if tp.sequence_parallel else 1  # the hidden state holds T/split tokens
        if self.is_first:  # as TPTinyGPT.forward, up to the blocks
            T = x.shape[1]
            if T % split:
                raise ValueError(f"sequence_parallel needs the sequence length ({T}) divisible by tp ({tp.tp})")
            h = tp._bound(self.tok_emb(x))
            if self.pos_emb is not None:
                start = tp.rank * (T // tp.tp) if tp.sequence_parallel else 0
                h = h + self.pos_emb(torch.arange(start, start + h.shape[1], device=x.device))
        else:
            h, T = x, x.shape[1] * split
        cos = self.rope_cos[:T] if self.rope_cos is not None else None  # attention sees all T tokens
        sin = self.rope_sin[:T] if self.rope_sin is not None else None
        for i in self.block_ids:
            h = tp.run_block(i, h, cos, sin)  # checkpointed as the model's checkpointing says
        if not self.is_last:
            self.finish_moe(None)
            return h
        logits = self.lm_head(self.norm_f(h))  # [B, T, vocab/tp]
        if targets is None:
            self.finish_moe(None)
            return logits
        return self.finish_moe(vocab_parallel_cross_entropy(logits, targets, tp.group, check_targets=False))


def run_pipeline(stage: PipelineStage, batches: list[tuple[torch.Tensor, torch.Tensor]], *, schedule: str,
                 ranks: list[int], act_shape: tuple[int, ...], act_dtype: torch.dtype, device: torch.device,
                 autocast: Callable[[], Any], on_loss: Callable[[torch.Tensor], torch.Tensor],
                 backward: Callable[[torch.Tensor], None], forward: Callable | None = None,
                 loss_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Forward and backward of the step's ``k = len(batches)`` micro-batches on this stage;
    gradients accumulate in ``.grad``. ``ranks[s]``: global rank of stage s of this pipeline.
    ``act_shape``/``act_dtype``: the hidden state a stage sends on (every micro-batch alike).
    ``forward``: what runs the stage (default the stage itself; the trainer passes its
    ``torch.compile`` wrapper under ``train.compile``).

    The last stage computes each micro-batch's mean loss, passes it through ``on_loss``, then
    ``backward(loss / k)`` - the arithmetic of gradient accumulation, so the gradients equal one
    process on the k micro-batches. Returns the mean loss on the last stage (detached, on the
    device), None on the others. Sends are non-blocking and receives blocking, as in
    :func:`~.pipeline.schedules.run_schedule` (why that cannot deadlock is explained there).

    MoE layers on a stage other than the last: their balancing loss (``stage.moe_aux`` after each
    forward) is part of the one-process loss, but this stage's backward starts from the gradient
    the next stage sent, not from a loss. So it joins that backward with the seed the last stage's
    loss gets: 1 / k, times ``loss_scale`` (the fp16 loss scale, a device tensor; None: 1). Such a
    stage returns the mean of its balancing losses (detached) instead of None, for the trainer to
    add to the loss it logs."""
    k, s = len(batches), stage.stage
    prev = ranks[s - 1] if not stage.is_first else None
    nxt = ranks[s + 1] if not stage.is_last else None
    forward = stage if forward is None else forward
    inputs, outputs, grads, pending, aux = {}, {}, {}, [], {}
    total = aux_total = None
    for op, i in stage_actions(schedule, stage.pp, k, s):
        if op == "recv_activation":
            buf = torch.empty(act_shape, dtype=act_dtype, device=device)
            dist.recv(buf, src=prev, tag=TAG_ACTIVATION)
            inputs[i] = buf.requires_grad_()  # its .grad is what goes back to the previous stage
        elif op == "forward":
            x, y = batches[i]
            with autocast():
                out = forward(x if stage.is_first else inputs[i], y if stage.is_last else None)
            if stage.is_last:
                loss = on_loss(out)
                total = loss.detach().float() if total is None else total + loss.detach().float()
                outputs[i] = loss / k if k > 1 else loss
            else:
                # One dtype on the wire whatever autocast produced (the receiver allocated act_dtype);
                # the cast is part of the graph, so the gradient flows back through it.
                outputs[i] = out.to(act_dtype)
                if stage.moe_aux is not None:
                    aux[i] = stage.moe_aux
                    done = stage.moe_aux.detach().float()
                    aux_total = done if aux_total is None else aux_total + done
        elif op == "send_activation":
            pending.append(dist.isend(outputs[i].detach().contiguous(), dst=nxt, tag=TAG_ACTIVATION))
        elif op == "recv_grad":
            grads[i] = torch.empty(act_shape, dtype=act_dtype, device=device)
            dist.recv(grads[i], src=nxt, tag=TAG_GRAD)
        elif op == "backward":
            out = outputs.pop(i)  # dropping it frees the micro-batch's activations
            if stage.is_last:
                backward(out)  # the trainer's backward: fp16 multiplies by the loss scale first
            elif i in aux:  # the balancing loss, seeded as the last stage seeds its loss
                term = aux.pop(i)
                seed = torch.full_like(term, 1.0 / k)
                if loss_scale is not None:
                    seed = seed * loss_scale.to(seed.dtype)
                torch.autograd.backward([out, term], grad_tensors=[grads.pop(i), seed])
            else:
                torch.autograd.backward(out, grad_tensors=grads.pop(i))
        elif op == "send_grad":
            pending.append(dist.isend(inputs.pop(i).grad.contiguous(), dst=prev, tag=TAG_GRAD))
    for work in pending:  # send buffers must stay alive until the bytes are out
        work.wait()
    if not stage.is_last:
        return None if aux_total is None else aux_total / k
    return total / k if k > 1 else total
