"""Rank functions for tests/test_zero_scratch.py (spawned ranks import them from here).

Gradients are multiples of 2**-10 in [-0.5, 0.5): any order of summing them over ranks is exact,
and dividing by N = 2 or 4 is exact, so the averaged gradients are the same bits whichever
collective (all_reduce, reduce_scatter) or order produced them. Bitwise equality with the
unsharded optimizer then tests the sharding, not luck in rounding.
"""
import torch
import torch.distributed as dist

from course_lib.parallel.data_parallel.zero import ShardedOptimizer

SHAPES = [(7,), (96, 96), (3, 5), (11,), (2, 3, 4), (5,), (13,)]  # one much larger than the rest
# a GPT-like list (embedding, 4 blocks of qkv/proj/mlp + biases and norms): the state balances
GPT_SHAPES = [(256, 64)] + [(64, 192), (192,), (64, 64), (64,), (64, 256), (256,), (256, 64), (64,),
                            (64,), (64,)] * 4 + [(64,), (64,)]
LATE_SHAPES = [(9,), (4, 4), (6,)]  # the group added mid-training
STEPS, ADD_AT = 6, 3
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grad(shape, step, rank, index):
    g = torch.Generator().manual_seed(1000 * step + 37 * rank + index)
    return torch.randint(-512, 512, shape, generator=g).float() / 1024


def _state_bytes(opt):
    return sum(v.numel() * v.element_size() for st in opt.state.values()
               for v in st.values() if torch.is_tensor(v))


class _NoBroadcast(ShardedOptimizer):  # sabotage: owners never send their updates
    def _broadcast_params(self, by_owner):
        pass


class _WrongOwner(ShardedOptimizer):  # sabotage: every rank steps the next rank's shard
    def _local_group(self, group):
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._owner[p] == (self._rank + 1) % self._world]
        return local


def _run(rank, world, name, zero2, cls=ShardedOptimizer, shapes=SHAPES):
    opt_cls, kw = OPTIMIZERS[name]
    shard, ref = _params(shapes, 0), _params(shapes, 0)
    late_shard, late_ref = _params(LATE_SHAPES, 1), _params(LATE_SHAPES, 1)
    opt = cls([{"params": shard[:4]}, {"params": shard[4:], "lr": kw["lr"] / 2}], opt_cls,
              reduce_scatter_grads=zero2, **kw)
    reference = opt_cls([{"params": ref[:4]}, {"params": ref[4:], "lr": kw["lr"] / 2}], **kw)
    lam = lambda step: 0.5 ** step  # noqa: E731 - same schedule on both
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(reference, lam)
    only_own_grads, lr_synced = True, True
    for step in range(STEPS):
        if step == ADD_AT:
            opt.add_param_group({"params": late_shard, "lr": kw["lr"] * 3})
            reference.add_param_group({"params": late_ref, "lr": kw["lr"] * 3})
            for s in (sched, ref_sched):  # torch 2.13 schedulers need one entry per group
                s.base_lrs.append(kw["lr"] * 3)
                s.lr_lambdas.append(lam)
        pairs = list(zip(shard, ref)) + (list(zip(late_shard, late_ref)) if step >= ADD_AT else [])
        for i, (ps, pr) in enumerate(pairs):
            if step == 1 and i == 2:  # no gradient anywhere: both optimizers must skip it
                ps.grad = pr.grad = None
                continue
            local = _grad(ps.shape, step, rank, i)
            total = local.clone()
            dist.all_reduce(total)
            avg = total / world
            ps.grad = local if zero2 else avg.clone()
            pr.grad = avg.clone()
        opt.step()
        reference.step()
        # the lr the local (shard) optimizer just used is the scheduled one on the wrapper
        lr_synced &= [g["lr"] for g in opt._local.param_groups] == [g["lr"] for g in opt.param_groups]
        if zero2:
            for ps, _ in pairs:
                if ps.grad is not None and opt.owner(ps) != rank:
                    only_own_grads = False
        sched.step()
        ref_sched.step()
        lr_synced &= [g["lr"] for g in opt.param_groups] == [g["lr"] for g in reference.param_groups]
        opt.zero_grad()
        reference.zero_grad()
    lr_synced &= opt._local.param_groups[0]["lr"] == kw["lr"] * 0.5 ** (STEPS - 1)
    all_params = list(zip(shard + late_shard, ref + late_ref))
    return {
        "mismatch": [i for i, (a, b) in enumerate(all_params) if not torch.equal(a, b)],
        "only_own_grads": only_own_grads,
        "lr_synced": lr_synced,
        "state_bytes": _state_bytes(opt),
        "ref_state_bytes": _state_bytes(reference),
        "owned_numel": opt.owned_numel(),
        "owners": [opt.owner(p) for p, _ in all_params],
    }


