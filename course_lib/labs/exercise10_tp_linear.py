"""Exercise 10 (column- and row-parallel linear): the rank runners and checks.

Exercise 10 works like exercises 08/09 (:mod:`course_lib.labs.exercise_harness`): the learner's
cell is written to ``ex10_tp_linear.py``, the check sends ranks a reference (``"module:name"`` plus
its folder) and each rank imports it fresh. Every rank compares the learner's operators and layers
with **dense** ``nn.Linear`` math computed in the same process (same seed, no communication), never
with the library's tensor-parallel layers, and counts the collectives issued in forward and in
backward.

Checks raise :class:`course_lib.kit.checks.CheckFailed` with a sentence that says what was expected,
what came out and the likely bug (``NotImplementedError`` while the learner's code raises it),
and otherwise return table rows for the notebook.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.kit.checks import CheckFailed
from course_lib.labs.exercise_harness import _first_problem, _guard, _launch, impl_ref, load_impl

RTOL, ATOL = 1e-5, 1e-6  # fp32: sums over ranks and matmul shards add in another order
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_gather_single", "reduce_scatter_single",
               "broadcast", "send", "recv", "isend", "irecv")


class _Counter:
    """Replaces the collectives of ``torch.distributed`` in a rank (before the learner's module is
    imported, so ``from torch.distributed import all_reduce`` sees it too) and counts calls per
    phase, e.g. ``{"forward": {"all_reduce": 1}}``."""

    def __init__(self):
        self.phase, self.counts = None, {}
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, real):
        def counted(*args, **kwargs):
            per = self.counts.setdefault(self.phase, {})
            per[name] = per.get(name, 0) + 1
            return real(*args, **kwargs)
        return counted

    def take(self, phase: str) -> dict:
        return self.counts.pop(phase, {})


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _close(a, b) -> bool:
    return (a is not None and b is not None and a.shape == b.shape
            and torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def _err(a, b) -> float:
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return (a - b).abs().max().item()


def _mismatch(what: str, got, want, hint: str) -> str | None:
    """None when equal, else a sentence: what was expected, what came out, and ``hint``."""
    hint = hint[:1].upper() + hint[1:]
    if got is None:
        return f"{what} is None, expected a tensor of shape {tuple(want.shape)}. {hint}"
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}. {hint}"
    if _close(got, want):
        return None
    hint = hint[:1].upper() + hint[1:]
    return (f"{what} differs from the expected value by up to {_err(got, want):.3g} (largest |expected| "
            f"{want.abs().max().item():.3g}). {hint}")


def _tp_group(world_size: int, tp: int | None):
    """(group, its size, this rank's index in it): the default group, or groups of ``tp``
    consecutive ranks (every rank must create every group, in the same order)."""
    if tp is None or tp == world_size:
        return None, world_size, dist.get_rank()
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world_size, tp)]
    return groups[dist.get_rank() // tp], tp, dist.get_rank() % tp


# ============================================================= exercise 10: f and g
def _raw(t):
    """A detached copy of what the learner's code produced (None stays None, a non-tensor too):
    the grader compares these values themselves, never a summary computed from them."""
    return t.detach().clone() if isinstance(t, torch.Tensor) else None


def _ops_scenario(f, g, shape, group, n, r, calls) -> dict:
    problems, counts = [], {}
    raw = {"f(x)": None, "f x.grad": None, "g(x)": None, "g x.grad": None}
    # f: identity forward; backward sums the gradients of every rank (each rank's differ)
    x = _randn(shape, 1)
    xin = x.clone().requires_grad_()
    calls.phase = "f forward"
    y = f(xin, group)
    counts["f forward"] = calls.take("f forward")
    raw["f(x)"] = _raw(y)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not torch.equal(y.detach(), x):
        problems.append((1, "f(x) is not x (same shape, same values): in forward, the column layer after f needs "
                            "the very x every rank was given"))
    elif not y.requires_grad or y.grad_fn is None:
        problems.append((1, "f(x) is not connected to x in the autograd graph: a torch.autograd.Function "
                            "that returns its input object itself records no node"))
    else:
        ups = [_randn(shape, 100 + k) for k in range(n)]  # rank k's gradient of f's output
        mine = ups[r].clone()
        calls.phase = "f backward"
        y.backward(mine)
        counts["f backward"] = calls.take("f backward")
        raw["f x.grad"] = _raw(xin.grad)
        want = torch.stack(ups).sum(0)
        hint = ("every rank read the same x, and each rank's gradient is one part of x's true "
                "gradient: does every rank end with all of it?")
        if xin.grad is not None and _close(xin.grad, ups[r]):
            hint = "it equals this rank's own part only: " + hint
        elif xin.grad is not None and _close(xin.grad, want / n):
            hint = f"it is {n} times too small: the mean over ranks, not their total"
        p = _mismatch("x.grad after f's backward", xin.grad, want, hint)
        if p:
            problems.append((2, p))
        if not torch.equal(mine, ups[r]):
            problems.append((2, "f's backward changed the incoming gradient in place: all-reduce a "
                                "clone (autograd may still need the tensor it handed you)"))
    # g: all-reduce forward; identity backward
    xs = [_randn(shape, 200 + k) for k in range(n)]
    xin = xs[r].clone().requires_grad_()
    calls.phase = "g forward"
    y = g(xin, group)
    counts["g forward"] = calls.take("g forward")
    raw["g(x)"] = _raw(y)
    want = torch.stack(xs).sum(0)
    hint = "each rank's x is one partial sum of the output; every rank should hold the whole output"
    if isinstance(y, torch.Tensor) and _close(y.detach(), xs[r]):
        hint = "it equals this rank's own x: " + hint
    elif isinstance(y, torch.Tensor) and _close(y.detach(), want / n):
        hint = f"it is {n} times too small: the mean over ranks, not their total"
    p = _mismatch("g(x)", y.detach() if isinstance(y, torch.Tensor) else None, want, hint)
    if p:
        problems.append((3, p))
    if not torch.equal(xin.detach(), xs[r]):
        problems.append((3, "g changed its input x in place: all-reduce a clone, x may be needed elsewhere"))
    if not p and y.requires_grad and y.grad_fn is not None:
        up = _randn(shape, 300)  # the same on every rank: what follows g is replicated
        calls.phase = "g backward"
        y.backward(up)
        counts["g backward"] = calls.take("g backward")
        raw["g x.grad"] = _raw(xin.grad)
        hint = ("what is the derivative of a sum with respect to one of its terms? The gradient "
                "from above is already the same on every rank")
        if xin.grad is not None and _close(xin.grad, n * up):
            hint = f"it is {n} times too large (the gradient was all-reduced again): " + hint
        p = _mismatch("x.grad after g's backward", xin.grad, up, hint)
        if p:
            problems.append((4, p))
    elif not p:
        problems.append((4, "g(x) is not connected to x in the autograd graph: wrap it in a "
                            "torch.autograd.Function"))
    want_counts = {"f forward": 0, "f backward": 1, "g forward": 1, "g backward": 0}
    for phase, n_want in want_counts.items():
        got = counts.get(phase, {})
        if phase in counts and (got.get("all_reduce", 0) != n_want or sum(got.values()) != n_want):
            problems.append((5, f"{phase} issued {got or 'no collectives'}; it should issue exactly "
                                f"{n_want} all_reduce and nothing else"))
    return {"problems": problems, "counts": {k: sum(v.values()) for k, v in counts.items()}, "raw": raw}


def ops_rank(rank: int, world_size: int, refs: tuple, folder: str, shapes: list, tp) -> dict:
    """Rank function: the learner's f and g (``refs``) on every shape."""
    calls = _Counter()
    f, g = (load_impl(ref, folder) for ref in refs)
    group, n, r = _tp_group(world_size, tp)
    out = {str(tuple(s)): _guard(str(tuple(s)), _ops_scenario, f, g, tuple(s), group, n, r, calls)
           for s in shapes}
    dist.barrier()
    return out


def check_conjugate_ops(f, g, world_size: int, shapes: list, *, tp: int | None = None,
                        timeout: float = 120.0) -> list[dict]:
    """Run the learner's ``f`` (identity / all-reduce) and ``g`` (all-reduce / identity) on
    ``world_size`` gloo ranks (in groups of ``tp`` ranks; None: all of them) for every shape;
    raise on the first problem, else one row per shape with the collectives of each phase and
    ``outputs``: per rank, what the learner's operators returned on the seeded inputs (``f(x)``,
    ``f x.grad``, ``g(x)``, ``g x.grad``; fp32 tensors, None where not reached), for the grader."""
    refs = [impl_ref(fn) for fn in (f, g)]
    per_rank = _launch(ops_rank, world_size, "your f and g", timeout,
                       tuple(ref for ref, _ in refs), refs[0][1], [tuple(s) for s in shapes], tp,
                       deadlock_hint="Every rank of the group must call the same all_reduce, with the same group.")
    _first_problem(per_rank, world_size)
    return [{"ranks": world_size, "shape": name, **per_rank[0][name]["counts"],
             "outputs": [per_rank[r][name]["raw"] for r in range(world_size)]} for name in per_rank[0]]


# ============================================================= exercise 10: the layers
def _dense(kind: str, dims: tuple, bias: bool) -> nn.Module:
    torch.manual_seed(0)  # the same dense layer on every rank, for the learner and the reference
    if kind == "mlp":
        return nn.Sequential(nn.Linear(dims[0], dims[1], bias=bias), nn.GELU(),
                             nn.Linear(dims[1], dims[0], bias=bias))
    return nn.Linear(dims[0], dims[1], bias=bias)


def _shard_hint(kind: str) -> str:
    return {"column": "A column-parallel layer keeps this rank's out/N output channels (r = "
                      "dist.get_rank(group) of N = its size): part of the weight and of the bias.",
            "row": "A row-parallel layer keeps this rank's in/N input channels of the weight, and the "
                   "whole bias, counted once in the output."}[kind]


def _layer_scenario(col_cls, row_cls, kind, dims, bias, lead, group, n, r, calls) -> dict:
    problems = []
    dense = _dense(kind, dims, bias)  # the reference, computed here without communication
    x = _randn(lead + (dims[0],), 11)
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    up = _randn(yd.shape, 12)  # d loss / d output, the same on every rank
    (yd * up).sum().backward()
    twin = _dense(kind, dims, bias)  # the learner shards a fresh copy: nothing shared with `dense`
    if kind == "column":
        layers = [col_cls.from_linear(twin, group)]
        want_y, x_in, want_xg = yd.detach().chunk(n, -1)[r], x.clone().requires_grad_(), xd.grad
        want = [(dense.weight.grad.chunk(n, 0)[r], dense.bias.grad.chunk(n, 0)[r] if bias else None)]
        kinds = ["column"]
    elif kind == "row":
        layers = [row_cls.from_linear(twin, group)]
        want_y, x_in = yd.detach(), x.chunk(n, -1)[r].clone().requires_grad_()
        want_xg = xd.grad.chunk(n, -1)[r]
        want = [(dense.weight.grad.chunk(n, 1)[r], dense.bias.grad if bias else None)]
        kinds = ["row"]
    else:
        layers = [col_cls.from_linear(twin[0], group), row_cls.from_linear(twin[2], group)]
        want_y, x_in, want_xg = yd.detach(), x.clone().requires_grad_(), xd.grad
        want = [(dense[0].weight.grad.chunk(n, 0)[r], dense[0].bias.grad.chunk(n, 0)[r] if bias else None),
                (dense[2].weight.grad.chunk(n, 1)[r], dense[2].bias.grad if bias else None)]
        kinds = ["column", "row"]
    for layer, k, (wg, bg) in zip(layers, kinds, want):
        got_b = getattr(layer, "bias", None)
        got_w = getattr(layer, "weight", None)
        if got_w is None or got_w.shape != wg.shape:
            problems.append((0, f"the {k}-parallel weight on {n} ranks should have shape {tuple(wg.shape)}, "
                                f"got {None if got_w is None else tuple(got_w.shape)}. " + _shard_hint(k)))
        elif (bg is None) != (got_b is None) or (bg is not None and got_b.shape != bg.shape):
            problems.append((0, f"the {k}-parallel bias should be {None if bg is None else tuple(bg.shape)}, "
                                f"got {None if got_b is None else tuple(got_b.shape)}. " + _shard_hint(k)))
    if problems:
        return {"problems": problems}
    calls.phase = "forward"
    y = layers[0](x_in) if kind != "mlp" else layers[1](F.gelu(layers[0](x_in)))
    fwd = calls.take("forward")
    hint = _shard_hint(kinds[-1])
    if kind == "row" and y.shape == want_y.shape:
        partial = F.linear(x_in.detach(), layers[0].weight.detach())
        if bias and _close(y.detach(), want_y + (n - 1) * dense.bias.detach()):
            hint = f"the bias was added {n} times: each rank added it before the sum"
        elif _close(y.detach() - (dense.bias.detach() if bias else 0), partial) and n > 1:
            hint = "it is this rank's partial sum only, not the whole output"
    elif kind == "column" and y.shape == yd.shape and n > 1:
        hint = "the layer should return only this rank's out/N output channels (no gather)"
    if group is not None:
        hint += (f" Here the tensor-parallel group is {n} of the {dist.get_world_size()} ranks: pass "
                 "group= to every collective and take r from dist.get_rank(group).")
    p = _mismatch("the output", y.detach(), want_y, hint)
    if p:
        return {"problems": [(1, p)]}
    calls.phase = "backward"
    (y * (up.chunk(n, -1)[r] if kind == "column" else up)).sum().backward()
    bwd = calls.take("backward")
    hint = ("x is read by every rank, and each rank's shard sends back only its part of x's "
            "gradient: where does your layer put the parts together?" if kind != "row" else
            "the row layer's input gradient is this rank's slice of the dense one")
    p = _mismatch("the input's gradient", x_in.grad, want_xg, hint)
    if p:
        problems.append((2, p))
    for layer, k, (wg, bg) in zip(layers, kinds, want):
        got_bg = layer.bias.grad if layer.bias is not None else None
        for what, got, w in ((f"{k}-parallel weight.grad", layer.weight.grad, wg),
                             (f"{k}-parallel bias.grad", got_bg, bg)):
            if w is not None and (p := _mismatch(what, got, w, _shard_hint(k))):
                problems.append((3, p))
    want_fwd = {"column": 0, "row": 1, "mlp": 1}[kind]
    want_bwd = {"column": 1, "row": 0, "mlp": 1}[kind]
    for phase, got, n_want in (("forward", fwd, want_fwd), ("backward", bwd, want_bwd)):
        if not problems and n > 1 and (got.get("all_reduce", 0) != n_want or sum(got.values()) != n_want):
            problems.append((4, f"{phase} issued {got or 'no collectives'}; a {kind} layer needs exactly "
                                f"{n_want} all_reduce there"))
    err = max(_err(y.detach(), want_y), _err(x_in.grad, want_xg),
              *(_err(layer.weight.grad, wg) for layer, (wg, _) in zip(layers, want)))
    raw = {"y": _raw(y), "x.grad": _raw(x_in.grad),
           "grads": [[_raw(layer.weight.grad), _raw(getattr(getattr(layer, "bias", None), "grad", None))]
                     for layer in layers]}  # this rank's shard, [weight, bias] per layer
    return {"problems": problems, "forward": sum(fwd.values()), "backward": sum(bwd.values()),
            "max_err": err, "raw": raw, "shards": [layer.weight.detach().clone() for layer in layers],
            "dense_weights": [m.weight.detach().clone() for m in dense.modules() if isinstance(m, nn.Linear)],
            "params": sum(p.numel() for layer in layers for p in layer.parameters()),
            "dense_params": sum(p.numel() for p in dense.parameters())}


def layers_rank(rank: int, world_size: int, refs: tuple, folder: str, scenarios: list) -> dict:
    """Rank function: every scenario ``(name, kind, dims, bias, lead, tp)`` with the learner's layers."""
    calls = _Counter()
    col_cls, row_cls = (load_impl(ref, folder) for ref in refs)
    groups, out = {}, {}
    for name, kind, dims, bias, lead, tp in scenarios:
        if tp not in groups:  # every rank meets the scenarios in the same order: same groups
            groups[tp] = _tp_group(world_size, tp)
        out[name] = _guard(name, _layer_scenario, col_cls, row_cls, kind, tuple(dims), bias, tuple(lead),
                           *groups[tp], calls)
    dist.barrier()
    return out


def check_parallel_linears(col_cls, row_cls, world_size: int, scenarios: list, *,
                           timeout: float = 120.0) -> list[dict]:
    """Run the learner's ``ColumnParallelLinear`` / ``RowParallelLinear`` on ``world_size`` gloo
    ranks in every scenario ``(name, "column"|"row"|"mlp", dims, bias, leading input dims[, tp])``
    (``tp``: tensor-parallel groups of that many consecutive ranks; left out or None: all ranks):
    outputs and gradients equal to the dense layer, and the all-reduces each direction needs.
    Raises on the first problem, else one row per scenario; its ``outputs`` hold, per rank, what
    the learner's layers produced on the seeded input (``y``, ``x.grad``, and ``grads``: [weight,
    bias] gradients of this rank's shard per layer; fp32 tensors), for the grader."""
    for cls in (col_cls, row_cls):
        if cls.__module__.startswith("course_lib"):
            raise CheckFailed(f"{cls.__name__} is the library's own class ({cls.__module__}): this "
                              "exercise asks for yours, from the %%writefile cell")
    scenarios = [tuple(sc) + (None,) * (6 - len(sc)) for sc in scenarios]
    refs = [impl_ref(cls) for cls in (col_cls, row_cls)]
    per_rank = _launch(layers_rank, world_size, "your tensor-parallel layers", timeout,
                       tuple(ref for ref, _ in refs), refs[0][1], scenarios,
                       deadlock_hint="Every rank of the group must issue the same all-reduces, on the same group.")
    _first_problem(per_rank, world_size)
    rows = []
    for name, kind, dims, bias, lead, _tp in scenarios:
        r0 = per_rank[0][name]
        rows.append({"ranks": world_size, "scenario": name, "kind": kind, "forward": r0["forward"],
                     "backward": r0["backward"], "params_per_rank": r0["params"],
                     "dense_params": r0["dense_params"],
                     "max_err": max(per_rank[r][name]["max_err"] for r in range(world_size)),
                     "shards": [per_rank[r][name]["shards"] for r in range(world_size)],
                     "outputs": [per_rank[r][name]["raw"] for r in range(world_size)],
                     "dense_weights": r0["dense_weights"]})
    return rows
