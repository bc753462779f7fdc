# %% [markdown]
# # Exercise 14 — Expert-parallel dispatch and combine
#
# A mixture-of-experts layer has `E` experts (small MLPs) and a router that sends each token to
# `k` of them. **Expert parallelism** (EP) deals the experts out over the `N` ranks of an EP
# group: rank `r` holds experts `r·E/N … (r+1)·E/N − 1`, its *local* experts `0 … E/N − 1`.
# Tokens live where the data put them, so before the experts can run, every token must travel to
# the rank that holds the expert it chose, and its output must travel back.
#
# A token with `k` chosen experts becomes `k` **rows**, one per choice. Each rank starts with its
# rows `x` `[n, d]` and the global expert of each row, `expert` `[n]`. You will write:
#
# * **dispatch**: every row goes to the rank of its expert; each rank ends with the rows for its
#   local experts, grouped by local expert, so each expert runs one matrix multiply on one block;
# * **combine**: the experts' outputs go back to the ranks the rows came from, each to its place.
#
# The exchange is `torch.distributed.all_to_all_single`: each rank sends a different block of one
# tensor to every rank and receives one block from each. The number of rows per expert changes
# with every batch (the router decides), so the ranks must first tell each other how many rows
# are coming. The checks compare with one process, where no row travels: the same rows through
# the same experts.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
ROWS = 24  # rows per rank in Parts 2 and 3 (each rank gets a few more than the one before)

# %%
import importlib

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.labs import exercise14_expert_dispatch as exercise_runs

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    ROWS = 10

# %% [markdown]
# ## Part 1: the contract
#
# `all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)` cuts
# `input` along its first dimension into `N` consecutive blocks of `input_split_sizes[i]` rows
# (block `i` goes to rank `i`, this rank's own block included) and fills `output` with the blocks
# received, rank 0's first, `output_split_sizes[i]` rows from rank `i`. Without split sizes it
# cuts both tensors into `N` equal blocks. Both sides must agree: what rank `a` sends to `b` is
# exactly what `b` expects from `a`.
#
# The next cell *writes your code to a file* (`ex14_expert_dispatch.py`) so that spawned ranks can
# import it. Four functions:
#
# * `sort_by_expert(expert, num_experts) -> (order, counts)`: `order` (int64 `[n]`) lists the
#   rows so that `expert[order]` is ascending, rows of one expert in their original order;
#   `counts` (int64 `[num_experts]`) the rows of each expert, 0 for one that no row chose.
# * `group_by_local_expert(rows, counts) -> (grouped, perm)`: `rows` as an all-to-all delivers
#   them, source rank 0's first, each source's rows sorted by local expert; `counts` `[N, E/N]`
#   the rows from source `s` for local expert `j`. `grouped` holds one block per local expert
#   (local expert 0's first), inside a block source 0's rows first; `perm` is the index with
#   `grouped == rows[perm]`.
# * `dispatch(x, expert, num_experts, group=None) -> (rows, counts, state)`: `rows` `[m, d]`, every
#   row any rank of the group routed to this rank's experts, as `group_by_local_expert` groups
#   them; `counts` (int64 `[E/N]`) the rows per local expert; `state`, whatever combine will need.
#   Exactly two exchanges, both `all_to_all_single`: first the counts, then the rows.
# * `combine(y, state, group=None) -> out`: `y` `[m, d_out]` the experts' outputs for dispatch's
#   rows, in the same order; `out` `[n, d_out]` on each rank, the output of each row of its `x`,
#   in the order of `x`. Exactly one `all_to_all_single`.
#
# `group=None` means all ranks; pass `group=` to every collective, and use `dist.get_world_size(group)`
# for `N`. Never change a tensor you were given. `num_experts` is a multiple of `N`.

# %%
# %%writefile ex14_expert_dispatch.py
"""Expert-parallel dispatch and combine over all_to_all_single (exercise 14)."""
import torch
import torch.distributed as dist


def sort_by_expert(expert, num_experts):
    """(order, counts): the rows in expert order (stable), and the rows of each expert."""
    ### BEGIN SOLUTION Is there a sort that keeps tied rows in their original order? And a count that includes the experts nobody chose?
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts)
    return order, counts
    ### END SOLUTION


