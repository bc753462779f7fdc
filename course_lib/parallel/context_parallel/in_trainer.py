"""Context parallelism inside the trainer: ring attention in TinyGPT, zig-zag chunks of each batch.

With ``parallel.cp = N`` the N ranks of a cp group read the *same* sequences (they share a
data-parallel coordinate) and each keeps its own tokens of them, laid out zig-zag
(:mod:`.layout`): the sequence is cut into 2N equal pieces and cp rank r keeps pieces r and
2N-1-r, so under the causal mask every rank scores the same number of query-key pairs.

:func:`apply_context_parallel` is all a strategy calls. It

* swaps the attention core of every attention module of the model (the dense
  ``model.layers.Attention`` or the tensor-parallel ``TPAttention``: whatever heads the rank holds)
  for :class:`ContextParallelCore` - RoPE at this rank's rows, grouped-query heads expanded, then
  :func:`.ring_attention` over the cp group (exact, so the loss equals one process's);
* returns a :class:`ContextParallelModel`: called with the full micro-batch ``(idx, targets)`` as
  every cp peer reads it, it keeps this rank's chunk, sets the model's ``position_ids`` to the true
  positions of that chunk (the learned table and the RoPE rows are read at them), runs the model and
  rescales its loss (:func:`loss_share`).

Loss and gradients. One process's micro-batch loss is the mean over the micro-batch's scored
tokens, ``sum_r S_r / n`` (S_r: the summed loss of cp rank r's tokens, n: all scored tokens). The
model returns the mean over this rank's tokens, ``S_r / n_r``; :func:`loss_share` turns it into
``N * S_r / n``, which *is* ``S_r / n_r`` whenever the chunks hold equally many scored tokens (every
task of the kit: zig-zag gives each rank one piece of each half of the sequence). Its mean over the
cp ranks is the micro-batch's mean, so the strategy averages gradients over the ranks that hold the
same weights - ``mesh.groups["dp_cp"]``, dp x cp - and means the reported loss over them, exactly as
plain data parallelism over dp x cp replicas would: nothing else changes for the data-parallel mode
(all-reduce here; FSDP / ZeRO over the same group). The token counts are read from the full targets
every cp rank holds: no communication, no host read.

Recomputation (``model.checkpointing`` full / selective) works unchanged: the recomputed core
runs the ring forward again in backward (every cp rank recomputes in the same order, so the
transfers pair up), which adds one forward ring pass of traffic per recomputed layer.

Not handled here (the trainer's config refuses them with cp > 1): sliding-window attention (the
ring scores whole blocks under the causal mask only), attention dropout, pipeline stages,
activation offload and ``train.compile`` (not tried with the ring).
"""
from __future__ import annotations

from typing import Any

import torch

from course_lib.model.layers import apply_rope
from course_lib.parallel.context_parallel.layout import chunk_segments, split_sequence
from course_lib.parallel.context_parallel.ring_attention import ring_attention
from course_lib.validate import check_int

LAYOUT = "zigzag"


