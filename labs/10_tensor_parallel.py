# %% [markdown]
# # Lab 10 — Tensor and sequence parallelism
#
# Data parallelism (labs 08-09) gives every rank the whole model and a slice of the batch. Tensor
# parallelism (TP, Megatron-LM: Shoeybi et al. 2019) does the opposite: every rank sees the
# **whole batch** and holds a **slice of every weight matrix**, so a layer too big for one device
# is computed by several at once. The price is communication inside every layer. This lab builds
# it up and measures each piece:
#
# 1. **a matmul split two ways** on the blackboard (one process), then on 2 ranks;
# 2. **the operators `f` and `g`**, the only communication Megatron needs, and why they are each
#    other's transpose;
# 3. **Megatron's MLP and attention** (heads split, grouped-query K/V heads) equal to the dense
#    block, with one all-reduce forward and one backward per sub-layer, counted;
# 4. **sequence parallelism**: the same bytes as all-gather + reduce-scatter, and the activation
#    memory per rank *measured* next to Korthikanti et al.'s formula;
# 5. **DTensor** doing the same from a declared plan (`parallelize_module`);
# 6. **why TP stays inside a node**: bytes per layer x layers against NVLink, InfiniBand and the
#    loopback of this machine.
#
# Ranks are processes on this machine talking over loopback with **gloo** (on GPUs the same code
# uses NCCL over NVLink), and "memory" is the bytes of CPU tensors autograd saves (on GPUs: CUDA
# memory). The from-scratch layers live in `course_lib.parallel.tensor_parallel`; the rank
# functions of this lab in `course_lib.labs.lab10_tensor_parallel` (spawned ranks can only
# run importable code).

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
WORLD_SIZE = 2  # tensor-parallel ranks; 2 fits a 2-core laptop (and must divide the 2 K/V heads of section 3)
BATCH, SEQ_LEN, D_MODEL = 2, 32, 64  # sections 3-4: one block's input [B, T, C]
STEPS = 30  # section 5: AdamW steps of the dense, scratch-TP and DTensor-TP TinyGPT
TRAIN_BATCH = 8  # section 5: sequences per step (the same on every rank: TP splits the model)
REPEATS = 20  # section 6: timed repetitions per measurement

# %%
import math

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.kit.checks import check
from course_lib.estimate import (ModelShape, accelerator, activation_breakdown_per_layer, comm,
                                 model_flops_per_iteration, tp_comm_bytes_per_layer)
from course_lib.measure import tinygpt_activation_kwargs
from course_lib.model import TinyGPT
from course_lib.parallel import run_ranks
from course_lib.labs import lab10_tensor_parallel as lab_runs
from course_lib.parallel.tensor_parallel import tinygpt_tp_plan

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    SEQ_LEN, D_MODEL, STEPS, REPEATS = 16, 32, 4, 3
torch.set_num_threads(1)  # the single-process parts run in this kernel: one thread, like each rank

# %% [markdown]
# ## 1. A matmul split two ways
#
# A Linear layer computes `y = x W^T`, with `x` of shape `[tokens, in]` and `W` of shape
# `[out, in]`. There are two ways to give each of N ranks a 1/N slice of `W`:
#
# * **by output channels** ("column-parallel": the columns of `y`, i.e. the rows of `W`): each rank
#   computes *some of the outputs* completely, from the whole input. Putting `y` together is a
#   concatenation (an **all-gather**);
# * **by input channels** ("row-parallel": the columns of `W`): each rank reads only *its* input
#   channels and produces a **partial sum** of every output. Putting `y` together is a sum (an
#   **all-reduce**).
#
# On the blackboard first: one process, the "ranks" are just slices.

# %%
torch.manual_seed(0)
x = torch.randn(4, 8)  # 4 tokens, 8 input channels
W = torch.randn(6, 8)  # 6 output channels
y = x @ W.T
W0, W1 = W.chunk(2, dim=0)  # column-parallel: 3 output channels each
y_by_cols = torch.cat([x @ W0.T, x @ W1.T], dim=-1)
Wa, Wb = W.chunk(2, dim=1)  # row-parallel: 4 input channels each ...
xa, xb = x.chunk(2, dim=-1)  # ... and the matching 4 channels of x
y_by_rows = xa @ Wa.T + xb @ Wb.T

A = torch.randn(16, 8)  # an MLP: up (8 -> 16) column-parallel, down (16 -> 8) row-parallel
B = torch.randn(8, 16)
mlp = torch.nn.functional.gelu(x @ A.T) @ B.T
A0, A1 = A.chunk(2, dim=0)
B0, B1 = B.chunk(2, dim=1)
mlp_split = torch.nn.functional.gelu(x @ A0.T) @ B0.T + torch.nn.functional.gelu(x @ A1.T) @ B1.T
print(f"{'split':<40} {'each rank holds':<28} {'combine':<12} {'max |split - dense|':>20}")
blackboard = {"by output channels (column-parallel)": ("W rows [3, 8]", "concatenate", y_by_cols, y),
              "by input channels (row-parallel)": ("W cols [6, 4], x cols [4, 4]", "sum", y_by_rows, y),
              "MLP: up by columns, down by rows": ("A rows [8, 8], B cols [8, 8]", "sum", mlp_split, mlp)}
for name, (holds, how, got, want) in blackboard.items():
    print(f"{name:<40} {holds:<28} {how:<12} {(got - want).abs().max().item():>20.1e}")

# %%
for name, (_, _, got, want) in blackboard.items():
    check(torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"{name}: the pieces put together should give "
          "the dense result up to float rounding; a slice taken along the wrong dim does not")

