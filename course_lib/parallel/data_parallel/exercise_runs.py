"""Rank runners and checks for exercises 08 (bucketed DDP) and 09 (ZeRO-1 sharded optimizer).

How the learner's class reaches the ranks: the exercise cell that holds it is written to a module
next to the notebook (``%%writefile ex08_bucketed_ddp.py``); the notebook imports the class and
hands it to a ``check_*`` function here. Spawned ranks cannot unpickle a class defined in a
notebook, so the check sends only a reference, ``"module:Class"`` plus the module's folder, and
every rank imports that module fresh (:func:`load_impl`): it always runs the file as last written.

Each rank compares the learner's class with a reference computed in the same process (a single
process on the global batch for DDP; the plain, unsharded optimizer fed the same averaged
gradients for ZeRO-1) and returns plain dicts: numbers plus ``problems``, sentences that say what
was expected, what came out and the likely bug. The checks raise
:class:`course_lib.checks.CheckFailed` with the first problem, or ``NotImplementedError`` while
the learner's code still raises it, and otherwise return table rows for the notebook.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.checks import CheckFailed
from course_lib.parallel.launch import RankFailedError, run_ranks

RTOL, ATOL = 1e-5, 1e-7  # fp32 allclose for DDP against one process (sums in another order)


# ----------------------------------------------------------------------------- shared plumbing
def impl_ref(obj) -> tuple[str, str]:
    """``("module:Name", folder)`` for a class or function defined in a written ``.py`` module;
    TypeError (with what to do) for one defined in the notebook itself."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if file is None or obj.__module__ == "__main__":
        raise TypeError(f"{getattr(obj, '__name__', obj)!r} is defined in the notebook itself, which "
                        "spawned ranks cannot import: run the cell that starts with %%writefile, "
                        "then import the class from the module it wrote")
    return f"{obj.__module__}:{obj.__qualname__}", str(Path(file).resolve().parent)


def load_impl(ref: str, folder: str):
    """In a rank: import ``module`` from ``folder`` and return ``module.Name`` (``ref`` is
    ``"module:Name"``)."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _guard(name: str, fn, *args):
    """Run one scenario; name it in any error except NotImplementedError (kept as is)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as exc:
        raise RuntimeError(f"in scenario {name!r}: {type(exc).__name__}: {exc}") from exc


DDP_DEADLOCK_HINT = ("Every rank must issue the same collectives in the same order (launch buckets in a "
                     "fixed order, launch one even when a gradient in it is missing) and wait for every "
                     "handle it started")


def _launch(fn, world_size: int, what: str, timeout: float, *args,
            deadlock_hint: str = DDP_DEADLOCK_HINT) -> list:
    """Run the learner's code on ``world_size`` ranks; a NotImplementedError, an exception or a
    hang (``timeout`` seconds) becomes a message that says what to do (``deadlock_hint``: the
    likely cause of a hang in this exercise)."""
    try:
        return run_ranks(fn, world_size, *args, timeout=timeout, show_output=False)
    except RankFailedError as exc:
        if exc.exc_type == "NotImplementedError":
            raise NotImplementedError(
                f"{what}: a 'YOUR CODE HERE' still raises NotImplementedError (rank {exc.rank}): "
                "fill in every one, run those cells, then this check") from None
        tail = "\n".join(exc.remote_traceback.strip().splitlines()[-6:])
        raise CheckFailed(f"{what} raised an exception on {world_size} ranks (rank {exc.rank}); "
                          f"the end of its traceback:\n{tail}") from None
    except TimeoutError:
        raise CheckFailed(f"{what} did not finish within {timeout:g} s on {world_size} ranks: a "
                          f"deadlock. {deadlock_hint}") from None


