"""Rank functions for tests/test_train_fsdp_tp.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations

import shutil
from pathlib import Path


def full_state(strategy) -> dict | None:
    """The model and optimizer state in the dense layout, on rank 0 (None elsewhere): ``{"model":
    {name: tensor}, "optim": {"state": {name: {...}}, "param_groups": [...]}}``, CPU copies. A
    collective where the state is sharded: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer, options=opts)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None

    def cpu(v):
        return v.detach().float().cpu().clone() if hasattr(v, "detach") else v

    return {"model": {k: cpu(v) for k, v in model_sd.items()},
            "optim": {"state": {k: {n: cpu(t) for n, t in s.items()} for k, s in optim_sd["state"].items()},
                      "param_groups": optim_sd["param_groups"]}}


def census_after_backward(strategy, vocab_size: int, micro_batch: int, seq_len: int) -> dict:
    """Model-state bytes on this rank with gradients present: one forward/backward on a fixed
    batch through the strategy (the trainer's loop leaves none after zero_grad), the census, then
    the gradients dropped again."""
    import contextlib

    import torch

    from course_lib.parallel.memory_census import model_state_bytes_on_rank

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size, (micro_batch, seq_len), generator=g)
    y = torch.randint(0, vocab_size, (micro_batch, seq_len), generator=g)
    strategy.forward_backward([(x, y)], autocast=contextlib.nullcontext, on_loss=lambda loss: loss,
                              backward=lambda loss: loss.backward())
    census = model_state_bytes_on_rank(strategy.model, strategy.optimizer).to_dict()
    strategy.zero_grad()
    return census


def _copy_on_rank0(src: str, dst: str, drop_newest: bool) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
        if drop_newest:  # the resume then starts from the checkpoint before
            shutil.rmtree(sorted((Path(dst) / "checkpoints").glob("step_*"))[-1])
    dist.barrier()


def device_mesh_matches_kit_mesh(rank, world_size) -> dict:
    """The torch DeviceMeshes the strategy builds (dp x tp, and dp x cp x tp with its flattened
    dp_cp dim) hold, along each dim, the same global ranks as course_lib.parallel.mesh's groups."""
    from course_lib.parallel.composed.fsdp_tp import build_device_mesh
    from course_lib.parallel.mesh import MeshLayout

    out = {}
    for layout in (MeshLayout(dp=2, tp=2), MeshLayout(dp=1, cp=2, tp=2)):
        mesh = build_device_mesh("cpu", layout)
        dims = ("dp", "cp", "tp", "dp_cp") if layout.cp > 1 else ("dp", "tp")
        for dim in dims:
            torch_ranks = mesh[dim].mesh.flatten().tolist()
            kit = next(g for g in layout.group_ranks(dim) if rank in g)
            out[(layout.shape, dim)] = (torch_ranks, kit)
    return out


def fresh_then_loads(rank, world_size, fresh, short, to_fsdp, faulty=None, cp_run=None):
    """Every 4-rank run of the test in one launch (starting ranks and each process's first train()
    are the slow part):

    1. ``fresh = (cfg, out)``: fsdp x tp trains, its host reads per step counted on the way
       (model_parallel_rank_fns.train_counting_reads); its final state, coordinates and byte census;
    2. ``short``: more ``(name, cfg, out)`` runs (sequence parallel, bf16): their final weights;
    3. the resume: a copy of ``out`` without its newest checkpoint, resumed with the same cfg;
    4. the cross-layout chain, ``to_fsdp = (cfg_load, cfg_more, out)``: plain FSDP2 on 4 ranks
       loads the fsdp x tp checkpoint (``cfg_load``: max_steps = the saved step, trains nothing),
       then trains on from it and saves (``cfg_more``).
    5. ``faulty = (cfg, out, faults)``: another copy of ``out`` without its newest checkpoint,
       resumed with injected faults (skip, roll-back): the spike detector's window comes from the
       checkpoint, so the faults can sit in the last steps;
    6. :func:`device_mesh_matches_kit_mesh`;
    7. ``cp_run = (cfg, out)``: fsdp x cp trains, counting its host reads per step on the way, then
       resumes from the checkpoint before its last (bit-exact).
    Returns a dict per rank (states on rank 0 only)."""
    import course_lib.train as train_mod
    from model_parallel_rank_fns import copy_without_newest, train_counting_reads

    cfg, out = fresh
    res, reads = train_counting_reads(cfg, out)
    report = {"host_reads_per_step": reads, "coords": res.strategy.coords, "dp": (res.strategy.dp_rank, res.strategy.dp_size),
              "strategy": type(res.strategy).__name__, "fresh": full_state(res.strategy),
              "census": census_after_backward(res.strategy, cfg["data"]["vocab_size"],
                                              cfg["train"]["micro_batch"], cfg["data"]["seq_len"])}
    report["short"] = {}
    for name, c, o in short:
        r = train_mod.train(c, o)
        report["short"][name] = full_state(r.strategy)

    cut = out + "-cut"
    copy_without_newest(out, cut)
    res = train_mod.train(cfg, cut, resume=True)
    report["resume"] = {"resumed_from": res.resumed_from, "steps": res.steps, "state": full_state(res.strategy)}

    cfg_load, cfg_more, out4 = to_fsdp
    _copy_on_rank0(out, out4, drop_newest=False)
    res = train_mod.train(cfg_load, out4, resume=True)
    report["fsdp4_loaded"] = {"resumed_from": res.resumed_from, "strategy": type(res.strategy).__name__,
                              "state": full_state(res.strategy)}
    res = train_mod.train(cfg_more, out4, resume=True)
    report["fsdp4_more"] = {"resumed_from": res.resumed_from, "steps": res.steps, "state": full_state(res.strategy)}
    if faulty is not None:
        c, o, faults = faulty
        copy_without_newest(out, o)
        res = train_mod.train(c, o, resume=True, faults=faults)
        report["faulty"] = {"steps": res.steps, "rollbacks": res.rollbacks, "skipped": res.skipped_steps,
                            "resumed_from": res.resumed_from}
    report["meshes"] = device_mesh_matches_kit_mesh(rank, world_size)
    if cp_run is not None:
        c, o = cp_run
        res, reads = train_counting_reads(c, o)
        fresh_cp = {"coords": res.strategy.coords, "strategy": type(res.strategy).__name__,
                    "state": full_state(res.strategy)}
        copy_without_newest(o, o + "-cut")
        res = train_mod.train(c, o + "-cut", resume=True)
        report["cp"] = {"fresh": fresh_cp, "resumed_from": res.resumed_from, "steps": res.steps,
                        "resumed": full_state(res.strategy), "host_reads_per_step": reads}
    return report


def single_loads(rank, world_size, runs):
    """One process loads sharded checkpoints written on 4 ranks: each ``(cfg, src, dst)`` copies
    ``src`` to ``dst`` and resumes it with max_steps = the saved step (trains nothing)."""
    from course_lib.train import train

    out = []
    for cfg, src, dst in runs:
        shutil.copytree(src, dst)
        res = train(cfg, dst, resume=True)
        out.append({"resumed_from": res.resumed_from, "strategy": type(res.strategy).__name__,
                    "state": full_state(res.strategy)})
    return out


def train_states(rank, world_size, runs):
    """Each ``(cfg, out)`` trained fresh: its :func:`full_state` (rank 0; None elsewhere)."""
    from course_lib.train import train

    return [full_state(train(cfg, out).strategy) for cfg, out in runs]
