# %% [markdown]
# # Exercise 13 — Merging partial attention: the online softmax
#
# Ring attention never holds a whole row of attention scores. A rank meets the keys of the
# sequence one block at a time, and from each block it can only compute a **partial** result for
# its queries: attention over that block's keys alone. You will write the function that combines
# two partial results into the partial result of both blocks. Folded over every block, it gives
# exactly full attention, without ever holding all the scores at once.
#
# For each query row, a partial is a pair:
#
# * `out` `[..., rows, dv]`: the softmax over **this block's keys only**, times their values;
# * `lse` `[..., rows]`: the log-sum-exp of the row's scores over this block's keys,
#   `lse = log(sum over the block's keys j of exp(s_j))`.
#
# A row that sees no key of the block (every one masked, e.g. by the causal mask) has `out` = 0 and
# `lse` = -inf: the partial of "no keys at all".
#
# The checks compare your merge with attention computed over all the keys at once, on the same
# scores: two blocks; scores far too large for `exp`; rows that see no key; and a ring of N ranks,
# simulated in one process, against full causal attention (`scaled_dot_product_attention`).

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
RING_N, RING_SEQ = 4, 64  # Part 3: ranks and tokens of the drawn ring

# %%
import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.labs import exercise13_online_softmax as exercise_runs

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    RING_SEQ = 32
torch.set_num_threads(1)

# %% [markdown]
# ## Part 1: a partial result
#
# `exercise_runs.block_attention(q, k, v, mask)` computes the partial of queries `q` over one block
# of keys `k` and values `v` (`mask`: True where a query may see a key). Three queries over a block
# of four keys: row 0 may see keys 0-1, row 1 all four, row 2 none.

# %%
g = torch.Generator().manual_seed(0)
q_demo, k_demo, v_demo = (torch.randn(n, 2, generator=g) for n in (3, 4, 4))
mask_demo = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
out_demo, lse_demo = exercise_runs.block_attention(q_demo, k_demo, v_demo, mask_demo)
for row in range(3):
    print(f"row {row}: sees keys {mask_demo[row].nonzero().flatten().tolist()}, out {out_demo[row].tolist()}, "
          f"lse {lse_demo[row].item():.4f}")

# %%
check(torch.isfinite(out_demo[:2]).all() and torch.isfinite(lse_demo[:2]).all(),
      "rows 0 and 1 see keys: their out and lse should be finite numbers")
check(torch.equal(out_demo[2], torch.zeros(2)) and lse_demo[2].item() == float("-inf"),
      "a row that sees no key should have out 0 and lse -inf")

# %% [markdown]
# **What you should see:** rows 0 and 1 with finite numbers, row 2 (no key) with out `[0, 0]` and
# lse `-inf`.
#
# Now the merge. If block `a` and block `b` are two disjoint sets of keys, the partial of `a ∪ b`
# depends only on the two partials: no score has to be computed again. The contract of
# `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`:
#
# * any leading dimensions (batch, heads, rows); `out_*` has one more, the value size;
# * `out` and `lse` are the partial of both blocks together, with the inputs' shapes and dtype;
# * it must stay finite when the scores are huge (`exp(100)` is already inf in float32), and a
#   block whose rows see no key must count for nothing; a row with no key in either block stays
#   `out` 0, `lse` -inf (never NaN);
# * do not change the tensors you are given.
#
# Write it on paper first: what is `exp(lse)` for one block, and for both?

