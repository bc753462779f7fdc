"""Lab 00 (orientation) and exercise 00 (ring all-reduce): rank functions for collectives on small tensors, timing, and a checker
that compares a learner's all-reduce with ``torch.distributed.all_reduce``.

They live here, not in the notebook, because a spawned rank can only run importable code.
Every function has the ``fn(rank, world_size, ...)`` signature that
:func:`course_lib.parallel.ranks.launch.run_ranks` calls.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from course_lib.parallel.ranks.launch import COLLECTIVES_PRELOAD, RankFailedError, run_ranks
from course_lib.parallel.wire import count_collectives

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int32": torch.int32}


def whoami(rank: int, world_size: int) -> dict:
    """What one rank sees: its rank, the group size, backend, process id and CPU threads."""
    return {"rank": rank, "world_size": world_size, "backend": dist.get_backend(),
            "pid": os.getpid(), "threads": torch.get_num_threads()}


def show_collectives(rank: int, world_size: int) -> dict:
    """Run the four basic collectives on tiny tensors; return what this rank held before/after.

    Rank ``r`` starts with ``[10r+1, 10r+2, ..., 10r+world_size]`` so every number says where it
    came from. Returns ``{collective: (before, after)}`` as Python lists."""
    def start() -> torch.Tensor:
        return torch.arange(1, world_size + 1, dtype=torch.float32) + 10 * rank

    shown = {}
    t = start()
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # every rank ends with the elementwise sum
    shown["all_reduce (sum)"] = (before, t.tolist())

    t = start()
    out = torch.zeros(1)
    dist.reduce_scatter(out, list(t.chunk(world_size)))  # rank r keeps element r of the sum
    shown["reduce_scatter (sum)"] = (t.tolist(), out.tolist())

    t = start()[rank:rank + 1]
    parts = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(parts, t)  # every rank ends with every rank's piece, in rank order
    shown["all_gather"] = (t.tolist(), torch.cat(parts).tolist())

    t = start()
    before = t.tolist()
    dist.broadcast(t, src=0)  # every rank ends with rank 0's tensor
    shown["broadcast (from rank 0)"] = (before, t.tolist())
    return shown


def time_all_reduce(rank: int, world_size: int, sizes_bytes: Sequence[int], repeats: int = 10,
                    warmup: int = 2) -> list[float]:
    """Median seconds of one fp32 all-reduce per message size (bytes per rank), slowest rank.

    Each repetition starts after a barrier, so the time is the collective itself; the slowest
    rank's time is returned (what the step waits for)."""
    medians = []
    for size in sizes_bytes:
        t = torch.ones(max(1, int(size) // 4), dtype=torch.float32)
        times = []
        for i in range(warmup + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times.append(elapsed)
        med = torch.tensor(sorted(times)[len(times) // 2], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        medians.append(med.item())
    return medians


POINT_TO_POINT = {"send", "isend", "recv", "irecv", "barrier"}  # what the exercise's rules allow


@contextlib.contextmanager
def _learner_bindings_counted(impl: Callable) -> Iterator[None]:
    """Inside :func:`course_lib.parallel.wire.count_collectives`: also count the collectives the
    learner's module bound at import (``from torch.distributed import all_reduce``), which the
    counter's patches of ``torch.distributed`` cannot see, by pointing those names at the counted
    wrappers for the block. Catches an honest shortcut, not a determined cheat."""
    names = getattr(impl, "__globals__", None)
    swapped = {}
    if isinstance(names, dict):
        for key, value in list(names.items()):
            counted = getattr(dist, getattr(value, "__name__", ""), None)
            if callable(value) and getattr(counted, "__wrapped__", None) is value:
                swapped[key] = value
                names[key] = counted
    try:
        yield
    finally:
        if swapped:
            names.update(swapped)


def case_data(rank: int, numel: int, dtype_name: str, seed: int) -> torch.Tensor:
    """The seeded input one rank feeds the all-reduce in a test case (``numel`` elements)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if DTYPES[dtype_name].is_floating_point:
        return torch.randn(numel, generator=gen).to(DTYPES[dtype_name])
    return torch.randint(-1000, 1000, (numel,), generator=gen).to(DTYPES[dtype_name])


def compare_all_reduce(rank: int, world_size: int, impl: Callable,
                       cases: Sequence[tuple[int, str, int]]) -> list[dict]:
    """Run ``impl(tensor)`` (an in-place sum all-reduce) and ``dist.all_reduce`` on the same data.

    ``cases`` is a list of ``(numel, dtype_name, seed)``. Returns, per case, the max abs error
    against ``dist.all_reduce``, whether the call changed the tensor in place, the collectives the
    call used (``collectives``: names, forbidden by the rules) and ``result``, the tensor ``impl``
    produced (a copy, for the grader)."""
    report = []
    for numel, dtype_name, seed in cases:
        data = case_data(rank, numel, dtype_name, seed)
        expected = data.clone()
        dist.all_reduce(expected)
        mine = data.clone()
        with count_collectives() as wire, _learner_bindings_counted(impl):
            returned = impl(mine)
        result = mine if returned is None else returned
        is_tensor = isinstance(result, torch.Tensor)
        shape_ok = is_tensor and result.shape == data.shape
        err = (result.double() - expected.double()).abs().max().item() if numel and shape_ok else 0.0
        report.append({"numel": numel, "dtype": dtype_name, "max_abs_err": err,
                       "in_place": is_tensor and shape_ok and torch.equal(mine, result),
                       "shape_ok": shape_ok, "dtype_ok": is_tensor and result.dtype == data.dtype,
                       "collectives": sorted({c.function for c in wire.calls} - POINT_TO_POINT),
                       "result": result.detach().clone() if is_tensor else None})
    return report


def check_all_reduce(impl: Callable, world_sizes: Sequence[int],
                     cases: Sequence[tuple[int, str, int]], *, timeout: float = 120.0) -> list[dict]:
    """Check a learner's all-reduce against ``dist.all_reduce`` on each world size; explain failures.

    Raises ``NotImplementedError`` when the learner's function still raises it,
    :class:`course_lib.kit.checks.CheckFailed` with a sentence when a result is wrong. Returns the
    rows of a table (world size, numel, dtype, max error) on success; each row also carries
    ``outputs``, every rank's result tensor for that case (rank order), for the grader to compare
    with the instructor's: unlike the error, it cannot be right without a working all-reduce."""
    from course_lib.kit.checks import CheckFailed

    rows = []
    for world_size in world_sizes:
        try:
            per_rank = run_ranks(compare_all_reduce, world_size, impl, list(cases), timeout=timeout,
                                 show_output=False, preload=COLLECTIVES_PRELOAD)  # collectives only
        except RankFailedError as exc:
            if exc.exc_type == "NotImplementedError":
                raise NotImplementedError(
                    f"{getattr(impl, '__name__', impl)} still raises NotImplementedError on rank "
                    f"{exc.rank}: fill in the solution cell, run it, then this check") from None
            raise CheckFailed(f"your all-reduce crashed on {world_size} ranks: {exc}") from None
        except TimeoutError:
            raise CheckFailed(
                f"your all-reduce did not finish within {timeout:g} s on {world_size} ranks: a "
                "deadlock? With blocking send/recv every rank may be waiting to send; post the "
                "receive with dist.irecv (or send with dist.isend) before waiting.") from None
        for rank, report in enumerate(per_rank):
            for row in report:
                where = f"{world_size} ranks, numel={row['numel']}, {row['dtype']}, rank {rank}"
                if row["collectives"]:
                    used = ", ".join(f"dist.{name}" for name in row["collectives"])
                    raise CheckFailed(
                        f"{where}: your ring called {used} while it ran; the rules allow only "
                        "point-to-point messages (dist.send / dist.recv / dist.isend / dist.irecv). "
                        "Build the sum from the ring's reduce-scatter and all-gather steps.")
                if not (row["shape_ok"] and row["dtype_ok"]):
                    raise CheckFailed(f"{where}: the result must keep the input's shape and dtype")
                tol = 1e-2 * world_size if row["dtype"] == "bfloat16" else 1e-4
                if row["max_abs_err"] > tol:
                    raise CheckFailed(
                        f"{where}: result differs from dist.all_reduce by up to "
                        f"{row['max_abs_err']:.3g} (tolerance {tol:g}). Check that every chunk is "
                        "summed exactly once in the reduce-scatter phase and then passed around "
                        "unchanged in the all-gather phase.")
                if not row["in_place"]:
                    raise CheckFailed(f"{where}: the sum must end up in the tensor you were given "
                                      "(in place), like dist.all_reduce")
        for i, row in enumerate(per_rank[0]):
            rows.append({"ranks": world_size, **{k: row[k] for k in ("numel", "dtype", "max_abs_err")},
                         "outputs": [report[i]["result"] for report in per_rank]})
    return rows
