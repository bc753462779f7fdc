"""Data parallelism that overlaps communication with backward: bucketed asynchronous all-reduces.

Same contract as :mod:`.naive_ddp` (broadcast at start, mean gradient after sync), two changes
that make it fast:

* **Buckets.** Gradients are copied into a few large flat buffers and each buffer is reduced in
  one call: one big message costs about one latency instead of one per parameter.
* **Overlap.** Backward produces gradients from the last layer to the first. A hook on each
  parameter (``register_post_accumulate_grad_hook``, run once ``.grad`` is final for this
  backward) counts the bucket's ready gradients; when a bucket is complete its all-reduce starts
  with ``async_op=True`` while backward goes on computing the earlier layers.
  :meth:`BucketedDDP.finish_gradient_synchronization` only waits for what is still in flight.

Buckets are filled in *reverse* parameter order (the order backward produces gradients) and are
launched strictly in bucket order on every rank, so all ranks issue the same collectives in the
same sequence even if a gradient is late or missing on one of them.

Gradient accumulation: inside ``with model.no_sync():`` the hooks do nothing (gradients just add
up in ``.grad``); the first backward after it reduces the accumulated sums.

Timeline (``record_timeline=True``, off by default): every sync appends events to
:attr:`BucketedDDP.timeline`, so a lab can draw when each bucket was ready, launched and finished
next to backward compute. Each event is a dict ``{"event", "t", "bucket", "bytes"}``: ``t`` in
seconds from ``time.perf_counter()`` (this process's clock), ``bucket`` the bucket index (launch
order; ``None`` for whole-sync events), ``bytes`` the bucket's flat buffer in bytes (gradients plus
flags; 0 for whole-sync events). Events:

* ``"ready"``: the bucket's last gradient arrived (its hook ran); ``"launch"``: its gradients were
  copied into the flat buffer and the async all-reduce call returned (``in_backward``: launched
  from a hook, i.e. overlapping backward, or from the finish);
* ``"complete"``: the all-reduce was found finished, ``how="poll"`` (``work.is_completed()``, polled
  at every later hook and at the start of the finish: an upper bound on the true finish time) or
  ``how="wait"`` (``work.wait()`` returned);
* ``"finish_start"`` / ``"finish_end"``: :meth:`~BucketedDDP.finish_gradient_synchronization`
  entered / left.

Clear it with ``model.timeline.clear()`` between steps you do not want. When off, ``timeline`` is
``None`` and the only cost is one ``is None`` test per hook.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.data_parallel.naive_ddp import (
    broadcast_from_first_rank,
    require_group,
    trainable_params,
)
from course_lib.validate import check_bool, check_number

MB = 2**20  # bytes: bucket sizes are in MiB


class _Bucket:
    """Parameters whose gradients travel together; one flat buffer: the gradients, then one
    "this rank has a gradient" flag (1.0 / 0.0) per parameter, summed along with them."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.numel + len(params), dtype=params[0].dtype,
                                device=params[0].device)
        self.ready = 0
        self.handle = None
        self.seen_done = False  # timeline only: completion already recorded for this launch


