"""Rank functions for the sharded-checkpoint tests (spawned ranks import them from here)."""
import torch
import torch.distributed as dist
from torch import nn

from course_lib.checkpoint.dcp import load_sharded, save_sharded


class Position:
    """A per-rank data position with a state_dict (what a sampler would save)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _model_and_opt():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, rank, steps, seed):
    losses = []
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = model(x).pow(2).mean() + torch.rand(()) * 0  # touch the global RNG too
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
    return losses


def full_state(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def sharded_roundtrip(rank, world_size, root):
    """Train 3 steps, save sharded, train 3 more (the reference); then a fresh model loads the
    checkpoint and trains the same 3 steps: losses and weights must match exactly."""
    model, opt, sched = _model_and_opt()
    _train(model, opt, sched, rank, 3, seed=1)
    pos = Position(100 + rank)
    path = save_sharded(root, 3, model, opt, shared={"sched": sched}, per_rank={"pos": pos},
                        metrics={"loss": 1.5}, keep_last=2)
    torch.manual_seed(1234)  # what follows the save uses this RNG state...
    ref_losses = _train(model, opt, sched, rank, 3, seed=2)
    ref_state = full_state(model)
    path2 = save_sharded(root, 6, model, opt, shared={"sched": sched}, per_rank={"pos": pos}, keep_last=2)

    model2, opt2, sched2 = _model_and_opt()
    pos2 = Position(-1)
    res = None
    # load the step-3 checkpoint: hide the newer one first (rank 0 renames, everyone waits)
    if rank == 0:
        path2.rename(path2.with_name(".tmp-hidden"))
    dist.barrier()
    res = load_sharded(root, model2, opt2, shared={"sched": sched2}, per_rank={"pos": pos2})
    torch.manual_seed(1234)
    losses = _train(model2, opt2, sched2, rank, 3, seed=2)
    return {"path": str(path), "loaded_step": res.step, "pos": pos2.value, "metrics": res.metrics,
            "ref_losses": ref_losses, "losses": losses, "lr": sched2.get_last_lr(),
            "ref_lr": sched.get_last_lr(),
            "weights_equal": all(torch.equal(ref_state[k], v) for k, v in full_state(model2).items())}


def sharded_corrupt_fallback(rank, world_size, root):
    """Two sharded saves; rank 0 flips a byte in the newest; loading falls back to the older."""
    import warnings

    model, opt, sched = _model_and_opt()
    _train(model, opt, sched, rank, 1, seed=1)
    save_sharded(root, 1, model, opt)
    _train(model, opt, sched, rank, 1, seed=1)
    newest = save_sharded(root, 2, model, opt)
    if rank == 0:
        shard = sorted(p for p in newest.iterdir() if p.suffix == ".distcp")[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    model2, opt2, _ = _model_and_opt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = load_sharded(root, model2, opt2)
    return {"step": res.step, "warned": any("unusable" in str(w.message) for w in caught)}


def sharded_all(rank, world_size, root):
    """Both checks in one launch (starting ranks is the slow part on 2 cores)."""
    import os
    return {"roundtrip": sharded_roundtrip(rank, world_size, os.path.join(root, "a")),
            "corrupt": sharded_corrupt_fallback(rank, world_size, os.path.join(root, "b"))}
