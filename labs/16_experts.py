# %% [markdown]
# # Lab 16 — Experts: mixture-of-experts and expert parallelism
#
# Take this lab after lab 15. A **mixture-of-experts** (MoE) layer replaces a transformer block's
# MLP with `E` smaller MLPs, the *experts*, and a *router* that sends each token to `k` of them.
# Only those `k` run, so the model holds far more parameters than one token uses. This lab:
#
# 1. **why experts**: parameters held against parameters used per token, from the estimator and a
#    real model;
# 2. **the router, watched while training**: tokens per expert at every step, with no balancing,
#    with the balancing loss and with the expert bias;
# 3. **capacity**: what a fixed number of slots per expert drops;
# 4. **expert parallelism**: dispatch and combine, their code, drawn rank by rank; 2 gloo ranks
#    equal to one process, and the all-to-all bytes predicted before they are measured;
# 5. **DeepSeek-V3's layout**, recomputed by hand from the planner's numbers.
#
# Ranks are processes on this machine talking over loopback with **gloo** (on GPUs the same code
# uses NCCL). The lab's rank functions live in `course_lib.labs.lab16_experts`; the MoE layer in
# `course_lib.model.moe`, expert parallelism in `course_lib.parallel.expert_parallel`.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
STEPS = 40  # section 2: training steps per balancing mode
EP = 2  # section 4: gloo ranks

# %%
import inspect

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.estimate import alltoall_bytes_per_layer, alltoall_bytes_per_token, moe_flops_per_token, moe_preset
from course_lib.estimate.moe import expert_data_parallel
from course_lib.kit.checks import check
from course_lib.labs import lab16_experts as lab_runs
from course_lib.model import ModelConfig, TinyGPT

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    STEPS = 6
torch.set_num_threads(1)

# %% [markdown]
# ## 1. Why experts
#
# The kit's `moe-tiny` model: 2 blocks of width 64, each MLP replaced by 8 SwiGLU experts of width
# 32, top 2. Next to it, a dense model whose MLP is exactly as wide as the two experts a token
# passes through (64). Per token both do the same matrix multiplies; the MoE holds four times the
# expert weights.

# %%
moe_net = TinyGPT(lab_runs.moe_config())
dense_net = TinyGPT(ModelConfig.preset("moe-tiny", moe_experts=None, d_ff=64))
router = sum(m.router.proj.weight.numel() for m in lab_runs.moe_layers(moe_net))
print(f"moe-tiny: {moe_net.num_params():,} parameters, {moe_net.num_active_params():,} used per token")
print(f"dense, MLP width 64: {dense_net.num_params():,} parameters (+ {router:,} router weights = "
      f"{dense_net.num_params() + router:,})")
check(moe_net.num_active_params() == dense_net.num_params() + router,
      "the parameters one token uses should be the dense model's plus the routers'")

print(f"\n{'model':<16} {'total':>9} {'active':>9} {'total/active':>12} {'train GFLOP/token':>18}")
published = {}
for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"):
    shape = moe_preset(name)
    published[name] = (shape.num_params() / 1e9, shape.active_params() / 1e9)
    print(f"{name:<16} {shape.num_params() / 1e9:>8.1f}B {shape.active_params() / 1e9:>8.1f}B "
          f"{shape.num_params() / shape.active_params():>12.1f} {moe_flops_per_token(shape) / 1e9:>18.0f}")
check(round(published["deepseek-v3"][0]) == 671 and round(published["deepseek-v3"][1], 1) == 37.6,
      "DeepSeek-V3 should hold 671B parameters and use 37.6B per token")
ratios = {name: total / active for name, (total, active) in published.items()}
check(ratios["mixtral-8x7b"] < 4 and 17.5 < ratios["deepseek-v3"] < 18.5,
      "Mixtral's total/active should be under 4, DeepSeek-V3's about 18")
check(1.8 < moe_net.num_params() / moe_net.num_active_params() < 2,
      "moe-tiny should hold about twice (1.8-2x) the parameters one token uses")