class BucketedDDP(nn.Module):
    """Wrap ``module``; after the syncing ``backward()`` call :meth:`finish_gradient_synchronization`.

    ``bucket_mb``: size cap of one bucket in MiB (2**20 bytes) of gradient data; a parameter
    larger than the cap gets a bucket of its own. ``None``: one bucket for everything (no
    overlap, fewest messages). ``process_group``: the replicating ranks (``None``: all).

    Missing gradients (``.grad is None`` at sync, e.g. a parameter this rank did not use): the
    bucket holding one is launched at finish time with zeros in its place, so every rank issues
    the same collectives. With ``find_unused_parameters=True`` (the default here) a parameter with
    no gradient on *any* rank (its flag sums to 0) keeps ``.grad = None``, as it would in a single
    process; that costs one host read of the flags per bucket at sync. ``False`` (torch DDP's
    default, what the trainer uses): no host read; every parameter gets the rank-mean gradient,
    zeros for one nobody used. One Parameter reached by two names (tied weights) has one hook and
    is reduced once.

    ``launched_in_backward``: how many bucket all-reduces the last sync started from hooks, i.e.
    overlapped with backward (the rest started in ``finish_gradient_synchronization``).

    ``ignored_params``: parameters left out entirely (not broadcast at construction, not bucketed,
    their gradients untouched): expert slices, which differ between ranks and are reduced over
    their own expert-data-parallel group (torch DDP's ``_set_params_and_buffers_to_ignore_for_model``).

    ``record_timeline``: append timing events to :attr:`timeline` (a list of dicts, see the module
    docstring); ``False`` (the default): ``timeline`` is ``None`` and nothing is recorded.
    """

    def __init__(self, module: nn.Module, bucket_mb: float | None = 25.0, process_group=None,
                 find_unused_parameters: bool = True, record_timeline: bool = False, ignored_params=()):
        super().__init__()
        self.find_unused_parameters = check_bool("find_unused_parameters", find_unused_parameters)
        self.timeline: list[dict] | None = [] if check_bool("record_timeline", record_timeline) else None
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if bucket_mb is not None:
            check_number("bucket_mb", bucket_mb, 0, lo_open=True)  # MiB; None = one bucket
        self.process_group = require_group(process_group, "BucketedDDP")
        self.module = module
        self.world_size = dist.get_world_size(process_group)
        ignored_params = list(ignored_params)
        ignored = {id(p) for p in ignored_params}
        broadcast_from_first_rank(module, process_group, skip=ignored_params)
        cap = float("inf") if bucket_mb is None else bucket_mb * MB
        self._buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, int] = {}  # keyed by identity (Parameter hashes by id)
        group: list[nn.Parameter] = []
        for p in reversed([p for p in trainable_params(module) if id(p) not in ignored]):
            size = sum(q.numel() * q.element_size() for q in group)
            if group and (size + p.numel() * p.element_size() > cap or p.dtype != group[0].dtype
                          or p.device != group[0].device):
                self._add_bucket(group)
                group = []
            group.append(p)
        if group:
            self._add_bucket(group)
        self._next = 0  # index of the next bucket to launch: launches go strictly in order
        self._sync = True
        self.launched_in_backward = 0
        self._launched_now = 0
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        for p in params:
            self._where[p] = len(self._buckets)
        self._buckets.append(_Bucket(params))

    @property
    def bucket_count(self) -> int:
        return len(self._buckets)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: no communication for backward passes inside."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _record(self, event: str, bucket: int | None = None, **extra) -> None:
        """Append one timeline event (only called when recording is on)."""
        nbytes = 0 if bucket is None else self._buckets[bucket].flat.numel() * \
            self._buckets[bucket].flat.element_size()
        self.timeline.append({"event": event, "t": time.perf_counter(), "bucket": bucket,
                              "bytes": nbytes, **extra})

    def _poll_in_flight(self) -> None:
        """Timeline only: stamp buckets whose all-reduce has finished since the last look."""
        for i in range(self._next):
            bucket = self._buckets[i]
            if bucket.handle is not None and not bucket.seen_done and bucket.handle.is_completed():
                bucket.seen_done = True
                self._record("complete", i, how="poll")

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        index = self._where[p]
        bucket = self._buckets[index]
        bucket.ready += 1
        if self.timeline is not None:
            self._poll_in_flight()
            if bucket.ready == len(bucket.params):
                self._record("ready", index)
        if bucket.ready == len(bucket.params):
            while self._next < len(self._buckets) and \
                    self._buckets[self._next].ready == len(self._buckets[self._next].params):
                self._launch(self._buckets[self._next])
                self._launched_now += 1

    @torch.no_grad()
    def _launch(self, bucket: _Bucket, in_backward: bool = True) -> None:
        """Copy the bucket's gradients (zeros where missing) and flags in, start the all-reduce."""
        offset, flags = 0, bucket.flat[bucket.numel:]
        for i, p in enumerate(bucket.params):
            view = bucket.flat[offset:offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            flags[i] = 0.0 if p.grad is None else 1.0
            offset += p.numel()
        bucket.handle = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM,
                                        group=self.process_group, async_op=True)
        if self.timeline is not None:
            bucket.seen_done = False
            self._record("launch", self._next, in_backward=in_backward)
        self._next += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets not yet started (in order), wait for all, write the rank-mean into
        every ``.grad``. Call after the syncing ``backward()``, before ``optimizer.step()``."""
        if not self._sync:
            raise RuntimeError("finish_gradient_synchronization() was called inside no_sync(): "
                               "call it after the backward of the first micro-batch outside it")
        recording = self.timeline is not None
        if recording:
            self._record("finish_start")
            self._poll_in_flight()
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next], in_backward=False)
        for index, bucket in enumerate(self._buckets):
            bucket.handle.wait()
            if recording and not bucket.seen_done:
                bucket.seen_done = True
                self._record("complete", index, how="wait")
            bucket.flat[:bucket.numel].div_(self.world_size)
            flags = (bucket.flat[bucket.numel:].tolist() if self.find_unused_parameters
                     else [1.0] * len(bucket.params))  # no host read: every parameter takes the mean
            offset = 0
            for p, flag in zip(bucket.params, flags):
                if flag > 0:  # some rank had a gradient: every rank takes the mean
                    avg = bucket.flat[offset:offset + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = avg.clone()
                    else:
                        p.grad.copy_(avg)
                offset += p.numel()
            bucket.handle, bucket.ready = None, 0
        self.launched_in_backward, self._launched_now, self._next = self._launched_now, 0, 0
        if recording:
            self._record("finish_end")
