"""The data-parallel dimension of :class:`~course_lib.parallel.composed.model_parallel.ModelParallel`:
what happens to this rank's (TP-sharded / stage) gradients, optimizer state and weights across the
ranks that hold the *same* weights - the mesh's ``dp_cp`` group (the dp group when cp = 1).

``train.strategy`` names the mode when ``parallel.tp * pp * cp > 1``:

* ``"ddp"`` (:class:`ReplicatedDP`): replicated weights and optimizer; after the last micro-batch
  one all-reduce of every gradient, flattened (per-call latency dominates small tensors on gloo).
* ``"zero1"`` / ``"zero2"`` (:class:`FlatZero`): the local parameters, flattened in the optimizer's
  order and padded to a multiple of N = |dp_cp|, are cut into N equal *contiguous* element ranges
  (Megatron's distributed-optimizer layout, not the whole-parameter ownership of the teaching
  :class:`~course_lib.parallel.ShardedOptimizer`: equal ranges make the bytes per rank exactly the
  estimator's Psi/N, and the weight update an all-gather of equal shards). Rank r's range is a list
  of *pieces* - 1-D views into the parameters it intersects - and the trainer's optimizer class
  (same groups and options) steps only those pieces, so its Adam moments are 1/N of the state.
  Per step: gradients reduce-scattered (one collective) into this rank's range, which is all the
  stabilizer measures and clips (:attr:`DataParallelMode.grads_module`); the pieces step; the
  updated ranges are all-gathered into every parameter (one collective). ZeRO-1 keeps the full
  gradient buffers (its range written back into them), ZeRO-2 frees them after the
  reduce-scatter and keeps only its range's gradient.

Expert slices (an MoE model, :mod:`.experts`) differ between the dp_cp ranks, so no mode flattens
them with the rest: their gradients are summed over their expert-data-parallel group and divided
by dp (:meth:`DataParallelMode._reduce_experts`), and under zero1/zero2 they stay whole, outside the
flat ranges, stepped by every rank that holds them (their optimizer state replicated over
expert-DP, not sharded: DeepSeek-V3's ZeRO-1 over the experts' data-parallel group is not built
here). The stabilizer counts each slice once in the world and reports whole-tensor norms.

The interface a mode implements (the FSDP mode of another branch adds itself the same way):
``setup(module, groups, optimizer_cls, kwargs) -> optimizer``; ``finish_gradients(sync_tied)``
after the last backward (``sync_tied()`` adds the tied embedding / head parts across pp: each mode
calls it where its layout allows); ``reduce_grad_sq(sq)`` for the stabilizer's one host read;
``grads_module`` (what the stabilizer measures and clips); ``after_step()``; ``zero_grad()``;
``optimizer_view(saving)`` (the optimizer as one optimizer over the local parameters, full-shape
state: a collective when saving, what the dense-layout checkpoint gathers and loads through).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.expert_parallel.shard import is_expert


class DataParallelMode:
    """Base: the pieces every mode shares. ``strategy``: the ModelParallel that owns it (mesh,
    tp/pp coordinates, the local module)."""

    name = "?"

    def __init__(self, strategy):
        self.s = strategy
        self.group = strategy.mesh.groups["dp_cp"]
        self.size = strategy.mesh.size("dp_cp")
        self.rank = strategy.mesh.ranks["dp_cp"].index(strategy.mesh.rank)
        self.optimizer = None

    def _count_mask(self, params: list[torch.Tensor], device) -> torch.Tensor:
        """1.0 for a parameter whose gradient this rank counts in the global norm: TP shards on
        every tp rank, replicated tensors on tp rank 0 only, the last stage's tied head copy
        never (the first stage counts the matrix); an expert slice on the ranks of its stage's
        first EP group (each slice once in the world: :class:`.experts.StageExperts`)."""
        s = self.s
        tied = s.model.tied_param if s.pp > 1 and s.model.tied and s.is_last else None
        in_norm = 1.0 if s.experts is not None and s.experts.counts_in_norm else 0.0
        return torch.tensor([in_norm if is_expert(p) else 0.0 if p is tied else
                             (1.0 if hasattr(p, "tp_partition_dim") or s.tp_rank == 0 else 0.0)
                             for p in params], device=device)

    def _reduce_experts(self) -> None:
        """The expert slices' gradients over their expert-DP group (:mod:`.experts`), if any."""
        if self.s.experts is not None:
            self.s.experts.reduce_gradients()

    @property
    def grads_module(self) -> nn.Module:
        return self.s.model

    def after_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_view(self, saving: bool):
        return self.optimizer

    def census_params(self) -> list[torch.Tensor]:
        """The tensors whose storage and ``.grad`` hold this rank's weights and gradients, for
        :func:`~course_lib.parallel.memory_census.model_state_bytes_on_rank` (``params=``)."""
        return list(self.s.model.parameters())