# %% [markdown]
# **What you should see:** moe-tiny uses per token exactly the dense model's parameters plus its
# routers, and holds about twice as many. DeepSeek-V3 holds 671B parameters and uses 37.6B per
# token (the paper rounds to 37B): its training FLOPs per token are those of a 37.6B dense model
# (MFU counts the active parameters), its memory that of a 671B one. Mixtral holds under 4 times
# what it uses, DeepSeek-V3 about 18 times: many small experts, 8 of 256 per token.

# %% [markdown]
# ## 2. The router, watched while training
#
# The router is one matrix: a score per expert for every token, the `k` highest win. Nothing in
# the language-model loss asks it to spread the tokens, and an expert that gets more tokens learns
# faster and scores higher next time. Three runs of `STEPS` steps on the kit's own text, the same
# data and seed:
#
# * **none**: only the language-model loss;
# * **balancing loss** (Switch, GShard): add `coef × E × Σᵢ fᵢ Pᵢ` (`fᵢ` the share of tokens
#   routed to expert i, `Pᵢ` its mean router probability), 1.0 when uniform;
# * **expert bias** (DeepSeek-V3): no extra loss; after every step each expert's bias (added to
#   its score only to *choose*, never to weigh) moves by `rate` toward balance: down if the expert
#   got more than the mean, up if less.
#
# With 8 experts and top 2, the worst case is every token on the same 2 experts: the busiest gets
# 4 times the mean (`E / k`).

# %%
runs = {mode: lab_runs.train_router(mode, STEPS) for mode in lab_runs.BALANCING}
E = runs["none"]["load"][0].shape[1]
fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
for ax, (mode, r) in zip(axes, runs.items()):
    load = r["load"][0].float()
    ax.stackplot(range(STEPS), load.T, labels=[f"expert {e}" for e in range(E)], cmap=None)
    ax.set(title=f"{mode}: tokens per expert (block 0)", xlabel="step", ylabel="token copies")
for mode, r in runs.items():
    axes[3].plot(r["max_over_mean"][0], label=mode)
