"""Cutting a TinyGPT into pipeline stages: which blocks go where, and the stage module itself.

A pipeline of ``pp`` stages runs stage s on rank s. Every stage gets a contiguous run of the
model's transformer blocks; the first stage also holds the embeddings (token table, learned
positions, embedding dropout) and the last stage the final norm, the LM head and the loss::

    stage 0: tok_emb, pos_emb, blocks 0..a-1
    stage 1: blocks a..b-1
    ...
    stage pp-1: blocks ..n_layers-1, norm_f, lm_head  (-> loss)

How many blocks each stage gets is the ``balance`` (a list of block counts, one per stage):

* ``None``: as even as possible; when ``n_layers % pp != 0`` the *first* stages get one block
  more (the last stage already carries the LM head).
* ``"balanced"``: :func:`balanced_split`, which counts the LM head's matmul as work. Every stage
  waits for the slowest one in a synchronous pipeline, so a stage with extra work makes all the
  others idle; with a large vocabulary the head alone costs several blocks (GPT-2 small: about
  4.5), and the balanced split gives the last stage fewer blocks.
* a list such as ``[3, 4, 4, 1]``: exactly that.

A :class:`PipelineStage` is an ``nn.Module`` whose parameters keep the dense model's names
(``blocks.5.attn.q_proj.weight`` stays ``blocks.5.attn.q_proj.weight`` on the stage that holds
block 5), so its gradients and weights can be compared with a single-process model by name.
It *shares* the dense model's modules (no copy): each rank builds the whole model with the same
seed, keeps its stage and drops the rest.

Tied embeddings (GPT-2 uses one matrix as token table and LM head): with pp > 1 the first and the
last stage each hold a copy. Each copy gets only part of the gradient (the embedding part on the
first stage, the head part on the last), so after backward the two parts must be summed on both
ranks (:func:`course_lib.parallel.pipeline.schedules.sync_tied_grads`, what Megatron-LM does with
its "embedding group"); the copies then receive the same update and stay equal.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.model import ModelConfig, TinyGPT
from course_lib.model.moe import collect_aux, moe_layers
from course_lib.validate import check_int

__all__ = ["even_split", "balanced_split", "resolve_balance", "stage_costs", "PipelineStage",
           "build_stage", "split_model"]


# ------------------------------------------------------------------------------------ the split
def even_split(n_layers: int, pp: int) -> list[int]:
    """Blocks per stage, as even as possible; the first ``n_layers % pp`` stages get one more."""
    check_int("n_layers", n_layers, 1)
    check_int("pp", pp, 1, n_layers, "n_layers")  # every stage needs at least one block
    base, extra = divmod(n_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _cost_terms(cfg: ModelConfig, seq_len: int) -> tuple[int, int, int]:
    """(embedding, one block, head) forward FLOPs for one sequence of ``seq_len`` tokens.

    Matmuls only, the count of ``course_lib.estimate.flops.model_flops_per_iteration``
    (Narayanan et al. 2021): a block is 2s(h(h + 2 kv_dim) + h^2 + k h d_ff) + 4 s^2 h (k = 2
    matrices for GELU, 3 for SwiGLU), the head 2 s h V. The embedding is a table lookup: 0
    FLOPs. Norms, softmax and the loss are not counted. Integers, so ties are exact.
    """
    s, h, f = seq_len, cfg.d_model, cfg.ffn_dim
    kv_dim = cfg.kv_heads * cfg.head_dim
    mats = 2 if cfg.mlp == "gelu" else 3
    block = 2 * s * (h * (h + 2 * kv_dim) + h * h + mats * h * f) + 4 * s * s * h
    head = 2 * s * h * cfg.vocab_size
    return 0, block, head


def stage_costs(cfg: ModelConfig, pp: int, balance=None, seq_len: int | None = None) -> list[int]:
    """Forward FLOPs of each of the ``pp`` stages for one sequence of ``seq_len`` tokens (default
    the config's ``block_size``): its blocks, plus the embedding on the first stage and the head
    on the last. ``balance`` as in :func:`resolve_balance`. Backward costs about twice the forward
    on every part, so the ratios between stages hold for a training step too."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    seq_len = cfg.block_size if seq_len is None else check_int("seq_len", seq_len, 1)
    # "balanced" for the same sequence length the costs are counted at
    counts = balanced_split(cfg, pp, seq_len) if balance == "balanced" else resolve_balance(cfg, pp, balance)
    emb, block, head = _cost_terms(cfg, seq_len)
    costs = [n * block for n in counts]
    costs[0] += emb
    costs[-1] += head
    return costs


def balanced_split(cfg: ModelConfig, pp: int, seq_len: int | None = None) -> list[int]:
    """Blocks per stage that minimise the slowest stage's work, embedding and head included.

    A synchronous pipeline runs at the pace of its slowest stage, so the objective is the largest
    :func:`stage_costs` entry. Many splits reach the same maximum; among them this picks the one
    with the smallest sum of squared stage costs (the most even), and then the one that gives
    *earlier* stages fewer blocks (under 1F1B the first stage holds the most micro-batches in
    flight, so its activations are the memory peak). Every stage gets at least one block.
    Exact dynamic programming over contiguous splits, O(pp * n_layers^2).
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    L = cfg.n_layers
    check_int("pp", pp, 1, L, "n_layers")
    seq_len = cfg.block_size if seq_len is None else check_int("seq_len", seq_len, 1)
    emb, block, head = _cost_terms(cfg, seq_len)

    def cost(stage: int, n_blocks: int) -> int:
        return n_blocks * block + (emb if stage == 0 else 0) + (head if stage == pp - 1 else 0)

    # Pass 1: the smallest achievable maximum. best_max[k][i]: stages k.. cover blocks i..L-1.
    inf = float("inf")
    best_max = [[inf] * (L + 1) for _ in range(pp + 1)]
    best_max[pp][L] = 0
    for k in range(pp - 1, -1, -1):
        for i in range(L):
            for j in range(i + 1, L + 1):  # stage k takes blocks i..j-1
                best_max[k][i] = min(best_max[k][i], max(cost(k, j - i), best_max[k + 1][j]))
    cap = best_max[0][0]
    # Pass 2: under that cap, the smallest sum of squares; ties -> stage k ends as early as possible.
    best = [[None] * (L + 1) for _ in range(pp + 1)]  # (sum of squares, counts) or None
    best[pp][L] = (0, [])
    for k in range(pp - 1, -1, -1):
        for i in range(L):
            for j in range(i + 1, L + 1):
                c, rest = cost(k, j - i), best[k + 1][j]
                if c > cap or rest is None:
                    continue
                candidate = (c * c + rest[0], [j - i] + rest[1])
                if best[k][i] is None or candidate[0] < best[k][i][0]:  # strict: earliest j wins
                    best[k][i] = candidate
    return best[0][0][1]


def resolve_balance(cfg: ModelConfig, pp: int, balance=None) -> list[int]:
    """The ``balance`` argument (None | "balanced" | list of counts) as a checked list of counts."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    L = cfg.n_layers
    check_int("pp", pp, 1, L, "n_layers")  # every stage holds at least one block
    if balance is None:
        return even_split(L, pp)
    if isinstance(balance, str):
        if balance != "balanced":
            raise ValueError(f"balance must be None, 'balanced' or a list of {pp} block counts; got {balance!r}")
        return balanced_split(cfg, pp)
    if not isinstance(balance, (list, tuple)):
        raise TypeError(f"balance must be None, 'balanced' or a list of block counts, got {type(balance).__name__}")
    if len(balance) != pp:
        raise ValueError(f"balance must have one entry per stage (pp={pp}), got {len(balance)}: {list(balance)}")
    for s, n in enumerate(balance):
        check_int(f"balance[{s}]", n, 1, L, "n_layers")
    if sum(balance) != L:
        raise ValueError(f"balance must sum to n_layers={L} (every block on exactly one stage), "
                         f"got sum({list(balance)}) = {sum(balance)}")
    return list(balance)


# ------------------------------------------------------------------------------------ the stage
class PipelineStage(nn.Module):
    """Stage ``stage`` of ``pp`` of a :class:`~course_lib.model.TinyGPT`, sharing its modules.

    ``forward(x, targets=None)``:

    * first stage: ``x`` is int64 token ids [B, T]; other stages: ``x`` is the previous stage's
      hidden state [B, T, d_model] (float);
    * returns the hidden state [B, T, d_model], except on the last stage: the loss (mean
      cross-entropy per scored token, fp32, as ``TinyGPT``) when ``targets`` is given, else the
      logits [B, T, vocab].

    Attributes: ``stage``, ``pp``, ``is_first``, ``is_last``, ``block_ids`` (the dense indices it
    holds), ``balance`` (blocks per stage of the whole pipeline).
    """

    def __init__(self, model: TinyGPT, stage: int, pp: int, balance=None):
        super().__init__()
        if not isinstance(model, TinyGPT):
            raise TypeError(f"model must be a course_lib.model.TinyGPT, got {type(model).__name__}")
        self.balance = resolve_balance(model.cfg, pp, balance)
        check_int("stage", stage, 0, pp - 1, "pp - 1")
        self.cfg, self.stage, self.pp = model.cfg, stage, pp
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        start = sum(self.balance[:stage])
        self.block_ids = list(range(start, start + self.balance[stage]))
        # Attribute names are the dense model's, so named_parameters() keeps its names.
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        # ModuleDict keyed by the dense index: block 5 stays "blocks.5.*" on any stage.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in self.block_ids})
        self._checkpointed = {i: model._checkpoint_block(i) for i in self.block_ids}  # same memory strategy
        if self.is_last:
            self.norm_f, self.lm_head = model.norm_f, model.lm_head
        if model.rope_cos is not None:  # every block needs the RoPE tables
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None

    #: The balancing loss (course_lib.model.moe) of this stage's MoE layers in its last training
    #: forward, with gradient; None without MoE layers. The last stage adds it to its loss; on the
    #: other stages the pipeline runner adds it to the micro-batch's backward
    #: (course_lib.parallel.composed.stage.run_pipeline), so it trains as in one process.
    moe_aux: torch.Tensor | None = None

    def finish_moe(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        """After the blocks ran: collect the MoE layers' balancing losses (and their loads, for the
        bias update) into :attr:`moe_aux`, outside any checkpointed block as ``TinyGPT`` does;
        returns ``loss`` plus them on the last stage in training, ``loss`` unchanged otherwise."""
        layers = moe_layers(self.blocks)
        if not layers:
            return loss
        self.moe_aux = collect_aux(layers, self.training) if self.training else None
        if loss is not None and self.moe_aux is not None:
            loss = loss + self.moe_aux
        return loss

    @property
    def tied(self) -> bool:
        """True when this stage holds one copy of a token table tied to the LM head on another
        stage (pp > 1, ``tie_embeddings``): its gradient must be summed with the other copy's."""
        return self.cfg.tie_embeddings and self.pp > 1 and (self.is_first or self.is_last)

    @property
    def tied_param(self) -> nn.Parameter | None:
        """This stage's copy of the tied matrix (``tok_emb.weight`` or ``lm_head.weight``)."""
        if not self.tied:
            return None
        return self.tok_emb.weight if self.is_first else self.lm_head.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)
                   if cfg.offload_activations and torch.is_grad_enabled() else contextlib.nullcontext())
        with offload:
            if self.is_first:
                if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                    raise ValueError(f"the first stage takes int64 token ids [batch, seq], got "
                                     f"{tuple(x.shape)} {x.dtype}")
                T = x.shape[1]
                # TinyGPT._bound reads only self.cfg: the same embedding bound as the dense model.
                h = TinyGPT._bound(self, self.tok_emb(x))
                if self.pos_emb is not None:
                    h = h + self.pos_emb(torch.arange(T, device=x.device))
                h = self.drop(h)
            else:
                if x.dim() != 3 or x.shape[-1] != cfg.d_model:
                    raise ValueError(f"stage {self.stage} takes a hidden state [batch, seq, "
                                     f"{cfg.d_model}], got {tuple(x.shape)}")
                h, T = x, x.shape[1]
            cos = self.rope_cos[:T] if self.rope_cos is not None else None
            sin = self.rope_sin[:T] if self.rope_sin is not None else None
            grad = torch.is_grad_enabled()
            for i in self.block_ids:
                block = self.blocks[str(i)]
                if grad and self._checkpointed[i]:
                    h = checkpoint(block, h, cos, sin, use_reentrant=False)
                else:
                    h = block(h, cos, sin)
            if not self.is_last:
                self.finish_moe(None)
                return h
            logits = self.lm_head(self.norm_f(h))
            if targets is None:
                self.finish_moe(None)
                return logits
            return self.finish_moe(F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                                                   ignore_index=-100))

    def extra_repr(self) -> str:
        return f"stage={self.stage}/{self.pp}, blocks={self.block_ids}, balance={self.balance}"


def build_stage(model: TinyGPT, stage: int, pp: int, balance=None) -> PipelineStage:
    """Stage ``stage`` (0-based) of a ``pp``-stage split of ``model``; see :class:`PipelineStage`."""
    return PipelineStage(model, stage, pp, balance)


def split_model(model: TinyGPT, pp: int, balance=None) -> list[PipelineStage]:
    """All ``pp`` stages of ``model`` (sharing its modules): run them in a row and you get the
    dense forward; handy for single-process checks and for drawing the layout."""
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a course_lib.model.TinyGPT, got {type(model).__name__}")
    counts = resolve_balance(model.cfg, pp, balance)
    return [PipelineStage(model, s, pp, counts) for s in range(pp)]
