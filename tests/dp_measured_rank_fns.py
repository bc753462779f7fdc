"""Rank functions for tests/test_dp_measured.py: one launch per world size runs every measurement
(starting ranks is the slow part)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel import wire as wire_mod
from course_lib.labs import lab09_zero_fsdp_deepspeed as mr
from course_lib.parallel.data_parallel.zero import ShardedOptimizer
from course_lib.parallel.wire import count_collectives

KNOWN = 1000  # elements of the sanity all-reduce

# model specs beyond the default (4 x Linear(32, 32), bias-free)
PADDED = {"dim": 31}          # 961 elements per layer: not a multiple of 2 or 4
WITH_NORM = {"norm": True}    # a replicated LayerNorm (weight + bias, 32 + 32 elements)
NO_INPUT_GRAD = {"input_requires_grad": False}


def _sanity(rank, world):
    originals = (dist.all_reduce, dist.all_gather_into_tensor, dist.distributed_c10d.all_gather_single)
    out = {}
    t = torch.ones(KNOWN)
    with count_collectives() as outer:
        with count_collectives() as w:
            dist.all_reduce(t)
            full = torch.empty(4 * world)
            dist.all_gather_into_tensor(full, torch.ones(4))  # calls all_gather_single inside: once
            dist.broadcast(torch.zeros(10, dtype=torch.float64), src=0)
        dist.all_reduce(torch.ones(3, dtype=torch.int32))  # outer only
    dist.all_reduce(torch.ones(7))  # outside every block: not counted
    out["reduced"] = t[0].item()
    out["bytes"] = w.bytes_per_rank()
    out["exact"] = w.exact_bytes_per_rank()
    out["by_kind"] = w.by_kind()
    out["outer_calls"] = len(outer.calls)
    out["fp32_only"] = w.bytes_per_rank(dtypes=torch.float32)
    out["elements"] = w.elements_per_rank()
    out["restored"] = (dist.all_reduce, dist.all_gather_into_tensor,
                       dist.distributed_c10d.all_gather_single) == originals
    try:
        with count_collectives():
            raise KeyError("boom")
    except KeyError:
        pass
    out["restored_after_error"] = dist.all_reduce is originals[0] and not wire_mod._saved
    # torch DDP without the counting hook: its C++ reducer bypasses dist.all_reduce
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(nn.Linear(8, 8, bias=False))
    with count_collectives() as blind:
        F.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 8)).backward()
    out["ddp_without_hook_calls"] = len(blind.calls)
    return out


def all_checks(rank, world):
    cases = [("zero3-scratch", PADDED), ("fsdp2", PADDED), ("zero3-scratch", WITH_NORM),
             ("fsdp2", WITH_NORM), ("zero3-scratch", NO_INPUT_GRAD), ("fsdp2", NO_INPUT_GRAD)]
    zero1_available = hasattr(ShardedOptimizer, "reduce_gradients")
    strategies = [s for s in mr.STRATEGIES if zero1_available or s != "zero1"]
    return {"sanity": _sanity(rank, world),
            "main": {r["strategy"]: r for r in mr.measure_strategies(rank, world, strategies)},
            "extra": mr.measure_cases(rank, world, cases),
            "zero1_available": zero1_available}
