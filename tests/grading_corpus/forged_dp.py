"""Forged submissions for the exercises that run the learner's code on ranks (00, 08, 09).

Each one leaves the learner's answer wrong or unimplemented, silences the in-kernel checks
(``check``/``check_close``) and replaces course_lib's rank checker *in the kernel* with a function
that runs nothing on ranks and returns the rows the instructor's solution prints: the structural
values (ranks, scenarios, all-reduce counts, elements of state held) right and every error 0.0.
Before the checkers handed back the raw outputs, such rows earned every point; now each test
cell also records the tensors the learner's code produced on seeded inputs, which the forgery can
only fill with wrong ones (here: what its broken implementation would have left), so every test
cell that runs ranks earns nothing.

``FORGED[NN]`` maps an answer cell's index (as :func:`tests.grading_corpus.patched` takes it) to
its forged source; ``FORGED_KEEPS[NN]`` is the number of points the forged notebook still earns,
from answer cells it leaves as the solution's: in 00 the byte count of a ring (a pure function,
answer cell 1, 1 + 1 points); nothing in 08 and 09.
"""

# Exercise 00: the "ring" returns its input unsummed; check_all_reduce returns, for every world size
# and case, a row with max_abs_err 0.0 and, as outputs, each rank's own seeded input (what that
# ring leaves), built in the kernel without starting a rank.
FORGED_00_RING = '''
import pathlib
pathlib.Path("ex00_ring_allreduce.py").write_text(
    "import torch\\n\\n\\ndef ring_all_reduce(tensor):\\n    return tensor  # sums nothing\\n")

import torch
from course_lib.labs import lab00_orientation as _collectives

globals()["check"] = lambda *a, **k: None
globals()["check_close"] = lambda *a, **k: None
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32}


def _own_input(rank, numel, dtype, seed):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if _DTYPES[dtype].is_floating_point:
        return torch.randn(numel, generator=gen).to(_DTYPES[dtype])
    return torch.randint(-1000, 1000, (numel,), generator=gen).to(_DTYPES[dtype])


def _forged_check_all_reduce(impl, world_sizes, cases, **kwargs):
    return [{"ranks": w, "numel": n, "dtype": d, "max_abs_err": 0.0,
             "outputs": [_own_input(r, n, d, s) for r in range(w)]}
            for w in world_sizes for n, d, s in cases]


_collectives.check_all_reduce = _forged_check_all_reduce
print("ring all-reduce matches dist.all_reduce")
'''

# Exercise 08: the wrapper synchronises nothing; check_bucketed_ddp returns the solution's table
# (all-reduces per step, how many started during backward) with max_err 0.0 and, as outputs, zero
# gradients and the untrained model (seed 0) on every rank.
FORGED_08_DDP = '''
import pathlib
pathlib.Path("ex08_bucketed_ddp.py").write_text(
    "import contextlib\\n"
    "from torch import nn\\n\\n\\n"
    "class BucketedDDP(nn.Module):\\n"
    "    def __init__(self, module, bucket_mb=25.0):\\n"
    "        super().__init__()\\n"
    "        self.module = module\\n\\n"
    "    def forward(self, *args, **kwargs):\\n"
    "        return self.module(*args, **kwargs)\\n\\n"
    "    def no_sync(self):\\n"
    "        return contextlib.nullcontext()\\n\\n"
    "    def finish_gradient_synchronization(self):\\n"
    "        pass  # averages nothing\\n")

import torch
from course_lib.labs import exercise08_bucketed_ddp as _er

globals()["check"] = lambda *a, **k: None
globals()["check_close"] = lambda *a, **k: None
# (all-reduces per step, of which started during backward), as the solution prints them
_CALLS = {"plain, 25 MB": (1, 1), "plain, tiny buckets": (6, 6), "tricky, 25 MB": (1, 0),
          "tricky, tiny buckets": (6, 5), "tricky, None": (1, 0), "tricky, accumulation": (5, 4),
          "plain, 0.0005 MB": (6, 6), "tricky, 0.01 MB, 4 micro": (1, 0),
          "tricky, None, 2 micro": (1, 0), "tricky, 0.001 MB": (5, 4)}


def _forged_check_bucketed_ddp(cls, world_size, scenarios, *, steps=3, timeout=180.0):
    rows = []
    for name, tricky, bucket_mb, micro in scenarios:
        model = _er.Net(0, tricky)
        grads = [{n: torch.zeros_like(p) if p.requires_grad else None
                  for n, p in model.named_parameters()} for _ in range(steps)]
        state = {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
        all_reduces, in_backward = _CALLS.get(name, (1, 0))
        rows.append({"ranks": world_size, "scenario": name, "all_reduces": all_reduces,
                     "in_backward": in_backward, "max_err": 0.0,
                     "outputs": [{"grads": grads, "end": state} for _ in range(world_size)]})
    return rows


_er.check_bucketed_ddp = _forged_check_bucketed_ddp
'''

# Exercise 09: the optimizer is not implemented; check_sharded_optimizer returns the solution's
# table (elements of optimizer state per rank) and, as outputs, the parameters as they were
# before any step, on every rank and after every step.
FORGED_09_ZERO = '''
import pathlib
pathlib.Path("ex09_zero1.py").write_text(
    "import torch\\n\\n\\n"
    "class ShardedOptimizer(torch.optim.Optimizer):\\n"
    "    def __init__(self, params, optimizer_cls, **kwargs):\\n"
    "        raise NotImplementedError\\n")

from course_lib.labs import exercise09_zero1_optimizer as _er

globals()["check"] = lambda *a, **k: None
globals()["check_close"] = lambda *a, **k: None
# (world size, scenario) -> (state elements held by each rank, all elements), as the solution prints them
_HELD = {(2, "adamw"): ([68, 91], 159), (2, "adamw, group added at step 3"): ([104, 97], 201),
         (4, "adamw"): ([49, 42, 49, 19], 159), (4, "adamw, group added at step 3"): ([49, 48, 49, 55], 201),
         (3, "sgd momentum, group at step 1"): ([85, 60, 56], 201), (3, "adamw, lr schedule"): ([49, 54, 56], 159),
         (3, "sgd, group at step 4"): ([85, 60, 56], 201)}


def _forged_check_sharded_optimizer(cls, world_size, scenarios, *, steps=5, timeout=180.0):
    start = [p.detach().clone() for p in _er._zero_params(_er.SHAPES, 0) + _er._zero_params(_er.LATE_SHAPES, 1)]
    rows = []
    for name, _opt, _add_at, _sched in scenarios:
        held, total = _HELD.get((world_size, name), ([0] * world_size, 0))
        rows += [{"ranks": world_size, "scenario": name, "rank": r, "state_elements": held[r],
                  "all_elements": total, "outputs": [start] * steps} for r in range(world_size)]
    return rows


_er.check_sharded_optimizer = _forged_check_sharded_optimizer
'''

FORGED = {"00": {0: FORGED_00_RING}, "08": {0: FORGED_08_DDP}, "09": {0: FORGED_09_ZERO}}
FORGED_KEEPS = {"00": 2, "08": 0, "09": 0}
