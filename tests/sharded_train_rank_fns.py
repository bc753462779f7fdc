"""Rank functions for tests/test_train_sharded.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_and_report(rank, world_size, cfg, out_dir, resume=False, faults=()):
    """One rank of a trainer run (``faults``: ``--inject-fault`` specs): steps, the final loss and
    (rank 0) the full weights, gathered through the strategy where they are sharded."""
    from course_lib.train import train

    result = train(cfg, out_dir, resume=resume, faults=list(faults))
    full = result.strategy.full_weights()  # a collective: every rank calls it
    return {"steps": result.steps, "resumed_from": result.resumed_from, "final_loss": result.final_loss,
            "weights": {k: v.float().cpu().clone() for k, v in full.items()} if rank == 0 else None}


def train_many(rank, world_size, runs):
    """Several trainer runs in one launch (each ``(cfg, out_dir, resume[, faults])``): the process
    start and the group set-up are paid once. Returns one report per run (see train_and_report)."""
    return [train_and_report(rank, world_size, *run) for run in runs]


def train_killed_in_async_save(rank, world_size, cfg, out_dir, kill_step):
    """A trainer run with async sharded saves whose rank 1 is SIGKILLed in the middle of the
    background write of the step-``kill_step`` checkpoint: after DCP wrote every shard and
    ``.metadata``, as rank 1 starts writing its own ``rank1.pt``. Never returns (run_ranks raises
    RankFailedError)."""
    import os
    import signal
    import time
    from pathlib import Path

    from course_lib.checkpoint import io as cio
    from course_lib.train import train

    real_write = cio.write_durable
    torn = f".tmp-step_{kill_step:09d}-"

    def killing_write(path, data):
        path = Path(path)
        if rank == 1 and path.name == "rank1.pt" and path.parent.name.startswith(torn):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(path, data)

    cio.write_durable = killing_write
    try:
        train(cfg, out_dir)
    except BaseException:  # rank 0 losing its peer: wait to be killed with the group, as torchrun does
        if rank == 0:
            time.sleep(120)
        raise
    raise AssertionError(f"rank {rank} finished a run that should have been killed at step {kill_step}")


def train_many_then_killed(rank, world_size, runs, report_path, killed_cfg, killed_out, kill_step):
    """:func:`train_many`, its reports saved by rank 0 to ``report_path`` (``torch.save``), then
    :func:`train_killed_in_async_save` in the same launch (which ends it): one process start
    fewer than a launch of its own."""
    import torch
    import torch.distributed as dist

    reports = train_many(rank, world_size, runs)
    if rank == 0:
        torch.save(reports, report_path)
    dist.barrier()
    train_killed_in_async_save(rank, world_size, killed_cfg, killed_out, kill_step)


def fsdp_refuses_a_model_without_blocks(rank, world_size):
    """The FSDP2 strategy's error for a module that has no ``blocks`` to shard."""
    import torch
    from torch import nn

    from course_lib.parallel.data_parallel.fsdp2 import FSDP2
    from course_lib.parallel.ranks.launch import init_distributed

    info = init_distributed(backend="gloo")
    strategy = FSDP2(info, torch.device("cpu"))
    try:
        strategy.setup(nn.Sequential(nn.Linear(4, 4)), lambda m: torch.optim.AdamW(m.parameters()))
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def resume_into_other_formats(rank, world_size, cases, root):
    """Per case ``(name, [(cfg, resume[, "copied"]), ...], cfg_resumed)`` under ``root/name``: the
    runs that fill the folder, then ``--resume auto`` with ``cfg_resumed``, expecting a ConfigError.
    A fill marked "copied" trains a folder of its own beside it, whose step directories the folder
    lacks rank 0 then copies in (a second fresh run into the folder itself is refused). Returns
    ``{name: (message or None, the folder's step directories and metrics.jsonl before, after)}``."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.train import train
    from course_lib.trainer.config import ConfigError

    def snapshot(folder):
        steps = sorted(p.name for p in (folder / "checkpoints").iterdir())
        return steps, (folder / "metrics.jsonl").read_bytes(), (folder / "config.json").read_bytes()

    out = {}
    for name, fills, resumed in cases:
        folder = Path(root) / name
        for c, resume, *copied in fills:
            if not copied:
                train(c, folder, resume=resume)
                continue
            side = folder.with_name(f"{name}-copied")
            train(c, side, resume=resume)
            dist.barrier()
            if rank == 0:
                for step_dir in sorted((side / "checkpoints").glob("step_*")):
                    if not (folder / "checkpoints" / step_dir.name).exists():
                        shutil.copytree(step_dir, folder / "checkpoints" / step_dir.name)
        dist.barrier()
        before = snapshot(folder)
        message = None
        try:
            train(resumed, folder, resume=True)
        except ConfigError as exc:
            message = str(exc)
        dist.barrier()
        out[name] = (message, before, snapshot(folder))
    return out


def bundle_stats_with_empty_shards(rank, world_size):
    """The non-finite guard's per-tensor statistics (the diagnostic bundle's ``grads``) of an FSDP2
    model whose first layer (1 output row) leaves rank 1 with empty gradient shards, after an Inf
    was injected into ``0.bias`` (one element, on rank 0). Returns ``(local shard shapes, stats,
    the error of an inf_grad that names a gradient no rank holds)``."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_lib.stability.faults import FaultInjector
    from course_lib.stability.nonfinite import NonFiniteGuard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Linear(1, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    model(torch.randn(2, 4)).sum().backward()
    FaultInjector(["inf_grad@0=0.bias"]).on_grads(model, 0)
    shapes = {n: tuple(p.grad.to_local().shape) for n, p in model.named_parameters()}
    stats = NonFiniteGuard()._grad_stats(model, {})
    try:
        FaultInjector(["inf_grad@1=2.weight"]).on_grads(model, 1)  # no such parameter anywhere
        missing = None
    except ValueError as exc:
        missing = str(exc)
    return shapes, stats, missing


def train_many_then_stats(rank, world_size, runs):
    """:func:`train_many`, then :func:`bundle_stats_with_empty_shards`, in one launch."""
    return train_many(rank, world_size, runs), bundle_stats_with_empty_shards(rank, world_size)


def train_many_stats_then_killed(rank, world_size, runs, report_path, killed_cfg, killed_out, kill_step):
    """:func:`train_many` and :func:`bundle_stats_with_empty_shards`, saved by rank 0 to
    ``report_path`` as ``(reports, [stats of every rank])``, then
    :func:`train_killed_in_async_save` in the same launch (which ends it): every 2-rank check of
    tests/test_train_sharded.py that needs no earlier launch shares this one process start."""
    import torch
    import torch.distributed as dist

    reports = train_many(rank, world_size, runs)
    stats = [None] * world_size
    dist.all_gather_object(stats, bundle_stats_with_empty_shards(rank, world_size))
    if rank == 0:
        torch.save((reports, stats), report_path)
    dist.barrier()
    train_killed_in_async_save(rank, world_size, killed_cfg, killed_out, kill_step)
