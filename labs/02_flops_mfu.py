# %% [markdown]
# # Lab 02 — FLOPs, MFU and time to train
#
# Lab 01 asked "will it fit?". This one asks "how long will it take?". Three numbers answer it:
#
# 1. **FLOPs per token**: how much arithmetic one training token costs (forward + backward);
# 2. **MFU**, model FLOPs utilization: the fraction of the hardware's peak FLOP/s the run
#    actually turns into model arithmetic;
# 3. **time to train** = FLOPs per token x tokens / (devices x peak x MFU).
#
# We count FLOPs two ways, redo nanoGPT's GPT-2 124M arithmetic, measure the MFU of a small
# training run on this CPU against *this CPU's own* measured matmul peak, translate it to
# A100/H100 numbers, and estimate how many days GPT-3 takes on a cluster.
#
# A FLOP here is one floating-point operation: a multiply-add counts 2. FLOP/s is per second.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
D_MODEL, N_LAYERS, N_HEADS = 256, 4, 8  # the TinyGPT we train on this CPU
SEQ, BATCH = 128, 16  # tokens per sequence, sequences per step
ROUNDS, STEPS_PER_ROUND = 4, 6  # timing: each round measures the CPU peak again, then times steps

# %%
import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib import estimate, measure
from course_lib.data import tasks as data
from course_lib.kit.checks import check
from course_lib.estimate import format_si
from course_lib.model import ModelConfig, TinyGPT

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    D_MODEL, N_LAYERS, N_HEADS, SEQ, BATCH, ROUNDS, STEPS_PER_ROUND = 128, 2, 4, 64, 8, 2, 2

# %% [markdown]
# ## 1. FLOPs per token: 6N, and the attention term
#
# A matmul of an (m x k) by a (k x n) matrix costs 2mkn FLOPs. Each parameter of a linear layer
# takes part in one multiply-add per token in the forward pass (2 FLOPs) and two in the backward
# pass (gradient of the input and of the weight: 4 FLOPs): **6N per token** (Kaplan et al. 2020).
#
# 6N misses the attention scores, which involve no parameters: Q K^T and scores x V cost
# 2 x 2 x s x h per token per layer forward, x 3 with backward. PaLM (Appendix B) adds them:
# **6N + 12 L H Q T** (L layers, H heads, Q head dimension, T sequence length).

# %% tags=["nbval-check-output"]
print(f"{'model':<12}{'params N':>18}{'seq T':>7}{'6N':>14}{'6N + 12LHQT':>14}{'attention share':>17}")
for name in ("gpt2-small", "gpt2-xl", "llama2-7b", "llama3-70b", "gpt3-175b"):
    shape = estimate.ModelShape.preset(name)
    six_n = estimate.flops_per_token(shape, formula="6n")
    palm = estimate.flops_per_token(shape, formula="palm")
    print(f"{name:<12}{shape.num_params():>18,}{shape.seq_len:>7}{format_si(six_n, 'FLOP'):>14}"
          f"{format_si(palm, 'FLOP'):>14}{(palm - six_n) / palm:>17.1%}")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.8))
seqs = [2**k for k in range(9, 18)]
for name in ("gpt2-small", "llama2-7b", "gpt3-175b"):
    shape = estimate.ModelShape.preset(name)
    six_n = 6 * shape.num_params()
    share = [12 * shape.n_layers * shape.d_model * t / (six_n + 12 * shape.n_layers * shape.d_model * t)
             for t in seqs]  # H x Q = d_model
    ax.semilogx(seqs, [100 * x for x in share], "o-", base=2, label=name)
ax.set_xlabel("sequence length T (tokens)")
ax.set_ylabel("attention share of FLOPs per token (%)")
ax.set_title("What 6N leaves out grows with the context")
ax.legend()
ax.grid(alpha=0.3)
plt.show()
# The share at each model's own training context, as in the table above: per token the attention
# term is 12 L h T against 6N ~ 72 L h^2 (N ~ 12 L h^2 without embeddings), about T / (6 h) of 6N.
trained = {}
for name in ("gpt2-small", "gpt2-xl", "llama2-7b", "llama3-70b", "gpt3-175b"):
    shape = estimate.ModelShape.preset(name)
    six_n, palm = (estimate.flops_per_token(shape, formula=f) for f in ("6n", "palm"))
    trained[name] = (shape.seq_len / shape.d_model, (palm - six_n) / palm)