# %% [markdown]
# **What you should see:** all three equal the dense result to ~1e-6 or better (float rounding: the
# sums run in another order). The third line is Megatron's key observation: a column-parallel layer
# followed by a row-parallel one needs **no communication in between**. The first layer's output
# slice (8 of the 16 hidden channels) is exactly the input slice the second layer needs, and GELU
# acts on each channel separately. Only the final sum crosses the wire.
#
# The same on `WORLD_SIZE` real ranks: each rank keeps only its slice, the recombination is a
# real collective (counted with `course_lib.parallel.wire.count_collectives`), and the library's
# `ColumnParallelLinear` / `RowParallelLinear`, cut from the same `nn.Linear` with `from_linear`,
# must give the same `y`. (Starting ranks is the slow part, so this launch also runs section 2's
# experiments.)

# %%
launched = run_ranks(lab_runs.primitives, WORLD_SIZE, show_output=False)
split, ops = [r["split"] for r in launched], [r["ops"] for r in launched]
print(f"{'rank':>4} {'column: W shard':>16} {'y shard':>8} {'collective':>18} {'max |y - dense|':>16}   "
      f"{'row: W shard':>13} {'collective':>18} {'max |y - dense|':>16}")
for rank, r in enumerate(split):
    print(f"{rank:>4} {str(r['w_col_shape']):>16} {str(r['y_col_shape']):>8} {str(r['col_wire']):>18} "
          f"{r['col_diff']:>16.1e}   {str(r['w_row_shape']):>13} {str(r['row_wire']):>18} {r['row_diff']:>16.1e}")
r0 = split[0]
print(f"\nbytes per rank (ring): all-gather {r0['col_bytes']:.0f} B, all-reduce {r0['row_bytes']:.0f} B "
      f"(y is {4 * 6 * 4} B); before the all-reduce, rank 0's partial sum is off by {r0['partial_vs_y']:.2f}")
print(f"library layers: ColumnParallelLinear {max(r['lib_col_diff'] for r in split):.1e}, "
      f"RowParallelLinear {max(r['lib_row_diff'] for r in split):.1e} from the dense y")

# %%
for rank, r in enumerate(split):
    check(r["col_wire"] == {"all-gather": 1} and r["row_wire"] == {"all-reduce": 1},
          "putting y together should take one all-gather (column split) and one all-reduce (row split)")
    for key in ("col_diff", "row_diff", "lib_col_diff", "lib_row_diff"):
        check(r[key] < 1e-5, f"rank {rank}: {key} = {r[key]:.1e}; the split matmul should equal the dense one "
              "up to rounding. A shard cut along the wrong dim, or a missing collective, does this")
check(r0["partial_vs_y"] > 0.1, "a row-parallel partial sum alone should be far from y: it is only part of the sum")

# %% [markdown]
# **What you should see:** each rank holds half of `W` (`[3, 8]` by output channels, `[6, 4]` by input
# channels) and, after one collective, every rank has the dense `y` to ~1e-7. The all-reduce
# charges twice the bytes of the all-gather: a ring all-reduce is a reduce-scatter followed by an
# all-gather (lab 00), each moving (N-1)/N of the tensor. A lone row-parallel partial sum is
# visibly wrong: the all-reduce is not optional.
#
# ## 2. The operators `f` and `g`
#
# Megatron writes all of TP's communication as two autograd functions:
#
# | operator | forward | backward | where |
# | --- | --- | --- | --- |
# | `f` = `copy_to_tp_region` | identity | all-reduce of the gradient | where a replicated activation enters column-parallel layers |
# | `g` = `reduce_from_tp_region` | all-reduce | identity | after a row-parallel layer |
#
# Why `f` needs an all-reduce in backward: every rank reads the same `x`, but each rank's weight
# shard sends back only its own part of `dL/dx`; the true gradient is the sum over ranks. Why `g`
# needs nothing in backward: its output is the same on every rank, so the gradient arriving from
# above is too, and each rank's partial sum contributed to it with weight 1.
#
# Readable numbers (from the launch of section 1): rank 0 holds `[1, 2, 3, 4]`, rank 1
# `[10, 20, 30, 40]`; `f`'s upstream gradient is `rank + 1` everywhere, `g`'s is the same on both
# ranks.

# %%
for name in ("f", "g"):
    print(f"{name}:  {'rank':>4} {'x':>24} {'forward out':>24} {'grad from above':>22} {'x.grad':>22}   "
          f"collectives fwd / bwd")
    for rank, o in enumerate(ops):
        v = o[name]
        print(f"    {rank:>4} {str(v['x']):>24} {str(v['y']):>24} {str(v['upstream']):>22} {str(v['x_grad']):>22}"
              f"   {v['fwd']} / {v['bwd']}")
adj = ops[0]["adjoint"]
print(f"\nadjoint test: sum_r <f(x)_r, y_r> = {adj['lhs']:.12f}, <x, g(y)> = {adj['rhs']:.12f}")

# %%
for rank, o in enumerate(ops):
    f_, g_ = o["f"], o["g"]
    check(f_["y"] == f_["x"] and f_["x_grad"] == [3.0] * 4, f"rank {rank}: f should pass x through unchanged "
          "and return the SUM of the ranks' upstream gradients (1 + 2 = 3)")
    check(g_["y"] == [11.0, 22.0, 33.0, 44.0] and g_["x_grad"] == g_["upstream"], f"rank {rank}: g should sum "
          "the ranks' tensors and pass the gradient through unchanged")
    check(f_["fwd"] == {} and f_["bwd"] == {"all-reduce": 1} and g_["fwd"] == {"all-reduce": 1} and g_["bwd"] == {},
          "f communicates only in backward and g only in forward: one all-reduce each")
check(abs(adj["lhs"] - adj["rhs"]) <= 1e-9 * abs(adj["lhs"]), "sum_r <f(x)_r, y_r> should equal <x, g(y)>: "
      "g is the transpose of f, which is why each one's backward is the other's forward")

