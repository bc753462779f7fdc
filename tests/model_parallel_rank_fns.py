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
    from course_lib.trainer.config import ConfigError

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

    from course_lib.parallel.ranks.launch import DistInfo
    from course_lib.parallel.mesh import build_mesh, mesh_layout
    from course_lib.parallel.composed.model_parallel import ModelParallel

    par = cfg["parallel"]
    mesh = build_mesh(mesh_layout(world_size, tp=par["tp"], pp=par["pp"]))
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo")
    strategy = ModelParallel(info, torch.device("cpu"), cfg, mesh=mesh)
    return {"coords": mesh.coords, "ranks": mesh.ranks, "kept": strategy.mesh is mesh,
            "dp": (strategy.dp_rank, strategy.dp_size)}


def refusals_then_train(rank, world_size, cases, root, runs, mesh_cfg, count_reads=()):
    """:func:`refusals`, :func:`explicit_mesh`, then :func:`train_then_resume` (every fresh run,
    every resume, the host reads of ``count_reads``), in one launch (starting 4 ranks is the slow
    part)."""
    return {"refusals": refusals(rank, world_size, cases, root), "mesh": explicit_mesh(rank, world_size, mesh_cfg),
            **train_then_resume(rank, world_size, runs, count_reads)}


def copy_without_newest(src: str, dst: str) -> None:
    """Rank 0 copies the run folder ``src`` to ``dst`` without its newest checkpoint (a resume of
    ``dst`` then starts from the one before); every rank waits for the copy. Call it after the run
    in ``src`` returned (its saves, async ones included, are complete by then)."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
        shutil.rmtree(sorted((Path(dst) / "checkpoints").glob("step_*"))[-1])
    dist.barrier()


def train_counting_reads(cfg: dict, out: str):
    """Train ``cfg`` fresh into ``out`` and count this rank's host reads per optimizer step on the
    way (tests/host_reads.reads_between_rows: the reads between consecutive metrics rows), so the
    run a test needs anyway is the counted one: no extra steps. Returns ``(TrainResult, {step:
    reads})`` for every step from 2 on (step 1 also holds the set-up's reads) but those that
    follow a checkpoint save (``checkpoint.save_every``), and with ``checkpoint.async_save`` none
    after the first save (its thread runs on into later steps): saves are counted in the
    checkpoint tests, not as a step's reads."""
    import course_lib.train as train_mod
    from host_reads import reads_between_rows

    steps, every = cfg["train"]["max_steps"], cfg["checkpoint"]["save_every"]
    saves = set(range(every, steps, every)) if every else set()
    last = min(saves, default=steps) if cfg["checkpoint"]["async_save"] else steps
    peak = train_mod._peak_flops
    train_mod._peak_flops = lambda cfg, device: 1e12  # set-up only; keeps the count to the loop
    box = {}
    try:
        per_step = reads_between_rows(lambda: box.setdefault("result", train_mod.train(cfg, out)))
    finally:
        train_mod._peak_flops = peak
    return box["result"], {s: n for s, n in per_step.items() if s - 1 not in saves and s <= last}


def weights_entry(rank: int, result) -> dict:
    """:func:`train_many`'s per-run report of a TrainResult (a collective: every rank calls it)."""
    full = result.strategy.full_weights()
    mesh = getattr(result.strategy, "mesh", None)
    return {"steps": result.steps, "resumed_from": result.resumed_from,
            "coords": mesh.coords if mesh is not None else None,
            "weights": {k: v.float().cpu().clone() for k, v in full.items()} if rank == 0 else None}


def train_then_resume(rank, world_size, runs, count_reads=(), entry=None):
    """Every fresh run, then every resume, in ONE launch (starting 4 ranks and the first train()
    in each process are the slow part). ``runs``: ``(cfg, out_dir)`` pairs, each trained fresh
    into ``out_dir + "/full"``; then ``full`` is copied to ``cut`` without its newest checkpoint and
    resumed with the same cfg. The fresh runs whose index is in ``count_reads`` also count the
    host reads per step (:func:`train_counting_reads`). Returns ``{"first": [...], "second":
    [...], "reads": {index: {step: reads}}}`` with :func:`train_many`'s entries, or what
    ``entry(rank, result)`` reports of each run."""
    from course_lib.train import train

    entry = entry or weights_entry
    first, reads = [], {}
    for i, (cfg, out) in enumerate(runs):
        if i in count_reads:
            result, reads[i] = train_counting_reads(cfg, out + "/full")
        else:
            result = train(cfg, out + "/full")
        first.append(entry(rank, result))
    return {"first": first, "second": resume_each(rank, runs, entry), "reads": reads}


def resume_each(rank, runs, entry=None) -> list:
    """For each ``(cfg, out_dir)`` whose fresh run is in ``out_dir + "/full"``: copy it to
    ``out_dir + "/cut"`` without its newest checkpoint, resume that with the same cfg, and report
    the result with ``entry(rank, result)`` (default :func:`weights_entry`)."""
    from course_lib.train import train

    entry = entry or weights_entry
    reports = []
    for cfg, out in runs:
        copy_without_newest(out + "/full", out + "/cut")
        reports.append(entry(rank, train(cfg, out + "/cut", resume=True)))
    return reports

