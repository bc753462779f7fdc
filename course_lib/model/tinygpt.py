"""TinyGPT: one small decoder-only transformer with GPT-2 and Llama switches.

    cfg = ModelConfig.preset("tiny")                 # GPT-2 style, trains on a CPU in seconds
    cfg = ModelConfig.preset("llama-tiny")           # RMSNorm, SwiGLU, RoPE, grouped-query attention
    model = TinyGPT(cfg)
    logits, loss = model(idx, targets)               # idx, targets: int64 [batch, seq]

Switches (all on `ModelConfig`):

| switch | GPT-2 | Llama |
| --- | --- | --- |
| `norm` | `layernorm` | `rmsnorm` |
| `mlp` | `gelu` (4C wide) | `swiglu` (~8C/3 wide) |
| `position` | `learned` | `rope` |
| `bias` | True | False |
| `n_kv_heads` | = `n_heads` | < `n_heads` (grouped-query attention) |
| `tie_embeddings` | True | False |

Experts: `moe_experts = E` (with `moe_top_k`, `moe_ffn_dim`, ...) replaces the MLP of every block
from `moe_first_dense` on by a mixture of E SwiGLU experts (course_lib/model/moe.py); in training
mode the loss then includes the balancing loss. Presets `moe-tiny` (CPU), `mixtral-8x7b`,
`qwen3-30b-a3b`, `deepseek-v3` (count on the meta device).

Memory strategies, switchable on a built model with `set_memory_strategy` so a lab can compare them
on the same weights: activation checkpointing `none | full | selective` (always
`use_reentrant=False`) and offloading saved activations to CPU memory (`save_on_cpu`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from course_lib.model.layers import Block, RMSNorm, init_linear_, make_norm, rope_tables
from course_lib.model.moe import Experts, collect_aux, moe_layers
# The config dataclass and presets live in a torch-free module (config validation imports it).
from course_lib.model.config import CHECKPOINTING, INIT_SCHEMES, PRESETS, ModelConfig  # noqa: F401
from course_lib.validate import check_int as _check_int
from course_lib.validate import check_number as _check_float


class TinyGPT(nn.Module):
    """Decoder-only transformer. `forward(idx, targets=None) -> (logits, loss)`.

    Init schemes (`cfg.init`) differ in how Linear weights are drawn; biases start at zero, norms
    at weight 1, embeddings at N(0, init_std) (N(0, sqrt(2/(5C))) for `small`):

    - `normal`: every matrix N(0, init_std=0.02).
    - `scaled_residual`: as normal, but the two projections that write into the residual stream
      (attention output, MLP down) use init_std / sqrt(2 * n_layers) (GPT-2), so the variance of the
      residual stream does not grow with depth.
    - `zero_out_proj`: those residual projections start at zero; every block is the identity at
      step 0 and learns its way in.
    - `kaiming`, `xavier`, `small`: alternatives common in tutorials, for comparison. kaiming is
      He-normal (fan_in, ReLU gain), xavier is Glorot-uniform, small is N(0, sqrt(2/(5C))).
    """

    #: None: a sequence of T tokens sits at positions 0..T-1. Context parallelism
    #: (course_lib.parallel.context_parallel.in_trainer) sets this rank's true positions, int64 [T],
    #: which the learned table and the RoPE rows are read at.
    position_ids: torch.Tensor | None = None
    #: The balancing loss the last forward added (sum over MoE layers, detached); None: none added.
    moe_aux_loss: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self._moe = moe_layers(self.blocks)  # empty for a dense model
        self.norm_f = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one matrix, two uses
        if cfg.position == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_theta)
            # Not persistent: derived from the config, so they stay out of checkpoints.
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        if not self.tok_emb.weight.is_meta:  # on the meta device (counting shapes) there is nothing to draw
            self.reset_parameters()
        self.set_memory_strategy(cfg.checkpointing, cfg.checkpoint_every, cfg.offload_activations)

    # ----------------------------------------------------------------------------- set-up
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re-)initialise every parameter according to `cfg.init` (see the class docstring)."""
        cfg = self.cfg
        emb_std = math.sqrt(2.0 / (5.0 * cfg.d_model)) if cfg.init == "small" else cfg.init_std
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, emb_std)
            elif isinstance(module, nn.Linear):
                if module is self.lm_head and cfg.tie_embeddings:
                    continue  # it is the embedding matrix, already drawn above
                init_linear_(module, cfg.init, cfg.init_std, residual_std, cfg.d_model)
            elif isinstance(module, Experts):  # stacked [E, out, in]: each expert drawn as one Linear
                for w, residual in module.matrices():
                    # kaiming and xavier read fan-in/out from a 2-D shape: one expert at a time;
                    # the other schemes draw every entry alike, so the whole stack at once
                    parts = [w[e] for e in range(w.shape[0])] if cfg.init in ("kaiming", "xavier") else [w]
                    for part in parts:
                        one = types.SimpleNamespace(weight=part, bias=None, is_residual_projection=residual)
                        init_linear_(one, cfg.init, cfg.init_std, residual_std, cfg.d_model)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def set_memory_strategy(
        self, checkpointing: str = "none", checkpoint_every: int | None = None, offload_activations: bool = False
    ) -> None:
        """Switch activation checkpointing / offloading on this model without touching weights.

        - `none`: keep every activation autograd saves.
        - `full`: checkpoint every block: keep only each block's input, recompute the block in backward.
        - `selective`, `checkpoint_every=None`: recompute only the attention core in every block.
        - `selective`, `checkpoint_every=k`: checkpoint whole blocks 0, k, 2k, ... (trade memory for
          compute on a fraction of the layers).
        - `offload_activations=True`: tensors autograd saves are moved to CPU memory in forward and
          back in backward (pinned when on CUDA). On a CPU-only run this costs copies and saves nothing.
        Gradients are identical in fp32 for every combination (tested).
        """
        self.cfg = dataclasses.replace(
            self.cfg, checkpointing=checkpointing, checkpoint_every=checkpoint_every,
            offload_activations=offload_activations,
        )  # replace() re-runs the config validation
        core_only = checkpointing == "selective" and checkpoint_every is None
        for block in self.blocks:
            block.attn.recompute_core = core_only

    def _checkpoint_block(self, index: int) -> bool:
        cfg = self.cfg
        if cfg.checkpointing == "full":
            return True
        return cfg.checkpointing == "selective" and cfg.checkpoint_every is not None and index % cfg.checkpoint_every == 0

    def num_params(self, include_position_embedding: bool = True) -> int:
        """Number of parameters (a count, not bytes); a tied matrix counts once."""
        n = sum(p.numel() for p in self.parameters())
        if not include_position_embedding and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def num_active_params(self) -> int:
        """Parameters one token passes through (a count): all of them for a dense model; with
        experts, the router, the shared experts and k of the E routed experts of every MoE layer."""
        n = self.num_params()
        for m in self._moe:
            per_expert = sum(p[0].numel() for p in m.experts.parameters())
            n -= (m.n_experts - m.top_k) * per_expert
        return n

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer groups: decay on matrices and embeddings (dim >= 2), none on biases and norms."""
        _check_float("weight_decay", weight_decay, 0.0)
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    # ----------------------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: int64 [B, T] token ids with T <= block_size; targets == -100 are ignored.

        Returns (logits [B, T, vocab] in the compute dtype, loss or None). The loss is the mean
        cross-entropy in nats per scored token, computed in float32; in training mode a model with
        experts adds each MoE layer's balancing loss (``moe_aux_loss_coef`` x E sum f_i P_i) and
        keeps the sum, detached, in ``self.moe_aux_loss``.
        """
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an int64 tensor [batch, seq], got {tuple(idx.shape)} {idx.dtype}")
        T = idx.shape[1]
        if not 1 <= T <= self.cfg.block_size:
            raise ValueError(f"sequence length must be in [1, block_size={self.cfg.block_size}], got {T}")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")

        offload = (
            torch.autograd.graph.save_on_cpu(pin_memory=idx.is_cuda)
            if self.cfg.offload_activations and torch.is_grad_enabled()
            else contextlib.nullcontext()
        )
        with offload:
            x = self._bound(self.tok_emb(idx))
            pos = self.position_ids  # None: tokens 0..T-1 (context parallelism sets its own)
            if pos is not None and pos.shape[0] != T:
                raise ValueError(f"position_ids holds {pos.shape[0]} positions for a sequence of {T} tokens")
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(T, device=idx.device) if pos is None else pos)
            x = self.drop(x)
            cos = sin = None
            if self.rope_cos is not None:
                cos, sin = (self.rope_cos[:T], self.rope_sin[:T]) if pos is None else (self.rope_cos[pos], self.rope_sin[pos])
            grad = torch.is_grad_enabled()
            for i, block in enumerate(self.blocks):
                if grad and self._checkpoint_block(i):
                    x = checkpoint(block, x, cos, sin, use_reentrant=False)
                else:
                    x = block(x, cos, sin)
            logits = self.lm_head(self.norm_f(x))
            loss = None
            if targets is not None:
                loss = F.cross_entropy(
                    logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
                )
            if self._moe:  # read here, outside any checkpointed block (a recompute must not count twice)
                aux = collect_aux(self._moe, self.training)
                self.moe_aux_loss = None if aux is None else aux.detach()
                if loss is not None and aux is not None and self.training:
                    loss = loss + aux
        return logits, loss

    def _bound(self, emb: torch.Tensor) -> torch.Tensor:
        b = self.cfg.embedding_bound
        if b is None:
            return emb
        if self.cfg.embedding_bound_mode == "tanh":
            return b * torch.tanh(emb / b)
        return emb.clamp(-b, b)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after idx [B, T]; returns [B, T + max_new_tokens].

        temperature 0 means greedy. The context is cropped to the last block_size tokens.
        """
        _check_int("max_new_tokens", max_new_tokens, 0)
        _check_float("temperature", temperature, 0.0)
        if top_k is not None:
            _check_int("top_k", top_k, 1, self.cfg.vocab_size)
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, top_k).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
