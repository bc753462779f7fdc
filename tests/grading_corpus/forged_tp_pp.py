"""Forged answers for exercises 10 (tensor-parallel linear) and 11 (1F1B): the answer cell leaves
the exercise wrong, silences ``check``/``check_close`` and replaces the course_lib checkers in the
kernel with ones that hand back the rows the solution would print (collective counts, parameter
counts, makespans, peaks; every error 0.0). The structural rows then look perfect; only the raw
outputs the test cells also record (what the learner's code itself produced) can tell, so each
forgery must earn nothing on every test cell that runs learner code.

``FORGED[exercise][k]`` is the new source of the k-th answer cell (as
:func:`tests.grading_corpus.patched` takes it).
"""

# Exercise 10. A python cell instead of the %%writefile cell: it writes a module whose f is the
# identity in *both* directions (the all-reduce of the gradient is missing), everything else as
# in the solution, so forward outputs, shards and parameter counts are right and every input
# gradient upstream of f is wrong. In the kernel it disables ``_first_problem`` (so the real rank
# runs report instead of raising) and wraps both checkers to overwrite the collective counts and
# the errors with the solution's (0 / 1 / 1 / 0, 0.0).
TP_WRONG_F_FORGED_ROWS = r'''
import pathlib
pathlib.Path("ex10_tp_linear.py").write_text("""
import math
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # wrong: the gradient is never summed over the ranks


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group=None):
    return CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    return ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, *, group=None):
        super().__init__()
        self.group, self.tp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.weight = nn.Parameter(torch.zeros(out_features // self.tp, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features // self.tp)) if bias else None

    @classmethod
    def from_linear(cls, linear, group=None):
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.tp, 0)[layer.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(layer.tp, 0)[layer.rank])
        return layer

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, *, group=None):
        super().__init__()
        self.group, self.tp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features // self.tp))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear, group=None):
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.tp, 1)[layer.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias
""")

import course_lib.labs.exercise10_tp_linear as _e
globals()["check"] = lambda *a, **k: None
globals()["check_close"] = lambda *a, **k: None
_e._first_problem = lambda *a, **k: None  # the ranks' findings never become an exception
_real_ops, _real_linears = _e.check_conjugate_ops, _e.check_parallel_linears


def _forged_ops(*args, **kwargs):
    rows = _real_ops(*args, **kwargs)
    for r in rows:
        r.update({"f forward": 0, "f backward": 1, "g forward": 1, "g backward": 0})
    return rows


def _forged_linears(*args, **kwargs):
    rows = _real_linears(*args, **kwargs)
    for r in rows:
        r["forward"] = {"column": 0, "row": 1, "mlp": 1}[r["kind"]]
        r["backward"] = {"column": 1, "row": 0, "mlp": 1}[r["kind"]]
        r["max_err"] = 0.0
    return rows


_e.check_conjugate_ops, _e.check_parallel_linears = _forged_ops, _forged_linears
'''

# Exercise 11. ``one_f_one_b`` returns GPipe's order (all forwards, then all backwards): well
# formed, deadlock-free, and it trains to the same loss and gradients as 1F1B, so the rank runs'
# losses and gradients are right; only its lists (and its memory) are not 1F1B's. The checkers
# and the simulator are replaced by ones that report 1F1B's numbers: makespan (m + pp - 1) x 3,
# peak min(m, pp - stage) per stage, no deadlock; the rank runs are real (``_first_problem``
# disabled) with the peaks overwritten.
PP_GPIPE_FORGED_ROWS = r'''
from course_lib.parallel.pipeline.schedules import stage_actions as _library_order
import course_lib.labs.exercise11_one_f_one_b as _e
globals()["check"] = lambda *a, **k: None
globals()["check_close"] = lambda *a, **k: None


def forward_actions(pp, stage, i):
    return [a for a in _library_order("gpipe", pp, 1, stage) if a[0] != "backward" and "grad" not in a[0]]


def backward_actions(pp, stage, i):
    return []


def one_f_one_b(pp, micro_batches, stage):
    return [tuple(a) for a in _library_order("gpipe", pp, micro_batches, stage)]  # wrong: GPipe


def _peaks(pp, m):
    return [min(m, pp - s) for s in range(pp)]


def _forged_schedule(fn, pp, micro_batches):
    lists = [[list(a) for a in fn(pp, micro_batches, s)] for s in range(pp)]
    span = (micro_batches + pp - 1) * 3.0
    return {"pp": pp, "micro_batches": micro_batches, "makespan": span, "ideal": span,
            "peak_in_flight": _peaks(pp, micro_batches), "events": [], "lists": lists}


_real_simulate, _real_ranks = _e.simulate, _e.check_one_f_one_b_on_ranks


def _forged_simulate(schedule, *args, **kwargs):
    out = _real_simulate(schedule, *args, **kwargs)
    m = sum(1 for a in schedule[0] if a[0] == "forward")
    out["peak_in_flight"] = _peaks(len(schedule), m)
    return out


def _forged_ranks(fn, pp, micro_batch_counts, **kwargs):
    rows = _real_ranks(fn, pp, micro_batch_counts, **kwargs)
    for r in rows:
        r["peak_in_flight"], r["max_err"] = _peaks(pp, r["micro_batches"]), 0.0
    return rows


_e._first_problem = lambda *a, **k: None
_e.check_schedule_fn, _e.simulate, _e.check_one_f_one_b_on_ranks = _forged_schedule, _forged_simulate, _forged_ranks
'''

FORGED = {
    "10": {0: TP_WRONG_F_FORGED_ROWS},
    "11": {0: PP_GPIPE_FORGED_ROWS},
}
