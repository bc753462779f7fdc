"""The mixture-of-experts MLP: a router picks k of E SwiGLU experts for every token.

    moe = MoE(cfg)                     # cfg.moe_experts = E, cfg.moe_top_k = k
    y = moe(x)                         # x, y: [B, T, C]; moe.aux_loss, moe.last_load set for the model

One forward, in the order the code runs (every step is a function below, so a lab can call it alone):

1. :class:`Router`: scores [N, E] from one matrix (softmax, or sigmoid as in DeepSeek-V3); the k best
   experts per token, chosen on scores + ``expert_bias`` (the bias picks, it never weighs); the
   combine weights are the chosen scores, divided by their sum when ``moe_norm_topk``, times
   ``moe_route_scale``.
2. :func:`keep_mask`: with a capacity factor c every expert takes at most ``capacity(N, k, E, c)``
   tokens; the rest of its tokens are dropped (they skip this expert; the residual stream carries
   them on). ``moe_capacity_factor = None`` is dropless.
3. :func:`permute`: the kept (token, expert) pairs sorted by expert, so each expert reads one
   contiguous slice; ``counts[e]`` is the length of expert e's slice.
4. :class:`Experts`: E SwiGLU MLPs held as stacked weights [E, F, C] / [E, C, F], each run on its
   slice. Expert parallelism replaces only this step (``MoE.dispatcher``: send each slice to the
   rank holding its expert, run, send back: course_lib.parallel.expert_parallel).
5. :func:`unpermute`: every expert output times its combine weight, summed back into its token's row.
6. Shared experts (DeepSeek) see every token and are added; one SwiGLU of width
   ``moe_shared_experts * moe_ffn_dim`` computes exactly the sum of that many experts.

Sequence parallelism (``MoE.sequence_split``, set by tensor parallelism with sequence parallelism):
each tensor-parallel rank holds a slice of the same sequences and routes its own tokens. Capacity,
dropping and the balancing loss are then decided over the whole micro-batch, as one process
decides them: the routing choices are all-gathered (small: k ids a token) and the keep mask is
computed on the one-process token order; the balancing loss takes f_i and P_i over every token and
keeps on each rank only its own tokens' share of the gradient (the ranks' shares add up to the
one-process gradient when the router's weight gradients are summed over the group).

Balancing. :func:`load_balancing_loss` is Switch/GShard's ``E * sum_i f_i * P_i`` (f_i: fraction of
the N*k routed slots that chose expert i, P_i: mean router probability of expert i); it is 1 when
the router is uniform and grows as it concentrates. The model adds ``moe_aux_loss_coef`` times it,
per MoE layer, to the training loss. The auxiliary-loss-free way (DeepSeek-V3) is
:func:`update_expert_bias`: after each optimizer step, ``bias_i += rate * sign(mean load - load_i)``
from the token counts of that step, outside autograd.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Routing(NamedTuple):
    """What the router decided for N tokens (k = top_k, E = experts)."""

    probs: torch.Tensor  # [N, E] float32, each row sums to 1: the P_i of the balancing loss
    experts: torch.Tensor  # [N, k] int64: the chosen experts
    weights: torch.Tensor  # [N, k] float32: their combine weights


class Router(nn.Module):
    """Token-choice top-k router: one [E, C] matrix, no bias; ``expert_bias`` [E] (a buffer, saved in
    checkpoints, never trained by gradients) exists when bias balancing is on."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, score: str = "softmax", norm_topk: bool = True,
                 route_scale: float = 1.0, bias_balancing: bool = False) -> None:
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.proj = nn.Linear(d_model, n_experts, bias=False)
        self.n_experts, self.top_k, self.score = n_experts, top_k, score
        self.norm_topk, self.route_scale = norm_topk, route_scale
        self.register_buffer("expert_bias", torch.zeros(n_experts) if bias_balancing else None)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, C] -> :class:`Routing`. Scores in float32 (a softmax over E logits in bf16 would
        round the small probabilities the balancing loss reads)."""
        logits = self.proj(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choose = scores if self.expert_bias is None else scores + self.expert_bias.float()
        experts = choose.topk(self.top_k, dim=-1).indices  # the bias only picks ...
        weights = scores.gather(1, experts)  # ... the weights are the scores themselves
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(probs, experts, weights)


def capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Slots per expert (a count of tokens): ceil(factor * n_tokens * top_k / n_experts). factor 1
    gives exactly the slots a perfectly balanced router fills."""
    if factor <= 0:
        raise ValueError(f"capacity factor must be > 0, got {factor}")
    return math.ceil(factor * n_tokens * top_k / n_experts)