class ReplicatedDP(DataParallelMode):
    """``"ddp"``: replicas all-reduce their gradients; optimizer and weights replicated."""

    name = "ddp"

    def setup(self, module, groups, optimizer_cls, kwargs):
        self.optimizer = optimizer_cls(groups, **kwargs)
        self._mask = None
        return self.optimizer

    @torch.no_grad()
    def finish_gradients(self, sync_tied) -> None:
        if self.size > 1:
            grads = [p.grad for p in self.s.model.parameters() if p.grad is not None and not is_expert(p)]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat /= self.size
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])
        self._reduce_experts()  # over expert-DP, which may span tp ranks even when dp = 1
        sync_tied()  # after the mean, so both copies add the same two (averaged) parts

    def reduce_grad_sq(self, sq: torch.Tensor):
        """Per-tensor squares of this rank's gradients -> (whole-tensor squares, global total):
        TP shards summed over tp (expert slices over their EP group); the total counts each
        logical parameter once, summed over the model-parallel group (after the mean the replicas
        hold the same gradients) - with experts over the world, dense tensors counted on dp rank 0
        (an EP group may span replicas, so one replica's ranks do not hold every slice)."""
        s = self.s
        params = [p for p in s.model.parameters() if p.grad is not None]
        if self._mask is None or self._mask[0] != len(params):
            sharded = torch.tensor([1.0 if hasattr(p, "tp_partition_dim") else 0.0 for p in params], device=sq.device)
            at = [i for i, p in enumerate(params) if is_expert(p)]  # where the expert slices sit
            expert = torch.zeros(len(params), device=sq.device)
            expert[at] = 1.0
            # cp peers hold the same gradients after the dp_cp mean: cp rank 0 counts them
            count = self._count_mask(params, sq.device) * (0.0 if s.cp_rank else 1.0)
            if s.experts is not None:
                count = count * expert + count * (1 - expert) * (0.0 if s.dp_rank else 1.0)
            self._mask = (len(params), sharded, count, torch.tensor(at, dtype=torch.long, device=sq.device))
        _, sharded, count, at = self._mask
        total = (sq * count).sum()
        dist.all_reduce(total, group=s.mp_group if s.experts is None else None)
        if s.tp > 1:
            shard_sq = sq * sharded
            dist.all_reduce(shard_sq, group=s.tp_group)
            sq = shard_sq + sq * (1 - sharded)
        if at.numel():  # the expert slices' squares -> their whole tensors' (shape, no host read)
            sq = sq.clone()
            sq[at] = s.experts.whole_sq(sq[at])
        return sq, total


class _Pieces(nn.Module):
    """What the stabilizer measures and clips under ZeRO: this rank's gradient range, as the 1-D
    pieces of the parameters it intersects (names ``dense.name[a:b]``). Not a module to run."""

    def __init__(self, named):
        super().__init__()
        object.__setattr__(self, "_named", named)

    def named_parameters(self, *args, **kwargs):
        return iter(self._named)

    def parameters(self, *args, **kwargs):
        return (p for _, p in self._named)


