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