def _first_problem(per_rank: list[dict], world_size: int) -> None:
    """Raise the earliest problem (scenarios in order; within one, the earliest stage on any rank:
    a wrong broadcast on rank 1 explains wrong gradients on rank 0)."""
    for name in per_rank[0]:
        found = [(stage, rank, text) for rank, result in enumerate(per_rank)
                 for stage, text in result[name]["problems"]]
        if found:
            stage, rank, text = min(found)
            raise CheckFailed(f"{world_size} ranks, scenario {name!r}, rank {rank}: {text}")


# ----------------------------------------------------------------------------- exercise 08: DDP
VOCAB, DIM, SEQ, BATCH = 16, 8, 5, 8  # BATCH: the global batch, split over 2 or 4 ranks


class Net(nn.Module):
    """A tiny language model. ``tricky=True`` adds what trips up a DDP: a parameter forward never
    uses (registered first), a frozen layer, a buffer, and a head tied to the embedding."""

    def __init__(self, seed: int, tricky: bool):
        super().__init__()
        torch.manual_seed(seed)
        if tricky:
            self.unused = nn.Parameter(torch.randn(3))
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM) if tricky else nn.Identity()
        self.frozen.requires_grad_(False)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tricky:
            self.head.weight = self.emb.weight  # one Parameter reached by two names
        self.register_buffer("scale", torch.full((DIM,), 1.0 + 0.5 * seed))

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc2(torch.tanh(self.fc1(self.frozen(h))))
        return self.head(h * self.scale)


def _batches(steps: int):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(steps)]


def _loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _sgd(model):  # weight decay: a zero gradient where None was due would move the parameter
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _state(model):
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.clone() for n, b in model.named_buffers()})
    return out


def ddp_reference(tricky: bool, steps: int) -> dict:
    """One process, the whole global batch: start state, gradients of every step, end state."""
    model = Net(0, tricky)
    start, opt, grads = _state(model), _sgd(model), []
    for x, y in _batches(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"start": start, "grads": grads, "end": _state(model)}


class _Calls:
    """Counts dist.all_reduce calls by phase ("no_sync", "backward", "finish") for one step."""

    def __init__(self):
        self.phase, self.counts, self.async_in_backward = None, {}, 0
        self._real = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        if self.phase == "backward" and kwargs.get("async_op"):
            self.async_in_backward += 1
        return self._real(*args, **kwargs)


def _compare(what: str, got: dict, want: dict, hint: str) -> list[str]:
    problems = []
    for name, w in want.items():
        g = got[name]
        if w is None and g is not None:
            problems.append(f"{what}: {name} has a gradient, but no rank used it in forward, so one "
                            "process leaves its .grad None (and the optimizer skips it). Keep .grad "
                            "None when no rank produced one: send a 'has a gradient' flag with the bucket")
        elif w is not None and g is None:
            problems.append(f"{what}: {name}.grad is None, expected the rank-averaged gradient")
        elif w is not None and g.shape != w.shape:
            problems.append(f"{what}: {name} has shape {tuple(g.shape)}, expected {tuple(w.shape)}. "
                            "Use .view_as(p) when copying a slice of the bucket back")
        elif w is not None and not torch.allclose(g, w, rtol=RTOL, atol=ATOL):
            err = (g - w).abs().max().item()
            problems.append(f"{what}: {name} differs from the single-process value by up to {err:.3g} "
                            f"(max |expected| {w.abs().max().item():.3g}). {hint}")
    return problems


