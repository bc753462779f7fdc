# %% [markdown]
# # Lab 01 — Where the memory goes
#
# Before any parallelism, the first question about a training run is: **will it fit?** Four
# things live in GPU memory while a model trains:
#
# 1. **parameters**, the weights the forward pass reads;
# 2. **gradients**, one per parameter, written by the backward pass;
# 3. **optimizer state**: for Adam, two moments per parameter, and in mixed precision an fp32
#    master copy of the weights;
# 4. **activations**: the tensors the forward pass keeps so the backward pass can use them.
#
# The first three scale with the parameter count N; activations scale with the tokens in flight
# (micro-batch x sequence length) and the model's width and depth. This lab:
#
# 1. recomputes a widely quoted back-of-envelope budget for a 7B model, and corrects it against
#    the ZeRO paper (Rajbhandari et al., 2020) and Korthikanti et al. (2022);
# 2. shows what ZeRO sharding and activation recomputation do to each component;
# 3. gives you a calculator to play with;
# 4. measures the same quantities on a small model on this machine, next to the estimate.
#
# Bytes are printed with their unit: **GB = 10^9 bytes, GiB = 2^30 bytes** (they differ by 7%).

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
MODEL = "llama2-7b"  # the 7B example: Llama 2 7B's shape (32 layers, hidden 4096, 32 heads)
SEQ = 4096  # tokens per sequence
MICRO_BATCH = 1  # sequences per micro-batch, per GPU
DP = 8  # data-parallel ranks for the ZeRO comparison

# %%
import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib import estimate, measure
from course_lib.kit.checks import check
from course_lib.estimate import format_bytes
from course_lib.model import ModelConfig, TinyGPT
from course_lib.labs.plots_memory import stacked_memory_bars
from course_lib.labs.widgets import COMPONENTS, MemoryCalculator, memory_per_rank

SMOKE = course_lib.smoke(SMOKE)
TINY_SEQ, TINY_BATCH = (32, 2) if SMOKE else (128, 8)  # the model we measure on this CPU

# %% [markdown]
# ## 1. A rule-of-thumb 7B budget, recomputed
#
# A quick budget often quoted for a 7B model trained with AdamW in mixed precision uses two rules:
#
# * **12 bytes per parameter** for weights + gradients + optimizer: 2 (bf16 weights) + 2 (bf16
#   gradients) + 8 (Adam's two fp32 moments). In `course_lib.estimate` this is recipe `"bf16-adam-no-master"` (bf16 weights and gradients, Adam moments, no fp32 master copy).
# * **34 bytes per token per hidden unit per layer** for activations: 34 x s x b x h x L.
#
# Next to them, the published numbers: the ZeRO paper's **16 bytes per parameter** (recipe
# `"mixed-adam"`) and Korthikanti et al.'s **s b h (34 + 5 a s / h)** bytes per layer
# (`estimate.activation_bytes_per_layer` with its defaults, which are the paper's assumptions).

# %% tags=["nbval-check-output"]
shape = estimate.ModelShape.preset(MODEL)
N, L, h, a = shape.num_params(), shape.n_layers, shape.d_model, shape.n_heads
s, b = SEQ, MICRO_BATCH
rule_state = estimate.model_state_bytes(N, recipe="bf16-adam-no-master")  # 2 + 2 + 8
zero_state = estimate.model_state_bytes(N, recipe="mixed-adam")  # 2 + 2 + 4 + 8 (ZeRO paper)
rule_acts = 34 * s * b * h * L  # the rule of thumb
korthikanti_acts = L * estimate.activation_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, n_heads=a)

rows = [("parameters (bf16)", rule_state.params, zero_state.params),
        ("gradients (bf16)", rule_state.grads, zero_state.grads),
        ("optimizer state", rule_state.optimizer, zero_state.optimizer),
        (f"activations, {L} layers", rule_acts, korthikanti_acts)]
rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows)))
print(f"{MODEL}: N = {N:,} parameters, s = {s}, b = {b}, h = {h}, a = {a}, L = {L}\n")
print(f"{'':<24}{'rule of thumb':>14}{'corrected':>14}{'corrected':>14}")
for name, text, fixed in rows:
    print(f"{name:<24}{format_bytes(text, 'GB', 1):>14}{format_bytes(fixed, 'GB', 1):>14}"
          f"{format_bytes(fixed, 'GiB', 1):>14}")
print(f"\nbytes per parameter of model state: rule of thumb {rule_state.total / N:g}, "
      f"ZeRO paper {zero_state.total / N:g}")

# %% [markdown]
# **What you should see:** the same parameters and gradients, a larger optimizer line and a much
# larger activation line in the corrected column. Why:
#
# * **The optimizer line.** Mixed-precision Adam keeps an **fp32 master copy** of the weights and
#   applies each update to it: a bf16 weight has 8 mantissa bits and would round most small
#   updates away (lab 03 shows this). The ZeRO paper (Sec. 3.1) counts K = 12 bytes of optimizer
#   state per parameter: master weights 4 + momentum 4 + variance 4. The rule of thumb's 8 counts
#   only the two moments.
# * **The activation line.** Korthikanti et al. count 34 bytes per token per hidden unit per
#   layer for every tensor of size s x b x h (matmul inputs, norm inputs, GELU, dropout masks)
#   **plus 5 a s / h** for the attention scores: per score the softmax output (2 bytes), its
#   dropout mask (1) and the dropped-out copy (2), a x s x s scores per sequence. The rule of
#   thumb leaves this term out. That is right only when the attention scores are never stored:
#   with **selective recomputation** (recompute them in backward) or a fused **flash attention**
#   kernel. At long sequences the term dominates.

# %%
extra_state = zero_state.total - rule_state.total
extra_acts = korthikanti_acts - rule_acts
check(extra_state == 4 * N, "the corrected optimizer state should differ by exactly the fp32 master copy, 4 bytes "
      "per parameter")
check(extra_acts == 5 * a * s * s * b * L, "the activation difference should be exactly the attention-score "
      "term 5 a s^2 b per layer")
print(f"missing master copy: 4 x N = {format_bytes(extra_state, 'GB', 1)}")
print(f"missing attention scores: 5 a s^2 b L = {format_bytes(extra_acts, 'GB', 1)}; at s = {s} the "
      f"score term 5as/h = {5 * a * s / h:g} vs the 34 of everything else")
for label, parts in [("rule of thumb", dict(zip(("params", "grads", "optimizer", "activations"),
                                               [r[1] for r in rows[:4]]))),
                     ("corrected", dict(zip(("params", "grads", "optimizer", "activations"),
                                            [r[2] for r in rows[:4]])))]:
    print(f"largest component, {label}: {max(parts, key=parts.get)}")

# %% [markdown]
# **What you should see:** the two corrections, each exactly the missing term, and the largest
# component *changes*: by the rule of thumb the optimizer state dominates; with the
# attention scores stored (no recomputation, no flash attention) the activations do.
#
# Korthikanti's formula is itself a model of one implementation (Megatron: GELU MLP of width 4h,
# dropout, scores materialised). Each assumption is a keyword of the estimator. A Llama block has
# a SwiGLU MLP instead, and a fused attention kernel with no dropout keeps no score matrix at all:

# %% tags=["nbval-check-output"]
variants = {
    "Korthikanti (GELU 4h, dropout, scores stored)": {},
    "  + Llama's SwiGLU MLP (d_ff = %d)" % shape.ffn_dim: dict(mlp="swiglu", d_ff=shape.ffn_dim),
    "  + selective recomputation": dict(mlp="swiglu", d_ff=shape.ffn_dim, recompute="selective"),
    "  or flash attention, no dropout": dict(mlp="swiglu", d_ff=shape.ffn_dim, attention="flash", dropout=False),
    "  or full recomputation": dict(mlp="swiglu", d_ff=shape.ffn_dim, recompute="full"),
}
for label, kw in variants.items():
    per_layer = estimate.activation_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, n_heads=a, **kw)
    print(f"{label:<48} {per_layer / (s * b * h):7.1f} bytes/(token x hidden) per layer"
          f"  x {L} layers = {format_bytes(per_layer * L, 'GB', 1):>9}")

