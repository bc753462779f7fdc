"""Full checkpoints of a tensor/pipeline-parallel model, in the *dense* model's names and layout.

A rank of a tp x pp x dp run holds one stage's blocks, and of each matrix one tp shard
(``tp_partition_dim`` says along which dense dim it was cut; replicated tensors carry none). To
save, the writer (rank 0) needs the dense ``state_dict`` and AdamW state: the shards are
all-gathered over each stage's tp group (only data-parallel replica 0 takes part: the replicas
are identical), and each stage's tp-rank-0 sends its whole tensors to rank 0. To load, every rank
reads the same dense checkpoint and keeps its slice: ``full.chunk(tp, dim)[tp_rank]``, exactly
how :mod:`~course_lib.parallel.tensor_parallel.layers` cut the shards. So a checkpoint written by
any layout loads in any other, and in one process (``train.strategy = "single"``).

Experts (an MoE model, :mod:`.experts`): a rank holds ``E / ep`` experts of its stage's MoE layers,
and the ranks of its EP group the others - possibly other data-parallel replicas. To save, every
rank first all-gathers its slices (and their AdamW moments) over its EP group, so replica 0 holds
whole ``[E, ...]`` tensors; to load, a rank keeps its EP rank's block of experts. A file is then the
one-process layout at any EP size.

Tied embeddings: the dense model has one matrix under two names (``tok_emb.weight`` and
``lm_head.weight`` in its state dict; one optimizer entry, named ``tok_emb.weight``). Under pp > 1
the first and the last stage each hold a copy with identical values and identical Adam moments
(their gradients are summed on both); the checkpoint takes the first stage's, and both copies
load it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.expert_parallel.shard import is_expert

TIED_ALIAS = ("tok_emb.weight", "lm_head.weight")  # (dense optimizer name, its second name)


class DenseLayout:
    """What the dense model looks like (state-dict keys, shapes, dtypes; the optimizer's groups by
    name) and how this rank's module maps onto it (:meth:`bind`). ``ep``: the EPGroup its expert
    slices are spread over (set by the strategy; None without experts)."""

    ep = None

    def __init__(self, dense: nn.Module, named_groups: list[dict]):
        sd = dense.state_dict()
        self.keys = list(sd)
        self.meta = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
        self.tied = bool(getattr(dense.cfg, "tie_embeddings", False))
        self.group_names = [list(g["params"]) for g in named_groups]  # dense optimizer order
        self.index = {n: i for i, n in enumerate(n for g in self.group_names for n in g)}
        self.param_shape = {n: self.meta[n][0] for n in self.index}

    def bind(self, local: nn.Module) -> None:
        """Record this rank's module: which dense parameter each local one is, its tp dim."""
        self.local = local
        params = dict(local.named_parameters(remove_duplicate=False))
        self.tp_dim = {k: p.tp_partition_dim for k, p in params.items() if hasattr(p, "tp_partition_dim")}
        self.param_of = {}  # dense optimizer name -> local parameter
        for n in self.index:
            if n in params:
                self.param_of[n] = params[n]
            elif self.tied and n == TIED_ALIAS[0] and TIED_ALIAS[1] in params:
                self.param_of[n] = params[TIED_ALIAS[1]]  # the last stage's copy of the tied matrix
        # What this rank contributes to a gathered checkpoint: the tied matrix only from the stage
        # that holds it as the token table (the first).
        self.owns = [n for n in self.param_of if n in params]
        self.name_of = {id(p): n for n, p in self.param_of.items()}
        self.dim_of = {id(p): getattr(p, "tp_partition_dim", None) for p in self.param_of.values()}
        self.expert_keys = {k for k, p in params.items() if is_expert(p)}

    def local_groups(self, named_groups: list[dict]) -> list[dict]:
        """The dense optimizer's groups (same options, same count) over the local parameters."""
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [self.param_of[n] for n in g["params"] if n in self.param_of]} for g in named_groups]

    # ---------------------------------------------------------------- gather (saving)
    def gather(self, mesh, optimizer=None) -> tuple[dict | None, dict | None]:
        """Collective. On rank 0: (the dense state dict, the dense optimizer state dict or None);
        (None, None) elsewhere. Tensors on the CPU."""
        c = mesh.coords
        experts, expert_state = self._gather_experts(optimizer)  # every rank: its EP group's slices
        if c["dp"] != 0 or c["cp"] != 0:
            return None, None  # replica 0 holds the same numbers
        tp_group, tp = mesh.groups["tp"], mesh.size("tp")

        def whole(t: torch.Tensor, dim) -> torch.Tensor:
            if dim is None or tp == 1 or t.dim() == 0:
                return t.detach().cpu().clone()
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
            return torch.cat(parts, dim=dim).cpu()

        skip = {TIED_ALIAS[1]} if self.tied else set()  # the alias is re-made from the token table
        model = {k: experts[k] if k in experts else whole(v, self.tp_dim.get(k))
                 for k, v in self.local.state_dict().items() if k not in skip}
        optim = None
        if optimizer is not None:
            optim = {}
            for n in self.owns:
                p = self.param_of[n]
                if n in expert_state:
                    optim[n] = expert_state[n]
                    continue
                st = optimizer.state.get(p, {})
                optim[n] = {k: whole(v, self.dim_of[id(p)]) if torch.is_tensor(v) else v for k, v in st.items()}
        if c["tp"] != 0:
            return None, None
        if mesh.rank != 0:  # a later stage's tp rank 0: hand the whole tensors to the writer
            dist.send_object_list([(model, optim)], dst=0)
            return None, None
        for s in range(1, mesh.size("pp")):
            box = [None]
            dist.recv_object_list(box, src=mesh.layout.rank_of(pp=s))
            m, o = box[0]
            model.update(m)
            if optim is not None:
                optim.update(o)
        if self.tied:
            model[TIED_ALIAS[1]] = model[TIED_ALIAS[0]]  # one tensor under both names, as the dense model
        model = {k: model[k] for k in self.keys}
        if optim is None:
            return model, None
        state = {self.index[n]: st for n, st in optim.items() if st}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [self.index[n] for n in names]}
                  for g, names in zip(optimizer.param_groups, self.group_names)]
        return model, {"state": state, "param_groups": groups}

    def _gather_experts(self, optimizer) -> tuple[dict, dict]:
        """Collective over each EP group (every rank): ({state-dict key: whole [E, ...] weight},
        {dense name: AdamW state with whole moments}) of this rank's expert slices, on the CPU;
        empty without experts. Every rank of a group has the same keys in the same order (same
        stage, same steps taken), so the all-gathers line up."""
        ep = self.ep
        single = ep is None or ep.size == 1

        def whole(t: torch.Tensor) -> torch.Tensor:  # this rank's slice -> every expert, on the CPU
            if single or t.dim() == 0:  # every expert here; a 0-d tensor (Adam's step) is not sliced
                return t.detach().cpu().clone()
            parts = [torch.empty_like(t) for _ in range(ep.size)]
            dist.all_gather(parts, t.detach().contiguous(), group=ep.group)
            return torch.cat(parts).cpu()

        model = {k: whole(v) for k, v in self.local.state_dict().items() if k in self.expert_keys}
        states = {}
        if optimizer is not None:
            for n in sorted(n for n, p in self.param_of.items() if is_expert(p)):  # same order on every rank
                p = self.param_of[n]
                states[n] = {k: whole(v.to(p.device)) if torch.is_tensor(v) else v
                             for k, v in sorted(optimizer.state.get(p, {}).items())}
        return model, states

    def gather_model(self, mesh) -> dict | None:
        return self.gather(mesh)[0]

    # ---------------------------------------------------------------- slice (loading)
    def slice(self, full: torch.Tensor, dim, mesh, expert: bool = False) -> torch.Tensor:
        """This rank's tp shard of a dense tensor (a copy: the full tensor can be freed); of an
        expert weight (``expert``: [E, ...], dim 0), its EP rank's block of experts."""
        if expert:
            if self.ep is None or self.ep.size == 1:
                return full
            return full.chunk(self.ep.size, dim=0)[self.ep.rank].clone()
        if dim is None or mesh.size("tp") == 1 or full.dim() == 0:
            return full
        return full.chunk(mesh.size("tp"), dim=dim)[mesh.coords["tp"]].clone()


