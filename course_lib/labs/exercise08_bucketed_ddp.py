"""Exercise 08 (bucketed DDP): the rank runner and the check of the learner's ``BucketedDDP``.

Each rank trains a tiny language model (:class:`Net`; ``tricky=True`` adds an unused parameter and
a frozen one) with the learner's class and compares every gradient and parameter with one process
on the global batch (same seed, sums in another order: fp32 allclose). The learner's class reaches
the ranks as a reference (see :mod:`course_lib.labs.exercise_harness`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.kit.checks import CheckFailed

from course_lib.labs.exercise_harness import _first_problem, _guard, _launch, impl_ref, load_impl

RTOL, ATOL = 1e-5, 1e-7  # fp32 allclose for DDP against one process (sums in another order)

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


def _factor(got: torch.Tensor, want: torch.Tensor) -> str:
    """', N x the expected' when ``got`` is the expected gradient scaled by one number, else ''."""
    norm = float((want * want).sum())
    if norm == 0:
        return ""
    scale = float((got * want).sum()) / norm
    if abs(scale - 1) > 1e-3 and torch.allclose(got, scale * want, rtol=RTOL, atol=ATOL):
        return f", {scale:.4g} x the expected everywhere"
    return ""


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
            problems.append(f"{what}: {name} has shape {tuple(g.shape)}, expected {tuple(w.shape)}: "
                            "a slice of the flat bucket is 1-D, the parameter is not")
        elif w is not None and not torch.allclose(g, w, rtol=RTOL, atol=ATOL):
            err = (g - w).abs().max().item()
            problems.append(f"{what}: {name} differs from the single-process value by up to {err:.3g} "
                            f"(max |expected| {w.abs().max().item():.3g}){_factor(g, w)}. {hint}")
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
        hint = ("Step 1 was right and this step is not: what does your wrapper still hold from the "
                "step before when this backward starts?" if step and not problems else
                "All-reduce sums over the ranks, and one process sees the whole batch. Does each "
                "parameter get back its own slice of the bucket (same order and offsets as when it was "
                "filled)?")
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
                "async_op=True, while backward was still running: no overlap. In which order does "
                "backward produce gradients, and when does each bucket become complete?")
        if bucket_mb is None and total > 2:
            raise CheckFailed(f"{world_size} ranks, scenario {name!r}: bucket_mb=None should put "
                              f"everything in one bucket (one all-reduce), saw {total} per step")
        rows.append({"ranks": world_size, "scenario": name, "all_reduces": total,
                     "in_backward": calls["async_in_backward"],
                     "max_err": max(per_rank[r][name]["max_err"] for r in range(world_size)),
                     "outputs": [per_rank[r][name]["outputs"] for r in range(world_size)]})
    return rows