def _ddp_scenario(cls, rank, world, tricky, bucket_mb, micro, steps, calls) -> dict:
    ref = ddp_reference(tricky, steps)
    model = Net(rank, tricky)  # every rank starts different (rank 0 as the reference): broadcast
    ddp = cls(model, bucket_mb=bucket_mb)
    problems = []  # (stage, sentence): stage 0 construction, k step k, steps + 1 the end
    if getattr(ddp, "module", None) is not model:
        problems.append((0, "wrapper.module should be the module you were given, the same object"))
    problems += [(0, t) for t in _compare("right after construction", _state(model), ref["start"],
                 "Broadcast every parameter (frozen ones too) and every buffer from rank 0.")]
    opt, per, table, max_err, seen = _sgd(model), BATCH // world, [], 0.0, []
    for step, (x, y) in enumerate(_batches(steps)):
        xs, ys = x[rank * per:(rank + 1) * per].chunk(micro), y[rank * per:(rank + 1) * per].chunk(micro)
        opt.zero_grad(set_to_none=True)
        calls.counts, calls.async_in_backward = {}, 0
        if micro > 1:
            calls.phase = "no_sync"
            with ddp.no_sync():
                for i in range(micro - 1):
                    (_loss(ddp, xs[i], ys[i]) / micro).backward()
        calls.phase = "backward"
        (_loss(ddp, xs[-1], ys[-1]) / micro).backward()
        calls.phase = "finish"
        ddp.finish_gradient_synchronization()
        calls.phase = None
        table.append(dict(calls.counts, async_in_backward=calls.async_in_backward))
        got = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        seen.append(got)
        hint = ("Step 1 was right: reset the per-bucket ready counts and the pending work at the end "
                "of finish_gradient_synchronization()." if step and not problems else
                "Divide the summed bucket by the world size and copy each parameter's slice of the "
                "bucket back into its .grad (same order and offsets as when you filled it).")
        if table[-1].get("no_sync"):
            problems.append((step + 1, f"dist.all_reduce was called {table[-1]['no_sync']} times "
                             "inside no_sync(): there the hooks must do nothing, gradients just "
                             "add up in .grad"))
        problems += [(step + 1, t) for t in _compare(f"step {step + 1} gradients", got,
                                                     ref["grads"][step], hint)]
        max_err = max([max_err] + [(g - w).abs().max().item() for n, w in ref["grads"][step].items()
                                   if w is not None and (g := got[n]) is not None and g.shape == w.shape])
        opt.step()
    problems += [(steps + 1, t) for t in _compare(
        f"parameters after {steps} SGD steps", _state(model), ref["end"],
        "The gradients were right: check what else your wrapper changes.")]
    if tricky and model.head.weight is not model.emb.weight:
        problems.append((steps + 1, "the tied weight was untied: head.weight must stay emb.weight"))
    # outputs: what the learner's wrapper produced (gradients after each step's synchronisation,
    # then parameters and buffers), for the grader to compare with the instructor's run
    return {"problems": problems, "calls": table, "max_err": max_err,
            "outputs": {"grads": seen, "end": _state(model)}}


def ddp_rank(rank: int, world_size: int, ref: str, folder: str, scenarios: list, steps: int) -> dict:
    """Rank function: every scenario ``(name, tricky, bucket_mb, micro)`` with the learner's class."""
    calls = _Calls()
    dist.all_reduce = calls  # before the learner's module is imported: `from ... import` sees it
    cls = load_impl(ref, folder)
    out = {}
    for name, tricky, bucket_mb, micro in scenarios:
        out[name] = _guard(name, _ddp_scenario, cls, rank, world_size, tricky, bucket_mb, micro,
                           steps, calls)
    dist.barrier()
    return out


