"""Bytes on the wire: count the collectives a training step issues, charged at ring volume.

Usage, inside each rank (e.g. a function started by :func:`course_lib.parallel.run_ranks`)::

    with count_collectives() as wire:
        loss_fn(model(x), y).backward()
        model.finish_gradient_synchronization()
        opt.step()
    wire.bytes_per_rank()         # bytes this rank is charged (ring convention below), a float
    wire.elements_per_rank()      # the same in elements, comparable with comm_elements_per_step
    wire.by_kind()                # {"all-reduce": {"count", "payload_bytes", "charged_bytes"}, ...}

How it counts. On entry the public collectives of ``torch.distributed`` (``all_reduce``,
``reduce_scatter``/``reduce_scatter_single``/``reduce_scatter_tensor``, ``all_gather``/
``all_gather_single``/``all_gather_into_tensor``, ``broadcast``, ``reduce``, ``all_to_all_single``,
``send``/``isend``, ...) are replaced by wrappers, in both the ``torch.distributed`` and the
``torch.distributed.distributed_c10d`` namespaces; on exit (also on an exception) the originals
are put back. Callers that look the function up at call time (``dist.all_reduce(...)``: the
course's NaiveDDP, BucketedDDP, ShardedOptimizer, SimpleFSDP, torch's DDP comm hooks, FSDP2's
``dist.all_gather_single``/``dist.reduce_scatter_single``) are counted. A collective that calls
another one (``all_gather_into_tensor`` -> ``all_gather_single``) is counted once, at the outermost
call. Not seen: code that bound the function at import time (``from torch.distributed import
all_reduce``), C++-side collectives (torch DDP's reducer without a comm hook: use
:func:`attach_ddp_counter`; its construction-time ``_broadcast_coalesced``), and the functional
collectives of DTensor (``torch.ops._c10d_functional``; use ``CommDebugMode`` for those).
Every call is counted when it is *issued* (async ones too), once per rank.

Charging convention (ring algorithms; NCCL's "bus bandwidth" convention, Patarasuk & Yuan 2009),
N = the group's size, S = bytes of the *full* buffer:

* all-reduce: 2(N-1)/N x S (S = the tensor reduced);
* reduce-scatter: (N-1)/N x S (S = the whole input: the list's sum, or the flat input tensor);
* all-gather: (N-1)/N x S (S = the whole output);
* broadcast of S bytes: (N-1)/N x S. A pipelined broadcast makes N-1 ranks forward S bytes, total
  (N-1) S over the group, so (N-1)/N x S is the *average over ranks*, not what the root sends.
  ``reduce`` is charged the same (its mirror image);
* all-to-all: (N-1)/N x S (S = this rank's input); send/isend: S; recv, barrier: 0;
  gather: S_local on each non-destination rank (the destination 0); scatter: (N-1)/N x S on the
  source (S = its scatter list). These last two are *not* averaged over ranks.

All-reduce, reduce-scatter and all-gather are symmetric (each rank sends the charge), and every
rank is charged the same for a broadcast, so :meth:`WireCounter.bytes_per_rank` is the same on
every rank and equals the average over ranks. Charges are kept as exact fractions
(``fractions.Fraction``), so a comparison with ``course_lib.estimate.comm`` can use ``==``.
Uneven list-form reduce-scatters/all-gathers are charged (N-1)/N of the total, the even-split
value (a real ring would send a little more or less per rank).

Units: ``*_bytes`` are bytes, ``*_elements`` are tensor elements (of whatever dtype); "per rank"
means what one rank is charged for the counted region.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass(frozen=True)
class CollectiveCall:
    """One collective issued by this rank. ``payload_bytes``/``payload_elements``: S, the full
    buffer (see the module docstring); ``charged_*``: the ring charge per rank, exact."""

    kind: str           # "all-reduce" | "reduce-scatter" | "all-gather" | "broadcast" | ...
    function: str       # the torch.distributed function called, e.g. "all_gather_single"
    dtype: str          # e.g. "torch.float32"; "mixed" for lists of several dtypes
    group_size: int     # N
    payload_elements: int
    payload_bytes: int
    charged_elements: Fraction
    charged_bytes: Fraction

    def to_dict(self) -> dict:
        return {"kind": self.kind, "function": self.function, "dtype": self.dtype,
                "group_size": self.group_size, "payload_elements": self.payload_elements,
                "payload_bytes": self.payload_bytes, "charged_elements": float(self.charged_elements),
                "charged_bytes": float(self.charged_bytes)}


def _nbytes(ts) -> tuple[int, int, str]:
    ts = [t for t in ts if isinstance(t, torch.Tensor)]
    dtypes = {str(t.dtype) for t in ts}
    return (sum(t.numel() for t in ts), sum(t.numel() * t.element_size() for t in ts),
            dtypes.pop() if len(dtypes) == 1 else ("mixed" if dtypes else "none"))


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flat(item)] if isinstance(x, (list, tuple)) else []


# function name -> (kind, name of the argument holding S, ring factor as a function of N)
_RING = lambda n: Fraction(n - 1, n)  # noqa: E731
_TWICE_RING = lambda n: 2 * Fraction(n - 1, n)  # noqa: E731
_ONE = lambda n: Fraction(1)  # noqa: E731
_ZERO = lambda n: Fraction(0)  # noqa: E731
_SPECS: dict[str, tuple[str, str | None, Callable[[int], Fraction]]] = {
    "all_reduce": ("all-reduce", "tensor", _TWICE_RING),
    "all_reduce_coalesced": ("all-reduce", "tensors", _TWICE_RING),
    "reduce_scatter": ("reduce-scatter", "input_list", _RING),
    "reduce_scatter_single": ("reduce-scatter", "input", _RING),
    "reduce_scatter_tensor": ("reduce-scatter", "input", _RING),
    "_reduce_scatter_base": ("reduce-scatter", "input", _RING),
    "all_gather": ("all-gather", "tensor_list", _RING),
    "all_gather_single": ("all-gather", "output_tensor", _RING),
    "all_gather_into_tensor": ("all-gather", "output_tensor", _RING),
    "_all_gather_base": ("all-gather", "output_tensor", _RING),
    "all_gather_coalesced": ("all-gather", "output_tensor_lists", _RING),
    "broadcast": ("broadcast", "tensor", _RING),
    "reduce": ("reduce", "tensor", _RING),
    "all_to_all_single": ("all-to-all", "input", _RING),
    "all_to_all": ("all-to-all", "input_tensor_list", _RING),
    "gather": ("gather", "tensor", _ONE),
    "scatter": ("scatter", "scatter_list", _RING),
    "send": ("send", "tensor", _ONE),
    "isend": ("send", "tensor", _ONE),
    "recv": ("recv", "tensor", _ZERO),
    "irecv": ("recv", "tensor", _ZERO),
    "barrier": ("barrier", None, _ZERO),
}

_lock = threading.Lock()
_active: list["WireCounter"] = []   # counters now open (nested ones all record)
_saved: dict[tuple[object, str], Callable] = {}  # (namespace, name) -> original
_depth = threading.local()          # >0 while inside a counted collective (inner calls skipped)


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _record(name: str, bound: inspect.BoundArguments) -> None:
    kind, arg, factor = _SPECS[name]
    args = bound.arguments
    n = _group_size(args.get("group"))
    tensors = _flat(args.get(arg)) if arg else []
    if name == "gather" and args.get("gather_list"):
        tensors = []  # the destination sends nothing; every other rank sends its tensor
    numel, nbytes, dtype = _nbytes(tensors)
    f = factor(n)
    call = CollectiveCall(kind, name, dtype, n, numel, nbytes, f * numel, f * nbytes)
    for counter in list(_active):
        counter.calls.append(call)


def _wrap(name: str, original: Callable) -> Callable:
    sig = inspect.signature(original)

    def counted(*args, **kwargs):
        if getattr(_depth, "n", 0) == 0 and _active:
            _record(name, sig.bind(*args, **kwargs))
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _depth.n -= 1

    counted.__wrapped__ = original
    counted.__name__ = name
    return counted


def _install() -> None:
    for ns in (dist, c10d):
        for name in _SPECS:
            fn = getattr(ns, name, None)
            if fn is None or (ns, name) in _saved:
                continue
            _saved[(ns, name)] = fn
            setattr(ns, name, _wrap(name, fn))


def _uninstall() -> None:
    for (ns, name), fn in _saved.items():
        setattr(ns, name, fn)
    _saved.clear()


class WireCounter:
    """The collectives issued inside one :func:`count_collectives` block, on this rank."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []

    def _select(self, kinds=None, dtypes=None) -> list[CollectiveCall]:
        kinds = None if kinds is None else {kinds} if isinstance(kinds, str) else set(kinds)
        dtypes = None if dtypes is None else {str(d) for d in (dtypes if isinstance(dtypes, (list, tuple, set))
                                                              else [dtypes])}
        return [c for c in self.calls if (kinds is None or c.kind in kinds)
                and (dtypes is None or c.dtype in dtypes)]

    def exact_bytes_per_rank(self, kinds=None, dtypes=None) -> Fraction:
        """Ring-charged bytes per rank (the average over ranks), as an exact Fraction.
        ``kinds``/``dtypes``: only those collectives (e.g. ``dtypes=torch.float32``)."""
        return sum((c.charged_bytes for c in self._select(kinds, dtypes)), Fraction(0))

    def bytes_per_rank(self, kinds=None, dtypes=None) -> float:
        """Ring-charged bytes per rank (= the average over ranks), float. See the module docstring."""
        return float(self.exact_bytes_per_rank(kinds, dtypes))

    def elements_per_rank(self, bytes_per_element: float | None = None, kinds=None, dtypes=None) -> float:
        """Ring-charged elements per rank, comparable with ``comm_elements_per_step``. With
        ``bytes_per_element`` the bytes divided by it (all calls in one element size); without,
        each call's own element count (mixed dtypes allowed)."""
        if bytes_per_element is not None:
            return float(self.exact_bytes_per_rank(kinds, dtypes) / Fraction(bytes_per_element))
        return float(sum((c.charged_elements for c in self._select(kinds, dtypes)), Fraction(0)))

    def by_kind(self) -> dict[str, dict]:
        """``{kind: {"count", "payload_bytes", "payload_elements", "charged_bytes"}}``: how many
        calls, the sum of their full buffers S (bytes, elements) and of their charges (bytes/rank)."""
        out: dict[str, dict] = {}
        for c in self.calls:
            row = out.setdefault(c.kind, {"count": 0, "payload_bytes": 0, "payload_elements": 0,
                                          "charged_bytes": Fraction(0)})
            row["count"] += 1
            row["payload_bytes"] += c.payload_bytes
            row["payload_elements"] += c.payload_elements
            row["charged_bytes"] += c.charged_bytes
        for row in out.values():
            row["charged_bytes"] = float(row["charged_bytes"])
        return out

    def breakdown(self) -> list[dict]:
        """One plain dict per call, in issue order."""
        return [c.to_dict() for c in self.calls]

    def to_dict(self) -> dict:
        return {"unit": "bytes charged per rank (ring convention)", "bytes_per_rank": self.bytes_per_rank(),
                "by_kind": self.by_kind(), "calls": self.breakdown()}


@contextlib.contextmanager
def count_collectives() -> Iterator[WireCounter]:
    """Count every ``torch.distributed`` collective issued in the block (see the module docstring).
    Nesting is allowed (inner and outer both count); patches are removed on exit, error or not."""
    counter = WireCounter()
    with _lock:
        if not _active:
            _install()
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                _uninstall()


def _counted_allreduce_hook(process_group, bucket):
    """DDP comm hook: what DDP's reducer does natively (divide by N, all-reduce the bucket), but
    through ``dist.all_reduce`` so :func:`count_collectives` sees it."""
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def attach_ddp_counter(ddp_model, process_group=None) -> None:
    """Make torch ``DistributedDataParallel``'s gradient all-reduces visible to
    :func:`count_collectives`: its C++ reducer calls the process group directly, never the Python
    ``dist.all_reduce``. Registers a comm hook equivalent to the default one (mean over ranks,
    one all-reduce per bucket). Call once, before the first backward."""
    ddp_model.register_comm_hook(process_group, _counted_allreduce_hook)