axes[3].axhline(E / 2, color="grey", ls=":", label="all on 2 experts")
axes[3].set(title="busiest expert / mean (block 0)", xlabel="step", ylim=(1, E / 2 + 0.3))
axes[3].legend(fontsize=8)
axes[0].legend(fontsize=6, ncol=2, loc="lower left")
fig.tight_layout()
plt.show()
tail = max(1, STEPS // 4)
late = {mode: sum(r["max_over_mean"][0][-tail:]) / tail for mode, r in runs.items()}
tokens = runs["none"]["load"][0][0].sum().item()
print(f"token copies per step: {tokens} (4 x 32 tokens, 2 experts each)")
for mode, r in runs.items():
    print(f"{mode:<15} loss at the end {sum(r['loss'][-tail:]) / tail:.3f}   busiest/mean over the last {tail} "
          f"steps: {late[mode]:.2f}")
check(all((r["load"][0].sum(1) == tokens).all() for r in runs.values()),
      "every step the router should place exactly tokens x k copies")

# %%
if not SMOKE:
    check(late["none"] > 3.5, f"without balancing the busiest expert should end above 3.5 x the mean, got {late['none']:.2f}")
    check(late["balancing loss"] < late["none"] - 1.0,
          "the balancing loss should bring the busiest expert at least 1.0 closer to the mean than no balancing")
    check(late["expert bias"] < late["none"] - 0.5,
          "the expert bias should bring the busiest expert at least 0.5 closer to the mean than no balancing")

# %% [markdown]
# **What you should see:** without balancing the router *collapses*: within a few steps nearly
# every token goes to the same two experts (busiest over mean above 3.5, the ceiling being 4) and
# the other six learn nothing. The balancing loss keeps the busiest expert at least 1.0 closer to
# the mean, the expert bias at least 0.5 closer, at about the same language-model loss. Both rates
# here are far above the published ones (0.01 and 0.001), so that 40 steps show what 100,000s do.

# %% [markdown]
# ## 3. Capacity and dropped tokens
#
# On a GPU an expert's batch must have a fixed size for fast kernels and a fixed memory budget,
# so many systems give every expert `capacity = ⌈c · N · k / E⌉` slots for `N` tokens (`c` the
# *capacity factor*). The tokens an expert cannot take are **dropped**: they skip that expert and
# the residual stream carries them on unchanged. "Dropless" MoE (Megatron's default, DeepSeek-V3)
# has no capacity and pays for imbalance in memory instead.
#
# Predict first: for one batch of 128 tokens, top 2 of 8 experts and `c = 1.25`, how many slots
# does each expert get?

# %%
my_capacity_slots = None  # your prediction: slots per expert for N = 128, k = 2, E = 8, c = 1.25

# %%
FACTORS = [0.5, 1.0, 1.25, 1.5, 2.0, 4.0, None]
cap_rows = {}
for mode in ("none", "balancing loss"):
    cap_rows[mode], load_now, n_tok = lab_runs.capacity_rows(runs[mode]["model"], FACTORS)
    print(f"{mode}: load per expert on this batch {load_now.tolist()}")
lab_runs.show_prediction("slots per expert at c = 1.25", my_capacity_slots, cap_rows["none"][2]["capacity"],
                         why="c x N x k / E = 1.25 x 128 x 2 / 8, rounded up")
print(f"\n{'factor':>7} {'slots':>6} | {'dropped (none)':>15} {'no expert':>9} | {'dropped (loss)':>15} {'no expert':>9}")
for a, b in zip(cap_rows["none"], cap_rows["balancing loss"]):
    f = "dropless" if a["factor"] is None else f"{a['factor']:g}"
    print(f"{f:>7} {str(a['capacity']):>6} | {a['dropped %']:>14.1f}% {a['tokens with no expert']:>9} | "
          f"{b['dropped %']:>14.1f}% {b['tokens with no expert']:>9}")
fig, ax = plt.subplots(figsize=(5.5, 3.2))
for mode, rows in cap_rows.items():
    ax.plot([r["factor"] for r in rows[:-1]], [r["dropped %"] for r in rows[:-1]], "o-", label=f"router trained with {mode}")
ax.set(xlabel="capacity factor c", ylabel="token copies dropped (%)", title="what capacity drops (block 0, 128 tokens)")
ax.legend(fontsize=8)
plt.show()
check(n_tok == 128 and cap_rows["none"][2]["capacity"] == 40, "N = 128, k = 2, E = 8, c = 1.25: 40 slots per expert")
check(all(r[-1]["dropped"] == 0 for r in cap_rows.values()), "dropless should drop nothing")
check(all(a["dropped"] >= b["dropped"] for rows in cap_rows.values() for a, b in zip(rows, rows[1:-1])),
      "a larger capacity factor should never drop more")
check(cap_rows["none"][2]["dropped"] > cap_rows["balancing loss"][2]["dropped"],
      "at c = 1.25 the collapsed router should drop more than the balanced one")
check(all(r["dropped"] > 0 for r in cap_rows["none"][:5]) and cap_rows["none"][5]["dropped"] == 0,
      "the collapsed router should drop token copies at every factor below 4, none at 4")
check(cap_rows["none"][2]["tokens with no expert"] > 0, "at c = 1.25 some tokens should lose both their experts")

# %% [markdown]
# **What you should see:** 40 slots per expert at `c = 1.25`. The collapsed router overflows its
# few favourite experts at every factor below 4 and drops far more than the balanced one; some
# tokens lose *both* experts and pass through the block with no MLP at all. Dropless drops
# nothing. Balance is what makes a capacity factor near 1 affordable.

# %% [markdown]
# ## 4. Expert parallelism
#
# With `EP` ranks each rank holds `E / EP` experts of every MoE layer and its own batch of
# tokens. The MoE layer sorts its (token, expert) pairs by expert exactly as in one process; then,
# in place of running the experts, it calls a **dispatcher** (`shard_experts(model, ep_group)`
# keeps each rank's slice of the experts and sets it on every MoE layer):
#
# 1. **counts**: one `all_to_all_single` of the count per expert, so every rank learns how many
#    rows each other rank will send it, per local expert;
# 2. **dispatch**: one `all_to_all_single` of the rows, block `i` to rank `i`, then a permute that
#    groups what arrived by local expert;
# 3. the local experts run, one block each;
# 4. **combine**: undo the permute and send every output back along the same splits.
#
# The backward pass is the same exchanges with the splits swapped (`AllToAll.backward`). The
# library's code, in the order it runs:

# %%
from course_lib.parallel import expert_parallel  # noqa: E402

for fn in (expert_parallel.AllToAllDispatcher.__call__, expert_parallel.exchange, expert_parallel.AllToAll,
           expert_parallel.group_by_local_expert, expert_parallel.ungroup):
    print(inspect.getsource(fn))

# %% [markdown]
# Predict before the ranks run: moe-tiny on `EP = 2` ranks, each rank with 4 × 64 = 256 tokens,
# top 2, width 64, fp32. If the router were uniform, how many **bytes** would rank 0's dispatch
# send to the other rank in one MoE layer? (Half its token copies live on the other rank.)

# %%
my_dispatch_bytes = None  # your prediction: bytes one rank's dispatch sends in one layer, uniform routing

# %%
ep_results = lab_runs.run_expert_parallel(EP)
r0 = ep_results[0]
n_layers = len(r0["layers"])
print(f"{'rank':>4} {'EP loss':>9} {'one process':>11} {'max logit diff':>14} {'max expert grad diff':>20}")
for rank, r in enumerate(ep_results):
    print(f"{rank:>4} {r['loss']:>9.5f} {r['ref loss']:>11.5f} {r['logit err']:>14.2e} {r['expert grad err']:>20.2e}")
check(all(abs(r["loss"] - r["ref loss"]) < 1e-5 and r["logit err"] < 1e-4 and r["expert grad err"] < 1e-5
          for r in ep_results),
      "expert parallelism should give one process's losses, logits and expert gradients to fp32 rounding")

# %% [markdown]
# **What you should see:** the same loss on each rank as one process, logits and the gradients of
# each rank's experts equal to fp32 rounding. The gradient of an expert collects what every rank's
# tokens contributed: it arrived through the backward of combine and dispatch.
#
# Rank by rank, block 0: on the left the rows each rank sent each rank (the diagonal stays home);
# on the right what each rank's local experts received, by source rank.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
m = lab_runs.rows_matrix(ep_results, 0)
axes[0].imshow(m, cmap="Blues", vmin=0)
for s in range(EP):
    for t in range(EP):
        axes[0].text(t, s, f"{m[s, t].item()}", ha="center", va="center")
axes[0].set(title="dispatch, block 0: rows from rank to rank", xlabel="to rank", ylabel="from rank",
            xticks=range(EP), yticks=range(EP))
e_local = r0["e_local"]
bottom = torch.zeros(EP * e_local)
for src in range(EP):
    got = torch.tensor([r["layers"][0]["received counts"][src] for r in ep_results]).flatten().float()
    axes[1].bar(range(EP * e_local), got, bottom=bottom, label=f"from rank {src}")
    bottom += got
axes[1].set_xticks(range(EP * e_local), [f"r{d}:e{d * e_local + j}" for d in range(EP) for j in range(e_local)])
axes[1].set(title="rows each expert received (rank:expert)", ylabel="token copies")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()
check(all(int(m[s].sum()) == r0["tokens"] * r0["top_k"] for s in range(EP)),
      "each rank dispatches tokens x k rows in all (dropless)")
check(int(bottom.sum()) == EP * r0["tokens"] * r0["top_k"], "the experts together receive every rank's rows")

# %% [markdown]
# Now the bytes. Per rank and MoE layer the forward sends the counts (`(EP − 1) × E/EP` int64),
# the dispatched rows that leave the rank and, in combine, the outputs of the rows it received
# from others; the backward sends rows again both ways (`alltoall_bytes_per_layer`, the
# estimator's formula). The measured bytes are counted at every call of `all_to_all_single`.

# %%
d, bpe = r0["d_model"], 4  # fp32
uniform = r0["tokens"] * r0["top_k"] * (EP - 1) / EP * d * bpe
lab_runs.show_prediction("rank 0, block 0: dispatch bytes", my_dispatch_bytes, r0["layers"][0]["dispatch bytes"],
                         unit="bytes", why=f"uniform routing would send tokens x k x (EP-1)/EP x d x 4 = {uniform:,.0f}; "
                                           "the measured router is not uniform")
print(f"\n{'rank':>4} {'block':>5} {'rows off':>8} {'rows in':>7} {'measured fwd':>12} {'formula fwd':>11} "
      f"{'measured bwd':>12} {'formula bwd':>11}")
for rank, r in enumerate(ep_results):
    fwd = bwd = 0
    for i, lay in enumerate(r["layers"]):
        off = sum(n for t, n in enumerate(lay["dispatch splits"]) if t != rank)
        back = sum(n for t, n in enumerate(lay["combine splits"]) if t != rank)
        pred = alltoall_bytes_per_layer(tokens_off_rank=off, tokens_received=back, d_model=d, ep=EP,
                                        n_experts=r["experts"], bytes_per_element=bpe)
        measured = lay["counts bytes"] + lay["dispatch bytes"] + lay["combine bytes"]
        print(f"{rank:>4} {i:>5} {off:>8} {back:>7} {measured:>12,} {pred.forward:>11,.0f} {'':>12} {pred.backward:>11,.0f}")
        check(measured == pred.forward, f"rank {rank}, block {i}: measured forward bytes should equal the formula")
        fwd += pred.forward
        bwd += pred.backward
    got_bwd = r["bytes"]["backward rows"]
    print(f"{rank:>4} {'all':>5} {'':>8} {'':>7} {r['bytes']['forward counts'] + r['bytes']['forward rows']:>12,} "
          f"{fwd:>11,.0f} {got_bwd:>12,} {bwd:>11,.0f}")
    check(got_bwd == bwd, f"rank {rank}: measured backward bytes should equal the formula")
    check(r["bytes"].get("backward counts", 0) == 0, "the backward needs no counts: the splits are known")
    check(got_bwd == r["bytes"]["forward rows"], "the backward should send as many row bytes as the forward")
check(uniform == 65536, "uniform routing: 256 x 2 x 1/2 x 64 x 4 = 65,536 bytes")

# %% [markdown]
# **What you should see:** the measured bytes equal the formula to the byte, forward and backward,
# on every rank and block: 65,536 bytes per dispatch if the router were uniform, more or less
# here, because it is not. The backward sends no counts (the splits are known from the forward)
# and as many row bytes as the forward. Per token and layer the traffic is `4 k (EP−1)/EP d`
# elements: it grows with `k` and the width, not with the number of experts.

# %% [markdown]
# ## 5. DeepSeek-V3's layout, by hand
#
# DeepSeek-V3 trained on 2,048 H800 GPUs with pipeline 16, expert parallelism 64 and ZeRO-1 data
# parallelism over the rest (no tensor parallelism). The planner scores that layout; here the
# numbers it rests on are recomputed by hand from the model's shape. Predict first: how many of
# the 256 experts of a layer does one GPU hold, and how many GPUs hold the same experts (the
# expert-data-parallel group)?

# %%
my_experts_per_gpu = None  # your prediction
my_expert_data_parallel = None  # your prediction

# %%
from course_lib.planner.layout_score import score_layout  # noqa: E402
from course_lib.planner.search import Plan  # noqa: E402
from course_lib.planner.spec import make_spec  # noqa: E402

ds_spec = make_spec(model="deepseek-v3", gpu="h800", gpus=2048, tokens="14.8T", seq=4096,
                    global_batch_tokens=15360 * 4096, moe_node_limit=4, precision="fp8", fp8_recipe="blockwise")
ds = score_layout(ds_spec, "tp1,pp16,dp128,ep64,etp1,zero1,recompute=selective", plan=Plan(ds_spec)).candidate
shape, lay = ds_spec.moe, ds.layout
print(f"planner: {lay.label()}, blocks per stage {list(ds.stage_blocks)}")
experts_per_gpu = shape.n_experts // lay.ep
edp = lay.dp * lay.tp // (lay.ep * lay.etp)
lab_runs.show_prediction("experts per GPU per MoE layer", my_experts_per_gpu, experts_per_gpu, why="256 experts / EP 64")
lab_runs.show_prediction("GPUs holding the same experts", my_expert_data_parallel, edp,
                         why="the 128 data-parallel ranks of a stage, folded into EP 64 x 2")
check(experts_per_gpu == 4 and edp == expert_data_parallel(dp=lay.dp, tp=lay.tp, ep=lay.ep, etp=lay.etp) == 2,
      "DeepSeek-V3: 4 experts per GPU, expert-data-parallel 2")

# by hand: the routed-expert parameters on one GPU of each stage, against the estimator's count
per_expert = 3 * shape.d_model * shape.expert_d_ff  # gate, up, down
first = 0
for stage, blocks in enumerate(ds.stage_blocks):
    moe_blocks = sum(1 for i in range(first, first + blocks) if i >= shape.n_dense_layers)
    by_hand = moe_blocks * experts_per_gpu * per_expert
    _, estimated = shape.params_on_rank(pp=lay.pp, ep=lay.ep, etp=lay.etp, stage=stage, blocks=list(ds.stage_blocks))
    check(by_hand == estimated, f"stage {stage}: {by_hand:,} expert parameters by hand, {estimated:,.0f} estimated")
    if stage in (0, 1, len(ds.stage_blocks) - 1):
        print(f"stage {stage:>2}: {blocks} blocks, {moe_blocks} with experts: {moe_blocks} x 4 x 3 x 7168 x 2048 = "
              f"{by_hand / 1e9:.2f}B expert parameters per GPU")
    first += blocks
per_token = 4 * shape.top_k * (lay.ep - 1) / lay.ep * shape.d_model * 2
print(f"all-to-all per token and MoE layer (bf16): 4 x 8 x 63/64 x 7168 x 2 = {per_token / 1e3:.0f} kB; "
      f"estimator {alltoall_bytes_per_token(shape, ep=lay.ep) / 1e3:.0f} kB")
check(per_token == alltoall_bytes_per_token(shape, ep=lay.ep), "the per-token all-to-all bytes by hand should equal the estimator's")
check(round(per_token / 1e3) == 452, "DeepSeek-V3 at EP 64: about 452 kB per token and MoE layer")

# %% [markdown]
# **What you should see:** 4 experts per GPU and each set held by 2 GPUs; the expert parameters
# per GPU by hand equal the estimator's, stage by stage. Each token sends about 452 kB per MoE layer
# over the all-to-alls in bf16 (DeepSeek-V3 sends the dispatch in FP8, halving that half), which
# is why it limits each token's experts to 4 nodes and overlaps the exchange with computation
# (DualPipe).
#
# ## Where next
#
# * **Exercise 14** asks you to write the dispatch and combine yourself: the counts exchange, the
#   row exchange with its split sizes, the permute by local expert, and the way back, on 1, 2 and 4
#   gloo ranks.
# * `course estimate --moe-model deepseek-v3 --pp 16 --dp 128 --ep 64 --zero-stage 1 --seq 4096`
#   prints the memory per GPU; `course plan --model deepseek-v3 ...` searches EP with the others.