def group_by_local_expert(rows, counts):
    """(grouped, perm): rows as they arrived (by source, then local expert) regrouped by local expert."""
    ### BEGIN SOLUTION Row indices cut into the blocks counts describes, in arrival order: which block comes first once you read them expert by expert instead of source by source?
    n_src, e_local = counts.shape
    blocks = torch.arange(rows.shape[0]).split(counts.flatten().tolist())
    perm = torch.cat([blocks[s * e_local + j] for j in range(e_local) for s in range(n_src)])
    return rows[perm], perm
    ### END SOLUTION


def dispatch(x, expert, num_experts, group=None):
    """(rows, counts, state): this rank's experts' rows from every rank of the group."""
    ### BEGIN SOLUTION Sort first: then each destination's rows are one block. How many counts does each rank receive from each other rank if the count tensor is cut into N equal blocks? From the counts, what are the split sizes on each side of the row exchange? What must combine know to undo every step?
    n = dist.get_world_size(group)
    e_local = num_experts // n
    order, counts = sort_by_expert(expert, num_experts)
    got_counts = torch.empty_like(counts)
    dist.all_to_all_single(got_counts, counts, group=group)  # [source, local expert], flattened
    got_counts = got_counts.view(n, e_local)
    send_splits = counts.view(n, e_local).sum(1).tolist()
    recv_splits = got_counts.sum(1).tolist()
    arrived = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(arrived, x[order].contiguous(), recv_splits, send_splits, group=group)
    rows, perm = group_by_local_expert(arrived, got_counts)
    return rows, got_counts.sum(0), (order, perm, send_splits, recv_splits)
    ### END SOLUTION


def combine(y, state, group=None):
    """The experts' outputs back on the ranks their rows came from, in the order of each x."""
    ### BEGIN SOLUTION Undo dispatch's steps in reverse order: which way does each split go now? And where does each returned row belong in x?
    order, perm, send_splits, recv_splits = state
    arrived = torch.empty_like(y)
    arrived[perm] = y
    back = y.new_empty(sum(send_splits), y.shape[1])
    dist.all_to_all_single(back, arrived, send_splits, recv_splits, group=group)
    out = torch.empty_like(back)
    out[order] = back
    return out
    ### END SOLUTION

# %% [markdown]
# ## Part 1 checked: sorting and grouping, in one process
#
# The two helpers need no other rank. `sort_by_expert` on a few routings (an expert nobody chose,
# all rows on one expert, no rows at all); `group_by_local_expert` on what 2 and 3 source ranks
# would deliver, empty blocks included.

# %% tags=["points:2"]
import ex14_expert_dispatch

importlib.reload(ex14_expert_dispatch)  # pick up your latest edit
from ex14_expert_dispatch import combine, dispatch, group_by_local_expert, sort_by_expert  # noqa: E402

SORT_CASES = [([2, 0, 2, 1, 0, 3], 4), ([1, 1, 1], 4), ([3, 0, 3, 0, 3], 4), ([], 2)]
sorted_rows = exercise_runs.check_sort_by_expert(sort_by_expert, SORT_CASES)
GROUP_CASES = [[[1, 2], [3, 0]], [[0, 0], [2, 1]], [[2, 0, 1], [0, 0, 0], [1, 1, 0]]]
grouped_rows = exercise_runs.check_group_by_local_expert(group_by_local_expert, GROUP_CASES)
record("helpers", [[r["order"], r["counts"]] for r in sorted_rows] + [[r["grouped"], r["perm"]] for r in grouped_rows])
for r in sorted_rows:
    print(f"experts {str(r['experts']):<20} order {str(r['order'].tolist()):<20} counts {r['counts'].tolist()}")
for r in grouped_rows:
    print(f"counts [source][local expert] {str(r['counts']):<28} perm {r['perm'].tolist()}")