check(min(trained, key=lambda n: trained[n][1]) == "gpt3-175b" and trained["gpt3-175b"][1] < 0.05,
      "GPT-3 (the widest model, d_model 12,288, at a 2,048-token context) should have the smallest attention "
      "share, a few percent")
check(all(share > 0.10 for ratio, share in trained.values() if ratio >= 1),
      "every model trained at a context at least as long as its width (T >= d_model) should spend more than "
      "10% of its FLOPs per token on attention scores")
check(all(a < b for a, b in zip(share[:-1], share[1:])), "the attention share should grow with the context")

# %% [markdown]
# **What you should see:** at their training contexts the attention term ranges from about 3%
# (GPT-3: very wide, d_model 12,288, at 2,048 tokens) to about 14% (Llama 2 7B: as wide as its
# context). It is not the parameter count that decides but the context against the width: per
# token the term is about T / (6 d_model) of 6N, so it grows with T and shrinks with the width. At long
# contexts it stops being a correction: 6N then underestimates the work, and an MFU computed with
# 6N looks worse than the run really is.
#
# ## 2. nanoGPT's GPT-2 124M, worked through
#
# nanoGPT's `estimate_mfu` (model.py) uses PaLM's formula with N = `get_num_params()`, which leaves
# out the position table (the tied token table stays in: it is also the output matmul). Its
# `config/train_gpt2.py` trains with 12 sequences x 1024 tokens x 5 accumulation steps x 8 GPUs
# per iteration for 600,000 iterations, and the README reports about **4 days on 8 A100 40GB**.
# nanoGPT divides by the A100's bf16 peak, 312 TFLOP/s.

# %% tags=["nbval-check-output"]
gpt2 = estimate.ModelShape.preset("gpt2-small")
n_nano = gpt2.num_params() - gpt2.position_params()
per_token = estimate.flops_per_token(gpt2, formula="palm", params="no-position")
tokens_per_iter = 12 * 1024 * 5 * 8
iters, days, gpus = 600_000, 4, 8
a100 = estimate.accelerator("a100-sxm4-40gb")
per_iter = per_token * tokens_per_iter
seconds_per_iter = days * 86_400 / iters
nano_mfu = estimate.mfu(tokens_per_iter / seconds_per_iter, per_token, n_devices=gpus,
                        peak_flops_per_device=a100.peak_flops("bf16"))
print(f"N without the position table   {n_nano:,}")
print(f"FLOPs per token, 6N + 12LHQT   {per_token:,.0f}  ({format_si(per_token, 'FLOP')})")
print(f"tokens per iteration           {tokens_per_iter:,}")
print(f"FLOPs per iteration            {format_si(per_iter, 'FLOP')}")
print(f"total tokens                   {tokens_per_iter * iters / 1e9:.0f} B")
print(f"{days} days / {iters:,} iterations  = {seconds_per_iter:.3f} s per iteration")
print(f"implied MFU on {gpus} x A100 bf16  {nano_mfu:.1%}")
check(abs(per_token - 855_166_464) < 1, "6N + 12LHQT for GPT-2 124M should be 855,166,464 FLOPs per token")

# %% [markdown]
# **What you should see:** about 0.86 GFLOP per token, and an implied MFU near 30%: the
# four-day run kept its A100s less than a third busy with model arithmetic (GPT-2 small's
# matrices are small for a GPU). Read it backwards too: a *measured* iteration time gives MFU, and an MFU you believe
# gives the training time.
#
# ## 3. This CPU's peak
#
# MFU needs a peak to divide by. A GPU has a datasheet number; for this CPU we **measure** it:
# the best time of a large fp32 matrix multiply (`measure.cpu_matmul_peak_flops`), on the same
# threads the training uses. It is the best the chip can do on the friendliest possible workload.

# %%
sizes = [128, 256, 512] if SMOKE else [128, 256, 512, 1024, 2048]
# Three passes over all sizes, best per size: a moment when another program holds a core then
# costs one pass of one size, not the whole curve.
passes = [{n: measure.cpu_matmul_peak_flops(n, repeats=2).flops_per_second for n in sizes} for _ in range(3)]
peaks = {n: max(p[n] for p in passes) for n in sizes}
print(f"{torch.get_num_threads()} threads, fp32, best of {len(passes)} passes")
print(f"  {'size':<13}{'best':>14}   {'each pass':<40}")
for n in sizes:
    each = "  ".join(format_si(p[n], "FLOP/s") for p in passes)
    print(f"  {n:>5} x {n:<5}{format_si(peaks[n], 'FLOP/s'):>14}   {each}")
