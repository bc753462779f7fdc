"""Bytes autograd holds for backward *right now*, and their peak: the live counterpart of
:func:`course_lib.measure.saved_activation_bytes` (which sums everything one forward saved).

A pipeline stage holds several micro-batches' activations at once and frees each at its backward;
this counter follows that (lab 11, benchmarks/bench_pipeline.py)."""
from __future__ import annotations

import torch


class _Held:
    """What autograd keeps instead of the saved tensor: the tensor plus a release on deletion."""
    __slots__ = ("owner", "key", "t")

    def __init__(self, owner, key, t):
        self.owner, self.key, self.t = owner, key, t

    def __del__(self):
        self.owner._release(self.key)


class LiveSavedBytes:
    """Bytes autograd currently holds for backward (each storage once), and their peak.

    ``with counter:`` installs the hook; ``counter.peak`` (bytes) is the largest live total seen
    since ``reset()``. Storages of ``modules``' parameters and buffers are not activations and are
    skipped (a Linear saves its weight)."""

    def __init__(self, modules):
        self.skip = {t.untyped_storage().data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()]}
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.live = self.peak = 0
        self._ctx = None

    def reset(self):
        self.peak = self.live

    def _pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.skip or st.nbytes() == 0:
            return t
        entry = self.refs.get(key)
        if entry is None:
            self.refs[key] = [1, st.nbytes()]
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Held(self, key, t)  # holding t keeps the storage (and its pointer) alive

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _release(self, key):
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