# %% [markdown]
# **What you should see:** `f` leaves `x` alone and hands each rank `1 + 2 = 3` as gradient; `g`
# gives both ranks `[11, 22, 33, 44]` and passes the gradient through. Each is the other's
# **transpose**: seen as linear maps, `f` copies one vector to N ranks and `g` sums N vectors into
# one. The adjoint identity `sum_r <f(x)_r, y_r> = <x, g(y)>` holds for every `x` and `y` (the two
# numbers agree to float64 rounding), and the backward of a linear map is its transpose: so
# `f`'s backward is `g`'s forward and vice versa. Put together, `g(row(act(col(f(x)))))` costs
# exactly one all-reduce forward and one backward. Leave one out and the numbers go wrong in a
# way a loss curve may not show:

# %%
print(f"{'2-layer MLP on 2 ranks':<24} {'fwd':>16} {'bwd':>16} {'max |y - dense|':>16} {'max |x.grad - dense|':>21}")
for variant in ("f and g", "no f", "no g"):
    worst = {k: max(o["mlp"][variant][k] for o in ops) for k in ("y_diff", "x_grad_diff")}
    m = ops[0]["mlp"][variant]
    print(f"{variant:<24} {str(m['fwd']):>16} {str(m['bwd']):>16} {worst['y_diff']:>16.1e} {worst['x_grad_diff']:>21.1e}")
mlp_rows = {v: {k: max(o["mlp"][v][k] for o in ops) for k in ("y_diff", "x_grad_diff")} for v in ("f and g", "no f", "no g")}
check(max(mlp_rows["f and g"].values()) < 1e-5, "with f and g the tensor-parallel MLP should equal the dense one")
check(mlp_rows["no f"]["y_diff"] < 1e-5 < mlp_rows["no f"]["x_grad_diff"],
      "without f the output is still right but the input gradient is only this rank's share")
check(mlp_rows["no g"]["y_diff"] > 1e-3, "without g every rank's output is only a partial sum")

# %% [markdown]
# **What you should see:** without `f` the forward output is still exact and only the *input
# gradient* is wrong (each rank keeps its share of `dL/dx`): the layers below train on a partial
# gradient, silently. Without `g` the output itself is a partial sum. This is why the kit tests
# every layer's gradients against a dense model, not just its loss.
#
# ## 3. Megatron's MLP and attention
#
# A transformer block is two sub-layers, each "column-parallel in, row-parallel out":
#
# * **MLP**: `f` -> `up` (and SwiGLU's `gate`) column-parallel -> activation -> `down` row-parallel -> `g`.
#   Each rank holds `F/N` of the hidden width.
# * **attention**: `f` -> `q, k, v` column-parallel -> attention -> `out` row-parallel -> `g`. Splitting
#   `q`'s output channels in N contiguous blocks gives each rank `H/N` whole **heads**; heads never
#   interact, so attention itself needs no communication. With **grouped-query attention**
#   (`n_kv_heads < n_heads`, query heads share K/V heads) `k` and `v` are split the same way:
#   rank r gets K/V heads `[r Hkv/N, (r+1) Hkv/N)`, exactly the ones its query heads read, as
#   long as N divides `Hkv`.
#
# `TPMLP`, `TPAttention` and `TPBlock` are cut from TinyGPT's dense modules with `from_dense`. One
# launch runs every comparison of this section and the next: a GPT-2 style block (LayerNorm, GELU,
# 4 heads) and a Llama style one (RMSNorm, SwiGLU, RoPE, 4 query heads sharing 2 K/V heads), input
# `[BATCH, SEQ_LEN, D_MODEL]`, each part's output, input gradient and every weight gradient
# against the dense block, collectives counted forward and backward.

# %%
blocks = run_ranks(lab_runs.megatron_blocks, WORLD_SIZE, ("gpt", "llama"), BATCH, SEQ_LEN, D_MODEL,
                   show_output=False)
est = tp_comm_bytes_per_layer(seq_len=SEQ_LEN, micro_batch=BATCH, d_model=D_MODEL, tp=WORLD_SIZE,
                              bytes_per_element=4)
print(f"{'block':<6} {'part':<10} {'heads q/kv':>10} {'forward':>17} {'backward':>17} {'bytes/rank':>10} "
      f"{'max |y diff|':>12} {'|x.grad diff|':>13} {'|grad diff|':>11}")
for kind in ("gpt", "llama"):
    for part in ("mlp", "attention", "block"):
        row = blocks[0][(kind, False, part)]
        worst = {k: max(b[(kind, False, part)][k] for b in blocks) for k in ("y_diff", "x_grad_diff", "grad_diff")}
        heads = "{}/{}".format(*row["heads"]) if "heads" in row else ""
        print(f"{kind:<6} {part:<10} {heads:>10} {str(row['fwd']):>17} {str(row['bwd']):>17} {row['bytes']:>10.0f} "
              f"{worst['y_diff']:>12.1e} {worst['x_grad_diff']:>13.1e} {worst['grad_diff']:>11.1e}")
print(f"\ntp_comm_bytes_per_layer(seq_len={SEQ_LEN}, micro_batch={BATCH}, d_model={D_MODEL}, tp={WORLD_SIZE}, "
      f"bytes_per_element=4): {est.collectives}, {est.bytes_per_rank:.0f} B per rank "
      f"(message {est.message_bytes:.0f} B = B x T x C x 4)")

# %%
for b in blocks:
    for kind in ("gpt", "llama"):
        for part in ("mlp", "attention", "block"):
            row = b[(kind, False, part)]
            for key in ("y_diff", "x_grad_diff", "grad_diff"):
                check(row[key] < 1e-5, f"{kind} {part}: {key} = {row[key]:.1e}; the tensor-parallel {part} should "
                      "equal the dense one (outputs, input gradient, every weight gradient) up to rounding")
            n = 2 if part == "block" else 1
            check(row["fwd"] == {"all-reduce": n} and row["bwd"] == {"all-reduce": n},
                  f"{kind} {part}: expected {n} all-reduce(s) forward and {n} backward (one each way per "
                  f"sub-layer), got {row['fwd']} / {row['bwd']}")
        check(b[(kind, False, "block")]["bytes"] == est.bytes_per_rank,
              f"{kind}: the counted bytes of one block should equal tp_comm_bytes_per_layer exactly")