check(sorted_rows[1]["counts"].tolist() == [0, 3, 0, 0], "three rows of expert 1 out of 4 experts: counts [0, 3, 0, 0]")
check(grouped_rows[0]["perm"].tolist() == [0, 3, 4, 5, 1, 2],
      "counts [[1, 2], [3, 0]]: local expert 0's rows are row 0 (from source 0) and rows 3-5 (source 1), then rows 1-2")

# %% [markdown]
# **What you should see:** each `order` lists the rows of expert 0 first, then 1, …, in their
# original order; `counts` has one entry per expert, zeros included. With counts `[[1, 2], [3, 0]]`
# (source 0 sent 1 row for local expert 0 and 2 for expert 1; source 1 sent 3 for expert 0),
# `perm` is `[0, 3, 4, 5, 1, 2]`: expert 0's four rows, then expert 1's two.

# %% [markdown]
# ## Part 2: dispatch on 2 ranks
#
# Two gloo ranks, 4 experts (2 per rank), rows of width 4. Rank `s` has `ROWS + 3s` rows, routed
#
# * `even`: every expert equally often;
# * `uneven`: expert `e` drawn with weight `2^-e`, so expert 0 gets about half the rows and rank 0
#   receives far more than rank 1;
# * `empty`: expert 1 and both experts of rank 1 are never chosen: rank 1 receives **no row at
#   all**, but must still take part in both exchanges.
#
# Each rank compares what your `dispatch` hands back with the rows it must hold, picked out of
# every rank's inputs in one process. It also counts the exchanges and the bytes your two
# all-to-alls send to the other rank.

# %% tags=["points:3"]
EP2 = [exercise_runs.scenario(kind, 2, 4, [ROWS, ROWS + 3], kind) for kind in ("even", "uneven", "empty")]
rows2 = exercise_runs.check_expert_parallel(dispatch, 2, EP2)
record("dispatch", [[r["scenario"], r["rank"], r["rows in"], r["rows out"], r["counts"], r["dispatch bytes"]]
                    for r in rows2])
record("dispatch.outputs", [[r["raw"]["rows"], r["raw"]["counts"]] for r in rows2])
print(f"{'scenario':<8} {'rank':>4} {'rows in':>7} {'rows out':>8} {'per local expert':>16} {'bytes sent':>10}")
for r in rows2:
    print(f"{r['scenario']:<8} {r['rank']:>4} {r['rows in']:>7} {r['rows out']:>8} {str(r['counts']):>16} "
          f"{r['dispatch bytes']:>10}")
wire = {sc["name"]: exercise_runs.wire_rows(sc) for sc in EP2}
# bytes to the other rank: its block of the counts (2 int64) plus the rows it gets (4 fp32 each)
expected_bytes = [2 * 8 + wire[sc["name"]][s][1 - s] * 4 * 4 for sc in EP2 for s in range(2)]
check([r["dispatch bytes"] for r in rows2] == expected_bytes,
      "each rank should send the other its 2 counts and exactly the rows routed there, nothing more")
check(rows2[-1]["rows out"] == 0, "in 'empty', rank 1 should receive no row")
check(rows2[2]["rows out"] > rows2[3]["rows out"], "in 'uneven', rank 0 (expert 0's rank) should receive more rows than rank 1")

fig, axes = plt.subplots(1, 3, figsize=(10, 3))
for ax, sc in zip(axes, EP2):
    m = torch.tensor(wire[sc["name"]])
    ax.imshow(m, cmap="Blues", vmin=0)
    for s in range(2):
        for t in range(2):
            ax.text(t, s, str(m[s, t].item()), ha="center", va="center")
    ax.set(title=sc["name"], xlabel="to rank", ylabel="from rank", xticks=[0, 1], yticks=[0, 1])
fig.suptitle("rows each rank sends each rank (diagonal: rows that stay)")
fig.tight_layout()
plt.show()

# %% [markdown]
# **What you should see:** every scenario passes; the rows out of each rank add up to the rows in
# of both. The bytes a rank sends are its two counts (16 bytes) plus 16 bytes for each row that
# leaves it: rows routed to its own experts never touch the wire. In `uneven` rank 0 receives most
# rows (its expert 0 is the popular one); in `empty` rank 1 receives nothing and still took part in
# both exchanges, or the other rank would have waited for it forever.