def keep_mask(experts: torch.Tensor, weights: torch.Tensor, n_experts: int, cap: int | None,
              policy: str = "position") -> torch.Tensor:
    """Bool [N, k]: which (token, expert) pairs fit in their expert's ``cap`` slots (all when cap is
    None). ``position``: each expert keeps its earliest tokens (GShard, Switch); ``probs``: the
    tokens with the largest combine weights (Megatron's ``--moe-token-drop-policy probs``)."""
    if cap is None:
        return torch.ones_like(experts, dtype=torch.bool)
    if policy not in ("position", "probs"):
        raise ValueError(f"policy must be 'position' or 'probs', got {policy!r}")
    flat = experts.reshape(-1)
    pre = (torch.argsort(-weights.reshape(-1), stable=True) if policy == "probs"
           else torch.arange(flat.numel(), device=flat.device))
    order = pre[torch.argsort(flat[pre], stable=True)]  # grouped by expert, by priority inside
    counts = torch.bincount(flat, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]  # place in its queue
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank < cap
    return keep.view_as(experts)


def permute(x: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor, n_experts: int):
    """Kept (token, expert) pairs grouped by expert. x [N, C], experts/keep [N, k] -> (rows [M, C]:
    x's row of each pair, expert 0's first; counts [E] int64: pairs per expert; order [M]: each
    row's flat slot index token * k + j, what :func:`unpermute` needs to put it back)."""
    flat = experts.reshape(-1)
    kept = keep.reshape(-1).nonzero().squeeze(1)  # slot ids, token-major
    order = kept[torch.argsort(flat[kept], stable=True)]
    counts = torch.bincount(flat[order], minlength=n_experts)
    return x[order // experts.shape[1]], counts, order


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Inverse of :func:`permute` with the combine: out[t] = sum over t's kept pairs of weight *
    expert output. rows [M, C] (expert outputs in permuted order) -> [n_tokens, C]; a token whose
    pairs were all dropped gets zeros."""
    w = weights.reshape(-1)[order].to(rows.dtype)
    out = rows.new_zeros(n_tokens, rows.shape[-1])
    return out.index_add_(0, order // weights.shape[1], rows * w[:, None])


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: gate, up [E, F, C], down [E, C, F]. Under expert
    parallelism a rank holds a slice of them (``n_local`` of the E)."""

    def __init__(self, n_experts: int, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model))
        self.up = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, ffn_dim))

    #: Set by expert parallelism under FSDP2, whose sharded weights do not show the count (None: gate's rows)
    local_count: int | None = None

    @property
    def n_local(self) -> int:
        """Experts this module holds."""
        return self.local_count if self.local_count is not None else self.gate.shape[0]

    def matrices(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """(stacked weight, writes into the residual stream?) for the init schemes."""
        yield self.gate, False
        yield self.up, False
        yield self.down, True

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """rows [M, C] grouped by expert (``counts[e]`` rows for local expert e, summing to M) ->
        [M, C]. An expert with no rows still takes part (a zero gradient, not a missing one)."""
        sizes = counts.tolist() if torch.is_tensor(counts) else list(counts)
        if len(sizes) != self.n_local or sum(sizes) != rows.shape[0]:
            raise ValueError(f"counts {sizes} must have {self.n_local} entries summing to the {rows.shape[0]} rows")
        # Under expert parallelism with FSDP2 the weights are DTensors over the (edp, ep) mesh: this
        # rank's block of experts is the local tensor (the gradient goes back to the DTensor).
        gate, up, down = (w.to_local() if hasattr(w, "to_local") else w for w in (self.gate, self.up, self.down))
        outs = [F.linear(F.silu(F.linear(r, gate[e])) * F.linear(r, up[e]), down[e])
                for e, r in enumerate(rows.split(sizes))]
        return torch.cat(outs) if outs else rows


class SharedExperts(nn.Module):
    """The experts every token passes through (DeepSeek): one SwiGLU, ``n * F`` wide."""

    def __init__(self, d_model: int, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, width, bias=False)
        self.up = nn.Linear(d_model, width, bias=False)
        self.down = nn.Linear(width, d_model, bias=False)
        self.down.is_residual_projection = True  # read by the init schemes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_i f_i * P_i (a float32 scalar, no coefficient).
    f_i = share of the N*k routed slots that chose expert i (no gradient: a count), P_i = mean of
    ``probs[:, i]`` (the gradient flows through it). 1.0 for a uniform router, up to E when one
    expert takes every token with probability 1."""
    n, k = experts.shape
    f = torch.bincount(experts.reshape(-1), minlength=n_experts).float() / (n * k)
    return n_experts * (f * probs.mean(0)).sum()


class SequenceSplit:
    """What an MoE layer needs to know when its input ``[B, T / size, C]`` is this rank's slice of
    the sequences (slice ``rank`` of ``size`` along T, as sequence parallelism splits them). The
    collectives run without gradient. Implemented in course_lib.parallel (the model imports no
    process groups)."""

    size: int = 1
    rank: int = 0

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[B, T / size, ...]`` concatenated along dim 1, in rank order -> ``[B, T, ...]``."""
        raise NotImplementedError

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the ranks (a new tensor)."""
        raise NotImplementedError


def split_keep_mask(r: Routing, everyone: torch.Tensor, split: SequenceSplit, batch: int, n_experts: int,
                    factor: float | None, policy: str) -> torch.Tensor:
    """:func:`keep_mask` for this rank's ``batch x T_local`` tokens, decided over the whole
    micro-batch: ``everyone`` holds every rank's chosen experts in the one-process token order
    (b * T + t, [N_all, k]), so a token is dropped exactly when one process would drop it."""
    k = r.experts.shape[1]
    weights = (split.gather(r.weights.view(batch, -1, k)).reshape(-1, k) if policy == "probs"
               else r.weights.new_zeros(everyone.shape))  # "position" reads no weights
    cap = None if factor is None else capacity(everyone.shape[0], k, n_experts, factor)
    keep = keep_mask(everyone, weights, n_experts, cap, policy)
    return keep.view(batch, split.size, -1, k)[:, split.rank].reshape(-1, k)


def split_balancing_loss(probs: torch.Tensor, everyone: torch.Tensor, split: SequenceSplit,
                         n_experts: int) -> torch.Tensor:
    """:func:`load_balancing_loss` over every rank's tokens (``everyone``: their chosen experts,
    [N_all, k]; ``probs``: this rank's [N_local, E]). The value is the one-process value on every
    rank; the gradient is this rank's tokens' share (E * f_i / N_all on each of their P_i), so the
    shares summed over the ranks are the one-process gradient."""
    n, k = everyone.shape
    f = torch.bincount(everyone.reshape(-1), minlength=n_experts).float() / (n * k)
    local_sum = probs.sum(0)
    part = n_experts * (f * local_sum).sum() / n  # with gradient
    whole = n_experts * (f * split.all_reduce(local_sum.detach())).sum() / n
    return part + (whole - part).detach()


#: ``dispatcher(rows, counts, experts) -> rows out``: how the expert step runs (None: locally)
Dispatcher = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]


class MoE(nn.Module):
    """The MoE MLP of one block (see the module docstring). After each forward it holds, for the
    model to read: ``aux_loss`` (the coefficient times :func:`load_balancing_loss`, with gradient;
    None when the coefficient is 0), ``last_load`` ([E] int64: tokens the router chose per expert,
    before dropping) and ``last_dropped`` (pairs dropped over capacity, a 0-d int64 tensor)."""

    #: None: every expert is here. Expert parallelism sets a callable (see :data:`Dispatcher`).
    dispatcher: Dispatcher | None = None
    #: None: the input holds whole sequences. Sequence parallelism sets a :class:`SequenceSplit`.
    sequence_split: SequenceSplit | None = None

    def __init__(self, cfg) -> None:
        super().__init__()
        E = cfg.moe_experts
        self.n_experts, self.top_k = E, cfg.moe_top_k
        self.router = Router(cfg.d_model, E, cfg.moe_top_k, cfg.moe_score, cfg.moe_norm_topk, cfg.moe_route_scale,
                             bias_balancing=cfg.moe_bias_update_rate is not None)
        self.experts = Experts(E, cfg.d_model, cfg.expert_dim)
        self.shared = (SharedExperts(cfg.d_model, cfg.moe_shared_experts * cfg.expert_dim)
                       if cfg.moe_shared_experts else None)
        self.aux_coef, self.bias_rate = cfg.moe_aux_loss_coef, cfg.moe_bias_update_rate
        self.capacity_factor, self.drop_policy = cfg.moe_capacity_factor, cfg.moe_drop_policy
        self.dropout = cfg.dropout
        self.aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None
        self.step_load: torch.Tensor | None = None  # summed by the model over a step's forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        n = h.shape[0]
        r = self.router(h)
        split = self.sequence_split
        if split is not None:  # this rank's slice of the sequences: decide over all of them
            k = self.top_k
            everyone = split.gather(r.experts.view(shape[0], -1, k)).reshape(-1, k)
            keep = split_keep_mask(r, everyone, split, shape[0], self.n_experts, self.capacity_factor,
                                   self.drop_policy)
        else:
            cap = None if self.capacity_factor is None else capacity(n, self.top_k, self.n_experts,
                                                                     self.capacity_factor)
            keep = keep_mask(r.experts, r.weights, self.n_experts, cap, self.drop_policy)
        rows, counts, order = permute(h, r.experts, keep, self.n_experts)
        out_rows = self.experts(rows, counts) if self.dispatcher is None else self.dispatcher(rows, counts, self.experts)
        out = unpermute(out_rows, order, r.weights, n)
        if self.shared is not None:
            out = out + self.shared(h)
        self.aux_loss = None
        if self.aux_coef:
            self.aux_loss = self.aux_coef * (load_balancing_loss(r.probs, r.experts, self.n_experts) if split is None
                                             else split_balancing_loss(r.probs, everyone, split, self.n_experts))
        self.last_load = torch.bincount(r.experts.reshape(-1), minlength=self.n_experts).detach()
        self.last_dropped = (~keep).sum().detach()
        return F.dropout(out.view(shape), self.dropout, self.training)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of ``model`` in block order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_aux(layers: list[MoE], training: bool) -> torch.Tensor | None:
    """After a forward: the sum of the layers' auxiliary losses (None when none has one) and, when
    ``training``, each layer's load added to its ``step_load`` for :func:`update_expert_bias`.
    The model calls this outside any checkpointed region, so a block recomputed in backward
    (activation checkpointing) is never counted twice."""
    total = None
    for m in layers:
        if training and m.last_load is not None:
            m.step_load = m.last_load.clone() if m.step_load is None else m.step_load + m.last_load
        if m.aux_loss is not None:
            total = m.aux_loss if total is None else total + m.aux_loss
    return total


@torch.no_grad()
def update_expert_bias(model: nn.Module, all_reduce: Callable[[torch.Tensor], None] | None = None) -> list | None:
    """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step: for every MoE layer with
    bias balancing, load_i = tokens routed to expert i since the last call (summed in place over the
    data-parallel ranks by ``all_reduce``, when given), then bias_i += rate * sign(mean(load) - load_i):
    an overloaded expert becomes less likely to be picked, an idle one more. The step's loads are
    reset. Returns the loads used (one [E] float tensor per layer; None entries for layers
    without balancing), for plots."""
    out = []
    for m in moe_layers(model):
        load, m.step_load = m.step_load, None
        if m.router.expert_bias is None or load is None:
            out.append(None)
            continue
        load = load.float()
        if all_reduce is not None:
            all_reduce(load)
        m.router.expert_bias.add_(m.bias_rate * torch.sign(load.mean() - load))
        out.append(load)
    return out