per_thread = max(peaks.values()) / torch.get_num_threads()
print(f"best per thread: {format_si(per_thread, 'FLOP/s')}; an H100's fp32 datasheet peak is "
      f"{estimate.accelerator('h100-sxm5-80gb').peak_flops('fp32') / per_thread:,.0f} times that")
check(estimate.accelerator("h100-sxm5-80gb").peak_flops("fp32") >= 100 * per_thread,
      f"an H100's fp32 peak should be at least a hundred times one CPU thread's, measured "
      f"{format_si(per_thread, 'FLOP/s')} per thread")

# %% [markdown]
# **What you should see:** a best column that, on a quiet machine, rises with the matrix size
# (small matmuls spend more of their time on start-up and data movement per FLOP), which is why
# the peak is read from a large matmul; where it is still rising at the largest size, the peak is
# a lower bound of what the chip can do. What varies between runs: a single pass can come out
# several times slower when another program holds a core (compare the "each pass" columns), and
# on a small shared machine the whole curve moves from run to run, enough to reorder neighbouring
# sizes; the best of the passes is the steadiest number. A CPU thread with a core to itself does
# tens to a couple of hundred GFLOP/s in fp32 (the line under the table); an H100 does about
# 67 TFLOP/s in fp32, at least a hundred times more, and 990 in bf16 on its tensor cores.
#
# ## 4. MFU of a training run on this CPU
#
# A TinyGPT on a synthetic Markov-chain task, AdamW, fp32, timed in **rounds**: each round measures
# the matmul peak again, then times a few steps. Other programs share this machine, and a busy
# moment can only make a timing *slower*. So the ceiling we divide by is the **best** peak measured
# anywhere in this notebook (section 3's passes and every round's): the closest to what the chip
# can do. A round that ran while the machine was busy then shows a low MFU, never one above 100%.

# %%
cfg = ModelConfig.preset("tiny", d_model=D_MODEL, n_layers=N_LAYERS, n_heads=N_HEADS, block_size=SEQ)
torch.manual_seed(0)
model = TinyGPT(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
stream = data.BatchStream(data.MarkovTask(vocab_size=cfg.vocab_size, seq_len=SEQ, seed=0), BATCH)
shape = measure.tinygpt_shape(cfg)
check(shape.num_params() == model.num_params(), "the estimator's shape should count TinyGPT's parameters")
flops_per_token = {"6N": estimate.flops_per_token(shape),
                   "6N + 12LHQT": estimate.flops_per_token(shape, formula="palm"),
                   "matmul count": estimate.model_flops_per_iteration(shape, batch=1) / SEQ}
losses = []


def train_step():
    x, y = next(stream)
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())


train_step()  # warm-up: allocates Adam's state, fills caches
rounds = []
for _ in range(ROUNDS):
    peak = measure.cpu_matmul_peak_flops(1024 if not SMOKE else 512, repeats=3).flops_per_second
    run = measure.time_steps(train_step, STEPS_PER_ROUND, warmup=0, tokens_per_step=BATCH * SEQ)
    rounds.append((peak, run.tokens_per_second))
cpu_peak = max(max(peaks.values()), *(peak for peak, _ in rounds))  # the best matmul of the notebook
mfus = [estimate.mfu(tps, flops_per_token["matmul count"], n_devices=1, peak_flops_per_device=cpu_peak)
        for _, tps in rounds]
