"""Exercise 09 (ZeRO-1 sharded optimizer): the rank runner and the check of ``ShardedOptimizer``.

Each rank steps the learner's sharded optimizer and, in the same process, the plain unsharded
optimizer fed the same averaged gradients; parameters, the shard each rank holds and the optimizer
state it keeps are compared (a parameter that never gets a gradient, a group added mid-training,
AdamW and SGD with momentum). The learner's class reaches the ranks as a reference (see
:mod:`course_lib.labs.exercise_harness`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.kit.checks import CheckFailed

from course_lib.labs.exercise_harness import _first_problem, _guard, _launch, impl_ref, load_impl

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
                    hint = ("An lr scheduler changes the learning rate in self.param_groups each "
                            "step: does your local optimizer ever see the new value?")
                else:
                    hint = ("Does your local optimizer get the same options (lr, betas, weight decay, "
                            "per group) as the plain one, and step once per step on the gradients as "
                            "they arrive?")
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


def contract_owners(numel: list[int], world_size: int, *, late: bool) -> list[int]:
    """The owner rank of each parameter (the scenario's order: the two initial groups, then the
    late group when ``late``) under the exercise contract's greedy rule (group by group, largest
    parameter first, stable for equal sizes; ties between ranks to the lowest). ``numel``: elements
    per parameter, late group included."""
    n = len(SHAPES)
    groups = [list(range(4)), list(range(4, n))] + ([list(range(n, len(numel)))] if late else [])
    owned, owner = [0] * world_size, {}
    for group in groups:
        for i in sorted(group, key=lambda i: -numel[i]):
            owner[i] = min(range(world_size), key=lambda r: owned[r])
            owned[owner[i]] += numel[i]
    return [owner.get(i, -1) for i in range(len(numel))]


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
                    + ("A rank's local optimizer holds a parameter another rank owns."
                       if who else "Did its owner step it?"))
        # the rule fixes how many elements each rank owns (equal-sized parameters may swap owners)
        want = contract_owners(numel, world_size, late=add_at is not None)
        want_held = [sum(numel[i] for i in stepped if want[i] == r) for r in range(world_size)]
        got_held = [sum(numel[i] for i in stepped if owners[i] == [r]) for r in range(world_size)]
        if got_held != want_held:
            raise CheckFailed(
                f"{world_size} ranks, scenario {name!r}: the ranks hold optimizer state for {got_held} elements, "
                f"but the contract's ownership rule (Part 1, 'Ownership') gives them {want_held}. Another rule "
                "(round-robin, by position, one group per rank) also shards the state, but not the way the "
                "contract says, and the tally runs on across groups, including the ones added later. Apply "
                "the contract's rule by hand to sizes 42, 7, 49, 7 on 2 ranks, then compare with your code.")
        total = sum(numel[i] for i in stepped)
        for r in range(world_size):
            held = got_held[r]
            rows.append({"ranks": world_size, "scenario": name, "rank": r, "state_elements": held,
                         "all_elements": total, "outputs": per_rank[r][name]["outputs"]})
    return rows