class FullModelView(nn.Module):
    """The local module seen in the dense layout: ``state_dict`` is the dense one (gathered at
    construction when ``gather``; otherwise shape-only stand-ins on the meta device, which is all a
    load checks against), ``load_state_dict`` takes a dense one and keeps this rank's part."""

    def __init__(self, layout: DenseLayout, mesh, full: dict | None = None):
        super().__init__()
        object.__setattr__(self, "_layout", layout)  # not submodules: the state dict is ours alone
        object.__setattr__(self, "_mesh", mesh)
        self._full = full  # the gathered dense state dict (rank 0, when saving)

    def state_dict(self, *args, **kwargs):
        if self._full is not None:
            return dict(self._full)
        return {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in self._layout.meta.items()}

    def load_state_dict(self, state_dict, strict: bool = True):
        lay = self._layout
        mine = {k: lay.slice(state_dict[k], lay.tp_dim.get(k), self._mesh, expert=k in lay.expert_keys)
                for k in lay.local.state_dict() if k in state_dict}
        return lay.local.load_state_dict(mine, strict=strict)

    def named_parameters(self, *args, **kwargs):  # names for messages (optimizer_mismatch)
        return self._layout.local.named_parameters(*args, **kwargs)


class FullOptimizerView:
    """The optimizer in the dense layout: ``param_groups`` hold full-shape stand-ins for every dense
    parameter (so a checkpoint's groups and state shapes are checked against the dense model),
    ``state_dict`` is gathered (``gather``), ``load_state_dict`` slices this rank's part."""

    def __init__(self, layout: DenseLayout, mesh, optimizer: torch.optim.Optimizer, full: dict | None = None):
        self._layout, self._mesh, self._opt = layout, mesh, optimizer
        self.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [torch.empty(layout.param_shape[n], device="meta") for n in names]}
                             for g, names in zip(optimizer.param_groups, layout.group_names)]
        self.state = {}  # shapes are checked against the stand-ins, not the shards
        self._full = full  # the gathered dense optimizer state (rank 0, when saving)

    def state_dict(self) -> dict:
        if self._full is None:
            raise RuntimeError("this optimizer view holds the gathered state on rank 0 only, when saving")
        return self._full

    def load_state_dict(self, state_dict: dict) -> None:
        lay, out, groups, i = self._layout, {}, [], 0
        for saved, group in zip(state_dict["param_groups"], self._opt.param_groups):
            groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": list(range(i, i + len(group["params"])))})
            for p in group["params"]:
                st = state_dict["state"].get(lay.index[lay.name_of[id(p)]])
                if st is not None:
                    dim, expert = lay.dim_of[id(p)], is_expert(p)
                    out[i] = {k: lay.slice(v, dim, self._mesh, expert) if torch.is_tensor(v) and v.dim() > 0 else v
                              for k, v in st.items()}
                i += 1
        self._opt.load_state_dict({"state": out, "param_groups": groups})
