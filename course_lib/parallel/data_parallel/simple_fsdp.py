"""ZeRO-3 by hand: every rank keeps 1/N of each big weight and gathers it only while it is needed.

At construction rank 0's parameters and buffers are broadcast (as in :mod:`.naive_ddp`), then the
``weight`` and ``bias`` of every ``nn.Linear`` and ``nn.Embedding`` is replaced by a *flat shard*:
the tensor is flattened, zero-padded at the end to a multiple of the world size N (so it splits
evenly; the padding is at most N-1 elements, never read by the model, and its gradient is
dropped), and rank r keeps slice r as the trainable fp32 ``nn.Parameter``, registered under the
original name (``model.module.fc1.weight`` is now that rank's shard). Norms and every other
parameter stay replicated; their gradients are averaged in :meth:`finish_gradient_synchronization`,
except ``ignored_params`` (expert slices under expert parallelism), which SimpleFSDP leaves alone.

Per sharded layer and step:

* forward pre-hook: all-gather the full weight (``all_gather_single``, supported by gloo) and
  put it in the layer's ``__dict__`` as a plain tensor, which ``self.weight`` finds before the
  registered shard; the gather is a custom autograd Function, so gradients flow to the shard;
* while the layer runs, a ``saved_tensors_hooks`` context replaces every tensor autograd wants to
  save that lives in the gathered storage by a note "re-gather me"; the forward hook drops the
  full weight, so between forward and backward only the shard is held;
* backward: the layer's own backward re-gathers the weight when it unpacks it; the Function's
  backward reduce-scatters (``reduce_scatter_single``, SUM, on gloo) the full fp32 gradient and
  divides by N: the shard's ``.grad`` is its slice of the rank-mean gradient.

Tied weights (one Parameter in an Embedding and a Linear, as GPT-2 ties them) are sharded once; each
use gathers it and each use's backward reduce-scatters into the same ``.grad``, where autograd sums
the contributions, exactly as in one process.

``compute_dtype`` (``torch.bfloat16`` / ``torch.float16``): the shard is cast *before* the
all-gather (half the bytes on the wire) and the forward runs under CPU/GPU autocast in that dtype;
gradients are reduce-scattered in fp32 and master shards, gradients and optimizer state stay fp32.

Prefetch (``prefetch=True``, the default): the first forward records the order in which sharded
layers run; in later forwards, entering layer i launches an *async* all-gather of layer i+1's
weights, so it travels while layer i computes, and layer i+1's pre-hook only waits for it. The
order is re-recorded whenever a forward runs the layers differently (the prefetch is then merely
wasted, never wrong: every rank issues the same collectives). Backward re-gathers are synchronous
(not prefetched).

Usage::

    model = SimpleFSDP(model)                 # after init_distributed() / inside run_ranks
    opt = torch.optim.AdamW(model.parameters())
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()   # after backward, before optimizer.step()
    opt.step()
    full = model.gather_full_params()         # {original name: full fp32 tensor}, on every rank
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.data_parallel.naive_ddp import (broadcast_from_first_rank, require_group,
                                                         trainable_params)
from course_lib.validate import check_bool, check_choice

SHARDED_TYPES = (nn.Linear, nn.Embedding)


class _Shard:
    """One sharded tensor: its flat padded shard (a Parameter) and how to rebuild the original."""

    def __init__(self, param: nn.Parameter, rank: int, world: int):
        self.shape, self.numel = param.shape, param.numel()
        per = -(-self.numel // world)  # ceil: the padded length is per * world
        flat = torch.zeros(per * world, dtype=param.dtype, device=param.device)
        flat[:self.numel] = param.detach().reshape(-1)
        self.param = nn.Parameter(flat[rank * per:(rank + 1) * per].clone(),
                                  requires_grad=param.requires_grad)


class _GatherFn(torch.autograd.Function):
    """shard -> full tensor in forward; full gradient -> rank-mean shard gradient in backward."""

    @staticmethod
    def forward(ctx, shard, owner, entry, dtype, prefetched):
        ctx.owner = owner  # prefetched: [full tensor] already gathered by a prefetch, or []
        return prefetched[0] if prefetched else owner._gather(entry, dtype)

    @staticmethod
    def backward(ctx, grad_full):
        flat = grad_full.detach().float().reshape(-1)  # reduce in fp32 whatever computed it
        return ctx.owner._reduce_scatter(flat), None, None, None, None


class SimpleFSDP(nn.Module):
    """Wrap ``module`` (sharded in place); after ``backward()`` call
    :meth:`finish_gradient_synchronization`. ``compute_dtype``: ``None`` (fp32), ``torch.bfloat16``
    or ``torch.float16``. ``process_group``: the ranks that share the model (``None``: all).
    ``find_unused_parameters=False``: every replicated parameter is known to get a gradient, so
    the per-step flag all-reduce and its host read are skipped (the trainer's setting).
    ``ignored_params``: parameters left out entirely (not broadcast, not replicated, their
    gradients untouched; they must not be a Linear's or Embedding's): expert slices, which differ
    between ranks and are reduced over their own expert-data-parallel group, as BucketedDDP's."""

    def __init__(self, module: nn.Module, compute_dtype=None, process_group=None,
                 prefetch: bool = True, find_unused_parameters: bool = True, ignored_params=()):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_choice("compute_dtype", compute_dtype, (None, torch.bfloat16, torch.float16))
        self.prefetch = check_bool("prefetch", prefetch)
        self.find_unused_parameters = check_bool("find_unused_parameters", find_unused_parameters)
        layers = [m for m in module.modules() if isinstance(m, SHARDED_TYPES)]
        if not layers:
            raise ValueError("SimpleFSDP: the module has no nn.Linear or nn.Embedding, so there is "
                             "nothing to shard; use NaiveDDP or BucketedDDP for it")
        ignored_params = list(ignored_params)
        ignored = {id(p) for p in ignored_params}
        for layer in layers:  # a sharded layer's weight cannot also be left alone
            for attr in ("weight", "bias"):
                if id(layer._parameters.get(attr)) in ignored:
                    raise ValueError(f"SimpleFSDP: ignored_params holds the {attr} of a {type(layer).__name__}, "
                                     "which SimpleFSDP shards; ignore only parameters of other modules (e.g. "
                                     "stacked expert weights)")
        self.process_group = require_group(process_group, "SimpleFSDP")
        self.module, self.compute_dtype = module, compute_dtype
        self.world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        broadcast_from_first_rank(module, process_group, skip=ignored_params)

        self._shards: dict[int, _Shard] = {}  # id(original Parameter) -> its shard (ties: once)
        self._layer_entries: dict[nn.Module, list[tuple[str, _Shard]]] = {}
        for layer in layers:
            entries = []
            for attr in ("weight", "bias"):
                p = layer._parameters.get(attr)
                if p is None:
                    continue
                entry = self._shards.setdefault(id(p), _Shard(p, rank, self.world_size))
                layer._parameters[attr] = entry.param  # same name, now the flat shard
                entries.append((attr, entry))
            self._layer_entries[layer] = entries
            layer.register_forward_pre_hook(self._before_layer)
            layer.register_forward_hook(self._after_layer)
        self._entry_by_name = {name: self._shard_of(name) for name, _ in
                               module.named_parameters(remove_duplicate=False)}
        sharded = {id(e.param) for e in self._shards.values()}
        self._replicated = [p for p in trainable_params(module) if id(p) not in sharded | ignored]
        self._active: dict[nn.Module, tuple] = {}
        self._order: list[nn.Module] = []  # sharded layers in the last forward's order
        self._seen: list[nn.Module] = []   # ... in this forward's order, so far
        self._pending: dict[nn.Module, list] = {}  # layer -> [(full tensor, async work)]
        self.prefetch_hits = 0  # forward gathers served by a prefetch (for tests)

    def _shard_of(self, name):
        mod_name, _, attr = name.rpartition(".")
        layer = self.module.get_submodule(mod_name)
        return dict(self._layer_entries.get(layer, [])).get(attr)

    # ---- communication -------------------------------------------------------------------------
    def _gather(self, entry: _Shard, dtype) -> torch.Tensor:
        """All ranks' shards of ``entry`` cast to ``dtype`` -> full tensor (padding dropped)."""
        shard = entry.param.detach().to(dtype)
        full = torch.empty(shard.numel() * self.world_size, dtype=dtype, device=shard.device)
        dist.all_gather_single(full, shard, group=self.process_group)
        return full[:entry.numel].view(entry.shape)

    def _reduce_scatter(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """Full flat fp32 gradient -> this rank's slice of its mean over ranks (padding = 0)."""
        per = -(-flat_grad.numel() // self.world_size)
        padded = torch.zeros(per * self.world_size, device=flat_grad.device)
        padded[:flat_grad.numel()] = flat_grad
        out = torch.empty(per, device=flat_grad.device)
        dist.reduce_scatter_single(out, padded, op=dist.ReduceOp.SUM, group=self.process_group)
        return out.div_(self.world_size)

    # ---- hooks -------------------------------------------------------------------------------
    def _launch_prefetch(self, layer, dtype):
        works = []
        for _, entry in self._layer_entries[layer]:
            shard = entry.param.detach().to(dtype)
            flat = torch.empty(shard.numel() * self.world_size, dtype=dtype, device=shard.device)
            work = dist.all_gather_single(flat, shard, group=self.process_group, async_op=True)
            works.append((flat[:entry.numel].view(entry.shape), work))
        self._pending[layer] = works

    def _before_layer(self, layer, args):
        dtype = self.compute_dtype or torch.float32
        ready = self._pending.pop(layer, None)
        if ready is not None:
            self.prefetch_hits += 1
        self._seen.append(layer)
        i = len(self._seen)
        if self.prefetch and self._seen == self._order[:i] and i < len(self._order):
            nxt = self._order[i]
            if nxt not in self._pending and nxt is not layer:
                self._launch_prefetch(nxt, dtype)  # travels while this layer computes
        fulls = []
        for k, (attr, entry) in enumerate(self._layer_entries[layer]):
            pre = None
            if ready is not None:
                pre, work = ready[k]
                work.wait()
            if entry.param.requires_grad and torch.is_grad_enabled():
                full = _GatherFn.apply(entry.param, self, entry, dtype, [] if pre is None else [pre])
            else:
                with torch.no_grad():
                    full = pre if pre is not None else self._gather(entry, dtype)
            layer.__dict__[attr] = full  # found before the registered shard by attribute lookup
            fulls.append((full, entry, dtype))

        def pack(t):  # a tensor in a gathered storage is saved as "re-gather it" + its view
            for full, entry, dt in fulls:
                if t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                    return ("regather", entry, dt, t.size(), t.stride(), t.storage_offset())
            return t

        def unpack(saved):
            if isinstance(saved, tuple) and saved and saved[0] == "regather":
                _, entry, dt, size, stride, offset = saved
                return self._gather(entry, dt).as_strided(size, stride, offset)
            return saved

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._active[layer] = hooks

    def _after_layer(self, layer, args, output):
        self._active.pop(layer).__exit__(None, None, None)
        for attr, _ in self._layer_entries[layer]:
            layer.__dict__.pop(attr, None)  # free the full weight: only the shard stays

    # ---- public API --------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._seen = []
        try:
            if self.compute_dtype is None:
                return self.module(*args, **kwargs)
            device = next(iter(self._shards.values())).param.device.type
            with torch.autocast(device, dtype=self.compute_dtype):
                return self.module(*args, **kwargs)
        finally:
            for works in self._pending.values():  # a prefetch this forward did not use
                for _, work in works:
                    work.wait()
            self._pending.clear()
            self._order = self._seen  # the order the next forward prefetches in

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Average the replicated parameters' gradients over ranks (the shards' gradients are
        already reduce-scattered in backward). ``None`` on some ranks counts as zero there; a
        parameter unused on every rank keeps ``None``, as in :class:`.NaiveDDP`."""
        if not self._replicated:
            return
        pg = self.process_group
        if self.find_unused_parameters:
            has_grad = torch.tensor([p.grad is not None for p in self._replicated], dtype=torch.int32,
                                    device=self._replicated[0].device)  # nccl reduces device tensors only
            dist.all_reduce(has_grad, group=pg)
            flags = has_grad.tolist()  # a host read
        else:  # every replicated parameter is used: no flags, no host read
            flags = [1] * len(self._replicated)
        for p, n in zip(self._replicated, flags):
            if n == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=pg)
            p.grad.div_(self.world_size)

    @torch.no_grad()
    def gather_full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """``{original name: full fp32 tensor}`` for every parameter (both names of a tied one),
        unpadded and in the original shape; ``grads=True``: their gradients instead (``None``
        where there is none). A collective: call it on every rank."""
        def value(p):
            return p.grad if grads else p

        full = {}
        for key, e in self._shards.items():
            v = value(e.param)
            if v is not None:
                gathered = torch.empty(v.numel() * self.world_size, dtype=torch.float32, device=v.device)
                dist.all_gather_single(gathered, v.detach().float(), group=self.process_group)
                full[key] = gathered[:e.numel].view(e.shape)
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            entry = self._entry_by_name[name]
            if entry is None:
                out[name] = None if value(p) is None else value(p).detach().clone()
            else:
                out[name] = full.get(next(k for k, e in self._shards.items() if e is entry))
        return out

    def sharded_bytes(self) -> int:
        """Bytes this rank holds for the sharded (Linear/Embedding) parameters."""
        return sum(e.param.numel() * e.param.element_size() for e in self._shards.values())