def check_bucketed_ddp(cls, world_size: int, scenarios: list, *, steps: int = 3,
                       timeout: float = 180.0) -> list[dict]:
    """Run ``cls`` (the learner's BucketedDDP) on ``world_size`` gloo ranks in every scenario
    ``(name, tricky, bucket_mb, micro)``; raise on the first problem, else return table rows:
    scenario, all-reduces per step, how many started asynchronously during backward, max error,
    and ``outputs``: per rank (rank order), ``{"grads": [{name: gradient or None} per step],
    "end": {name: parameter or buffer}}`` as the learner's wrapper left them (fp32 tensors)."""
    ref, folder = impl_ref(cls)
    per_rank = _launch(ddp_rank, world_size, "your BucketedDDP", timeout, ref, folder,
                       list(scenarios), steps)
    _first_problem(per_rank, world_size)
    rows = []
    for name, tricky, bucket_mb, micro in scenarios:
        r0 = per_rank[0][name]
        calls = r0["calls"][-1]
        total = calls.get("backward", 0) + calls.get("finish", 0)
        if bucket_mb is not None and bucket_mb <= 0.001 and 2 * calls["async_in_backward"] < total:
            raise CheckFailed(
                f"{world_size} ranks, scenario {name!r}: with tiny buckets only "
                f"{calls['async_in_backward']} of the {total} all-reduces of a step started, with "
                "async_op=True, while backward was still running: no overlap. Build the buckets in "
                "reverse parameter order (the order backward produces gradients) and launch each "
                "one from the hook that completes it.")
        if bucket_mb is None and total > 2:
            raise CheckFailed(f"{world_size} ranks, scenario {name!r}: bucket_mb=None should put "
                              f"everything in one bucket (one all-reduce), saw {total} per step")
        rows.append({"ranks": world_size, "scenario": name, "all_reduces": total,
                     "in_backward": calls["async_in_backward"],
                     "max_err": max(per_rank[r][name]["max_err"] for r in range(world_size)),
                     "outputs": [per_rank[r][name]["outputs"] for r in range(world_size)]})
    return rows


# ----------------------------------------------------------------------------- exercise 09: ZeRO-1
SHAPES = [(6, 7), (7,), (7, 7), (7,), (7, 6), (6,), (6,), (5,)]  # W1 b1 W2 b2 W3 b3 scale dead
DEAD = len(SHAPES) - 1  # the parameter that never gets a gradient
LATE_SHAPES = [(6, 6), (6,)]  # the group added mid-training
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01})}


def _zero_params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(0.5 * torch.randn(s, generator=g)).requires_grad_() for s in shapes]


def _zero_loss(ps, late, x, y):
    w1, b1, w2, b2, w3, b3, scale, _dead = ps
    out = (torch.tanh(torch.tanh(x @ w1 + b1) @ w2 + b2) @ w3 + b3) * scale
    if late:
        out = out + torch.tanh(out) @ late[0] + late[1]
    return ((out - y) ** 2).mean()


def _held(opt) -> set:
    """ids of parameters with optimizer state anywhere in ``opt`` (itself or an optimizer it holds)."""
    holders = [opt] + [v for v in vars(opt).values() if isinstance(v, torch.optim.Optimizer)]
    return {id(p) for h in holders for p, st in h.state.items() if st}