# %% [markdown]
# **What you should see:** selective recomputation and flash attention both land near 34 bytes
# per token per hidden unit, the figure Korthikanti et al. (2022) give for selective recomputation
# (SwiGLU's hidden tensors move it a little), full recomputation keeps only each layer's
# input: 2 bytes per token per hidden unit.
#
# ## 2. ZeRO: shard the model state
#
# Data parallelism replicates everything on every rank. ZeRO (Rajbhandari et al. 2020) shards it
# over the `dp` ranks instead: **stage 1** the optimizer state, **stage 2** also the gradients,
# **stage 3** also the parameters. Activations are not sharded by ZeRO: each rank runs its own
# micro-batch. Per rank, with selective recomputation:

# %% tags=["nbval-check-output"]
budgets = {z: memory_per_rank(MODEL, micro_batch=b, seq=s, zero_stage=z, dp=DP, recompute="selective")
           for z in range(4)}
print(f"{MODEL}, dp = {DP}, micro-batch {b} x seq {s}, selective recomputation, GiB per rank")
print(f"{'stage':<8}" + "".join(f"{c:>13}" for c in COMPONENTS) + f"{'total':>13}   fits {budgets[0].device}?")
for z, bud in budgets.items():
    print(f"ZeRO-{z:<3}" + "".join(f"{bud.parts[c] / 2**30:>13.2f}" for c in COMPONENTS)
          + f"{bud.total / 2**30:>13.2f}   {'yes' if bud.fits else 'no'}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, dp in zip(axes, (DP, 8 * DP)):
    per_stage = [memory_per_rank(MODEL, micro_batch=b, seq=s, zero_stage=z, dp=dp, recompute="selective")
                 for z in range(4)]
    stacked_memory_bars(ax, [f"ZeRO-{z}" for z in range(4)],
                        {c: [p.parts[c] for p in per_stage] for c in COMPONENTS},
                        limit_bytes=per_stage[0].device_bytes, limit_label=per_stage[0].device,
                        title=f"{MODEL}, dp = {dp}")
axes[0].get_legend().remove()
fig.tight_layout()
plt.show()

# %% [markdown]
# **What you should see:** stage 1 removes most of the bar (the optimizer state is the biggest
# piece of model state), stage 2 and 3 take smaller bites, and more ranks make every sharded piece
# thinner while the activations stay the same height. With ZeRO-3 over many ranks, what is left
# per GPU is mostly activations: that is where recomputation comes in.
#
# ## 3. Recomputation: trade compute for activation memory
#
# Per layer, by tensor, for one micro-batch of this model (Korthikanti's accounting, SwiGLU MLP):

# %% tags=["nbval-check-output"]
layer_kw = dict(seq_len=s, micro_batch=b, d_model=h, n_heads=a, mlp=shape.mlp, d_ff=shape.ffn_dim)
modes = {"none": dict(recompute="none"), "selective": dict(recompute="selective"),
         "full": dict(recompute="full"), "none + flash": dict(attention="flash", dropout=False)}
breakdowns = {m: estimate.activation_breakdown_per_layer(**layer_kw, **kw).components for m, kw in modes.items()}
names = [n for n in dict.fromkeys(n for comp in breakdowns.values() for n in comp)
         if any(comp.get(n, 0) for comp in breakdowns.values())]  # tensors some mode keeps
print(f"MiB per layer ({MODEL}, s = {s}, b = {b})")
print(f"{'tensor':<16}" + "".join(f"{m:>14}" for m in modes))
for n in names:
    print(f"{n:<16}" + "".join(f"{breakdowns[m].get(n, 0) / 2**20:>14.1f}" for m in modes))
print(f"{'total':<16}" + "".join(f"{sum(breakdowns[m].values()) / 2**20:>14.1f}" for m in modes))

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
labels = [m.replace(" + ", "\n+ ") for m in modes]
stacked_memory_bars(axes[0], labels, {n: [breakdowns[m].get(n, 0) for m in modes] for n in names},
                    unit="MiB", annotate=True, title="activations of one layer, by tensor")
axes[0].set_ylabel("bytes per layer (MiB)")
totals = [memory_per_rank(MODEL, micro_batch=b, seq=s, zero_stage=3, dp=DP, **kw) for kw in modes.values()]
stacked_memory_bars(axes[1], labels,
                    {c: [t.parts[c] for t in totals] for c in COMPONENTS},
                    limit_bytes=totals[0].device_bytes, limit_label=totals[0].device,
                    title=f"per rank, ZeRO-3 over dp = {DP}")
fig.tight_layout()
plt.show()

# %% [markdown]
# **What you should see:** without recomputation the attention core (the a x s x s scores) is the
# largest tensor of a layer; selective recomputation drops exactly that piece, for the price of
# recomputing the score matmuls (a few percent more FLOPs); flash attention removes it too (its
# backward kernel recomputes the scores tile by tile, on-chip). Full recomputation keeps only each
# layer's input and costs one more forward pass.
#
# ## 4. Your turn: the calculator
#
# Move the sliders: model, precision recipe, micro-batch, sequence length, ZeRO stage, data-parallel
# ranks, recomputation, attention kind. The table and the chart (all four ZeRO stages, yours
# marked) follow. The logic is `course_lib.labs.widgets.memory_per_rank`, a plain function you can call.

# %%
calc = MemoryCalculator(model=MODEL, seq=SEQ, micro_batch=MICRO_BATCH, dp=DP)
calc

# %% tags=["nbval-check-output"]
print(calc.budget.text("GiB"))  # the same table as text, for a notebook opened without a kernel

# %% [markdown]
# Try: at which sequence length does `llama2-7b` stop fitting on one H100 with ZeRO-3 over 8 ranks
# and no recomputation? How many ranks does ZeRO-3 need before `llama2-70b` fits, with full
# recomputation? Which component is largest for `gpt2-small` at micro-batch 16?
#
# ## 5. Estimate vs measurement, on this machine
#
# A closed form is only as good as its assumptions. Here we measure what autograd really keeps for
# backward on TinyGPT (fp32, CPU): a saved-tensor hook sees every tensor saved for backward, and
# each storage counts once (`course_lib.measure.saved_activation_bytes`). On a CPU this stands in
# for the GPU's peak-memory counter. The estimate gets TinyGPT's deviations from Korthikanti's
# assumptions as keywords (`measure.tinygpt_activation_kwargs`): no dropout, flash attention,
# 4-byte activations, K/V repeated for grouped-query heads, what PyTorch's norms keep.

# %%
print(f"TinyGPT, seq {TINY_SEQ}, micro-batch {TINY_BATCH}, fp32 on CPU; bytes")
print(f"{'model':<11}{'recompute':<11}{'component':<26}{'estimated':>12}{'measured':>12}{'ratio':>10}")
worst = 0.0
for preset in ("tiny", "llama-tiny"):
    for recompute in ("none", "selective", "full"):
        cfg = ModelConfig.preset(preset, checkpointing=recompute, block_size=max(64, TINY_SEQ))
        rows = measure.compare_tinygpt_activations(cfg, seq_len=TINY_SEQ, micro_batch=TINY_BATCH)
        for r in rows:
            if r["component"] in ("one block", "embedding + output layer", "token ids (int64)", "total"):
                print(f"{preset:<11}{recompute:<11}{r['component']:<26}{r['estimated']:>12,.0f}"
                      f"{r['measured']:>12,}{r['ratio']:>10.5f}")
                worst = max(worst, abs(r["ratio"] - 1))
            if r["component"] == "token ids (int64)":  # 8 bytes per input and per target token,
                learned = cfg.position == "learned"    # + 8 per position id of a learned-position model
                tokens = TINY_SEQ * TINY_BATCH
                check(r["measured"] == 16 * tokens + (8 * TINY_SEQ if learned else 0),
                      f"{preset}: the token ids should be 16 bytes per token (int64 inputs and targets)"
                      + (f" plus 8 bytes per position id ({TINY_SEQ} of them)" if learned else "")
                      + f", got {r['measured']:,} bytes for {tokens:,} tokens")
print(f"\nlargest |measured / estimated - 1|: {worst:.1e}")
check(worst < 0.02, "the estimate should be within 2% of what autograd saves: a keyword in "
      "measure.tinygpt_activation_kwargs no longer describes TinyGPT")

# %% [markdown]
# **What you should see:** ratios of 1.00000 for every block: the estimate is exact to the byte
# once its assumptions are the model's. The only difference is 4 bytes in the output layer
# (cross-entropy keeps one fp32 scalar). The int64 token ids are outside Korthikanti's
# accounting; they are a closed form of their own here: inputs and targets, 8 bytes each, so 16
# bytes per token (`llama-tiny` at seq 128, micro-batch 8: 16 x 128 x 8 = 16,384), plus, for `tiny` with its learned
# position table, the position ids of one sequence, 8 bytes each (17,408 = 16,384 + 8 x 128).
# `benchmarks/bench_activation_memory.py` runs 24 such configurations and adds the assumptions one
# at a time.
#
# The model state, measured the same way (each storage once), after one AdamW step in fp32,
# against the `"fp32-adam"` recipe (4 + 4 + 8 bytes per parameter):

# %%
torch.manual_seed(0)
model = TinyGPT(ModelConfig.preset("llama-tiny"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
idx = torch.randint(0, model.cfg.vocab_size, (TINY_BATCH, min(TINY_SEQ, 64)))
model(idx, idx)[1].backward()
opt.step()
got = measure.model_state_bytes_allocated(model, opt)
want = estimate.model_state_bytes(model.num_params(), recipe="fp32-adam")
print(f"{'':<20}{'estimated':>12}{'measured':>12}")
for name, est, meas in [("parameters", want.params, got.params), ("gradients", want.grads, got.grads),
                        ("Adam moments", want.optimizer, got.optimizer_moments)]:
    print(f"{name:<20}{est:>12,.0f}{meas:>12,}")
print(f"{'step counters':<20}{'-':>12}{got.optimizer_scalars:>12,}  (one fp32 scalar per parameter tensor)")
check(got.params + got.grads + got.optimizer_moments == want.total,
      "parameters + gradients + Adam moments should equal 16 bytes per parameter for fp32 AdamW")

# %% [markdown]
# **What you should see:** an exact match, plus AdamW's per-tensor step counters, which no closed
# form bothers with (4 bytes per parameter *tensor*, not per parameter).
#
# On a GPU the allocator also knows its peak. `measure.cuda_peak_memory` reads it around a step;
# on a CPU-only machine it says so instead of crashing:

# %%
try:
    peak = measure.cuda_peak_memory(lambda: model(idx, idx)[1].backward())
    print(f"CUDA peak during one step: {format_bytes(peak.step_peak, 'MiB')} above the "
          f"{format_bytes(peak.before, 'MiB')} already allocated")
except measure.CudaUnavailableError as exc:
    print(f"no CUDA here: {exc}")

# %% [markdown]
# **Measured on an H100** (benchmarks/RESULTS-gpu.md, torch 2.11, fp32 AdamW): the saved
# activations of GPT-2 small equal the estimator to the byte on CUDA too (12.18 GiB at micro-batch
# 16). The step's peak, though, was 19.72 GiB, not "16 B/param + activations" = 14.03 GiB: at the
# start of backward the output layer creates two more fp32 tensors the size of the logits (the
# gradients of the log-softmax and of the logits, 3.07 GiB each), which nothing *saves*.
# `estimate.training_step_peak_bytes` with `estimate.output_backward_transient_bytes` adds them and
# lands within 1% there (within 8% in all 17 configurations measured).
#
# ## Where next
#
# * **Exercise 01**: write the memory budget of a 7B model yourself and find which part dominates.
# * **Exercise 02**: the ZeRO stage table: what is sharded, memory per rank, traffic per step.
# * **Lab 02**: FLOPs, MFU and how long a training run takes.