rounds = [(peak, tps, m) for (peak, tps), m in zip(rounds, mfus)]
_, tokens_per_s, mfu_cpu = sorted(rounds, key=lambda r: r[2])[len(rounds) // 2]  # the median round
print(f"TinyGPT: {model.num_params():,} parameters, {N_LAYERS} layers, d_model {D_MODEL}, "
      f"batch {BATCH} x {SEQ} tokens; loss {losses[0]:.2f} -> {losses[-1]:.2f} nats")
print("FLOPs per token: " + ", ".join(f"{k} {format_si(v, 'FLOP')}" for k, v in flops_per_token.items()))
print(f"\n{'round':<7}{'its own peak':>16}{'tokens/s':>11}{'MFU':>8}")
for i, (peak, tps, m) in enumerate(rounds):
    print(f"{i:<7}{format_si(peak, 'FLOP/s'):>16}{tps:>11,.0f}{m:>8.1%}")
print(f"\nMFU against the best peak measured ({format_si(cpu_peak, 'FLOP/s')}); "
      f"median round: {mfu_cpu:.1%}, {tokens_per_s:,.0f} tokens/s")
check(0 < mfu_cpu < 1, "MFU must lie between 0 and 1; above 1 means the steps did more model "
      "arithmetic per second than the fastest matmul measured: a FLOP count that is too high "
      "(compare the three counts above) or a peak that is too low")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
ax1.plot(losses, ".-")
ax1.set_xlabel("step")
ax1.set_ylabel("loss (nats per token)")
ax1.set_title("the run we timed")
ax2.bar(range(len(rounds)), [100 * r[2] for r in rounds], color="#4C72B0")
ax2.axhline(100 * mfu_cpu, color="black", linestyle="--", label=f"median {mfu_cpu:.1%}")
ax2.set_xticks(range(len(rounds)))
ax2.set_ylim(0, 130 * max(r[2] for r in rounds))
ax2.set_xlabel("round")
ax2.set_ylabel("MFU against this CPU's best peak (%)")
ax2.set_title("model FLOP/s / best measured matmul")
ax2.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# **What you should see:** a falling loss, and an MFU well below 100% even on a CPU: the model's
# matrices are small (each matmul is far from the friendly square case that set the peak), and
# softmax, norms, the optimizer step and Python overhead do work that is not counted as model
# FLOPs at all. The three FLOP counts differ by several percent here (6N leaves out the attention term); we used the exact matmul count.
# On a quiet machine the rounds agree; a round that shared the machine shows a lower peak of its
# own and a lower MFU, which is why the headline is the median round, not the best one.
#
# ## 5. The same run on an A100 or H100
#
# MFU is portable, FLOP/s are not. If the same run reached the same MFU on a GPU, its throughput
# would be MFU x peak / FLOPs per token, and its speed-up over this CPU the ratio of the peaks.
# Each precision has its own peak (dense, from the datasheets in `estimate.ACCELERATORS`):

# %%
rows = []
for key in ("a100-sxm4-80gb", "h100-sxm5-80gb"):
    acc = estimate.accelerator(key)
    for dtype in ("fp32", "tf32", "bf16"):
        peak = acc.peak_flops(dtype)
        tps = mfu_cpu * peak / flops_per_token["matmul count"]
        rows.append((acc.name, dtype, peak, tps))
print(f"at the measured MFU of {mfu_cpu:.1%}:")
print(f"{'device':<24}{'dtype':<6}{'peak':>16}{'tokens/s':>16}{'x this CPU':>12}")
for name, dtype, peak, tps in rows:
    print(f"{name:<24}{dtype:<6}{format_si(peak, 'FLOP/s'):>16}{tps:>16,.0f}{peak / cpu_peak:>12,.0f}")
times_cpu = [peak / cpu_peak for _, _, peak, _ in rows]
bf16_over_fp32 = {key: estimate.accelerator(key).peak_flops("bf16") / estimate.accelerator(key).peak_flops("fp32")
                  for key in ("a100-sxm4-80gb", "h100-sxm5-80gb")}
print("bf16 / fp32 peak: " + ", ".join(f"{k} {v:.0f}x" for k, v in bf16_over_fp32.items()))
check(20 <= min(times_cpu) < 1000 <= max(times_cpu),
      f"the GPU peaks should run from a few dozen to a few hundred times this CPU's (fp32 on an A100) to "
      f"thousands of times "
      f"(bf16 on an H100); got {min(times_cpu):,.0f}x to {max(times_cpu):,.0f}x")
check(all(10 < v < 20 for v in bf16_over_fp32.values()),
      f"the datasheets' bf16 peak should be 10-20 times their fp32 peak, got {bf16_over_fp32}")

# %% [markdown]
# **What you should see:** from a few dozen to a few hundred times this CPU's throughput (fp32 on
# an A100; where in that range depends on your CPU) to thousands of times (bf16 on an H100), and bf16 about 15 times fp32 (16x on the A100, 15x on the H100):
# tensor cores only reach their peak in reduced precision (lab 03). Take these numbers as an upper
# bound for *this* model: a model this small cannot keep a GPU busy (kernel launches and memory
# traffic dominate), so its real GPU MFU would be far lower; large models keep a GPU far busier.
#
# **Measured on an H100** (benchmarks/RESULTS-gpu.md): GPT-2 small (124M, sequence 1024) in this
# kit's trainer with bf16, `train.compile`, flash attention and fused AdamW ran 398-424 k tokens/s
# at micro-batch 16: **35-37% MFU** against the 989.5 TFLOP/s datasheet peak, 44-49% against the
# 746-782 TFLOP/s a large matmul reached in the same run (38.6-38.9% at micro-batch 32). The
# profiler says why: matmuls ran at ~75% of the measured peak, but a third of the GPU time went to
# memory-bound kernels (norms, GELU, the cross-entropy over 50k logits) and ~10% to idling while the
# host read the step's loss and gradient norms.

# %%
# The four H100 runs above, as benchmarks/RESULTS-gpu.md records them: tokens/s and the MFU against
# the run's own measured matmul peak. The MFUs quoted above follow from them.
h100_runs = [(423_626, 0.488), (398_681, 0.441), (417_211, 0.459), (406_184, 0.447)]
gpt2_palm = estimate.flops_per_token(estimate.ModelShape.preset("gpt2-small"), formula="palm")
datasheet_mfu = [tps * gpt2_palm / estimate.accelerator("h100-sxm5-80gb").peak_flops("bf16") for tps, _ in h100_runs]
measured_peak = [tps * gpt2_palm / m for tps, m in h100_runs]
print(f"MFU against the datasheet: {min(datasheet_mfu):.1%} - {max(datasheet_mfu):.1%}; against the measured "
      f"peak: {min(m for _, m in h100_runs):.1%} - {max(m for _, m in h100_runs):.1%}, a peak of "
      f"{format_si(min(measured_peak), 'FLOP/s')} - {format_si(max(measured_peak), 'FLOP/s')}")
check(0.345 <= min(datasheet_mfu) and max(datasheet_mfu) < 0.375,
      "the recorded tokens/s should give the 35-37% datasheet MFU the text quotes")
check(0.435 <= min(m for _, m in h100_runs) and max(m for _, m in h100_runs) < 0.495
      and 740e12 < min(measured_peak) and max(measured_peak) < 790e12,
      "the recorded runs should give the 44-49% MFU against a 746-782 TFLOP/s measured peak the text quotes")

# %% [markdown]
#
# ## 6. Days to train GPT-3
#
# Time = k x N x tokens / (devices x achieved FLOP/s per device), k = 6 without recomputation and
# 8 with full activation recomputation (one more forward). Narayanan et al. 2021 (Sec. 5.1) train
# GPT-3 175B on 300B tokens with 1024 A100s sustaining 140 TFLOP/s each, with recomputation, and
# estimate **34 days**.

# %% tags=["nbval-check-output"]
gpt3 = estimate.ModelShape.preset("gpt3-175b")
h100 = estimate.accelerator("h100-sxm5-80gb")
scenarios = [
    ("Narayanan: 1024 A100, 140 TFLOP/s, recompute (8N)", 1024, 140e12, 8),
    ("same, no recomputation (6N)", 1024, 140e12, 6),
    ("1024 A100 at 40% MFU bf16 (6N)", 1024, 0.40 * a100.peak_flops("bf16"), 6),
    ("1024 H100 at 40% MFU bf16 (6N)", 1024, 0.40 * h100.peak_flops("bf16"), 6),
    ("4096 H100 at 40% MFU bf16 (6N)", 4096, 0.40 * h100.peak_flops("bf16"), 6),
]
print(f"GPT-3: N = {gpt3.num_params():,}, 300B tokens")
print(f"{'cluster':<52}{'per device':>16}{'days':>8}")
day_rows = []
for label, n_dev, achieved, k in scenarios:
    d = estimate.training_days(300e9, gpt3.num_params(), n_devices=n_dev, achieved_flops_per_device=achieved,
                               flops_per_param_per_token=k)
    day_rows.append((label, d))
    print(f"{label:<52}{format_si(achieved, 'FLOP/s'):>16}{d:>8.1f}")
check(round(day_rows[0][1]) == 34, "Narayanan et al.'s setting should give their 34 days")

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.barh([label for label, _ in day_rows][::-1], [d for _, d in day_rows][::-1], color="#55A868")
for y, (_, d) in enumerate(day_rows[::-1]):
    ax.annotate(f"{d:.1f} d", (d, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
ax.set_xlabel("days to train GPT-3 175B on 300B tokens")
ax.set_xlim(0, 1.15 * max(d for _, d in day_rows))
fig.tight_layout()
plt.show()

# %% [markdown]
# **What you should see:** Narayanan's 34 days reproduced, a quarter less without recomputation,
# and a few days on a large H100 cluster. Every line is the same formula: the levers are the
# device count, the precision's peak, and the MFU your software reaches. A learner's MFU on this
# CPU and a cluster's on H100s are the same kind of number.
#
# ## Where next
#
# * **Lab 03**: mixed precision, which is where the bf16 peak comes from.
# * **`course estimate --model gpt3-175b ...`**: FLOPs per token and per step for any shape.
