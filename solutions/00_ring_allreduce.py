# %% [markdown]
# # Exercise 00 — Ring all-reduce from send and receive
#
# Data-parallel training sums every gradient over all ranks once per step. NCCL and gloo do it
# with a **ring all-reduce**: each rank talks only to its two neighbours, and the bytes each rank
# sends do not grow with the number of ranks. You will build one from point-to-point messages.
#
# The algorithm, for `p` ranks and a tensor cut into `p` chunks:
#
# 1. **Reduce-scatter** (`p - 1` steps). At step `s`, rank `r` sends chunk `(r - s) mod p` to rank
#    `r + 1` and adds the chunk `(r - s - 1) mod p` it receives from rank `r - 1` into its own
#    copy. Afterwards rank `r` holds the *complete* sum of chunk `(r + 1) mod p`.
# 2. **All-gather** (`p - 1` steps). At step `s`, rank `r` sends chunk `(r + 1 - s) mod p` and
#    overwrites chunk `(r - s) mod p` with what it receives. Afterwards every rank has every sum.
#
# Rules: use `dist.send` / `dist.recv` / `dist.isend` / `dist.irecv` only (no collective), sum in
# place into the tensor you are given, and handle a tensor whose length is not a multiple of `p`.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes

# %%
import importlib

import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.labs import lab00_orientation as collectives

SMOKE = course_lib.smoke(SMOKE)

# %% [markdown]
# ## Part 1: your ring all-reduce
#
# Spawned ranks can only run code they can import, so the next cell *writes your function to a
# file* (`ex00_ring_allreduce.py`, next to this notebook) instead of defining it in the notebook.
# Edit the function inside the cell, run the cell, then run the check below it.
#
# A trap: if every rank first calls a blocking `dist.send` and only then `dist.recv`, every rank
# can wait for a receiver that never comes. Start the send with `dist.isend`, receive, then
# `wait()` on the send.

# %%
# %%writefile ex00_ring_allreduce.py
import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, with a ring of point-to-point messages."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    ### BEGIN SOLUTION Work the 2-rank case out on paper first: which chunk does each rank send, and which does it receive, in each phase? Writing into a view of the tensor writes the tensor itself, and a length that is not a multiple of p still has to split into p pieces
    chunks = tensor.view(-1).tensor_split(world)  # views: writing into them writes the tensor
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):  # reduce-scatter: partial sums travel around the ring
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_idx])
        request = dist.isend(chunks[send_idx], right)
        dist.recv(incoming, left)
        request.wait()
        chunks[recv_idx].add_(incoming)
    for step in range(world - 1):  # all-gather: finished sums travel around the ring
        send_idx, recv_idx = (rank + 1 - step) % world, (rank - step) % world
        request = dist.isend(chunks[send_idx], right)
        dist.recv(chunks[recv_idx], left)
        request.wait()
    ### END SOLUTION
    return tensor

# %% [markdown]
# The check runs your function on 2 and on 4 ranks (4 processes share this machine's cores, so it
# takes a few seconds) and compares every rank's result with `dist.all_reduce` on the same data.

# %% tags=["points:3"]
import ex00_ring_allreduce

importlib.reload(ex00_ring_allreduce)  # pick up your latest edit
from ex00_ring_allreduce import ring_all_reduce  # noqa: E402

visible_cases = [(1024, "float32", 0), (10, "float32", 1)]
rows = collectives.check_all_reduce(ring_all_reduce, [2, 4], visible_cases)
record("rows", [[r["ranks"], r["numel"], r["dtype"], r["max_abs_err"]] for r in rows], atol=1e-4)  # errors within 1e-4 of the reference's
# every rank's result on the seeded inputs: any correct ring matches the reference's to rounding
record("rows.outputs", [[r["ranks"], r["numel"], r["dtype"], r["outputs"]] for r in rows], rtol=1e-5, atol=2e-4)
for row in rows:
    print(f"{row['ranks']} ranks  numel={row['numel']:>5}  {row['dtype']:<8}  "
          f"max error vs dist.all_reduce: {row['max_abs_err']:.2e}")
print("ring all-reduce matches dist.all_reduce")

# %% [markdown]
# **What you should see:** four lines with errors around `1e-7` or smaller (floating-point sums
# in a different order round differently) and "ring all-reduce matches dist.all_reduce".

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
hidden_cases = [(7, "float32", 2), (1000, "float64", 3), (999, "int64", 4), (64, "bfloat16", 5),
                (33, "int32", 6)]
hidden_rows = collectives.check_all_reduce(ring_all_reduce, [3], hidden_cases)
hidden_rows += collectives.check_all_reduce(ring_all_reduce, [2], hidden_cases[:3])
record("hidden.rows", [[r["ranks"], r["numel"], r["dtype"]] for r in hidden_rows])
record("hidden.errors", [r["max_abs_err"] for r in hidden_rows], atol=0.03)  # bf16 on 3 ranks: the check allows 3e-2
for group, dtypes, tol in [("float", ("float32", "float64"), dict(rtol=1e-5, atol=2e-4)),
                           ("bf16", ("bfloat16",), dict(rtol=0.0, atol=0.06)),  # 2 x the check's 1e-2 x 3 ranks
                           ("int", ("int64", "int32"), {})]:  # integer tensors: exact
    record(f"hidden.outputs.{group}", [[r["ranks"], r["numel"], r["outputs"]] for r in hidden_rows
                                        if r["dtype"] in dtypes], **tol)
### END HIDDEN TESTS

# %% [markdown]
# ## Part 2: how many bytes does each rank send?
#
# Count it from the algorithm above: how many steps does each phase take, and how many
# elements does a rank send in one step? Assume `N` is a multiple of `p`. This is the number
# lab 00's latency-bandwidth model (section 5) uses, and why a ring's cost per rank barely grows
# with `p`.

# %%
def ring_bytes_sent_per_rank(numel: int, world_size: int, bytes_per_element: int) -> float:
    """Bytes one rank sends during a ring all-reduce of ``numel`` elements over ``world_size`` ranks."""
    ### BEGIN SOLUTION Count the sends on paper for 2 ranks, then for 4: how many steps, and how big is each message?
    return 2 * (world_size - 1) * (numel / world_size) * bytes_per_element
    ### END SOLUTION


# %% tags=["points:1"]
sent = ring_bytes_sent_per_rank(1024, 4, 4)
record("bytes", [sent, ring_bytes_sent_per_rank(1000, 1, 4)])
check(sent == 6144, f"1024 fp32 elements on 4 ranks: expected 6144 bytes sent per rank, got {sent}"
      + (f" ({sent / 6144:.3g} x the expected). Count the steps of both phases, and the size of one "
         "message" if isinstance(sent, (int, float)) and sent else ""))
check(ring_bytes_sent_per_rank(1000, 1, 4) == 0, "a single rank sends nothing")
print("byte count is right; per rank it approaches 2 x N x bytes as p grows:")
for p in (2, 4, 8, 64, 1024):
    print(f"  p={p:>5}: {ring_bytes_sent_per_rank(2**20, p, 4) / 2**20:.3f} MiB for a 1 MiB-element fp32 tensor")

# %% tags=["points:1"]
### BEGIN HIDDEN TESTS
for n, p, b in [(4096, 8, 2), (600, 3, 8), (2**30, 1024, 2)]:
    want = 2 * (p - 1) * n / p * b
    got = ring_bytes_sent_per_rank(n, p, b)
    record(f"hidden.bytes.{n}-{p}-{b}", got)
    check(abs(got - want) <= 1e-9 * want, f"n={n}, p={p}, b={b}: expected {want}, got {got}")
### END HIDDEN TESTS
