"""Rank functions for the sharded-checkpoint tests (spawned ranks import them from here).

Starting ranks is the slow part on 2 cores, so :func:`sharded_all` runs every 2-rank check in one
launch and :func:`sharded_load_one_rank` is the single 1-rank launch (resharding 2 -> 1)."""
import contextlib
import json
import os
import pickle
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from course_lib.checkpoint import io as cio
from course_lib.checkpoint.dcp import load_sharded, save_sharded


class Position:
    """A per-rank data position with a state_dict (what a sampler would save)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _model_and_opt(fsdp=True):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    if fsdp:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, rank, steps, seed, replicated=False):
    losses = []
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = model(x).pow(2).mean() + torch.rand(()) * 0  # touch the global RNG too
        loss.backward()
        if replicated:  # a plain replicated module: average the gradients by hand (what DDP does)
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        sched.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
    return losses


def _plain(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_state(model):
    return {k: _plain(v) for k, v in model.state_dict().items()}


def full_optim(model, opt):
    """The optimizer state as full tensors keyed by parameter name (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    _, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {fqn: {k: _plain(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for fqn, st in osd["state"].items()}


def same(a, b):
    """Equal nested dicts of tensors / numpy arrays / plain values (bit for bit)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def to_numpy(tree):
    """Tensors -> numpy arrays for results handed back by run_ranks: a tensor sent over the pipe
    goes through torch's shared-memory reduction, which the parent can no longer open once the
    rank has exited."""
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy().copy()
    return tree


def _warned(caught, needle):
    return [str(w.message) for w in caught if needle in str(w.message)]


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _expect_error(fn, *args, **kwargs):
    """Run a collective that must fail: ``(exception type name, message, seconds)``."""
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as e:  # the type is checked by the test
        return {"type": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0,
                "failures": [n for n, _ in getattr(e, "failures", [])]}
    return {"type": None, "msg": "", "seconds": time.monotonic() - t0, "failures": []}


@contextlib.contextmanager
def _disk_full_on_rank1(rank):
    """On rank 1 only: writing its ``rank1.pt`` raises ENOSPC (every other write goes through)."""
    from pathlib import Path

    real_write = cio.write_durable
    if rank == 1:
        def broken_write(path, data):
            if Path(path).name == "rank1.pt":
                raise OSError(28, "No space left on device")
            return real_write(path, data)
        cio.write_durable = broken_write
    try:
        yield
    finally:
        cio.write_durable = real_write


def sharded_roundtrip(rank, world_size, root):
    """Train 3 steps, save sharded, train 3 more (the reference); then a fresh model loads the
    checkpoint and trains the same 3 steps: losses and weights must match exactly."""
    model, opt, sched = _model_and_opt()
    _train(model, opt, sched, rank, 3, seed=1)
    pos = Position(100 + rank)
    path = save_sharded(root, 3, model, opt, shared={"sched": sched}, per_rank={"pos": pos},
                        metrics={"loss": 1.5}, keep_last=2)
    saved_weights, saved_optim = full_state(model), full_optim(model, opt)
    torch.manual_seed(1234)  # what follows the save uses this RNG state...
    ref_losses = _train(model, opt, sched, rank, 3, seed=2)
    ref_state = full_state(model)
    path2 = save_sharded(root, 6, model, opt, shared={"sched": sched}, per_rank={"pos": pos}, keep_last=2)

    model2, opt2, sched2 = _model_and_opt()
    pos2 = Position(-1)
    # load the step-3 checkpoint: hide the newer one first (rank 0 renames, everyone waits)
    if rank == 0:
        path2.rename(path2.with_name(".tmp-hidden"))
    dist.barrier()
    res = load_sharded(root, model2, opt2, shared={"sched": sched2}, per_rank={"pos": pos2})
    loaded_weights, loaded_optim = full_state(model2), full_optim(model2, opt2)
    torch.manual_seed(1234)
    losses = _train(model2, opt2, sched2, rank, 3, seed=2)
    return {"path": str(path), "loaded_step": res.step, "name": res.path.name, "pos": pos2.value,
            "metrics": res.metrics, "ref_losses": ref_losses, "losses": losses, "lr": sched2.get_last_lr(),
            "ref_lr": sched.get_last_lr(),
            "weights_equal": all(torch.equal(ref_state[k], v) for k, v in full_state(model2).items()),
            "loaded_equal_saved": same(saved_weights, loaded_weights) and same(saved_optim, loaded_optim),
            # for the 1-rank reshard load in the test (tiny tensors)
            "saved_weights": to_numpy(saved_weights) if rank == 0 else None,
            "saved_optim": to_numpy(saved_optim) if rank == 0 else None}


def sharded_corrupt_fallback(rank, world_size, root):
    """Two sharded saves; rank 0 flips a byte in the newest; loading falls back to the older and
    moves the corrupt one aside (.corrupt-*). Then the older is corrupt too: loading refuses,
    naming it and the quarantined one (it does not start fresh)."""
    from pathlib import Path

    model, opt, sched = _model_and_opt()
    _train(model, opt, sched, rank, 1, seed=1)
    older = save_sharded(root, 1, model, opt)
    _train(model, opt, sched, rank, 1, seed=1)
    newest = save_sharded(root, 2, model, opt)
    if rank == 0:
        _flip(sorted(p for p in newest.iterdir() if p.suffix == ".distcp")[0])
    dist.barrier()
    model2, opt2, _ = _model_and_opt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = load_sharded(root, model2, opt2)
    out = {"step": res.step, "warned": bool(_warned(caught, "unusable")),
           "after_fallback": sorted(p.name[:len(".corrupt-step_000000002")] if p.name.startswith(".corrupt-")
                                    else p.name for p in Path(root).iterdir())}
    dist.barrier()  # every rank has finished reading step 1 before rank 0 damages it
    if rank == 0:
        _flip(older / "rank1.pt")
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["all_corrupt"] = _expect_error(load_sharded, root, model2, opt2)
    return out


class Payload:
    """What an attacker plants: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_metadata(ckpt, marker):
    """Replace ``ckpt/.metadata`` by the real metadata with a payload inside, and recompute the
    manifest's checksums as an attacker would."""
    from course_lib.checkpoint.dcp_trust import read_metadata_file

    meta = read_metadata_file(ckpt / ".metadata")  # the restricted reader: the genuine file passes
    meta.storage_meta = Payload(marker)
    blob = pickle.dumps(meta)
    (ckpt / ".metadata").write_bytes(blob)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"sha256": cio.sha256_hex(blob), "bytes": len(blob)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def sharded_planted_metadata(rank, world_size, root):
    """A .metadata carrying a __reduce__ payload (checksums forged): never unpickled. Newest
    forged: fall back to the older with a warning; every one forged: refuse. Nothing runs."""
    from pathlib import Path

    marker = Path(root) / "pwned"
    model, opt, sched = _model_and_opt()
    older = save_sharded(root, 1, model, opt)
    newest = save_sharded(root, 2, model, opt)
    if rank == 0:
        _plant_metadata(newest, marker)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = load_sharded(root, model, opt)
    out = {"step": res.step, "warnings": _warned(caught, "step_000000002")}
    dist.barrier()  # every rank has finished reading step 1 before rank 0 forges it
    if rank == 0:
        _plant_metadata(older, marker)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["refused"] = _expect_error(load_sharded, root, model, opt)
    # the reader itself refuses too (a directory loaded straight through DCP, no manifest check)
    from course_lib.checkpoint.dcp_trust import RestrictedFileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    try:
        aside = next(Path(root).glob(f".corrupt-{older.name}-*"))  # moved aside by the refused load
        dcp_load({"model": msd, "optim": osd}, storage_reader=RestrictedFileSystemReader(str(aside)))
        out["reader"] = ""
    except BaseException as e:  # DCP wraps what the reader raised in a CheckpointException (a BaseException)
        out["reader"] = str(e)
    dist.barrier()
    out["marker"] = marker.exists()
    out["quarantined"] = sorted(p.name.split("-")[1] for p in Path(root).glob(".corrupt-*"))
    return out


def sharded_fail_fast(rank, world_size, root):
    """Rank 1 fails inside save_sharded (writing its rank file; then in get_state_dict): every
    rank raises promptly naming rank 1, nothing appears under a final name, and the group is
    still usable for a good save afterwards."""
    from pathlib import Path
    from torch.distributed.checkpoint import state_dict as sd_mod

    model, opt, sched = _model_and_opt()
    out = {}
    real_get = sd_mod.get_state_dict
    with _disk_full_on_rank1(rank):
        out["write"] = _expect_error(save_sharded, root, 1, model, opt)
    if rank == 1:
        def broken_get(*a, **k):
            raise RuntimeError("state dict exploded")
        sd_mod.get_state_dict = broken_get
    try:
        out["get_state_dict"] = _expect_error(save_sharded, root, 2, model, opt)
    finally:
        sd_mod.get_state_dict = real_get
    dist.barrier()
    out["left"] = sorted(p.name for p in Path(root).iterdir()) if rank == 0 else None
    good = save_sharded(root, 3, model, opt)
    out["good"] = good.name
    return out


def sharded_replicated(rank, world_size, root):
    """A plain replicated module (no FSDP) saves and loads through the same path."""
    model, opt, sched = _model_and_opt(fsdp=False)
    _train(model, opt, sched, rank, 2, seed=1, replicated=True)
    save_sharded(root, 2, model, opt, shared={"sched": sched})
    weights, optim = full_state(model), full_optim(model, opt)
    model2, opt2, sched2 = _model_and_opt(fsdp=False)
    res = load_sharded(root, model2, opt2, shared={"sched": sched2})
    # another model shape: refused by name on every rank before any weight is touched
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    before = full_state(other)
    wrong = _expect_error(load_sharded, root, other, torch.optim.AdamW(other.parameters()))
    wrong["untouched"] = same(before, full_state(other))
    return {"step": res.step, "equal": same(weights, full_state(model2)) and same(optim, full_optim(model2, opt2)),
            "lr": sched2.get_last_lr() == sched.get_last_lr(), "wrong_shape": wrong}


def sharded_async(rank, world_size, root):
    """AsyncShardedSaver on 2 ranks. Save at step 2 with the background write held back until
    the training thread has trained 2 more steps (weights and Adam state changed in place) and
    rank 1's own file delayed by 1 s more; both ranks then train 2 more steps while the
    background write and commit run (collectives on both groups at once). A watcher thread on
    rank 0 notes when the final name appears. Then a save whose background write fails on rank 1
    (disk full), then a good one."""
    import threading
    from pathlib import Path

    import course_lib.checkpoint.dcp_async as dcp_async
    from course_lib.checkpoint.dcp_async import AsyncShardedSaver

    model, opt, sched = _model_and_opt()
    _train(model, opt, sched, rank, 2, seed=1)
    pos = Position(7 + rank)
    saved_weights, saved_optim = full_state(model), full_optim(model, opt)
    saved_lr = sched.get_last_lr()
    trained = threading.Event()
    times = {}
    real_write_rank_state, real_write = dcp_async.write_rank_state, cio.write_durable

    def held_write(tmp, prepared, r, group):
        trained.wait(60)  # a write that read the live tensors would now save the changed ones
        real_write_rank_state(tmp, prepared, r, group)

    def slow_write(path, data):  # rank 1's rank file, written in the background thread
        if Path(path).name == "rank1.pt":
            time.sleep(1.0)
            real_write(path, data)
            times["rank1_written"] = time.monotonic()
            return None
        return real_write(path, data)

    final = Path(root) / "step_000000002"

    def watch():  # the moment the commit's rename becomes visible (it must, within 60 s)
        deadline = time.monotonic() + 60
        while "seen" not in times and time.monotonic() < deadline:
            if final.exists():
                times["seen"] = time.monotonic()
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    if rank == 0:
        watcher.start()
    dcp_async.write_rank_state = held_write
    if rank == 1:
        cio.write_durable = slow_write
    saver = AsyncShardedSaver()
    out = {}
    try:
        t0 = time.monotonic()
        saver.save(root, 2, model, opt, shared={"sched": sched}, per_rank={"pos": pos}, keep_last=2)
        out["save_s"] = time.monotonic() - t0
        out["in_flight_after_save"] = saver.in_flight
        _train(model, opt, sched, rank, 2, seed=2)  # the state changes while the save is pending
        trained.set()
        _train(model, opt, sched, rank, 2, seed=3)  # training collectives during the background ones
        out["path"] = saver.wait().name
    finally:
        dcp_async.write_rank_state, cio.write_durable = real_write_rank_state, real_write
    dist.barrier()
    if rank == 0:
        watcher.join()
        out["manifest_files"] = sorted(json.loads((final / "manifest.json").read_text())["files"])
    out["times"] = times
    model2, opt2, sched2 = _model_and_opt()
    pos2 = Position(-1)
    res = load_sharded(root, model2, opt2, shared={"sched": sched2}, per_rank={"pos": pos2})
    out["loaded"] = {"step": res.step, "pos": pos2.value, "lr": sched2.get_last_lr() == saved_lr,
                     "equal": same(saved_weights, full_state(model2)) and same(saved_optim, full_optim(model2, opt2))}

    # a background write that fails on rank 1: every rank's wait() raises, nothing is committed
    with _disk_full_on_rank1(rank):
        saver.save(root, 6, model, opt, shared={"sched": sched}, per_rank={"pos": pos}, keep_last=2)
        out["failed"] = _expect_error(saver.wait)
    dist.barrier()
    out["after_failure"] = sorted(p.name for p in Path(root).iterdir()) if rank == 0 else None
    saver.save(root, 7, model, opt, keep_last=2)
    saver.close()
    out["kept"] = sorted(p.name for p in Path(root).iterdir()) if rank == 0 else None
    return out


def sharded_all(rank, world_size, root):
    """Every 2-rank check in one launch (starting ranks is the slow part on 2 cores)."""
    return {"roundtrip": sharded_roundtrip(rank, world_size, os.path.join(root, "a")),
            "corrupt": sharded_corrupt_fallback(rank, world_size, os.path.join(root, "b")),
            "planted": sharded_planted_metadata(rank, world_size, os.path.join(root, "c")),
            "replicated": sharded_replicated(rank, world_size, os.path.join(root, "d")),
            "fail_fast": sharded_fail_fast(rank, world_size, os.path.join(root, "e")),
            "async": sharded_async(rank, world_size, os.path.join(root, "f"))}


def sharded_load_one_rank(rank, world_size, root):
    """Load a checkpoint saved by 2 ranks on 1 rank (DCP reshards): full weights and optimizer."""
    model, opt, _ = _model_and_opt()
    res = load_sharded(root, model, opt)
    return {"step": res.step, "weights": to_numpy(full_state(model)), "optim": to_numpy(full_optim(model, opt))}