# %% [markdown]
# ## Part 3: combine, and 4 ranks
#
# Now the round trip on 4 ranks, 8 experts (2 per rank). After your dispatch, each rank runs its
# local experts, a different linear map `d → d + 1` per expert, on their blocks, and hands the
# outputs to your `combine`. On every rank, each row's output must equal that row through its own
# expert in one process, in the order of `x`. The rows here are token choices: with top-2 routing
# the caller would add each token's two outputs, weighted by the router; that sum is the layer's
# output.

# %% tags=["points:3"]
EP4 = [exercise_runs.scenario(kind, 4, 8, [ROWS + 3 * s for s in range(4)], kind, seed=2)
       for kind in ("even", "uneven", "empty")]
rows4 = exercise_runs.check_expert_parallel(dispatch, 4, EP4, combine=combine)
record("round_trip", [[r["scenario"], r["rank"], r["rows in"], r["rows out"], r["counts"], r["dispatch bytes"],
                       r["combine bytes"]] for r in rows4])
record("round_trip.outputs", [[r["raw"]["rows"], r["raw"]["counts"], r["raw"]["combined"]] for r in rows4],
       rtol=1e-5, atol=1e-6)
print(f"{'scenario':<8} {'rank':>4} {'rows in':>7} {'rows out':>8} {'dispatch bytes':>14} {'combine bytes':>13}")
for r in rows4:
    print(f"{r['scenario']:<8} {r['rank']:>4} {r['rows in']:>7} {r['rows out']:>8} {r['dispatch bytes']:>14} "
          f"{r['combine bytes']:>13}")
wire4 = {sc["name"]: exercise_runs.wire_rows(sc) for sc in EP4}  # [from][to] rows
# rank r sends back the outputs of the rows every other rank t sent it: wire[t][r]
row_bytes = {name: [sum(w[t][r] for t in range(4) if t != r) for r in range(4)] for name, w in wire4.items()}
check([r["combine bytes"] for r in rows4] == [row_bytes[r["scenario"]][r["rank"]] * 5 * 4 for r in rows4],
      "combine should send the output of each row it received (d + 1 = 5 fp32) back to its source, and nothing else")

# %% [markdown]
# **What you should see:** every output equal to one process. Each rank's combine sends back the
# outputs of the rows it received from the others, 20 bytes each (5 fp32), exactly mirroring
# dispatch: combine is dispatch run backwards, which is also why the backward pass of an MoE layer
# needs the same two exchanges again, in the other direction.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
# test: EP 1, 2 and 4 inside 4 ranks (groups of 1 and 2: group= honoured), a rank with no rows, 3 experts per rank, wider rows
hidden = [exercise_runs.scenario("ep1 uneven", 1, 3, [17], "uneven", seed=11),
          exercise_runs.scenario("ep1 empty", 1, 4, [9], "empty", seed=12),
          exercise_runs.scenario("ep2 silent rank", 2, 6, [0, 13], "uneven", d=6, seed=13),
          exercise_runs.scenario("ep2 empty", 2, 4, [7, 5], "empty", seed=14),
          exercise_runs.scenario("ep4 uneven", 4, 12, [5, 0, 19, 8], "uneven", d=3, seed=15),
          exercise_runs.scenario("ep4 even", 4, 4, [8, 4, 12, 1], "even", seed=16)]
hidden_rows = exercise_runs.check_expert_parallel(dispatch, 4, hidden, combine=combine)
record("hidden.rows", [[r["scenario"], r["rank"], r["rows in"], r["rows out"], r["counts"], r["dispatch bytes"],
                        r["combine bytes"]] for r in hidden_rows])
record("hidden.outputs", [[r["raw"]["rows"], r["raw"]["counts"], r["raw"]["combined"]] for r in hidden_rows],
       rtol=1e-5, atol=1e-6)
check(all(r["dispatch bytes"] == 0 for r in hidden_rows if r["ep"] == 1), "hidden: EP 1 sends nothing")
### END HIDDEN TESTS