def zigzag_positions(seq_len: int, cp: int, cp_rank: int, device: Any = "cpu") -> torch.Tensor:
    """The global positions (int64 ``[seq_len / cp]``) of the tokens cp rank ``cp_rank`` keeps of a
    ``seq_len``-token sequence, in the order of its chunk: pieces r and 2*cp-1-r."""
    check_int("cp", cp, 1)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp} (zig-zag chunks)")
    segs = chunk_segments(seq_len // cp, cp, cp_rank, LAYOUT)
    return torch.cat([torch.arange(start, start + n, device=device) for start, n in segs])


def local_chunk(x: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's zig-zag tokens of ``x`` [batch, seq] (or [batch, seq, ...]): [batch, seq / cp]."""
    return split_sequence(x, cp, cp_rank, layout=LAYOUT, dim=1)


def loss_share(local_mean: torch.Tensor, local_targets: torch.Tensor, targets: torch.Tensor, cp: int,
               ignore_index: int = -100) -> torch.Tensor:
    """``cp * S_r / n`` from the model's mean over this rank's scored tokens ``S_r / n_r`` (see the
    module docstring): equal to ``local_mean`` when every chunk holds as many scored tokens; its
    mean over the cp group is the micro-batch's mean loss. Stays on the device. A chunk without a
    scored token contributes 0 (not the NaN of an empty mean)."""
    n_local = (local_targets != ignore_index).sum()
    n_all = (targets != ignore_index).sum()
    weight = (cp * n_local).to(local_mean.dtype) / n_all.to(local_mean.dtype)
    return torch.where(n_local > 0, local_mean * weight, torch.zeros_like(local_mean))


class ContextParallelCore:
    """What an attention module runs in place of its ``core(q, k, v, cos, sin)`` on a cp rank:
    q ``[B, H, T/N, D]``, k/v ``[B, Hkv, T/N, D]`` of this rank's zig-zag tokens (H: the heads this
    rank holds, all of them without TP), ``cos``/``sin`` the RoPE rows of those tokens' positions.
    Returns ``[B, H, T/N, D]``: causal attention over the whole sequence of the cp group.

    Grouped-query k/v heads are expanded before the ring (each rank sends H/Hkv times the bytes a
    ring of the Hkv heads would; simple, and what the lab's ring_attention takes).

    ``stats``: None, or a dict :func:`.ring_attention` adds this rank's bytes sent (forward /
    backward) and score-block sizes to, summed over every call (a lab sets it to measure)."""

    stats: dict | None = None

    def __init__(self, group, use_rope: bool):
        self.group, self.use_rope = group, use_rope

    def __call__(self, q, k, v, cos, sin):
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # query head h reads k/v head h // rep, as in the dense core
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return ring_attention(q, k, v, group=self.group, causal=True, layout=LAYOUT, stats=self.stats)

    def __deepcopy__(self, memo):  # a process group cannot be copied; the core holds no state
        return self


class ContextParallelModel:
    """Called like the model, with the *full* micro-batch: ``(idx [B, T], targets [B, T]) ->
    (logits of this rank's tokens [B, T/N, ...], loss share or None)``. ``module`` is what runs the
    forward (the model or a wrapper of it), ``model`` the module whose ``position_ids`` are set.
    Other attributes are looked up on ``module`` (e.g. a data-parallel wrapper's ``no_sync``)."""

    def __init__(self, module, model, group, cp: int, cp_rank: int):
        self.module, self.model, self.group, self.cp, self.cp_rank = module, model, group, cp, cp_rank
        self._positions: dict[tuple[int, str], torch.Tensor] = {}

    def positions(self, seq_len: int, device) -> torch.Tensor:
        """This rank's positions for a ``seq_len``-token sequence (built once per length)."""
        key = (seq_len, str(device))
        if key not in self._positions:
            self._positions[key] = zigzag_positions(seq_len, self.cp, self.cp_rank, device)
        return self._positions[key]

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = local_chunk(idx, self.cp, self.cp_rank)
        y = local_chunk(targets, self.cp, self.cp_rank) if targets is not None else None
        self.model.position_ids = self.positions(idx.shape[1], idx.device)
        logits, loss = self.module(x, y)
        if loss is not None:
            loss = loss_share(loss, y, targets, self.cp)
        return logits, loss

    def __getattr__(self, name):
        return getattr(self.__dict__["module"], name) if "module" in self.__dict__ else super().__getattribute__(name)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose core :func:`apply_context_parallel` swaps: every one with a ``cp_core``
    hook (``model.layers.Attention``, ``tensor_parallel.TPAttention``)."""
    return [m for m in model.modules() if hasattr(type(m), "cp_core") and hasattr(m, "core")]


def apply_context_parallel(model: torch.nn.Module, group, cp: int, cp_rank: int,
                           module: Any = None) -> ContextParallelModel:
    """Make ``model`` (a TinyGPT or TPTinyGPT on this rank) context parallel over ``group`` (the cp
    group, ``cp`` ranks, this one at ``cp_rank``): ring attention in every attention module, and
    the callable the strategy runs forward through (``module``: what runs the model, default
    ``model``). Weights are untouched, so checkpoints keep the dense layout. ValueError when the
    model has no attention module with the hook, or one uses a sliding window."""
    check_int("cp", cp, 1)
    check_int("cp_rank", cp_rank, 0, cp - 1, "cp - 1")
    attns = attention_modules(model)
    if not attns:
        raise ValueError(f"{type(model).__name__} has no attention module with a cp_core hook")
    for attn in attns:
        if getattr(attn, "window", None) is not None:
            raise ValueError("context parallelism runs full causal attention only; model.attention_window "
                             f"= {attn.window} is not supported by the ring")
        attn.cp_core = ContextParallelCore(group, attn.use_rope)
    return ContextParallelModel(model if module is None else module, model, group, cp, cp_rank)
