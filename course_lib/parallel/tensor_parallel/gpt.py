"""A whole TinyGPT, tensor-parallel: ``tp_tinygpt(model, group)``.

Layout (Megatron): the token table is vocab-parallel (:class:`.VocabParallelEmbedding`), every
block is a :class:`.TPBlock`, the final norm and the learned position table are replicated, and the
output head is column-parallel over the vocabulary with :func:`.vocab_parallel_cross_entropy`, so
the full ``[B, T, vocab]`` logits never exist on any rank. With tied embeddings (GPT-2) the head
and the table split the *same* rows, so the tie survives: one shard Parameter, two uses, exactly
as in the dense model.

Every rank feeds the same ``idx``/``targets`` (tensor parallelism splits the model, not the
batch) and gets the same loss. With ``sequence_parallel=True`` the residual stream is
``[B, T/N, C]`` per rank between the blocks (T must be divisible by N) and
:meth:`TPTinyGPT.finish_gradient_synchronization` must run after backward (it sums the gradients
of the replicated parameters that saw only this rank's tokens; a no-op without SP).

Recomputation follows the dense model's ``cfg.checkpointing`` (see ``TinyGPT.set_memory_strategy``):
``full`` checkpoints every TP block (only its input is kept: ``[B, T, C]``, ``[B, T/N, C]`` under
SP), ``selective`` recomputes each block's attention core on its local heads, ``selective`` with
``checkpoint_every = k`` checkpoints blocks 0, k, 2k, ... whole; ``offload_activations`` moves the
saved tensors to CPU memory. A recomputed block re-runs its collectives (the all-reduce ``g``, or the
all-gather / reduce-scatter under SP) inside backward. That is safe because every rank of the tp
group holds the same graph: torch's non-reentrant checkpoint (``use_reentrant=False``, the only kind
used here) recomputes a block when backward first unpacks one of its saved tensors, and stops the
recomputation after the last one it needs, at the same op on every rank, so the ranks issue the same
collectives in the same order. The recomputed forward is deterministic (no dropout under TP), so the
gradients are those of the run without recomputation.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.model import TinyGPT
from course_lib.model.moe import collect_aux, moe_layers
from course_lib.parallel.tensor_parallel.blocks import (TPBlock, mark_sequence_parallel,
                                                        sync_sequence_parallel_grads)
from course_lib.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from course_lib.parallel.tensor_parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding,
                                                        tp_size_and_rank)
from course_lib.validate import check_bool


class TPTinyGPT(nn.Module):
    """``forward(idx, targets=None) -> (logits_shard [B, T, vocab/N], loss or None)``; parameter
    names are those of the dense TinyGPT (``blocks.0.attn.q_proj.weight`` ...), each holding this
    rank's shard (``tp_partition_dim`` says along which dense dim) or a replica.
    ``check_targets``: see :func:`.vocab_parallel_cross_entropy` (the trainer sets it False: its
    data are checked at start-up, and the check costs a host read per micro-batch)."""

    check_targets = True
    position_ids = None  # as TinyGPT.position_ids: this rank's token positions under context parallelism

    def __init__(self, model, group=None, sequence_parallel: bool = False):
        super().__init__()
        if not isinstance(model, TinyGPT):
            raise TypeError(f"model must be a course_lib.model.TinyGPT, got {type(model).__name__}")
        check_bool("sequence_parallel", sequence_parallel)
        cfg = model.cfg
        self.tp, self.rank = tp_size_and_rank(group, "tp_tinygpt")
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        sp = sequence_parallel
        self.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, group, sequence_parallel=sp)
        self.pos_emb = copy.deepcopy(model.pos_emb)  # None without learned positions
        self.blocks = nn.ModuleList(TPBlock.from_dense(b, group, sp) for b in model.blocks)
        self.norm_f = copy.deepcopy(model.norm_f)
        for replicated in (self.pos_emb, self.norm_f):
            if replicated is not None:
                mark_sequence_parallel(replicated, sp)
        self.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, gather_output=False,
                                                        sequence_parallel=sp)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # both split the vocab rows the same way
        if model.rope_cos is not None:
            self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
            self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.set_memory_strategy(cfg.checkpointing, cfg.checkpoint_every, cfg.offload_activations)

    def set_memory_strategy(self, checkpointing: str = "none", checkpoint_every: int | None = None,
                            offload_activations: bool = False) -> None:
        """Recomputation and offloading on this TP model, with the meaning of
        ``TinyGPT.set_memory_strategy`` (the config is re-validated). Weights are not touched."""
        self.cfg = dataclasses.replace(self.cfg, checkpointing=checkpointing, checkpoint_every=checkpoint_every,
                                       offload_activations=offload_activations)
        core_only = checkpointing == "selective" and checkpoint_every is None
        for block in self.blocks:
            block.attn.recompute_core = core_only

    def checkpoints_block(self, index: int) -> bool:
        """Whether block ``index`` (dense numbering) is checkpointed whole: every block under
        ``full``, blocks 0, k, 2k, ... under ``selective`` with ``checkpoint_every = k``."""
        cfg = self.cfg
        if cfg.checkpointing == "full":
            return True
        return cfg.checkpointing == "selective" and cfg.checkpoint_every is not None and index % cfg.checkpoint_every == 0

    def offload_context(self, x: torch.Tensor):
        """``save_on_cpu`` (pinned when ``x`` is on CUDA) while ``offload_activations`` is on and
        grad mode is, else a no-op."""
        if self.cfg.offload_activations and torch.is_grad_enabled():
            return torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)
        return contextlib.nullcontext()

    def run_block(self, index: int, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """Block ``index`` on ``x``, checkpointed (non-reentrant) when the strategy says so."""
        block = self.blocks[index]
        if torch.is_grad_enabled() and self.checkpoints_block(index):
            return checkpoint(block, x, cos, sin, use_reentrant=False)
        return block(x, cos, sin)

    def _bound(self, emb: torch.Tensor) -> torch.Tensor:  # as TinyGPT._bound (elementwise)
        b = self.cfg.embedding_bound
        if b is None:
            return emb
        return b * torch.tanh(emb / b) if self.cfg.embedding_bound_mode == "tanh" else emb.clamp(-b, b)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an int64 tensor [batch, seq], got {tuple(idx.shape)} {idx.dtype}")
        T = idx.shape[1]
        if not 1 <= T <= self.cfg.block_size:
            raise ValueError(f"sequence length must be in [1, block_size={self.cfg.block_size}], got {T}")
        if self.sequence_parallel and T % self.tp:
            raise ValueError(f"sequence_parallel needs the sequence length ({T}) divisible by tp ({self.tp})")
        with self.offload_context(idx):
            return self._forward(idx, targets, T)

    def _forward(self, idx, targets, T):
        x = self._bound(self.tok_emb(idx))  # [B, T, C], or this rank's [B, T/N, C] under SP
        pos = self.position_ids  # None: 0..T-1; context parallelism: this rank's true positions [T]
        if pos is not None and pos.shape[0] != T:
            raise ValueError(f"position_ids holds {pos.shape[0]} positions for a sequence of {T} tokens")
        if self.pos_emb is not None:
            start = self.rank * (T // self.tp) if self.sequence_parallel else 0
            x = x + self.pos_emb(torch.arange(start, start + x.shape[1], device=idx.device) if pos is None
                                 else pos[start:start + x.shape[1]])
        cos = sin = None  # attention sees all T tokens
        if self.rope_cos is not None:
            cos, sin = (self.rope_cos[:T], self.rope_sin[:T]) if pos is None else (self.rope_cos[pos], self.rope_sin[pos])
        for i in range(len(self.blocks)):
            x = self.run_block(i, x, cos, sin)
        logits = self.lm_head(self.norm_f(x))  # [B, T, vocab/N]
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, self.group, check_targets=self.check_targets)
        layers = moe_layers(self.blocks)
        if layers:  # as TinyGPT: the balancing losses (their one-process value under SP) join the loss
            aux = collect_aux(layers, self.training)
            if loss is not None and aux is not None and self.training:
                loss = loss + aux
        return logits, loss

    def finish_gradient_synchronization(self) -> None:
        """Under sequence parallelism, sum the partial gradients of the replicated parameters
        (norms, row biases, position table) over the group; nothing to do without it."""
        if self.sequence_parallel:
            sync_sequence_parallel_grads(self, self.group)


def tp_tinygpt(model, group=None, sequence_parallel: bool = False) -> TPTinyGPT:
    """This rank's tensor-parallel copy of a dense ``TinyGPT`` (the dense model is left unchanged).
    Raises ValueError naming ``tp`` and ``n_heads`` / ``n_kv_heads`` / the vocabulary / the MLP
    width when the group size does not divide them, and for dropout > 0. The model's checkpointing
    and offloading settings carry over (see the module docstring)."""
    return TPTinyGPT(model, group, sequence_parallel)