def _zero_scenario(cls, rank, world, opt_name, add_at, schedule, steps) -> dict:
    opt_cls, kwargs = OPTIMIZERS[opt_name]
    ps, late = _zero_params(SHAPES, 0), _zero_params(LATE_SHAPES, 1)  # same on every rank
    twins = [p.detach().clone().requires_grad_() for p in ps + late]
    n = len(SHAPES)
    groups = lambda t: [{"params": t[:4]}, {"params": t[4:n], "weight_decay": 0.0}]  # noqa: E731
    opt, plain = cls(groups(ps), opt_cls, **kwargs), opt_cls(groups(twins), **kwargs)
    problems = [] if isinstance(opt, torch.optim.Optimizer) else [
        (0, "ShardedOptimizer should subclass torch.optim.Optimizer")]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.7 ** s) for o in (opt, plain)] \
        if schedule else []
    g = torch.Generator().manual_seed(99)
    per, active, after = 8 // world, [], []
    for step in range(steps):
        if step == add_at:
            opt.add_param_group({"params": late, "lr": 5e-3})
            plain.add_param_group({"params": twins[n:], "lr": 5e-3})
            active = late
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
        _zero_loss(ps, active, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        for p, t in zip(ps + late, twins):  # average over ranks (what DDP would have done)
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
                t.grad = p.grad.clone()
        before = [p.detach().clone() for p in ps + late]
        opt.step()
        plain.step()
        for s in scheds:
            s.step()
        opt.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        after.append([p.detach().clone() for p in ps + late])
        for i, (p, t) in enumerate(zip(ps + late, twins)):
            if not problems and not torch.equal(p.detach(), t.detach()):
                diff = (p.detach() - t.detach()).abs().max().item()
                if torch.equal(p.detach(), before[i]):
                    hint = ("It did not change in this step: does its owner step it, and broadcast "
                            "it to every rank afterwards?")
                    if i >= len(SHAPES):
                        hint += (" It belongs to the group added with add_param_group after your "
                                 "optimizer was built: its owned part must join the local optimizer.")
                elif schedule:
                    hint = ("An lr scheduler changes self.param_groups[i]['lr'] each step: copy each "
                            "group's options into the local group before stepping.")
                else:
                    hint = ("Step the real optimizer with the same options as the plain one, on the "
                            "gradients as they arrive, once per step.")
                problems.append((step + 1,
                    f"after step {step + 1}, parameter {i} (shape {tuple(p.shape)}) differs from the "
                    f"plain {opt_cls.__name__} by up to {diff:.3g}; it must be equal to the last bit. "
                    + hint))
    held = _held(opt)
    every = ps + late
    return {"problems": problems, "held": [i for i, p in enumerate(every) if id(p) in held],
            "numel": [p.numel() for p in every], "outputs": after}


def zero_rank(rank: int, world_size: int, ref: str, folder: str, scenarios: list, steps: int) -> dict:
    """Rank function: every scenario ``(name, optimizer, add_at, schedule)`` with the learner's class."""
    cls = load_impl(ref, folder)
    out = {name: _guard(name, _zero_scenario, cls, rank, world_size, opt_name, add_at, schedule, steps)
           for name, opt_name, add_at, schedule in scenarios}
    dist.barrier()
    return out


def check_sharded_optimizer(cls, world_size: int, scenarios: list, *, steps: int = 5,
                            timeout: float = 180.0) -> list[dict]:
    """Run ``cls`` (the learner's ShardedOptimizer) on ``world_size`` gloo ranks in every scenario
    ``(name, optimizer "adamw"/"sgd", step at which a group is added or None, lr schedule?)``;
    raise on the first problem, else return one row per scenario and rank: elements whose
    optimizer state the rank holds, against all elements, and ``outputs``, that rank's parameters
    after every step (a list per step, parameter order of the scenario, late group included)."""
    ref, folder = impl_ref(cls)
    per_rank = _launch(zero_rank, world_size, "your ShardedOptimizer", timeout, ref, folder,
                       list(scenarios), steps)
    _first_problem(per_rank, world_size)
    rows = []
    for name, _opt, add_at, _sched in scenarios:
        numel = per_rank[0][name]["numel"]
        stepped = [i for i in range(len(numel)) if i != DEAD and (i < len(SHAPES) or add_at is not None)]
        owners = {i: [r for r in range(world_size) if i in per_rank[r][name]["held"]] for i in stepped}
        for i, who in owners.items():
            if len(who) != 1:
                raise CheckFailed(
                    f"{world_size} ranks, scenario {name!r}: parameter {i} has optimizer state on "
                    f"ranks {who or 'none'}; it should live on exactly one rank, its owner. "
                    + ("Each rank's local optimizer must get only the parameters it owns."
                       if who else "Did its owner step it?"))
        total, biggest = sum(numel[i] for i in stepped), max(numel[i] for i in stepped)
        for r in range(world_size):
            held = sum(numel[i] for i in stepped if owners[i] == [r])
            if held > total / world_size + biggest:
                raise CheckFailed(
                    f"{world_size} ranks, scenario {name!r}: rank {r} holds state for {held} of "
                    f"{total} elements, more than 1/{world_size} plus the largest parameter "
                    f"({biggest}): give each new parameter to the rank that owns the fewest elements")
            rows.append({"ranks": world_size, "scenario": name, "rank": r, "state_elements": held,
                         "all_elements": total, "outputs": per_rank[r][name]["outputs"]})
    return rows