class FlatZero(DataParallelMode):
    """``"zero1"`` / ``"zero2"`` over the dp_cp group (see the module docstring)."""

    def __init__(self, strategy, stage: int):
        super().__init__(strategy)
        self.stage, self.name = stage, f"zero{stage}"

    def setup(self, module, groups, optimizer_cls, kwargs):
        params = [p for g in groups for p in g["params"]]
        if {id(p) for p in params} != {id(p) for p in module.parameters()} or len(params) != len(set(map(id, params))):
            raise ValueError("ZeRO under model parallelism needs every local parameter in exactly one optimizer group")
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("ZeRO flattens the local parameters: they must share one dtype and device")
        # Expert slices differ between the dp_cp ranks: they stay whole, outside the flat ranges
        # (reduced over their expert-DP group, stepped by every rank holding them; .experts).
        self.local_groups = [list(g["params"]) for g in groups]  # every local parameter, group order
        self.experts = [p for p in params if is_expert(p)]
        params = [p for p in params if not is_expert(p)]
        groups = [{**g, "params": [p for p in g["params"] if not is_expert(p)]} for g in groups]
        self.params = params
        self.group_sizes = [len(g) for g in self.local_groups]
        n, N = sum(p.numel() for p in params), self.size
        self.numel, self.shard = n, -(-n // N)  # elements, and each rank's range (padded: ceil)
        self.padded = self.shard * N
        if (N - 1) * self.shard >= n:
            raise ValueError(f"{n} local parameter elements cannot give each of {N} data-parallel ranks a "
                             f"non-empty range; use fewer data-parallel ranks")
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        names = {id(p): n for n, p in module.named_parameters()}
        self.pieces = []  # (param, start in param, end in param, start in this rank's range, piece)
        piece_groups, offset = [], 0
        for g, local in zip(groups, self.local_groups):
            mine = []
            for p in g["params"]:
                a, b = max(offset, lo), min(offset + p.numel(), hi)
                if a < b:
                    piece = p.detach().view(-1)[a - offset:b - offset]  # shares the weight's storage
                    self.pieces.append((p, a - offset, b - offset, a - lo, piece))
                    mine.append(piece)
                offset += p.numel()
            whole = [p for p in local if is_expert(p)]
            piece_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine + whole})
        self.optimizer = optimizer_cls(piece_groups, **kwargs)
        self._grads_module = _Pieces([(f"{names.get(id(p), '?')}[{a}:{b}]", piece) for p, a, b, _, piece in self.pieces]
                                     + [(names.get(id(p), "?"), p) for p in self.experts])
        self._count = None
        return self.optimizer

    @property
    def grads_module(self) -> nn.Module:
        return self._grads_module

    @torch.no_grad()
    def finish_gradients(self, sync_tied) -> None:
        # The tied copies add their parts first: after the reduce-scatter the first and last
        # stage hold different ranges of the matrix, so the parts could no longer be paired.
        sync_tied()
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p in self.params]
        pad = self.padded - self.numel
        if pad:
            grads.append(grads[0].new_zeros(pad))
        flat = torch.cat(grads)
        del grads
        mine = flat.new_empty(self.shard)
        dist.reduce_scatter_single(mine, flat, op=dist.ReduceOp.SUM, group=self.group)
        del flat
        mine /= self.size
        if self.stage == 1:  # keep the full buffers; this rank's range gets the mean
            for p, a, b, at, piece in self.pieces:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                view = p.grad.view(-1)[a:b]
                view.copy_(mine[at:at + b - a])
                piece.grad = view
        else:  # ZeRO-2: only this rank's range of gradient stays
            for p in self.params:
                p.grad = None
            for p, a, b, at, piece in self.pieces:
                piece.grad = mine[at:at + b - a]
        self._reduce_experts()

    def reduce_grad_sq(self, sq: torch.Tensor):
        """Squares of this rank's gradient pieces (then its expert slices, summed over their EP
        group: the whole tensor's) -> (their squares, global total). Every logical element sits in
        exactly one dp_cp rank's range, and every expert slice is counted on one rank
        (:meth:`_count_mask`), so the total is the masked sum over the whole world (one all-reduce)."""
        if self._count is None:
            mask = self._count_mask(self.params, sq.device)
            index = {id(p): i for i, p in enumerate(self.params)}
            self._count = torch.cat([mask[[index[id(p)] for p, *_ in self.pieces]],
                                     self._count_mask(self.experts, sq.device)])
        total = (sq * self._count).sum()
        dist.all_reduce(total)
        if self.experts:  # an expert slice's square -> its whole tensor's (pieces differ per rank: left out)
            n = len(self.pieces)
            sq = torch.cat([sq[:n], self.s.experts.whole_sq(sq[n:])])
        return sq, total

    @torch.no_grad()
    def after_step(self) -> None:
        """Every rank's updated range into every parameter: one all-gather of equal shards."""
        mine = torch.cat([piece for *_, piece in self.pieces])
        if mine.numel() < self.shard:  # the last range's padding
            mine = torch.cat([mine, mine.new_zeros(self.shard - mine.numel())])
        full = mine.new_empty(self.padded)
        dist.all_gather_single(full, mine, group=self.group)
        torch._foreach_copy_(self.params, [f.view_as(p) for f, p in zip(full[:self.numel].split(
            [p.numel() for p in self.params]), self.params)])

    def zero_grad(self) -> None:
        for p in self.params + self.experts:
            p.grad = None
        for *_, piece in self.pieces:
            piece.grad = None

    def optimizer_view(self, saving: bool):
        return _LocalOptimizerView(self, gather=saving)

    def census_params(self) -> list[torch.Tensor]:
        # The pieces share the weights' storage (counted once); their .grad is where ZeRO-2's
        # gradient range lives (ZeRO-1: views into the full buffers, counted once too).
        return [*self.params, *(piece for *_, piece in self.pieces), *self.experts]

    @torch.no_grad()
    def gather_state(self) -> dict:
        """Collective over dp_cp: {local param: {key: full-shape state}} (CPU tensors). Moments
        (one element per parameter element) are all-gathered; per-parameter scalars (AdamW's
        ``step``) are equal on every piece and taken from this rank's first piece."""
        states = [self.optimizer.state.get(piece, {}) for *_, piece in self.pieces]
        first = states[0]
        keys = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.numel() == self.pieces[0][4].numel()
                      and v.dim() > 0)
        scalars = {k: v for k, v in first.items() if k not in keys}
        out = {p: {} for p in self.params} if first else {}
        for k in keys:
            mine = torch.cat([st[k].reshape(-1) for st in states])
            if mine.numel() < self.shard:
                mine = torch.cat([mine, mine.new_zeros(self.shard - mine.numel())])
            full = mine.new_empty(self.padded)
            dist.all_gather_single(full, mine, group=self.group)
            for p, f in zip(self.params, full[:self.numel].split([p.numel() for p in self.params])):
                out[p][k] = f.view_as(p).cpu().clone()
        for p in out:
            out[p].update({k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
        for p in self.experts:  # whole slices: their own state
            st = self.optimizer.state.get(p)
            if st:
                out[p] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        return out

    def load_state(self, by_param: dict, groups: list[dict]) -> None:
        """Load full-shape local state ({param: {key: tensor}}) and the groups' options: each piece
        keeps its range."""
        state, piece_groups = {}, []
        index = {id(x): j for j, x in enumerate(x for g in self.optimizer.param_groups for x in g["params"])}
        for g, live in zip(groups, self.optimizer.param_groups):
            piece_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                 "params": [index[id(piece)] for piece in live["params"]]})
        for p, a, b, _, piece in self.pieces:
            st = by_param.get(p)
            if st:
                state[index[id(piece)]] = {k: (v.reshape(-1)[a:b].clone() if torch.is_tensor(v) and v.dim() > 0
                                               and v.numel() == p.numel() else v) for k, v in st.items()}
        for p in self.experts:  # whole slices (already this rank's experts: the view sliced them)
            st = by_param.get(p)
            if st:
                state[index[id(p)]] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": piece_groups})


