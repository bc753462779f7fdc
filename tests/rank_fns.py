"""Rank functions for the launcher tests (spawned ranks import them from here)."""
import os
import threading
import time

import torch
import torch.distributed as dist


def rank_and_sum(rank, world_size, offset=0):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t.item(), "offset": offset}


def fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()  # rank 0 would wait here forever: the launcher must kill it
    return rank


def peer_loss_first_then_the_cause(rank, world_size):
    """Rank 0 reports a gloo-style "peer gone" error at once, rank 1 the real cause 0.5 s later:
    the order a crashed rank and its stranded peer often reach the launcher in."""
    import time

    if rank == 0:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection closed by peer [127.0.0.1]:1234")
    time.sleep(0.5)
    raise ValueError("planted failure on rank 1")


def write_pid_then_sleep(rank, world_size, folder):
    with open(os.path.join(folder, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def die_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def crash_after_returning(rank, world_size):
    """Return a result, then abort the process while the launcher is tearing down."""
    threading.Timer(0.3, os.abort).start()
    return rank * 7


def tensors_back(rank, world_size):
    """Tensors (and a dict of them) as a result: they must reach the caller whole."""
    return {"rank": torch.full((3,), float(rank)), "big": torch.arange(100_000, dtype=torch.float32) * rank}


def say_hello(rank, world_size):
    print(f"hello from rank {rank}")
    return None


def unpicklable_result(rank, world_size):
    return threading.Lock()


def train_rank(rank, world_size, cfg, out_dir):
    """One rank of a DDP training run (tests/test_train.py)."""
    from course_lib.train import train

    result = train(cfg, out_dir)
    return {"steps": result.steps, "final_loss": result.final_loss}


def train_rank_digest(rank, world_size, cfg, out_dir, faults=(), slow_save_s=0.0):
    """One rank of a training run; returns what it did and a digest of its weights, so a test can
    check that the replicas are bit-identical. ``slow_save_s``: the background half of every
    checkpoint save first sleeps this long (slow storage), so a save is still in flight when the
    next steps run."""
    from course_lib.train import train

    if slow_save_s:
        import time

        from course_lib.checkpoint.manager import CheckpointManager

        finish = CheckpointManager._finish

        def slow_finish(self, *args, **kwargs):
            time.sleep(slow_save_s)
            return finish(self, *args, **kwargs)
        CheckpointManager._finish = slow_finish

    result = train(cfg, out_dir, faults=list(faults))
    return {"steps": result.steps, "final_loss": result.final_loss, "rollbacks": result.rollbacks,
            "skipped": result.skipped_steps, "digest": param_digest(result.model)}


def cli_rank(rank, world_size, argv):
    """One rank of ``python -m course_lib.train ARGV`` (the command line torchrun would start, the
    same config from the same flags) in a launch of run_ranks; returns the exit code."""
    from course_lib.train import main

    return main(list(argv))


def resume_rank_digest(rank, world_size, cfg, out_dir):
    """One rank of a resumed run (``resume=True``)."""
    from course_lib.train import train

    result = train(cfg, out_dir, resume=True)
    return {"resumed_from": result.resumed_from, "steps": result.steps, "digest": param_digest(result.model)}


def host_reads_on_rank(rank, world_size, cfg, out_dir, steps=10):
    """Host reads per optimizer step made by course_lib on this rank of a DDP run (runs of ``steps``
    and ``2 * steps`` steps)."""
    import os

    from host_reads import reads_per_step
    import course_lib.train as train_mod

    train_mod._peak_flops = lambda cfg, device: 1e12  # set-up only; keeps the count to the loop

    def run(steps):
        overrides = {**cfg, "train": {**cfg["train"], "max_steps": steps}}
        train_mod.train(overrides, os.path.join(out_dir, f"r{steps}"))

    return reads_per_step(run, steps=steps)


def param_digest(model) -> str:
    """A sha256 over every parameter and buffer (names, shapes and bytes, full tensors for
    DTensors): equal digests on two ranks mean bit-identical replicas."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        t = t.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def several(rank, world_size, calls):
    """Several rank functions in one launch, one after the other (each ``(fn, args)``, ``fn`` a
    module-level rank function): the process start, the imports and the group set-up (seconds per
    rank on a CPU) are paid once instead of once per function. Returns one result per call."""
    return [fn(rank, world_size, *args) for fn, args in calls]


def host_reads_on_rank_many(rank, world_size, cfgs, out_dir, steps=10):
    """:func:`host_reads_on_rank` for each ``{name: cfg}`` (under ``out_dir/name``), one launch:
    ``{name: host reads per optimizer step on this rank}``."""
    import os

    return {name: host_reads_on_rank(rank, world_size, cfg, os.path.join(out_dir, name), steps)
            for name, cfg in cfgs.items()}


def set_aside_then_resume(rank, world_size, cfg, out_dir, ckpt_name):
    """Rank 0 moves ``out_dir/checkpoints/ckpt_name`` (the newest checkpoint) and a copy of
    ``metrics.jsonl`` to ``out_dir/set-aside/``; then every rank resumes (:func:`resume_rank_digest`)
    from the checkpoint before it: a resume test's second half in the launch of its first."""
    import shutil
    from pathlib import Path

    out = Path(out_dir)
    if rank == 0:
        (out / "set-aside").mkdir()
        shutil.copy(out / "metrics.jsonl", out / "set-aside" / "metrics.jsonl")
        shutil.move(str(out / "checkpoints" / ckpt_name), str(out / "set-aside" / ckpt_name))
    dist.barrier()
    return resume_rank_digest(rank, world_size, cfg, out_dir)


def refused(rank, world_size, fn, *args):
    """``fn(rank, world_size, *args)`` expected to raise: ``"Type: message"`` of what it raised, or
    None when it returned. Lets a refusal share a launch with runs that must succeed."""
    try:
        fn(rank, world_size, *args)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    return None


def agreed_peak(rank, world_size):
    """Each rank's start-up peak differs (rank r measured r + 1 FLOP/s: the others held its cores);
    the trainer's agreement step gives every rank the highest."""
    from course_lib.parallel.ranks.launch import DistInfo
    from course_lib.train import _agreed_peak
    from course_lib.trainer.cpu_peak import Peak

    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo")
    return _agreed_peak(Peak(float(rank + 1), "start-up", "measured at start-up"), info).flops