check(blocks[0][("llama", False, "attention")]["heads"] == (4 // WORLD_SIZE, 2 // WORLD_SIZE),
      f"with 4 query and 2 K/V heads on {WORLD_SIZE} ranks each rank should run {4 // WORLD_SIZE} query "
      f"head(s) and {2 // WORLD_SIZE} K/V head(s)")

# %% [markdown]
# **What you should see:** every difference from the dense block is rounding, for both block
# styles: ~1e-7 for outputs and input gradients, ~1e-6 for weight gradients (larger numbers, each
# a sum over all B x T tokens). Each rank runs 2 of the 4 query heads, and in the Llama block 1 of the 2 K/V heads
# (the one its query heads share). Each sub-layer costs exactly **one all-reduce forward (`g`)
# and one backward (`f`)** of the `[B, T, C]` activation, so a block costs four, and the counted
# bytes equal `tp_comm_bytes_per_layer` to the byte: 4 x 2(N-1)/N x B T C x 4 bytes. Note what is
# *not* on the wire: the weights, their gradients and the attention scores never move. (`q, k,
# v` share one `f`: their input gradients are added locally, then all-reduced once.)
#
# ## 4. Sequence parallelism
#
# Under TP alone, the parts of a block *between* the sub-layers (the norms, the residual adds,
# dropout) are **replicated**: every rank computes them on all `T` tokens and keeps their
# activations. Korthikanti et al. (2022) noticed that these are independent per token, so they
# can be split along the **sequence** instead: each rank keeps `T/N` tokens there. The
# communication changes shape, not size:
#
# * `f` (identity / all-reduce) becomes an **all-gather** of the tokens forward, reduce-scatter backward;
# * `g` (all-reduce / identity) becomes a **reduce-scatter** forward, all-gather backward.
#
# An all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes are the same. The
# launch above also ran every part with `sequence_parallel=True` (input and output: this rank's
# `T/N` tokens).

# %%
est_sp = tp_comm_bytes_per_layer(seq_len=SEQ_LEN, micro_batch=BATCH, d_model=D_MODEL, tp=WORLD_SIZE,
                                 bytes_per_element=4, sequence_parallel=True)
print(f"{'block':<6} {'part':<10} {'forward':>38} {'backward':>38} {'bytes/rank':>10} {'|y diff|':>9} "
      f"{'|grad diff|':>11}")
for kind in ("gpt", "llama"):
    for part in ("mlp", "attention", "block"):
        row = blocks[0][(kind, True, part)]
        worst_y = max(b[(kind, True, part)]["y_diff"] for b in blocks)
        gd = f"{max(b[(kind, True, part)]['grad_diff'] for b in blocks):.1e}" if "grad_diff" in row else ""
        print(f"{kind:<6} {part:<10} {str(row['fwd']):>38} {str(row['bwd']):>38} {row['bytes']:>10.0f} "
              f"{worst_y:>9.1e} {gd:>11}")
sync = {k: blocks[0][(k, True, "block")] for k in ("gpt", "llama")}
print(f"\nestimator, sequence_parallel=True: {est_sp.collectives}, {est_sp.bytes_per_rank:.0f} B per rank "
      f"(without SP: {est.bytes_per_rank:.0f} B)")
print("after backward, sync_sequence_parallel_grads all-reduces the replicated parameters that saw only this "
      f"rank's tokens: {sync['gpt']['synced_params']} in the GPT block (2 norms' weight and bias, 2 row biases), "
      f"{sync['llama']['synced_params']} in the Llama block (2 RMSNorm weights)")

# %%
for b in blocks:
    for kind in ("gpt", "llama"):
        blk = b[(kind, True, "block")]
        check(blk["fwd"] == blk["bwd"] == {"all-gather": 2, "reduce-scatter": 2},
              f"{kind}: with SP each sub-layer should enter with an all-gather and leave with a reduce-scatter, "
              f"forward and (mirrored) backward; got {blk['fwd']} / {blk['bwd']}")
        check(blk["bytes"] == est_sp.bytes_per_rank == est.bytes_per_rank,
              f"{kind}: SP should move exactly the bytes of TP alone, and equal the estimator")
        for key in ("y_diff", "x_grad_diff", "grad_diff"):
            check(blk[key] < 1e-5, f"{kind} SP block: {key} = {blk[key]:.1e}; this rank's tokens of the output and "
                  "every gradient (after the sync) should equal the dense block's")

# %% [markdown]
# **What you should see:** the all-reduces are gone; in their place 2 all-gathers and 2
# reduce-scatters each way per block, and the **same bytes** as without SP, equal to the
# estimator. The outputs are this rank's tokens of the dense output. One new chore: a norm weight
# (and a row-parallel bias) is replicated but, under SP, sees only this rank's tokens, so its
# gradient is a partial sum until one extra all-reduce of these small vectors over the
# tensor-parallel ranks (Megatron-LM packs them into a single all-reduce after backward).
#
# ### The memory SP saves, measured
#
# What SP buys is **activation memory**. The launch also measured, on each rank, the bytes autograd
# saves for backward in one block's forward (`course_lib.measure.saved_activation_bytes`: a
# saved-tensor hook that adds each storage once). Next to it, Korthikanti et al.'s accounting,
# `activation_breakdown_per_layer(..., tp=, sequence_parallel=)`, with TinyGPT's own settings
# (`tinygpt_activation_kwargs`: fp32, no dropout, fused "flash" attention, the norms' statistics,
# K/V repeated to every query head).

# %%
mem_rows = []
print(f"{'block':<6} {'setting':<10} {'measured B/rank':>15} {'estimated':>10} {'measured - est.':>15}  "
      "norms / attention / MLP measured")
for kind in ("gpt", "llama"):
    cfg = lab_runs.block_config(kind, SEQ_LEN, D_MODEL)
    kw = tinygpt_activation_kwargs(cfg, seq_len=SEQ_LEN, micro_batch=BATCH)
    for label, tp, sp in (("tp=1", 1, False), (f"tp={WORLD_SIZE}", WORLD_SIZE, False),
                          (f"tp={WORLD_SIZE} + SP", WORLD_SIZE, True)):
        saved = blocks[0][(kind, sp, "saved")]
        groups = saved["dense_groups"] if tp == 1 else saved["tp_groups"]
        measured = saved["dense"] if tp == 1 else saved["tp"]
        estimated = activation_breakdown_per_layer(**kw, tp=tp, sequence_parallel=sp)
        mem_rows.append((kind, label, measured, estimated, groups))
        print(f"{kind:<6} {label:<10} {measured:>15,} {estimated.total:>10,.0f} {measured - estimated.total:>15,.0f}  "
              f"{groups['norms']:,} / {groups['attention']:,} / {groups['mlp']:,}")
gathered = 2 * 4 * SEQ_LEN * BATCH * D_MODEL * (1 - 1 / WORLD_SIZE)
print(f"\n2 x (1 - 1/N) x B T C x 4 bytes = {gathered:,.0f} B: the all-gathered inputs of q/k/v and of the MLP, "
      "kept whole (see below)")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
ax = axes[0]
colors = {"norms": "tab:blue", "attention": "tab:orange", "mlp": "tab:green"}
gpt_rows = [r for r in mem_rows if r[0] == "gpt"]
for i, (_, label, measured, estimated, groups) in enumerate(gpt_rows):
    bottom = 0
    for g, color in colors.items():
        ax.bar(i - 0.2, groups[g] / 1024, 0.38, bottom=bottom / 1024, color=color, label=g if i == 0 else None)
        bottom += groups[g]
    ax.bar(i + 0.2, estimated.total / 1024, 0.38, color="grey", alpha=0.5, label="estimate" if i == 0 else None)
ax.set_xticks(range(len(gpt_rows)), [r[1] for r in gpt_rows])
ax.set(ylabel="KiB saved per rank, one block", title=f"GPT block [{BATCH}, {SEQ_LEN}, {D_MODEL}]: measured (left) vs estimate")
ax.legend(fontsize=8)
# the same accounting at scale, with the paper's own assumptions (bf16, dropout, eager attention)
GPT3 = dict(seq_len=2048, micro_batch=1, d_model=12288, n_heads=96)
ts = [1, 2, 4, 8]
for label, kw, style in (("TP", {}, "o-"), ("TP + SP", {"sequence_parallel": True}, "s-"),
                         ("TP + selective recompute", {"recompute": "selective"}, "v--"),
                         ("TP + SP + selective recompute", {"sequence_parallel": True, "recompute": "selective"}, "^-")):
    axes[1].plot(ts, [activation_breakdown_per_layer(**GPT3, tp=t, **kw).total / 2**20 for t in ts], style, label=label)
axes[1].set(xlabel="tensor-parallel size t", ylabel="MiB per rank, one layer", yscale="log",
            title="GPT-3 175B layer (s=2048, b=1), Korthikanti's assumptions")
axes[1].set_xticks(ts, [str(t) for t in ts])
axes[1].grid(alpha=0.3, which="both")
axes[1].legend(fontsize=8)
plt.show()

# %%
for kind, label, measured, estimated, groups in mem_rows:
    expected_excess = gathered if label.endswith("SP") else 0
    check(measured - estimated.total == expected_excess,
          f"{kind} {label}: measured {measured:,} B vs estimated {estimated.total:,.0f} B; the only difference "
          f"should be the kept all-gathered inputs ({expected_excess:,.0f} B); anything else means a tensor is "
          "saved that the accounting does not know about")
check(all(r[4]["norms"] * WORLD_SIZE == s[4]["norms"] for r, s in zip(mem_rows[2::3], mem_rows[1::3])),
      f"with SP the norms should keep 1/{WORLD_SIZE} of the bytes: each rank sees 1/{WORLD_SIZE} of the tokens")
shrink = {(r[0], part): s[4][part] / r[4][part] for r, s in zip(mem_rows[0::3], mem_rows[1::3])
          for part in ("attention", "mlp")}
print("TP's share of the attention and MLP activations: "
      + ", ".join(f"{kind} {part} x{v:.2f}" for (kind, part), v in shrink.items()))
check(all(1 / WORLD_SIZE < v < 0.8 for v in shrink.values()),
      f"tp={WORLD_SIZE} should shrink the attention and MLP activations, but by less than {WORLD_SIZE}x: "
      "each sub-layer's [B, T, C] input stays whole on every rank")

# %% [markdown]
# **What you should see:** TP alone (`tp=2`) shrinks the attention and MLP activations without
# halving them (the printed factors): what is split by heads and hidden channels halves, but each
# sub-layer's `[B, T, C]` input, read by q/k/v or by the MLP's first projection, is whole on every
# rank. The **norms** do not shrink at all: they are replicated. SP halves
# the norms too. Measured and estimated agree **to the byte** for `tp=1` and `tp=2`. With SP the
# measurement sits above the estimate by exactly 2 x (1 - 1/N) x B T C x 4 bytes, and that is an
# implementation choice, not a measurement error: the all-gathered `[B, T, C]` input of `q/k/v`
# (and of the MLP's `up`) is needed again in backward for the weight gradients. This kit's
# `ColumnParallelLinear` simply keeps the gathered tensor; Megatron-LM, whose numbers Korthikanti
# et al. report, keeps only its `T/N` shard and **all-gathers it again in backward** (overlapped
# with the input-gradient matmul), trading one more all-gather per sub-layer for the memory.
#
# The right panel is the paper's setting (bf16, dropout masks, attention that stores its `s x s`
# scores): per layer `sbh(10 + 24/t + 5as/(ht))` with TP and `sbh/t (34 + 5as/h)` with TP+SP. At
# GPT-3's shape the scores term (`5as/h` = 80) dominates and already divides by t, so SP's gain
# looks modest; once selective recomputation (lab 04) drops the scores, TP alone is left with
# `sbh(10 + 24/t)`, whose replicated `10 sbh` never shrinks (the flattening dashed curve), while
# with SP everything divides by t: `34 sbh/t`.
# (TinyGPT's fused attention keeps no `s x s` scores at all, which is why its blocks are so much
# smaller relative to `sbh`.)
#
# ## 5. DTensor: the same layout, declared
#
# Everything so far wrote the collectives by hand. PyTorch's production path **declares** the
# layout instead: a plan maps module paths to `ParallelStyle`s (which weights are split along
# which dim, which layout each activation has where it enters and leaves a module), and
# `parallelize_module` turns the weights into **DTensors** and inserts the collectives.
# `course_lib.parallel.tensor_parallel.parallelize_tinygpt` applies this plan to a TinyGPT (with
# sequence parallelism here); building the plan needs no ranks:

# %% tags=["nbval-check-output"]
plan = tinygpt_tp_plan(TinyGPT(lab_runs.lab_model_config("llama")), sequence_parallel=True)
for path, style in plan.items():
    print(f"{path:<24} {lab_runs.describe_style(style)}")

# %% [markdown]
# `Shard(dim=1)` is "this rank's tokens" (sequence parallelism), `Replicate()` "the whole tensor on
# every rank", `Shard(dim=-1)` "this rank's channels". `PrepareModuleInput` on `attn` and `mlp` is
# where `f` (here: the all-gather) happens, once per sub-layer; `RowwiseParallel`'s output layout
# `Shard(dim=1)` is the reduce-scatter (`g`). The `lm_head` keeps its logits split over the
# vocabulary, and the loss runs under `loss_parallel()`, so the `[B, T, vocab]` logits are never
# gathered.
#
# The experiment: `STEPS` AdamW steps of a Llama-style TinyGPT (RMSNorm, SwiGLU, RoPE, grouped-query
# attention, untied head) on the synthetic Markov task, three ways on the same batches: dense (each
# rank computes it locally, the reference), the from-scratch `tp_tinygpt` and DTensor's
# `parallelize_tinygpt`, both with SP on `WORLD_SIZE` ranks.

# %%
run = run_ranks(lab_runs.dtensor_vs_scratch, WORLD_SIZE, STEPS, TRAIN_BATCH, "llama", D_MODEL, 2, SEQ_LEN,
                show_output=False, timeout=600)[0]
losses = run["losses"]
print(f"TinyGPT, {run['num_params']:,} parameters; parameter layouts on rank 0 (blocks.0 and the ends):")
print(f"{'parameter':<30} {'placements':<20} {'local shape':>12} {'global shape':>13}")
for name, place, local, full in run["layouts"]:
    if name.startswith("blocks.") and not name.startswith("blocks.0."):
        continue
    print(f"{name:<30} {place:<20} {str(local):>12} {str(full):>13}")

# %%
rel = {k: [abs(a - b) / b for a, b in zip(losses[k], losses["dense"])] for k in ("scratch", "dtensor")}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
ax1.plot(losses["dense"], "k-", lw=4, alpha=0.3, label="dense, 1 process")
ax1.plot(losses["scratch"], "--", label=f"from scratch (tp_tinygpt), {WORLD_SIZE} ranks")
ax1.plot(losses["dtensor"], ":", lw=2, label=f"DTensor (parallelize_tinygpt), {WORLD_SIZE} ranks")
ax1.set(xlabel="step", ylabel="loss (nats/token)", title="TP + SP training: three curves on one")
ax1.legend(fontsize=8)
for k, marker in (("scratch", "o"), ("dtensor", "x")):
    ax2.semilogy([max(r, 1e-9) for r in rel[k]], marker, ls="none", label=k)
ax2.axhline(1e-5, color="red", ls=":", label="tolerance 1e-5")
ax2.set(xlabel="step", ylabel="|TP - dense| / dense", ylim=(5e-10, 1e-3), title="relative difference (bottom: equal)")
ax2.legend(fontsize=8)
plt.show()
first = run["first"]
print(f"first step, max |gradient - dense|: scratch {first['grad_diff']['scratch']:.1e}, "
      f"DTensor {first['grad_diff']['dtensor']:.1e}")
print(f"collectives in one forward + backward: scratch {first['scratch_wire']}, DTensor {first['dtensor_comm']}")
print(f"median forward + backward: scratch {run['times_ms']['scratch']:.0f} ms, DTensor "
      f"{run['times_ms']['dtensor']:.0f} ms ({run['times_ms']['dtensor'] / run['times_ms']['scratch']:.1f}x)")

# %%
worst_rel = max(max(r) for r in rel.values())
check(worst_rel < 1e-5, f"a TP loss curve differs from the dense one by up to {worst_rel:.1e} (relative): more than "
      "fp32 rounding. Every rank must see the same batch; a missing reduction or gradient sync does this")
check(max(first["grad_diff"].values()) < 1e-5, "after the first backward every gradient should equal the dense one")
check(losses["dense"][-1] < losses["dense"][0] - (0.01 if SMOKE else 0.5), "the loss should fall in this run: "
      "is the learning rate or the data wrong?")
check(first["dtensor_comm"].get("all_gather_into_tensor") == first["scratch_wire"].get("all-gather")
      and first["dtensor_comm"].get("reduce_scatter_tensor") == first["scratch_wire"].get("reduce-scatter"),
      "DTensor should issue the same all-gathers and reduce-scatters as the hand-written layers")

# %% [markdown]
# **What you should see:** sharded weights are `Shard(dim=0)` (column-parallel: `q/k/v`, `gate`,
# `up`, the vocabulary rows of `tok_emb` and `lm_head`) or `Shard(dim=1)` (row-parallel: `out_proj`,
# `down`), each holding half the global shape; the norms are `Replicate()`. The three loss curves
# lie on each other (relative differences ~1e-7) and the first gradients agree to ~1e-8. Both
# paths issue the same all-gathers and reduce-scatters; the all-reduces differ by one (DTensor's
# parallel loss uses three small ones, max / sum / target logit, where the scratch loss packs two
# into one); the remaining small all-reduces are the norms' SP gradient sync. The price of
# declaring instead of writing is speed on CPU: DTensor dispatches every op through its sharding
# rules, which on these tiny matrices costs more than the math (one noisy number; on GPUs with
# real layer sizes the difference shrinks).
#
# ## 6. Why TP stays inside a node
#
# Data parallelism communicates once per step (the gradients) and can hide it behind backward.
# TP communicates **inside every layer, on the critical path**: the next matmul needs the
# all-reduced activation. Per micro-batch and rank, that is `L` layers x 4 collectives of
# `s b h` elements. First this machine: we fit lab 00's alpha-beta model to gloo all-reduces and
# replay the collectives that one TinyGPT step of section 5 issued (their sizes as the wire
# counter recorded them), alone, back to back.

# %%
sizes = [2**k for k in range(10, 23 if SMOKE else 25, 2)]  # bytes per rank: 1 KiB .. 16 MiB
calls = first["scratch_calls"]  # (kind, elements of the full tensor, dtype), as recorded in section 5
# the same step without SP: each all-gather + reduce-scatter pair is one all-reduce of the same tensor
as_all_reduce = [("all-reduce", n, d) for kind, n, d in calls if kind != "all-gather"]
replays = {"TP + SP (as recorded)": calls, "TP (all-reduces)": as_all_reduce}
timed = run_ranks(lab_runs.comm_timings, WORLD_SIZE, sizes, replays, REPEATS, show_output=False)[0]
fit = comm.fit_alpha_beta(sizes, timed["sweep"], collective="all-reduce", n_ranks=WORLD_SIZE)
step_alpha = fit.alpha_s / comm.ring_steps("all-reduce", WORLD_SIZE)  # latency per ring step
LOOPBACK = fit.bandwidth_bytes_per_s
if fit.seconds_per_byte == 0:
    # The noise of a busy machine hid the per-byte cost (a flat fit: infinite bandwidth). The
    # largest message is the one where bytes matter most: take its own bandwidth instead.
    LOOPBACK = comm.ring_bytes_per_rank("all-reduce", sizes[-1], WORLD_SIZE) / timed["sweep"][-1]
    print("the fit found no size-dependent time (noise); bandwidth taken from the largest message alone")
print(f"loopback fit: alpha = {fit.alpha_s * 1e6:.0f} us per all-reduce, bus bandwidth {LOOPBACK / 1e9:.2f} GB/s "
      f"(R^2 = {fit.r_squared:.2f})\n")
print(f"{'one TinyGPT step':<24} {'collectives':>11} {'ring kB/rank':>12} {'predicted':>10} {'measured alone':>15}")
replay_rows = {}
for name, cl in replays.items():
    ring = sum(comm.ring_bytes_per_rank(kind, n * 4, WORLD_SIZE) for kind, n, _ in cl)
    pred = sum(comm.collective_time(kind, n * 4, WORLD_SIZE, alpha_s=step_alpha, bandwidth_bytes_per_s=LOOPBACK)
               for kind, n, _ in cl)
    replay_rows[name] = (ring, pred, timed["replay"][name])
    print(f"{name:<24} {len(cl):>11} {ring / 1e3:>12.0f} {pred * 1e3:>7.1f} ms {timed['replay'][name] * 1e3:>12.1f} ms")
print(f"\nthe whole scratch forward + backward of that step took {run['times_ms']['scratch']:.0f} ms (section 5)")
check(replay_rows["TP + SP (as recorded)"][0] == replay_rows["TP (all-reduces)"][0],
      "the SP step and its all-reduce version should put the same bytes on the wire")
check(all(p > 0 and m > 0 for _, p, m in replay_rows.values()), "predictions and replays should be positive times")
check(all(p < 0.1 for _, p, _ in replay_rows.values()),
      "small messages: the predicted time of one step's collectives should be milliseconds, not seconds")

# %% [markdown]
# **What you should see:** the two versions put the same bytes on the wire, and both are predicted
# at milliseconds, not seconds (a few to a few tens, depending on this machine's latency): every
# message is small (tens of kB), so the latency alpha, paid once per
# collective, is most of it. The measured times sit above the prediction by a factor that
# changes from run to run (two busy cores shared by both ranks and everything else on the
# machine: trust the order of magnitude, not the digits), and they are a large part of the whole
# forward + backward: even a tiny model waits on TP's collectives when the link is slow. Gloo's
# CPU all-gather and reduce-scatter are often slower than its all-reduce for the same bytes;
# NCCL's ring all-reduce *is* a reduce-scatter plus an all-gather, so on GPUs SP's traffic costs
# what TP's does. A stand-in shows the algorithm; the timings belong to the backend.
#
# On a real model the messages are tens of MB and the bytes dominate. The estimate for **Llama 2 70B** (80 layers, h = 8192, s = 4096, one sequence per
# micro-batch, bf16 activations) per rank, against public link speeds:
#
# | link | bandwidth per GPU, one direction | source |
# | --- | --- | --- |
# | NVLink 4 (H100 SXM, inside a node) | 450 GB/s (900 GB/s both directions) | NVIDIA H100 Tensor Core GPU datasheet |
# | InfiniBand NDR (between nodes) | 400 Gb/s = 50 GB/s per port | NVIDIA ConnectX-7 / Quantum-2 NDR product pages |
# | InfiniBand HDR (between nodes) | 200 Gb/s = 25 GB/s per port | NVIDIA ConnectX-6 / Quantum HDR product pages |
#
# (A DGX/HGX H100 node has 8 GPUs on NVLink and one 400 Gb/s port per GPU.) Compute time is the
# model FLOPs of one micro-batch (`model_flops_per_iteration`) divided over the `t` GPUs at an
# assumed 50% MFU of an H100's dense bf16 peak. Only the bandwidth term is counted (the latency
# adds 320 x a few microseconds).

# %% tags=["nbval-check-output"]
LLAMA70B = ModelShape.preset("llama2-70b")
S, MB, BYTES = LLAMA70B.seq_len, 1, 2
LINKS = {"NVLink 4": 450e9, "InfiniBand NDR": 50e9, "InfiniBand HDR": 25e9}
MFU = 0.5
peak = accelerator("h100-sxm5-80gb").peak_flops("bf16")
TPS = [2, 4, 8, 16]
scale_rows = {}
print(f"{'t':>3} {'GB/rank/layer':>14} {'GB/rank/micro-batch':>20} {'compute':>9}   " +
      "   ".join(f"{name:>15}" for name in LINKS))
for t in TPS:
    per_layer = tp_comm_bytes_per_layer(seq_len=S, micro_batch=MB, d_model=LLAMA70B.d_model, tp=t,
                                        bytes_per_element=BYTES).bytes_per_rank
    total = per_layer * LLAMA70B.n_layers
    compute = model_flops_per_iteration(LLAMA70B, batch=MB) / t / (MFU * peak)
    times = {name: (total / bw if (name != "NVLink 4" or t <= 8) else math.nan) for name, bw in LINKS.items()}
    scale_rows[t] = (total, compute, times)
    print(f"{t:>3} {per_layer / 1e9:>14.3f} {total / 1e9:>20.1f} {compute * 1e3:>6.0f} ms   " +
          "   ".join(f"{'(> 8 GPUs)' if math.isnan(v) else f'{v * 1e3:.0f} ms':>15}" for v in times.values()))
check(scale_rows[8][2]["NVLink 4"] < scale_rows[8][1] < scale_rows[8][2]["InfiniBand NDR"],
      "at t=8 the TP traffic should take less time than the compute on NVLink and more on InfiniBand")

# %%
fig, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
for name, style in zip(LINKS, ("o-", "s-", "^-")):
    ax.plot(TPS, [scale_rows[t][2][name] for t in TPS], style, label=f"{name} ({LINKS[name] / 1e9:.0f} GB/s)")
ax.plot(TPS, [scale_rows[t][0] / LOOPBACK for t in TPS], "x--", color="grey",
        label=f"this machine's loopback ({LOOPBACK / 1e9:.1f} GB/s, measured)")
ax.plot(TPS, [scale_rows[t][1] for t in TPS], "k-", lw=3, alpha=0.4, label=f"compute at {MFU:.0%} MFU (H100 bf16)")
ax.axvspan(11, 17, color="tab:red", alpha=0.08, label="t > 8: the ring crosses nodes")
ax.set(xscale="log", yscale="log", xlabel="tensor-parallel size t",
       ylabel="seconds per micro-batch, per rank", title="Llama 2 70B: TP traffic time vs compute time")
ax.set_xticks(TPS, [str(t) for t in TPS])
ax.minorticks_off()
ax.grid(alpha=0.3)
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()
print(f"this machine's loopback at t=8: {scale_rows[8][0] / LOOPBACK:.0f} s of traffic per micro-batch")
print(f"traffic per rank from t = 2 to 16: x{scale_rows[16][0] / scale_rows[2][0]:.2f}")
check(1.5 < scale_rows[16][0] / scale_rows[2][0] < 2,
      "the ring factor 2(t-1)/t goes from 1 to 1.875: the traffic per rank should almost double from t = 2 to 16")
check(scale_rows[8][0] / LOOPBACK > scale_rows[8][2]["InfiniBand HDR"],
      "this machine's loopback should be slower than any of the links above")

# %% [markdown]
# **What you should see:** the traffic per rank *grows* with t, almost doubling from t = 2 to 16
# (the ring factor 2(t-1)/t goes from 1 towards 2), while the compute per rank *shrinks* as 1/t:
# TP gets less efficient the wider it is. Inside a node, over NVLink, the ~38 GB per micro-batch at t = 8 take ~85 ms
# against ~460 ms of compute: affordable, and Megatron overlaps part of it. Over InfiniBand the
# same traffic takes ~750 ms, longer than the compute, and at t = 16 the ring must cross nodes,
# so even the NVLink hops wait for the slowest link. That is why TP is kept to the GPUs of one
# node (t <= 8) and the rest of the scale comes from pipeline and data parallelism, whose traffic
# per step is far smaller or can be overlapped. This machine's loopback, at the bandwidth fitted
# above, is slower than every link in the table: it would spend seconds per micro-batch on
# communication alone (the dashed line; the printed figure).
#
# ## Where next
#
# * **Exercise 10** builds the column- and row-parallel layers and `f`/`g` yourself.
# * **Lab 04** for selective recomputation, which removes the attention-score term that SP
#   leaves; **lab 09** for ZeRO/FSDP, which shards the model state across the data-parallel ranks.
# * Pipeline parallelism (`course_lib.parallel.pipeline`) splits the *layers* over ranks instead;
#   its traffic is one activation per stage boundary, which is what crosses nodes in 3-D parallelism.