class _LocalOptimizerView:
    """The ZeRO optimizer seen as one optimizer over the *local* parameters (full local shapes),
    which is what :class:`~.checkpoint.DenseLayout` gathers and
    :class:`~.checkpoint.FullOptimizerView` loads through."""

    def __init__(self, mode: FlatZero, gather: bool):
        self._mode = mode
        self.param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(local)}
                             for g, local in zip(mode.optimizer.param_groups, mode.local_groups)]
        self.state = mode.gather_state() if gather else {}

    def load_state_dict(self, state_dict: dict) -> None:
        flat = [p for g in self.param_groups for p in g["params"]]
        by_param = {flat[i]: st for i, st in state_dict["state"].items()}
        self._mode.load_state(by_param, state_dict["param_groups"])


def make_dp_mode(name: str, strategy) -> DataParallelMode:
    """The data-parallel mode called ``name`` ("ddp", "zero1", "zero2") for ``strategy``."""
    if name == "ddp":
        return ReplicatedDP(strategy)
    if name in ("zero1", "zero2"):
        return FlatZero(strategy, int(name[-1]))
    from course_lib.parallel.registry import MODEL_PARALLEL_DP
    from course_lib.validate import ConfigError

    raise ConfigError(f"train.strategy = {name!r} is not a data-parallel dimension of tensor/pipeline "
                      f"parallelism; use one of {', '.join(MODEL_PARALLEL_DP)}")
