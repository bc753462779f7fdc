"""ZeRO-1 and ZeRO-2 from scratch: shard what the optimizer keeps, not the model.

In plain data parallelism every rank holds the same weights, gradients *and* optimizer state, and
every rank does the same optimizer step. ZeRO-1 gives each parameter one owner rank: only the owner
keeps that parameter's optimizer state (Adam's two moments) and steps it, then sends the new values
to the others. ZeRO-2 also shards the gradients: they are reduce-scattered, so each rank ends with
the averaged gradients of its own parameters only and drops the rest.

Memory per rank, Psi parameters in fp32 with AdamW (8 B/param of state), N ranks:
plain DP 4Psi + 4Psi + 8Psi = 16Psi B; ZeRO-1 4Psi + 4Psi + 8Psi/N; ZeRO-2 4Psi + 4Psi/N + 8Psi/N
(after the reduce-scatter; backward still makes full gradients first). Why it is exact: each
element of the update is the same arithmetic on the same numbers whichever rank computes it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from course_lib.validate import check_bool


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (``reduce_scatter_grads=False``) or ZeRO-2 (``True``) around any torch optimizer.

    ``ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)`` takes the same
    ``params`` (tensors or param-group dicts) and keyword arguments as ``optimizer_cls``.

    Sharding: whole parameters are assigned to ranks greedily (largest first, each to the rank with
    the fewest elements so far, ties to the lowest rank), so each rank owns ~1/N of the elements,
    unless one tensor alone is bigger than 1/N of the model. Every rank computes the same
    assignment (same order, same sizes): no communication needed. Parameters added later with
    :meth:`add_param_group` join the same running balance. Each rank builds the real
    ``optimizer_cls`` over the parameters it owns only (one local group per group here, possibly
    empty), so it holds ~1/N of the optimizer state (:attr:`state` is that local state).

    Gradient contracts (gradients in units of d(mean loss)/d(parameter), same dtype as the param):

    * ZeRO-1: before :meth:`step` the caller has already made ``p.grad`` the *average over ranks*
      (e.g. DDP, or ``all_reduce`` then divide by N); grads are identical on every rank. Only the
      owner reads them; nothing is communicated for gradients here.
    * ZeRO-2: the caller does *not* all-reduce (no DDP wrapper): each rank leaves its *own local*
      gradients in ``p.grad``. :meth:`step` reduce-scatters them (sum over ranks, divided by N), so
      the owner gets the average of its parameters' grads and every other rank sets those grads to
      ``None`` before stepping. A ``None`` local gradient counts as zeros; a parameter whose
      gradient is ``None`` on every rank is skipped (one small all-reduce of flags per step, read
      on the host). ``find_unused_parameters=False`` drops the flags (and that host read): every
      parameter then counts as having a gradient (zeros where None), as in a model whose
      parameters are all used every step - the trainer's case.

    ``gradient_divide_factor``: what the reduce-scattered sum is divided by (None: the group's
    size, the rank-average). Expert parallelism shards experts over an expert-data-parallel group
    smaller than the world, yet one process's gradient is that group's sum divided by the *world*
    size (FSDP2's ``set_gradient_divide_factor`` does the same).

    Every rank must call :meth:`step` together (it communicates); afterwards every rank holds the
    updated parameters (broadcast from each owner).
    Hyperparameters live in :attr:`param_groups` (all parameters, full option set): an lr
    scheduler on this object changes them, and they are copied into the local optimizer before
    each step. Checkpoints: :meth:`consolidate_state_dict` (collective) then :meth:`state_dict` on
    that rank gives the unsharded optimizer's full state; :meth:`load_state_dict` on every rank
    keeps each rank's own shard of it.
    """

    def __init__(self, params, optimizer_cls: type, *, reduce_scatter_grads: bool = False,
                 process_group=None, find_unused_parameters: bool = True,
                 gradient_divide_factor: float | None = None, **kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)) \
                or issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError("optimizer_cls must be a torch.optim.Optimizer subclass (the class, e.g. "
                            f"torch.optim.AdamW, not an instance), got {optimizer_cls!r}")
        check_bool("reduce_scatter_grads", reduce_scatter_grads)
        self._find_unused = check_bool("find_unused_parameters", find_unused_parameters)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedOptimizer needs a process group: start the ranks with "
                               "course_lib.parallel.run_ranks or torchrun + init_distributed() first")
        self._pg = process_group if process_group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self._pg)
        self._world = dist.get_world_size(self._pg)
        if gradient_divide_factor is not None and not (isinstance(gradient_divide_factor, (int, float))
                                                       and not isinstance(gradient_divide_factor, bool)
                                                       and gradient_divide_factor > 0):
            raise ValueError(f"gradient_divide_factor must be a number > 0 or None (the group size), "
                             f"got {gradient_divide_factor!r}")
        self._divide = gradient_divide_factor if gradient_divide_factor is not None else self._world
        self._cls, self._kwargs, self._zero2 = optimizer_cls, kwargs, reduce_scatter_grads
        self._owner: dict[torch.Tensor, int] = {}  # parameter -> owning rank in the group
        self._load = [0] * self._world  # elements owned per rank so far
        self._local = None  # Optimizer.__init__ calls add_param_group before the local one exists
        self._reduced = False  # reduce_gradients() already ran for this step
        self._consolidated: dict | None = None  # full state on the destination rank, see consolidate_state_dict
        # The wrapped class's own defaults (lr, betas, ...) so param_groups carry every option.
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)
        super().__init__(params, dict(probe.defaults))
        self._local = optimizer_cls([self._local_group(g) for g in self.param_groups], **kwargs)
        self.state = self._local.state  # only this rank's shard of the optimizer state

    # ---- sharding ---------------------------------------------------------------------------
    def _local_group(self, group: dict) -> dict:
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._owner[p] == self._rank]
        local.pop("param_names", None)
        return local

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (also mid-training): its parameters get owners, the local optimizer the
        owned part (an empty group where this rank owns none, so group indices stay aligned)."""
        super().add_param_group(param_group)  # normalises and fills defaults; rejects duplicates
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda t: -t.numel()):  # stable: ties keep order
            owner = min(range(self._world), key=lambda r: self._load[r])
            self._owner[p] = owner
            self._load[owner] += p.numel()
        if self._local is not None:
            self._local.add_param_group(self._local_group(group))

    def owner(self, param: torch.Tensor) -> int:
        """The rank (in the process group) that owns ``param``'s optimizer state."""
        return self._owner[param]

    def owned_numel(self) -> list[int]:
        """Elements owned by each rank, in rank order."""
        return list(self._load)

    def _by_owner(self) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[] for _ in range(self._world)]
        for group in self.param_groups:
            for p in group["params"]:
                out[self._owner[p]].append(p)
        return out

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self._pg, group_rank) if self._pg is not dist.group.WORLD else group_rank

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self, free_unowned: bool | None = None) -> None:
        """Reduce-scatter this step's *local* gradients now (a collective: every rank calls it):
        each owner gets the rank-average of its parameters' gradients. ``free_unowned``: True
        (ZeRO-2, the default when ``reduce_scatter_grads``) sets every other gradient to None;
        False (ZeRO-1 sent as the ZeRO paper does: reduce-scatter + parameter gather, 2 Psi per
        step instead of an all-reduce's 2 Psi plus the gather) zeroes them in place, so the full
        gradient buffers stay allocated as ZeRO-1 keeps them. :meth:`step` then does not reduce
        again. Call it after the last micro-batch's backward, before measuring or clipping: the
        trainer measures the gradient norm on the reduced gradients."""
        if free_unowned is None:
            free_unowned = self._zero2
        self._reduce_scatter_grads(self._by_owner(), free_unowned=free_unowned)
        self._reduced = True

    @torch.no_grad()
    def _reduce_scatter_grads(self, by_owner: list[list[torch.Tensor]], free_unowned: bool = True) -> None:
        # One flat buffer per owner (sizes differ: whole-parameter shards), and one list-form
        # reduce_scatter: rank r receives the sum of every rank's buffer r. gloo supports this
        # list form with uneven sizes in torch 2.13 (checked), so no per-owner dist.reduce
        # fallback is needed. Params with no grad on any rank are left out (a 1-element flag sum).
        params = [p for ps in by_owner for p in ps]
        if self._find_unused:
            has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                               device=params[0].device)  # nccl reduces device tensors only
            dist.all_reduce(has, group=self._pg)
            keep = {id(p) for p, n in zip(params, has.tolist()) if n > 0}  # a host read
        else:  # the caller promises every parameter gets a gradient somewhere: no flags, no host read
            keep = {id(p) for p in params}
        sends = []
        for ps in by_owner:
            ps = [p for p in ps if id(p) in keep]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
            sends.append(_flatten_dense_tensors(grads) if grads
                         else torch.empty(0, dtype=params[0].dtype, device=params[0].device))
        mine = [p for p in by_owner[self._rank] if id(p) in keep]
        recv = torch.empty_like(sends[self._rank])
        dist.reduce_scatter(recv, sends, op=dist.ReduceOp.SUM, group=self._pg)
        recv.div_(self._divide)  # the average (or the caller's factor); exact for powers of two
        for p, g in zip(mine, _unflatten_dense_tensors(recv, mine) if mine else []):
            p.grad = g.view_as(p)
        for ps in by_owner:  # everything this rank does not own: freed (ZeRO-2) or zeroed (ZeRO-1)
            for p in ps:
                if id(p) not in keep:
                    p.grad = None
                elif self._owner[p] != self._rank:
                    if free_unowned:
                        p.grad = None
                    elif p.grad is None:
                        p.grad = torch.zeros_like(p)  # every rank holds the same set of gradients
                    else:
                        p.grad.zero_()

    @torch.no_grad()
    def _broadcast_params(self, by_owner: list[list[torch.Tensor]]) -> None:
        # Broadcast from each owner, one flat buffer per owner (N collectives per step). Chosen
        # over an all-gather of flat shards because whole-parameter shards are uneven: all_gather
        # needs equal sizes, so padding to the largest shard would send up to N x (largest) bytes
        # when one parameter dominates; broadcasts send exactly each shard's bytes.
        for owner, ps in enumerate(by_owner):
            if not ps:
                continue
            flat = _flatten_dense_tensors([p.detach() for p in ps]) if owner == self._rank \
                else torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            dist.broadcast(flat, src=self._global(owner), group=self._pg)
            if owner != self._rank:
                for p, new in zip(ps, _unflatten_dense_tensors(flat, ps)):
                    p.copy_(new)

    def step(self, closure: Callable[[], float] | None = None):
        """Step this rank's shard, then give every rank the updated parameters. Returns the
        closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        by_owner = self._by_owner()
        if len({p.dtype for ps in by_owner for p in ps}) > 1 or \
                len({p.device for ps in by_owner for p in ps}) > 1:
            raise ValueError("ShardedOptimizer flattens per owner: all parameters must share one "
                             "dtype and device")
        if self._zero2 and not self._reduced:
            self._reduce_scatter_grads(by_owner)
        self._reduced = False
        for group, local in zip(self.param_groups, self._local.param_groups):
            for key, value in group.items():  # lr schedulers write here: hand it on
                if key not in ("params", "param_names"):
                    local[key] = value
        self._local.step()
        self._broadcast_params(by_owner)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients; the next :meth:`step` reduces again (unless
        :meth:`reduce_gradients` runs first)."""
        super().zero_grad(set_to_none=set_to_none)
        self._reduced = False

    # ---- checkpoints ------------------------------------------------------------------------
    def _flat_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather every rank's optimizer shard to rank ``to`` (a rank of the process
        group), where :meth:`state_dict` then returns the *full* state, in the layout of the
        unsharded optimizer (parameters numbered across all groups), loadable by it. Memory: the
        whole optimizer state, on the CPU of one rank, for the duration of a save."""
        index = {p: i for i, p in enumerate(self._flat_params())}
        mine = {index[p]: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                for p, st in self._local.state.items()}
        shards = [None] * self._world if self._rank == to else None
        dist.gather_object(mine, shards, dst=self._global(to), group=self._pg)
        if self._rank != to:
            self._consolidated = None
            return
        state = {}
        for shard in shards:
            state.update(shard)
        groups, start = [], 0
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(g)
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}

    def state_dict(self) -> dict:
        """The full optimizer state (as the unsharded optimizer would save it), on the rank that
        called :meth:`consolidate_state_dict` last. Elsewhere, or before consolidating, a
        RuntimeError: each rank alone holds only its shard."""
        if self._consolidated is None:
            raise RuntimeError("ShardedOptimizer.state_dict: call consolidate_state_dict(to=rank) on every "
                               "rank first (each rank holds only its shard); the full state is on that rank")
        out, self._consolidated = self._consolidated, None  # one save per consolidation
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a *full* optimizer state (from :meth:`state_dict` or from the unsharded
        optimizer) on every rank: each keeps the state of the parameters it owns and the group
        options (lr, betas, ...). Groups must match in number and size."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(live["params"]) for g, live in zip(groups, self.param_groups)):
            raise ValueError("state_dict does not match this optimizer's parameter groups (count or sizes)")
        saved = state_dict.get("state", {})
        local_groups, local_state, n = [], {}, 0
        for g, live in zip(groups, self.param_groups):
            opts = {k: v for k, v in g.items() if k != "params"}
            live.update(opts)  # hyperparameters for every parameter
            ids = []
            for idx, p in zip(g["params"], live["params"]):
                if self._owner[p] == self._rank:
                    if idx in saved:
                        local_state[n] = saved[idx]
                    ids.append(n)
                    n += 1
            local_groups.append({**opts, "params": ids})
        self._local.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self._local.state