# %%
def merge(out_a, lse_a, out_b, lse_b):
    """The partial (out, lse) of the keys of two blocks, from the partials of each."""
    ### BEGIN SOLUTION Each lse is the log of a block's total weight for that row: what is the total over both blocks, and which share of it belongs to each block's out? Compute the shares without exponentiating a large number, and make a block with lse -inf weigh nothing, also when both are -inf
    m = torch.maximum(lse_a, lse_b)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: no key seen yet
    w_a, w_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)  # at most 1: nothing overflows
    total = w_a + w_b
    lse = safe + torch.log(total)  # -inf where neither block has a key
    denom = torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    out = (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / denom
    return out, lse
    ### END SOLUTION

# %% [markdown]
# ## Part 2: checked against attention over all the keys
#
# Six queries (batch 2, 3 heads) over 8 keys cut into blocks of 5 and 3. The reference is
# `scaled_dot_product_attention` over all 8 keys (and the log-sum-exp of all 8 scores); both
# orders of the merge must give it.

# %% tags=["points:2"]
# test: two blocks against attention over all their keys
two = exercise_runs.check_two_blocks(merge)
record("two_blocks", [two["out"], two["lse"], two["swapped"][0], two["swapped"][1]], rtol=1e-5, atol=1e-6)
print(f"largest relative error against full attention: out {two['err_out']:.1e}, lse {two['err_lse']:.1e}; "
      f"the other order: {two['err_swapped']:.1e}")
check(max(two["err_out"], two["err_lse"], two["err_swapped"]) <= 1e-6,
      "the merge should equal attention over all the keys to float32 rounding (1e-6 or less)")

# %% [markdown]
# **What you should see:** errors of `1e-6` or less: the same sums, added in another order.
#
# Scores in a real model are not small: a long sequence and a sharp head easily give scores in
# the hundreds. The next partials come from rows whose scores sit near 200 (float32, where `exp`
# overflows above 88.7) and near 2,000 (float64, above 709.8). The two blocks' scores differ by 2
# or so, so both blocks matter. The tolerance is `1e-4` here: float32 holds a score of 200 only to
# about `1.5e-5`.

# %% tags=["points:2"]
# test: scores near 200 (float32) and 2,000 (float64)
large = exercise_runs.check_large_scores(merge)
record("large_scores", [list(v) for v in large["merged"].values()], rtol=exercise_runs.LARGE_RTOL, atol=1e-6)
for name, (err_out, err_lse) in large["errors"].items():
    print(f"{name:<26} relative error: out {err_out:.1e}, lse {err_lse:.1e}")
errs_large = list(large["errors"].values())
check(max(errs_large[0]) <= exercise_runs.LARGE_RTOL and max(errs_large[1]) <= 1e-11,
      "with huge scores the merge should still equal one softmax over both blocks: within 1e-4 in float32, "
      "1e-11 in float64")

# %% [markdown]
# **What you should see:** finite results, errors below `1e-4` in float32 and below `1e-11` in
# float64 (which holds a score of 2,000 to about `2e-13`).
#
# Last, masked rows. Six queries over 5 keys (block `a`: keys 0-2, block `b`: keys 3-4); rows 0-1
# see no key of `a`, rows 2-3 none of `b`, rows 4-5 none at all. The reference is attention over
# all 5 keys with the same mask; two empty partials must merge into an empty partial.

# %% tags=["points:2"]
# test: rows that see no key of a block, or of either
masked = exercise_runs.check_masked_rows(merge)
record("masked_rows", [masked["out"], masked["lse"], masked["empty"][0], masked["empty"][1]], rtol=1e-5, atol=1e-6)
print("merged lse per row:", [round(x, 4) for x in masked["lse"].tolist()])
print(f"largest relative error: out {masked['err_out']:.1e}, lse {masked['err_lse']:.1e}")
check(torch.isfinite(masked["lse"][:4]).all() and torch.isinf(masked["lse"][4:]).all()
      and torch.equal(masked["out"][4:], torch.zeros(2, 3)) and not torch.isnan(masked["out"]).any(),
      "rows 0-3 see keys (finite lse); rows 4-5 see none: lse -inf, out 0, and no output may be NaN")
check(max(masked["err_out"], masked["err_lse"]) <= 1e-6, "the masked rows' merge should equal attention over both "
      "blocks with the same mask to 1e-6 or less")

# %% [markdown]
# **What you should see:** rows 0-3 finite, rows 4-5 with lse `-inf` (and out 0), no NaN, errors
# of `1e-6` or less.

# %% [markdown]
# ## Part 3: the ring around it
#
# `exercise_runs.simulate_ring(merge, q, k, v, n, layout=...)` plays `n` ranks of causal ring
# attention in one process. Rank `r` keeps the queries of its chunk of the sequence and starts
# from the empty partial (out 0, lse -inf). At step `s` it holds the key/value block of rank
# `(r - s) mod n` (the blocks travel one rank further each step), computes the partial of its
# queries over that block under the causal mask, and folds it in with **your** merge. A block
# entirely in the future of all its queries is skipped, as real ring attention does.
#
# Below: which block each rank holds at each step, and how far each rank's running output still
# is from its final one after each step, for `RING_N` ranks with contiguous chunks.

# %% tags=["points:3"]
# test: rings of 3 and 4 ranks against full causal attention
q_r, k_r, v_r = exercise_runs.ring_inputs(1, 2, RING_SEQ, 8)
sim = exercise_runs.simulate_ring(merge, q_r, k_r, v_r, RING_N, layout="contiguous")
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
held = torch.tensor(sim["held"], dtype=torch.float64)
future = held > torch.arange(RING_N).unsqueeze(1)  # contiguous: a later rank's keys are all in the future
ax1.imshow(held.masked_fill(future, float("nan")), cmap="tab10", vmin=0, vmax=9)  # NaN: drawn white
for r, steps in enumerate(sim["held"]):
    for s, src in enumerate(steps):
        ax1.text(s, r, f"K/V {src}" + ("\nskipped" if future[r, s] else ""), ha="center", va="center", fontsize=8)
ax1.set(xlabel="step", ylabel="rank", title="the K/V block each rank holds (white: in its future)",
        xticks=range(RING_N), yticks=range(RING_N))
for r, errs in enumerate(sim["error"]):
    ax2.semilogy(range(RING_N), [max(e, 1e-9) for e in errs], "o-", label=f"rank {r}")
ax2.set(xlabel="step", ylabel="max |running out - final out|\n(0 drawn at 1e-9)",
        title="each rank's partial after each step",
        xticks=range(RING_N), ylim=(5e-10, 10))
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()
ring_cases = [(RING_N, RING_SEQ, "contiguous", True), (RING_N, RING_SEQ, "zigzag", True),
              (RING_N, RING_SEQ, "zigzag", False), (3, 3 * RING_SEQ // 4, "contiguous", False)]
ring = exercise_runs.check_ring(merge, ring_cases)
record("ring", [[row["out"], row["lse"]] for row in ring] + [sim["out"], sim["lse"]], rtol=1e-5, atol=1e-6)
print(f"{'ranks':>5} {'tokens':>6} {'layout':>10} {'future blocks':>13} {'blocks merged per rank':>23} "
      f"{'out error':>10} {'lse error':>10}")
for row in ring:
    print(f"{row['n']:>5} {row['seq_len']:>6} {row['layout']:>10} {'skipped' if row['skip_future'] else 'merged':>13} "
          f"{str(row['computed']):>23} {row['err_out']:>10.1e} {row['err_lse']:>10.1e}")
check(all(max(row["err_out"], row["err_lse"]) <= 1e-6 for row in ring),
      "every ring should equal full causal attention to 1e-6 or less")
check(sim["computed"] == [r + 1 for r in range(RING_N)],
      "with contiguous chunks rank r should merge r + 1 blocks (its own and the r before it)")
check(all(max(e[r:]) == 0 for r, e in enumerate(sim["error"])),
      "rank r's output should be final after step r: every later block is in its future and skipped")

# %% [markdown]
# **What you should see:** every case equal to full causal attention to `1e-6` or less. Rank 0 is
# done after step 0 (every other block is in its future), rank r after step r: contiguous chunks
# give the last rank all the work, which is why lab 15 deals the sequence out zig-zag. With the
# future blocks merged too, your merge meets rows that see none of the block's keys, in the middle
# of the ring, and must leave them unchanged.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
# test: three blocks in both orders with random masks (float32, float64), scores near 5000, rings of 1-6 ranks
g_h = torch.Generator().manual_seed(11)
hidden_pairs = []
for dtype in (torch.float32, torch.float64):
    q_h = torch.randn(2, 3, 7, 5, generator=g_h, dtype=torch.float64).to(dtype)
    k_h = torch.randn(2, 3, 9, 5, generator=g_h, dtype=torch.float64).to(dtype) * 3
    v_h = torch.randn(2, 3, 9, 4, generator=g_h, dtype=torch.float64).to(dtype)
    mask_h = torch.rand(7, 9, generator=g_h) < 0.6
    mask_h[0] = False  # a row with no key at all
    mask_h[1, :4] = False  # a row with no key in the first block
    parts = [exercise_runs.block_attention(q_h, k_h[..., sl, :], v_h[..., sl, :], mask_h[:, sl])
             for sl in (slice(0, 4), slice(4, 6), slice(6, 9))]
    left = exercise_runs.call_merge(merge, exercise_runs.call_merge(merge, parts[0], parts[1], "hidden"), parts[2],
                                    "hidden: three blocks, left to right")
    right = exercise_runs.call_merge(merge, parts[0], exercise_runs.call_merge(merge, parts[1], parts[2], "hidden"),
                                     "hidden: three blocks, right to left")
    want = exercise_runs.block_attention(q_h, k_h, v_h, mask_h)
    exercise_runs._compare("hidden: three blocks, left to right", left, want)
    exercise_runs._compare("hidden: three blocks, right to left", right, want)
    hidden_pairs += [list(left), list(right)]
s_big = [5000.0 + torch.randn(3, 4, generator=g_h, dtype=torch.float64) * (i + 1) for i in range(2)]
v_big = [torch.randn(4, 2, generator=g_h, dtype=torch.float64) for _ in range(2)]
big_merged = exercise_runs.call_merge(merge, *(exercise_runs.partial_from_scores(s, v) for s, v in zip(s_big, v_big)),
                                      "hidden: scores near 5000")
exercise_runs._compare("hidden: scores near 5000", big_merged,
                       exercise_runs.partial_from_scores(torch.cat(s_big, -1), torch.cat(v_big, -2)),
                       why=exercise_runs._INF_WHY)
hidden_rings = exercise_runs.check_ring(merge, [(1, 8, "contiguous", True), (5, 40, "contiguous", False),
                                                (6, 48, "zigzag", True), (3, 24, "zigzag", False)],
                                        batch=2, heads=3, head_dim=4, seed=13)
record("hidden", [hidden_pairs, list(big_merged), [[row["out"], row["lse"]] for row in hidden_rings]],
       rtol=1e-5, atol=1e-6)
check(torch.isfinite(big_merged[0]).all(), "hidden: scores near 5000 in float64 must merge to finite values")
### END HIDDEN TESTS