def zero_checks(rank, world_size):
    """Every check for one world size in one launch: ZeRO-1 and ZeRO-2 x AdamW and SGD, plus two
    sabotaged variants that must be caught."""
    torch.manual_seed(0)
    out = {f"{name}-zero{2 if z2 else 1}": _run(rank, world_size, name, z2)
           for name in OPTIMIZERS for z2 in (False, True)}
    out["gpt-like"] = _run(rank, world_size, "adamw", True, shapes=GPT_SHAPES)
    out["sabotage-no-broadcast"] = _run(rank, world_size, "adamw", False, _NoBroadcast)["mismatch"]
    out["sabotage-wrong-owner"] = _run(rank, world_size, "sgd", True, _WrongOwner)["mismatch"]
    try:
        ShardedOptimizer([torch.zeros(2, requires_grad=True)], torch.optim.SGD).state_dict()
        out["state_dict"] = "no error"
    except RuntimeError as exc:
        out["state_dict"] = str(exc)
    out["checkpoint"] = _checkpoint_roundtrip(rank)
    return out


def _checkpoint_roundtrip(rank):
    """consolidate_state_dict + state_dict on rank 0 equals the unsharded AdamW's state_dict
    bitwise; a fresh ShardedOptimizer loading that full state holds, on each rank, exactly the
    unsharded state of the parameters it owns."""
    shapes = [(5, 3), (7,), (4, 4), (2,)]
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    ref_params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = ShardedOptimizer([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
                           torch.optim.AdamW, lr=1e-2)
    ref = torch.optim.AdamW([{"params": ref_params[:2]}, {"params": ref_params[2:], "weight_decay": 0.0}], lr=1e-2)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]  # same on every rank
        for p, r, g in zip(params, ref_params, grads):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    opt.consolidate_state_dict(to=0)
    res = {}
    if rank == 0:
        mine, want = opt.state_dict(), ref.state_dict()
        res["groups_equal"] = [{k: v for k, v in g.items()} for g in mine["param_groups"]] == \
            [{k: v for k, v in g.items() if k != "param_names"} for g in want["param_groups"]]
        res["state_equal"] = sorted(mine["state"]) == sorted(want["state"]) and all(
            torch.equal(mine["state"][i][k], want["state"][i][k]) for i in want["state"] for k in want["state"][i])
    fresh = [torch.nn.Parameter(t.clone()) for t in start]
    loaded = ShardedOptimizer([{"params": fresh[:2]}, {"params": fresh[2:], "weight_decay": 0.0}],
                              torch.optim.AdamW, lr=1e-2)
    loaded.load_state_dict(ref.state_dict())
    owned = [i for i, p in enumerate(fresh) if loaded.owner(p) == rank]
    res["loaded_owned_only"] = sorted(id(p) for p in loaded.state) == sorted(id(fresh[i]) for i in owned)
    res["loaded_equal"] = all(torch.equal(loaded.state[fresh[i]]["exp_avg"], ref.state[ref_params[i]]["exp_avg"])
                              for i in owned)
    return res
