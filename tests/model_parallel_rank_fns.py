"""Rank functions for tests/test_train_model_parallel.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_many(rank, world_size, runs):
    """Several trainer runs in one launch (each ``(cfg, out_dir, resume[, faults])``), so the 4
    ranks start once. Per run: steps, where it resumed from, and (rank 0) the dense weights
    gathered through the strategy, plus this rank's mesh coordinates."""
    from course_lib.train import train

    out = []
    for cfg, out_dir, resume, *faults in runs:
        result = train(cfg, out_dir, resume=resume, faults=list(faults[0]) if faults else ())
        full = result.strategy.full_weights()  # a collective: every rank calls it
        mesh = getattr(result.strategy, "mesh", None)
        out.append({"steps": result.steps, "resumed_from": result.resumed_from,
                    "coords": mesh.coords if mesh is not None else None,
                    "weights": {k: v.float().cpu().clone() for k, v in full.items()} if rank == 0 else None})
    return out


def refusals(rank, world_size, cases, root):
    """Each ``(name, cfg)`` is expected to stop with a ConfigError before any file exists: returns
    {name: (message or None, whether the run folder exists)} per rank."""
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.train import train
    from course_lib.train_config import ConfigError

    out = {}
    for name, cfg in cases:
        run = Path(root) / name
        try:
            train(cfg, run)
            message = None
        except ConfigError as exc:
            message = str(exc)
        dist.barrier()
        out[name] = (message, run.exists())
    return out


def explicit_mesh(rank, world_size, cfg):
    """A mesh built by the caller and handed to the strategy (no global mesh): this rank's
    coordinates and the global ranks of its groups, and whether the strategy kept that object."""
    import torch

    from course_lib.parallel.launch import DistInfo
    from course_lib.parallel.mesh import build_mesh, mesh_layout
    from course_lib.parallel.model_parallel_strategy import ModelParallel

    par = cfg["parallel"]
    mesh = build_mesh(mesh_layout(world_size, tp=par["tp"], pp=par["pp"]))
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo")
    strategy = ModelParallel(info, torch.device("cpu"), cfg, mesh=mesh)
    return {"coords": mesh.coords, "ranks": mesh.ranks, "kept": strategy.mesh is mesh,
            "dp": (strategy.dp_rank, strategy.dp_size)}


def refusals_then_train(rank, world_size, cases, root, runs, mesh_cfg):
    """:func:`refusals`, :func:`explicit_mesh`, then :func:`train_many`, in one launch (starting 4
    ranks is the slow part)."""
    return {"refusals": refusals(rank, world_size, cases, root), "mesh": explicit_mesh(rank, world_size, mesh_cfg),
            "runs": train_many(rank, world_size, runs)}
