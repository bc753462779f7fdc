"""The loss of a vocabulary-parallel output layer, without ever gathering the logits.

The output head is column-parallel over the vocabulary (rank r computes the logits of token ids
``[r*V/N, (r+1)*V/N)``). Gathering ``[B, T, V]`` logits would move and hold the largest activation
of the model (V is 32k-256k); cross-entropy needs only three numbers per token from each rank:
its largest logit (for a safe ``exp``), its sum of ``exp``, and the target's logit if it owns the
target. Those are all-reduced; the gradient ``softmax - one_hot(target)`` is then local
(Megatron-LM's ``vocab_parallel_cross_entropy``, Shoeybi et al. 2019, Sec. 3).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.tensor_parallel.layers import tp_size_and_rank
from course_lib.validate import check_choice


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``log(sum_v exp z_v) - z_target`` from logit slices; 0 where ignored.

    Three per-token numbers cross the wire (max, sum of exps, target logit), never the logits.
    Backward needs nothing more: d loss / d z_v = softmax_v - [v == target], all local.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index):
        z = logits.float()  # [tokens, V/N]
        zmax = z.max(dim=-1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)  # the global max, for exp() safety
        z = z - zmax.unsqueeze(-1)  # the max cancels in the loss and the gradient: a constant here
        ignored = targets == ignore_index
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < z.shape[-1]) & ~ignored
        picked = z.gather(-1, local_t.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        exp = z.exp()
        # One all-reduce for both sums: the target logit (only its owner adds a non-zero) and the
        # softmax denominator.
        stats = torch.stack([torch.where(owned, picked, torch.zeros_like(picked)), exp.sum(dim=-1)])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        target_logit, sum_exp = stats[0], stats[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, owned, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, owned, ignored = ctx.saved_tensors
        grad = softmax.clone()
        rows = owned.nonzero().squeeze(-1)
        grad[rows, local_t[rows]] -= 1.0  # minus the one-hot target, on the rank that owns it
        grad = grad * grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group=None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 check_targets: bool = True) -> torch.Tensor:
    """Cross-entropy (nats) of logits split over the vocabulary, equal to ``F.cross_entropy`` on
    the gathered logits, forward and backward, without gathering them.

    ``logits_shard``: ``[..., V/N]``, this rank's vocabulary slice (rank r holds ids
    ``[r*V/N, (r+1)*V/N)``, as :class:`ColumnParallelLinear` with ``gather_output=False`` and
    :class:`VocabParallelEmbedding` split them). ``targets``: int ids ``[...]`` in ``[0, V)``, the
    same on every rank; ``ignore_index`` marks tokens left out. ``reduction``: ``mean`` (over the
    scored tokens; NaN when none is scored, as torch), ``sum`` or ``none`` (per-token, 0 where
    ignored). Computed in float32. Cost: 2 all-reduces of ``tokens`` elements (a max, then two sums
    in one call), instead of gathering ``tokens x V`` logits. ``check_targets``: refuse ids out of
    range with a ValueError, as ``F.cross_entropy`` does on a CPU - at the price of a host read
    (device -> host sync); training loops whose data were checked once (the trainer checks
    ``data.vocab_size <= model.vocab_size`` at start-up) pass False and keep one host read a step.
    """
    if not isinstance(logits_shard, torch.Tensor) or not logits_shard.is_floating_point():
        raise TypeError("logits_shard must be a floating-point torch.Tensor [..., V/N]")
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError("targets must be an int64/int32 torch.Tensor of token ids")
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits_shard shape without its "
                         f"last (vocabulary) dim, {tuple(logits_shard.shape[:-1])}")
    check_choice("reduction", reduction, ("mean", "sum", "none"))
    tp, rank = tp_size_and_rank(group, "vocab_parallel_cross_entropy")
    per = logits_shard.shape[-1]
    flat_t = targets.reshape(-1).long()
    if check_targets:
        scored = flat_t[flat_t != ignore_index]
        if scored.numel() and (scored.min() < 0 or scored.max() >= per * tp):  # F.cross_entropy refuses too
            raise ValueError(f"targets must be token ids in [0, {per * tp}) or ignore_index={ignore_index}; "
                             f"got values in [{scored.min().item()}, {scored.max().item()}]")
    losses = _VocabParallelCrossEntropy.apply(logits_shard.reshape(-1, per), flat_t, group, rank * per,
                                              ignore_index)
    if reduction == "none":
        return losses.view(targets.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (flat_t != ignore_index).sum()
