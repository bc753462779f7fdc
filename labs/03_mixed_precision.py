# %% [markdown]
# # Lab 03 — Mixed precision
#
# Training in 16-bit numbers halves the bytes of every activation and runs matmuls on the
# GPU's tensor cores, many times faster than fp32. The price: fewer bits for range and for
# precision. **Mixed** precision keeps the pieces that need fp32 (the master weights, the
# optimizer state, reductions such as the loss) in fp32 and computes the rest in 16 bits.
#
# This lab:
#
# 1. compares the three formats: fp32, bf16, fp16 (range and precision, a table and a picture);
# 2. shows rounding at work, and why the master weights must stay fp32;
# 3. measures fp16 **underflow** on real TinyGPT gradients, and what **loss scaling** recovers;
# 4. trains TinyGPT with bf16 autocast next to fp32 on this CPU;
# 5. runs the **dynamic loss scaler**: it skips a step whose gradients overflowed and halves its scale;
# 6. shows why gradients must be **unscaled before clipping**, by doing it wrong and measuring;
# 7. says what changes on a GPU;
# 8. goes one format further down, to **FP8**: its two formats, the scaling recipes frontier runs
#    use (per tensor, per row, DeepSeek-V3's blocks, MXFP8), the error of each on real TinyGPT
#    activations and gradients, TinyGPT trained in bf16 and in each recipe side by side, and what
#    a 14-bit accumulator does to a long dot product. On a CPU all FP8 arithmetic is **emulated**.
#
# The library pieces: `course_lib.precision` (policies, format helpers, FP8 recipes), `course_lib.model`
# (TinyGPT), `course_lib.data` (a synthetic Markov task whose best possible loss is known).

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
SEED = 0
TRAIN_STEPS = 120  # fp32 vs bf16 training run (bf16 autocast is emulated, so slow, on most CPUs)
SCALER_STEPS = 40  # fp16 steps in the dynamic loss-scaling demonstration
GROWTH_INTERVAL = 10  # clean steps before the loss scaler doubles its scale
FP8_STEPS = 40  # steps of each FP8 recipe's run next to bf16 (section 8; FP8 is emulated on a CPU)

# %%
import dataclasses
import time

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.labs import plots
from course_lib.kit.checks import check
from course_lib.data import BatchStream, MarkovTask
from course_lib.model import ModelConfig, TinyGPT
from course_lib.precision import (cast_report, dtype_ranges, flat_grads, format_dtype_table,
                                  loss_scaling_report, make_policy, round_to)
from course_lib.precision.accumulate import accumulation_error
from course_lib.precision.fp8 import format_facts, format_fp8_table, overflow_behaviour
from course_lib.precision.fp8_linear import convert_to_fp8
from course_lib.precision.recipes import RECIPES, fake_quantize, quantization_error, quantize

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    TRAIN_STEPS, SCALER_STEPS, FP8_STEPS = 30, 24, 12
VOCAB, SEQ_LEN, BATCH = (32, 32, 8) if SMOKE else (64, 64, 16)
LR = 3e-3
# The model is tiny: one thread is as fast as several here, and makes every run repeatable.
torch.set_num_threads(1)

# %% [markdown]
# ## 1. Three formats
#
# A float is sign × mantissa × 2^exponent. **Exponent bits buy range** (how large and how small a
# number can be); **mantissa bits buy precision** (how finely numbers of one size are spaced:
# `eps` is the gap just above 1.0). Below the smallest *normal* number a format still has
# *subnormals*, evenly spaced and with fewer significant bits, down to the smallest subnormal;
# anything smaller rounds to zero.

# %% tags=["nbval-check-output"]
print(format_dtype_table())
ranges = {row["dtype"]: row for row in dtype_ranges()}

# %%
# The table is read from torch.finfo; prove it against real casts.
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    row = ranges[name]
    check(round_to(row["max"], dtype) == row["max"] and round_to(row["max"] * 1.01, dtype) == float("inf"),
          f"{name}: its max should survive a cast and 1% more should overflow to inf")
    check(round_to(row["min_subnormal"], dtype) == row["min_subnormal"]
          and round_to(row["min_subnormal"] * 0.49, dtype) == 0.0,
          f"{name}: the smallest subnormal should survive a cast, and half of it should vanish to 0")
check(ranges["bf16"]["min_normal"] == ranges["fp32"]["min_normal"],
      "bf16 should have exactly fp32's exponent range (same 8 exponent bits)")
print("every range in the table agrees with a real cast")

# %%
fig, ax = plt.subplots(figsize=(8, 4))
plots.plot_number_formats(ax)
ax.set_title("range (width) and precision (height) of each format")
plt.show()

# %% [markdown]
# **What you should see:** bf16 spans the same width as fp32 (same exponent bits) but sits higher:
# its numbers are 2^16 times more coarsely spaced (`eps` 2^-7 against 2^-23). fp16 is
# more precise than bf16 (`eps` 2^-10) but its range is narrow: nothing above 65504, and values
# below its smallest normal (about 6e-5) lose precision until, below about 6e-8, they are zero.
# Those are the two failure modes of 16-bit training: **overflow** and **underflow** in fp16,
# **coarse rounding** in bf16.
#
# ## 2. Rounding, and why the master weights stay fp32
#
# Storing a number in a format rounds it to the nearest representable value:

# %% tags=["nbval-check-output"]
samples = [0.1, 1 + 2**-9, 1000.3, 70000.0, 3e-5, 1e-8, 1e-39]
print(f"{'value':>12} {'fp32':>14} {'bf16':>14} {'fp16':>14}")
for v in samples:
    print(f"{v:>12.6g} " + " ".join(f"{round_to(v, dt):>14.7g}"
                                    for dt in (torch.float32, torch.bfloat16, torch.float16)))

# %% [markdown]
# Read the rows: bf16 cannot tell `1 + 2^-9` from 1 and rounds 1000.3 to 1000; fp16 keeps both
# (to its 3 decimal digits) but turns 70000 into `inf`, keeps 3e-5 only as a subnormal with few
# significant bits, and rounds 1e-8 to 0, where bf16 keeps it.
#
# Now the reason the **weights** stay fp32 under mixed precision. An optimizer step adds a small
# update (`lr × gradient`) to each weight. Add an update of 1e-3 to a weight of 1.0, a thousand
# times, in each format:

# %% tags=["nbval-check-output"]
UPDATES, DELTA = 1000, 1e-3
accumulated = {}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    w = torch.tensor(1.0, dtype=dtype)
    for _ in range(UPDATES):
        w = w + torch.tensor(DELTA, dtype=dtype)
    accumulated[name] = w.item()
    print(f"{name}: 1.0 + {UPDATES} x {DELTA:g} = {w.item():.6f}   (exact: {1 + UPDATES * DELTA:.6f})")

# %%
check(accumulated["bf16"] == 1.0,
      "in bf16 every update of 1e-3 to 1.0 is below half the gap (2^-8) and should round away")
check(abs(accumulated["fp32"] - 2.0) < 1e-3, "fp32 should accumulate the thousand updates to ~2.0")
print(f"bf16 lost all {UPDATES} updates; fp16 ended {accumulated['fp16'] - 2:+.4f} off; fp32 "
      f"{accumulated['fp32'] - 2:+.1e} off")

# %% [markdown]
# **What you should see:** the bf16 weight never moves: every update is smaller than half the gap
# between 1.0 and its neighbour, so it rounds away, step after step. fp16 moves, but each update
# is rounded to a whole gap, so the total is off. This is why autocast computes the *matmuls* in
# 16 bits while the weights, the gradients the optimizer reads, and Adam's moments stay fp32.
#
# ## 3. Small gradients underflow in fp16
#
# Gradients are small numbers. In a big model they are smaller still: each weight shares the
# credit for the loss with billions of others, and gradient accumulation divides the loss by the
# number of micro-batches. We take real TinyGPT gradients and mimic that by dividing the loss
# by 1, 64 and 1024.

# %%
task = MarkovTask(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=SEED)
cfg = ModelConfig.preset("tiny", vocab_size=VOCAB, block_size=SEQ_LEN)
torch.manual_seed(SEED)
model = TinyGPT(cfg)
x0, y0 = task.get_batch(list(range(BATCH)))
DIVISORS = (1, 64, 1024)
# The key projection's bias has an exact gradient of zero (adding the same vector to every key
# shifts all attention scores of a query equally, and softmax ignores that): in fp32 it comes out
# as rounding noise. Leave it out, so that "lost" below means a real gradient lost.
is_key_bias = torch.cat([torch.full((p.numel(),), name.endswith("k_proj.bias"))
                         for name, p in model.named_parameters()])


def fp32_grads(divisor):
    """The exact (fp32) gradient of loss / divisor, flattened into one vector (key biases left out)."""
    model.zero_grad(set_to_none=True)
    _, loss = model(x0, y0)
    (loss / divisor).backward()
    return flat_grads(model)[~is_key_bias]


grads = {d: fp32_grads(d) for d in DIVISORS}
model.zero_grad(set_to_none=True)
model(x0, y0)[1].backward()
key_bias_grad = flat_grads(model)[is_key_bias].abs().max()
print(f"key-projection biases: {int(is_key_bias.sum())} values, largest |gradient| {key_bias_grad:.1e}; "
      f"median |gradient| of the other {grads[1].numel():,}: {grads[1].abs().median():.1e}")
check(key_bias_grad < 1e-4 * grads[1].abs().median(),
      "the key biases' gradient should be rounding noise, orders of magnitude below every real gradient")
fp16 = ranges["fp16"]
fig, ax = plt.subplots(figsize=(8, 4))
plots.plot_magnitude_histogram(ax, {f"loss / {d}": g for d, g in grads.items()},
                               lines={"fp16 smallest normal": fp16["min_normal"],
                                      "fp16 smallest subnormal": fp16["min_subnormal"]},
                               title=f"TinyGPT gradient magnitudes ({grads[1].numel():,} values each)")
plt.show()

# %% [markdown]
# **What you should see:** each division shifts the whole histogram to the left. With the loss
# divided by 1024, much of it lies in fp16's subnormal range (between the two dashed lines,
# where precision drains away) and a tail lies left of the smallest subnormal: those become zero.
#
# That was a simulation of storing the gradients. Now the real thing: a backward pass under fp16
# autocast (runs on a CPU, slowly), through `make_policy("fp16")` with a loss scale of 1 (no
# scaling) and of 2^16, each unscaled by the policy before we look. Lost = the gradient entry is
# exactly zero where fp32 has a nonzero value.

# %%
probe_opt = torch.optim.SGD(model.parameters(), lr=0.0)  # only so the scaler knows the parameters


def fp16_grads(divisor, scale):
    """Gradients of loss / divisor from a real fp16-autocast backward with loss scale `scale`."""
    model.zero_grad(set_to_none=True)
    policy = make_policy("fp16", init_scale=scale, cpu_fp16="allow")
    with policy.autocast():
        _, loss = model(x0, y0)
    policy.backward(loss / divisor)  # multiplies by the scale before backward
    policy.unscale_(probe_opt)  # divides the gradients by the scale again
    return flat_grads(model)[~is_key_bias]


real = {}
print(f"{'loss /':>7} {'median |g|':>11} | {'scale 1: lost':>14} {'rel. error':>11} | "
      f"{'scale 2^16: lost':>17} {'rel. error':>11}")
for d, g in grads.items():
    row = []
    for scale in (1.0, 2.0**16):
        g16 = fp16_grads(d, scale)
        lost = int(((g16 == 0) & (g != 0)).sum())
        rel = float((g16 - g).norm() / g.norm())
        real[d, scale] = (lost / g.numel(), rel)
        row.append(f"{lost:>8} ({lost / g.numel():5.1%}) {rel:>11.2e}")
    print(f"{d:>7} {g.abs().median():>11.2e} | {row[0]} | {row[1]:>29}")

# %%
worst = max(DIVISORS)
check(real[worst, 1.0][0] > 0.02 and real[worst, 1.0][1] > 0.1,
      f"without loss scaling, an fp16 backward of loss/{worst} should lose a visible share of the gradient "
      "entries to underflow, and the gradient should be far from fp32's")
check(real[worst, 2.0**16][0] < 0.001 and real[worst, 2.0**16][1] < 0.01,
      f"with a loss scale of 2^16 the same backward should lose (almost) nothing and match fp32 to ~1e-3")
check(all(real[d, 2.0**16][1] < real[d, 1.0][1] for d in DIVISORS),
      "loss scaling should bring every gradient closer to the fp32 one")
print(f"loss/{worst}: unscaled fp16 lost {real[worst, 1.0][0]:.1%} of the entries (gradient error "
      f"{real[worst, 1.0][1]:.0%}); with scale 2^16 it lost {real[worst, 2.0**16][0]:.3%} "
      f"(error {real[worst, 2.0**16][1]:.1e})")

# %% [markdown]
# **What you should see:** without scaling, the smaller the loss the more gradient entries are
# lost, and the gradient's relative error grows from fp16 rounding noise to a gradient that is
# simply wrong. Multiplying the loss by 2^16 before backward (so every gradient in the backward
# pass is 2^16 times larger) and dividing the result by 2^16 in fp32 brings it back to rounding
# noise. Scaling is exact: a power of two only moves the exponent.
#
# How large a scale? Too small and small gradients underflow; too large and the largest overflow
# to `inf`. Sweep it on the loss/1024 gradients (storing them in fp16 at each scale):

# %%
exponents = list(range(0, 41, 2))
sweep = loss_scaling_report(grads[worst], scales=[2.0**k for k in exponents], dtype=torch.float16)
underflow = [r["underflow"] / r["count"] for r in sweep]
overflow = [r["overflow"] / r["count"] for r in sweep]
good = [k for k, u, o in zip(exponents, underflow, overflow) if u < 0.001 and o == 0]
fig, ax = plt.subplots(figsize=(8, 4))
plots.plot_curves(ax, {"underflow (became 0)": (exponents, underflow),
                       "overflow (became inf)": (exponents, overflow)}, logy=True,
                  xlabel="log2(loss scale)", ylabel="share of gradient entries (log scale)",
                  title=f"storing loss/{worst} gradients in fp16 at each loss scale")
if good:
    ax.axvspan(good[0], good[-1], color="tab:green", alpha=0.15, label="lose < 0.1%, no overflow")
    ax.legend(fontsize=8)
plt.show()
print(f"scales 2^{good[0]} .. 2^{good[-1]} lose < 0.1% of the entries and overflow none" if good else
      "no scale keeps 99.9% of the entries without overflow")
check(underflow[0] > underflow[8] and overflow[-1] > 0 and len(good) > 0,
      "the sweep should show underflow falling as the scale grows, overflow at the largest scales, "
      "and a window of good scales in between")

# %% [markdown]
# **What you should see:** a window of good scales between the two failure modes. Its position
# depends on the model, the batch and the moment in training, so no fixed scale is safe: the
# **dynamic loss scaler** (section 5) searches for it while training.
#
# ## 4. bf16 autocast training vs fp32
#
# bf16 has fp32's range, so it needs no loss scaling: just autocast. One training loop serves
# every precision; the policy object decides what each line does:

# %%
def train(precision, steps, *, device="cpu", seed=SEED, recipe="tensorwise"):
    """Train a fresh TinyGPT on the Markov task; returns (losses, seconds per step, model).
    precision "fp8" (section 8): the Linear layers run FP8 under `recipe`, the rest bf16."""
    torch.manual_seed(seed)
    net = TinyGPT(cfg).to(device)
    if precision == "fp8":
        convert_to_fp8(net, recipe, skip=["lm_head"])
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    policy = make_policy(precision, device, cpu_fp16="allow")
    stream = BatchStream(task, BATCH, seed=seed, device=device)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        x, y = next(stream)
        with policy.autocast():  # matmuls in the low dtype; the weights stay fp32
            _, loss = net(x, y)
        opt.zero_grad(set_to_none=True)
        policy.backward(loss)  # fp16: multiplies the loss by the loss scale first
        policy.unscale_(opt)  # fp16: true gradients again, *before* clipping (section 6)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        policy.step(opt)  # fp16: skipped when a gradient is inf/nan
        losses.append(loss.item())
    return losses, (time.perf_counter() - start) / steps, net


runs = {name: train(name, TRAIN_STEPS) for name in ("fp32", "bf16")}
losses = {name: r[0] for name, r in runs.items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
plots.plot_curves(ax1, losses, smooth=5, title="training loss",
                  refs={"context-free loss (unigram entropy)": task.unigram_entropy(),
                        "best possible loss (entropy rate)": task.entropy_rate()})
plots.plot_curves(ax2, {"bf16 - fp32": [b - f for b, f in zip(losses["bf16"], losses["fp32"])]},
                  refs={"no difference": 0.0}, ylabel="loss difference", title="bf16 minus fp32, step by step")
plt.show()

# %%
tail = max(5, TRAIN_STEPS // 10)
mean_tail = {name: sum(ls[-tail:]) / tail for name, ls in losses.items()}
print(f"{'':>5} {'first loss':>11} {'mean of last ' + str(tail):>16} {'ms/step':>9}")
for name, (ls, sec, _) in runs.items():
    print(f"{name:>5} {ls[0]:>11.4f} {mean_tail[name]:>16.4f} {sec * 1e3:>9.1f}")
slowdown = runs["bf16"][1] / runs["fp32"][1]
print(f"bf16 autocast took {slowdown:.1f}x as long per step as fp32 on this CPU "
      f"({torch.backends.cpu.get_cpu_capability()})")
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits, _ = runs["bf16"][2](x0)
check(logits.dtype == torch.bfloat16, "under bf16 autocast the model's matmuls should produce bf16 logits")
check(all(p.dtype == torch.float32 for p in runs["bf16"][2].parameters()),
      "autocast must leave the master weights in fp32")
check(losses["bf16"] != losses["fp32"], "bf16 and fp32 losses are identical: did autocast run at all?")
check(all(m < task.unigram_entropy() - 0.5 for m in mean_tail.values()),
      "both runs should learn: their final loss should fall well below the context-free loss")
check(abs(mean_tail["bf16"] - mean_tail["fp32"]) < 0.05,
      "bf16 autocast should train to within 0.05 nats of fp32 on this task")

# %% [markdown]
# **What you should see:** two curves on top of each other, both falling from the random-guess
# loss towards the best possible loss; the difference panel shows bf16's rounding as small noise
# around zero, not a drift. On most CPUs bf16 is *slower* (the table's ms/step says how much here):
# CPUs without bf16 matrix instructions emulate it. On a GPU it is the other way round (section 7).
#
# ## 5. Dynamic loss scaling: skip, halve, grow
#
# fp16 needs a loss scale, and the right one changes during training. PyTorch's `GradScaler`
# (inside `make_policy("fp16")`) finds it by trial: after each backward it checks the unscaled
# gradients for `inf`/`nan`. If it finds any, it **skips the optimizer step** (the weights do not
# move) and **halves** the scale; after `growth_interval` clean steps in a row it **doubles** it.
# We start it at 2^32, far too large, and watch (fp16 on a CPU: slow, but the same code as on a GPU).

# %%
torch.manual_seed(SEED)
net = TinyGPT(cfg)
opt = torch.optim.AdamW(net.parameters(), lr=LR)
policy = make_policy("fp16", init_scale=2.0**32, growth_interval=GROWTH_INTERVAL, cpu_fp16="allow")
stream = BatchStream(task, BATCH, seed=SEED)
trace = []
for step in range(SCALER_STEPS):
    x, y = next(stream)
    with policy.autocast():
        _, loss = net(x, y)
    opt.zero_grad(set_to_none=True)
    scale = policy.loss_scale
    policy.backward(loss)
    policy.unscale_(opt)
    finite = bool(torch.isfinite(flat_grads(net)).all())
    before = [p.detach().clone() for p in net.parameters()]
    applied = policy.step(opt)
    moved = any(not torch.equal(b, p) for b, p in zip(before, net.parameters()))
    trace.append({"step": step, "scale": scale, "finite": finite, "applied": applied, "moved": moved,
                  "loss": loss.item()})
trace.append({"scale": policy.loss_scale})  # the scale the next step would use

# One row per step where something happened (a skip, or a new scale); the other steps repeat the row above.
print(f"{'step':>4} {'scale':>7} {'grads finite':>13} {'step applied':>13} {'weights moved':>14} {'loss':>7}")
for prev, t in zip([None] + trace[:-2], trace[:-1]):
    if prev is None or not t["applied"] or t["scale"] != prev["scale"] or t is trace[-2]:
        print(f"{t['step']:>4} {'2^' + str(int(torch.tensor(t['scale']).log2())):>7} {str(t['finite']):>13} "
              f"{str(t['applied']):>13} {str(t['moved']):>14} {t['loss']:>7.3f}")

# %%
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), layout="constrained", sharex=True)
steps_ = [t["step"] for t in trace[:-1]]
ax1.step(steps_, [torch.tensor(t["scale"]).log2().item() for t in trace[:-1]], where="post", label="log2(loss scale)")
skipped = [t for t in trace[:-1] if not t["applied"]]
ax1.plot([t["step"] for t in skipped], [torch.tensor(t["scale"]).log2().item() for t in skipped], "x",
         color="tab:red", label="overflow: step skipped")
ax1.set_ylabel("log2(scale)")
ax1.legend(fontsize=8)
ax1.grid(alpha=0.3)
plots.plot_curves(ax2, {"fp16 loss": [t["loss"] for t in trace[:-1]]}, xlabel="step")
plt.show()

# %%
n_skipped = sum(not t["applied"] for t in trace[:-1])
clean_run = 0
for t, nxt in zip(trace[:-1], trace[1:]):
    check(t["applied"] == t["finite"], f"step {t['step']}: the scaler should skip exactly the steps "
          "whose gradients are not finite")
    check(t["moved"] == t["applied"], f"step {t['step']}: a skipped step must leave the weights "
          "bit-for-bit unchanged, and an applied one must move them")
    clean_run = clean_run + 1 if t["applied"] else 0
    expected = t["scale"] / 2 if not t["applied"] else t["scale"] * (2 if clean_run == GROWTH_INTERVAL else 1)
    clean_run = 0 if clean_run == GROWTH_INTERVAL else clean_run
    check(nxt["scale"] == expected, f"step {t['step']}: the scale should go from {t['scale']:g} to "
          f"{expected:g} (halve after an overflow, double after {GROWTH_INTERVAL} clean steps), got {nxt['scale']:g}")
check(n_skipped > 0, "starting at 2^32 the scaler should overflow and skip at least one step")
first_ok = next(t for t in trace[:-1] if t["applied"])
print(f"{n_skipped} of {SCALER_STEPS} steps skipped; the first applied step ran at scale "
      f"2^{int(torch.tensor(first_ok['scale']).log2())}; final scale 2^{int(torch.tensor(trace[-1]['scale']).log2())}")
logged = trace[:-1]
early = first_ok["step"]  # the opening run of overflows: steps 0 .. early-1
later_skips = [t["step"] for t in logged[early:] if not t["applied"]]
grown = [t["step"] + 1 for t, nxt in zip(logged, trace[1:]) if nxt["scale"] > t["scale"]]  # a doubled scale's first step
probes_failed = [s for s in grown if s < SCALER_STEPS and not logged[s]["applied"]]
print(f"opening overflows: steps 0-{early - 1}; overflows after the first fit: {later_skips or 'none'}; "
      f"doublings: {len(grown)}, of which overflowed at once: {len(probes_failed)}")
check(all(not t["applied"] for t in logged[:early]) and early > 0,
      "the run should open with a series of skipped steps, one per halving, until the scale fits")
check(sum(t["loss"] for t in logged[-3:]) / 3 < first_ok["loss"],
      "once the scale fits, the loss should fall: the last steps should end below the first applied one")

# %% [markdown]
# **What you should see:** a staircase. The first steps overflow one after another, each skipped
# (weights untouched, loss flat) and each halving the scale, until the scaled gradients fit in
# fp16; from there the loss falls. A scale that fit once need not fit for good: as the weights
# move, the gradients change size, and a later step can overflow at a scale that was fine a step
# earlier; it is skipped and the scale halves again (the line under the table lists any such
# step). After `GROWTH_INTERVAL` clean steps in a row the scaler doubles the scale, probing for
# headroom; a doubling that overflows costs one skipped step and brings the scale back down,
# one that does not stays (the line counts both). A few skipped steps are the normal cost of
# fp16 training; a scale that keeps falling means real `inf`s in the model.
#
# ## 6. Clip *after* unscaling
#
# Gradient clipping rescales the gradients when their total norm exceeds `max_norm`. Under fp16
# the gradients after `backward` are multiplied by the loss scale, so the order matters. A
# common mistake clips right after `backward` (`scaler.scale(loss).backward();
# clip_grad_norm_(params, 1.0); scaler.step(opt)`), before the scaler unscales them. Do it both ways on
# the same batch, `max_norm = 1.0`, loss scale 2^16:

# %%
MAX_NORM, SCALE = 1.0, 2.0**16
torch.manual_seed(SEED)
base = TinyGPT(cfg)
base_state = {k: v.clone() for k, v in base.state_dict().items()}


def one_step(order, optimizer):
    """One fp16 step from the same weights; returns (norm the clipper saw, norm after, update size)."""
    base.load_state_dict(base_state)
    opt = (torch.optim.SGD(base.parameters(), lr=0.1) if optimizer == "SGD"
           else torch.optim.AdamW(base.parameters(), lr=LR))
    policy = make_policy("fp16", init_scale=SCALE, cpu_fp16="allow")
    opt.zero_grad(set_to_none=True)
    with policy.autocast():
        _, loss = base(x0, y0)
    policy.backward(loss)
    if order == "clip, then unscale (wrong)":
        seen = float(torch.nn.utils.clip_grad_norm_(base.parameters(), MAX_NORM))
        policy.unscale_(opt)
    else:
        policy.unscale_(opt)
        seen = float(torch.nn.utils.clip_grad_norm_(base.parameters(), MAX_NORM))
    after = float(flat_grads(base).norm())
    w0 = torch.cat([p.detach().flatten() for p in base.parameters()])
    policy.step(opt)
    return seen, after, float((torch.cat([p.detach().flatten() for p in base.parameters()]) - w0).norm())


orders = ("unscale, then clip (right)", "clip, then unscale (wrong)")
clip = {(o, name): one_step(o, name) for o in orders for name in ("SGD", "AdamW")}
print(f"{'order':<28} {'norm seen by clip':>18} {'grad norm after':>16} {'SGD update':>11} {'AdamW update':>13}")
for o in orders:
    seen, after, sgd = clip[o, "SGD"]
    print(f"{o:<28} {seen:>18.4g} {after:>16.4g} {sgd:>11.3g} {clip[o, 'AdamW'][2]:>13.3g}")

# %%
true_norm = clip[orders[0], "SGD"][0]
right_after, wrong_after = clip[orders[0], "SGD"][1], clip[orders[1], "SGD"][1]
check(abs(right_after - min(true_norm, MAX_NORM)) < 1e-3 * MAX_NORM,
      "unscale-then-clip should leave the gradient norm at min(true norm, max_norm)")
check(abs(clip[orders[1], "SGD"][0] / SCALE - true_norm) < 1e-2 * true_norm,
      "clipping before unscaling should see the true norm times the loss scale")
check(wrong_after < 2 * MAX_NORM / SCALE,
      "clip-then-unscale should leave gradients about loss-scale times too small")
sgd_ratio = clip[orders[1], "SGD"][2] / clip[orders[0], "SGD"][2]
adam_ratio = clip[orders[1], "AdamW"][2] / clip[orders[0], "AdamW"][2]
print(f"clipping first left the gradient {right_after / wrong_after:,.0f}x smaller than clipping after "
      f"unscaling: the SGD update was {sgd_ratio:.1e} of the right size, the AdamW update {adam_ratio:.0%} of it")

# %% [markdown]
# **What you should see:** the clipper sees the true norm times 2^16, decides the gradients are
# enormous, and shrinks them so their *scaled* norm is 1; unscaling then divides by 2^16 again.
# The step uses gradients tens of thousands of times too small: with SGD, training stops. AdamW
# divides by its running gradient size, which hides part of the damage (its update is "only"
# smaller, because the shrunk gradients now compete with Adam's `eps`), which is how this bug
# survives unnoticed; and the clip threshold means nothing any more, since it fires on every
# step. The fix is one line in the right place: `policy.unscale_(optimizer)` (PyTorch:
# `scaler.unscale_(optimizer)`) before `clip_grad_norm_`. Our `train` above does that.
#
# ## 7. What changes on a GPU
#
# * **Speed.** GPU tensor cores run bf16 and fp16 matmuls many times faster than fp32, so mixed
#   precision is the default for training. This CPU shows the opposite (below).
# * **fp16 needs the GradScaler; bf16 does not.** On CUDA, `make_policy("fp16", "cuda")` builds
#   the same scaler you saw in section 5, at full speed. bf16 needs an Ampere-or-newer GPU;
#   where it exists it is the simpler choice (no scaler, no skipped steps).
# * **DeepSpeed** takes the precision from its config (`"fp16": {"enabled": true}` or
#   `"bf16": ...`). Its CPU accelerator has no fp16, so an fp16 config fails on a CPU (below).
#
# Speed per training step on this machine, all three precisions, same model and batch:

# %%
fp16_losses, fp16_sec, _ = train("fp16", 6 if SMOKE else 10)
speed = {"fp32": runs["fp32"][1], "bf16": runs["bf16"][1], "fp16 (+ scaler)": fp16_sec}
for name, sec in speed.items():
    print(f"{name:<16} {sec * 1e3:8.1f} ms/step   {sec / speed['fp32']:5.1f}x fp32")
print(f"fastest here: {min(speed, key=speed.get)}; slowest: {max(speed, key=speed.get)}")
if torch.cuda.is_available():
    print(f"\nCUDA device: {torch.cuda.get_device_name()}")
    for name in ("fp32", "bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp32", "fp16"):
        ls, sec, _ = train(name, 30, device="cuda")
        print(f"{name:<16} {sec * 1e3:8.1f} ms/step on the GPU, loss {ls[0]:.3f} -> {ls[-1]:.3f}")
else:
    print("\nno CUDA device here: on a GPU this cell also times the three precisions there.")

# %%
try:
    import inspect

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine
except ImportError as exc:
    print(f"DeepSpeed is not importable here ({exc}); ./kit setup installs it")
else:
    acc = get_accelerator()
    print(f"DeepSpeed accelerator: {acc.device_name()}; fp16 supported: {bool(acc.is_fp16_supported())}; "
          f"bf16 supported: {bool(acc.is_bf16_supported())}")
    print("DeepSpeedEngine checks this when it is built (deepspeed.initialize):")
    print("\n".join(inspect.getsource(DeepSpeedEngine._do_sanity_check).splitlines()[:6]))

# %% [markdown]
# **What you should see:** on a CPU without 16-bit matrix instructions both 16-bit formats are
# slower than fp32 (they are emulated, and fp16 adds the scaler's checks; the line under the table
# says what this CPU did). On a CPU, DeepSpeed's accelerator reports no fp16, and the engine's
# own check turns an fp16 config into
# `ValueError: Type fp16 is not supported on your device.` The lessons carry over unchanged;
# only the speed flips on a GPU.
#
# ## 8. FP8: eight bits, and a scale for every block
#
# Hopper GPUs (H100, H200) multiply FP8 matrices twice as fast as bf16 ones, and an FP8 tensor is
# half the bytes. DeepSeek-V3 trained its 671B-parameter model in FP8 end to end, its loss within
# 0.25% of a bf16 run's; torchtitan with torchao's FP8 trains Llama 3.1 8B about 28% faster per
# GPU than bf16 (8,532 against 6,667 tokens/s with torch.compile). Eight bits leave little for
# range or precision, so there are two formats: **E4M3** (4 exponent bits, 3 mantissa bits, no
# infinity) for weights and activations, and **E5M2** (5 and 2, with inf like fp16) where range
# matters more than digits.
#
# **Predict first.** E4M3's exponent has 4 bits with bias 7, and the one pattern with every bit
# set (exponent 1111, mantissa 111) means NaN, so the largest finite number has exponent 1111 and
# mantissa 110. What is it? Put your answer in the next cell (leave `None` to skip).

# %%
MY_E4M3_MAX = None  # your prediction: a number

# %% tags=["nbval-check-output"]
print(format_fp8_table())
e4m3, e5m2 = format_facts("e4m3"), format_facts("e5m2")
edge = {fmt: overflow_behaviour(fmt) for fmt in ("e4m3", "e5m2")}
for fmt, o in edge.items():
    print(f"torch's plain cast to {fmt}: 2 x max -> {o['2*max']:g} ({o['2*max verdict']}), +inf -> {o['inf']:g}")

# %%
check(e4m3["max"] == (1 + 6 / 8) * 2.0 ** (15 - 7) == 448.0,
      "E4M3's max should be 1.110 (binary) x 2^(15 - 7) = 1.75 x 256 = 448")
check(e5m2["max"] == 57344.0 and e5m2["eps"] == 2 * e4m3["eps"],
      "E5M2 should reach 57344 with half of E4M3's precision (eps 0.25 against 0.125)")
check(edge["e5m2"]["2*max verdict"] == "overflows" and edge["e4m3"]["2*max verdict"] == "saturates",
      "E5M2 should overflow to inf past its max, and torch's E4M3 cast (no infinity) should clamp to 448")
check(e4m3["max"] / e4m3["min_subnormal"] == 448 * 2**9, "E4M3 should span 448 / 2^-9 = 229,376x")
if MY_E4M3_MAX is not None:
    check(MY_E4M3_MAX == e4m3["max"], f"your E4M3 max {MY_E4M3_MAX} is not {e4m3['max']:g}: mantissa 110 "
          f"is 1 + 1/2 + 1/4 = 1.75, and exponent 1111 is 2^(15 - 7)")
    print(f"your prediction {MY_E4M3_MAX:g} is right")
print(f"E4M3 spans {e4m3['max'] / e4m3['min_subnormal']:,.0f}x from its smallest subnormal to its max; "
      f"bf16 spans about 2^261")

# %% [markdown]
# **What you should see:** E4M3 tops out at 448 and bottoms out at 2^-9 (0.002), a span of about
# 230,000x; bf16 spans 2^261. A raw activation or gradient tensor does not fit: gradients live
# around 1e-5, far below E4M3's smallest number. So every FP8 recipe first divides a tensor by a
# **scale**, `amax / 448`, that lands its largest magnitude on 448, casts, and keeps the scale to
# multiply back (`torch._scaled_mm` takes both operands' scales and does that inside the GEMM).
# Past the range, E5M2 overflows to inf like fp16, while torch's E4M3 cast here clamps (the last
# two printed lines); the recipes never rely on either, since they clamp to ±max themselves.
#
# The recipes differ in **how many values share one scale**. One outlier sets the scale of
# everything it shares it with, pushing the small values of its group towards zero:
#
# | recipe | one scale per | formats | used by |
# | --- | --- | --- | --- |
# | tensorwise | tensor, from this step's amax | E4M3 forward, E5M2 gradients | torchao `tensorwise` |
# | delayed | tensor, from the max amax of the last 16 steps | as tensorwise | Transformer Engine's original recipe |
# | rowwise | row along the GEMM's inner dimension | E4M3 everywhere | torchao `rowwise` |
# | blockwise | 1 x 128 tile of activations and gradients, 128 x 128 block of weights | E4M3 everywhere | DeepSeek-V3 |
# | mxfp8 | 32 values, the scale a power of two (E8M0, one byte) | E4M3 | OCP Microscaling, Blackwell GPUs |
#
# An MX scale is `2^(floor(log2(amax)) - 8)`, where 8 is the exponent of E4M3's largest power of
# two (448 = 1.75 x 2^8). **Predict:** a block of 32 values whose largest magnitude is 5.0 gets
# which scale? And what does 5.0 become before the cast (5.0 / scale)?

# %%
MY_MX_SCALE = None  # your prediction: a power of two, e.g. 2**-3

# %%
block = torch.full((1, 32), 0.1)
block[0, 7] = 5.0
mx = quantize(block, "e4m3", (1, 32), scale_kind="e8m0")
mx_scale = float(mx.scale)
print(f"MX scale of the block: {mx_scale:g} = 2^{int(torch.log2(mx.scale).item())}; 5.0 / scale = {5.0 / mx_scale:g} "
      f"(<= 448: it fits), stored as {mx.data.float()[0, 7].item():g}")
check(mx_scale == 2.0 ** (2 - 8), "floor(log2(5.0)) = 2, so the MX scale should be 2^(2 - 8) = 2^-6")
if MY_MX_SCALE is not None:
    check(MY_MX_SCALE == mx_scale, f"your MX scale {MY_MX_SCALE:g} is not {mx_scale:g}: log2(5.0) is 2.32, its "
          f"floor 2, minus E4M3's 8")
    print(f"your prediction {MY_MX_SCALE:g} is right")

# %% [markdown]
# ### The error of each recipe on real tensors
#
# We take the fp32 TinyGPT trained in section 4, run one batch through it, and catch what every
# Linear layer sees: its input (an activation) and the gradient of its output. Each is pushed
# through every recipe (quantize, then multiply back), and we measure two things: the median
# error of a single value, and the share of values that became **zero** (underflow). The extra
# row "tensorwise, E4M3 grads" puts the gradients in E4M3 instead of E5M2, to see why the
# per-tensor recipe uses E5M2 there.

# %%
trained = runs["fp32"][2]
caught = {"input": [], "grad_output": []}
hooks = []
for name, layer in trained.named_modules():
    if isinstance(layer, torch.nn.Linear) and name != "lm_head":
        hooks.append(layer.register_forward_hook(lambda m, inp, out: caught["input"].append(inp[0].detach().flatten(0, -2))))
        hooks.append(layer.register_full_backward_hook(
            lambda m, gin, gout: caught["grad_output"].append(gout[0].detach().flatten(0, -2))))
trained.zero_grad(set_to_none=True)
trained(x0, y0)[1].backward()
for h in hooks:
    h.remove()
trained.zero_grad(set_to_none=True)

recipes = dict(RECIPES)
recipes["tensorwise, E4M3 grads"] = dataclasses.replace(RECIPES["tensorwise"], name="tensorwise, E4M3 grads",
                                                        grad_fmt="e4m3")
errors = {}
for name, recipe in recipes.items():
    for role, tensors in caught.items():
        rows = [quantization_error(t, recipe, role) for t in tensors]
        errors[name, role] = {k: sum(r[k] for r in rows) / len(rows) for k in ("median_rel_error", "underflow")}
print(f"{len(caught['input'])} activations and {len(caught['grad_output'])} gradients caught "
      f"(gradient magnitudes {min(float(t.abs().max()) for t in caught['grad_output']):.1e} to "
      f"{max(float(t.abs().max()) for t in caught['grad_output']):.1e})")
print(f"{'recipe':<24}{'activation error':>17}{'zeroed':>9}{'gradient error':>16}{'zeroed':>9}   (FP8 emulated)")
for name in recipes:
    a, g = errors[name, "input"], errors[name, "grad_output"]
    print(f"{name:<24}{a['median_rel_error']:>16.2%}{a['underflow']:>9.2%}{g['median_rel_error']:>15.2%}{g['underflow']:>9.2%}")

fig, ax = plt.subplots(figsize=(10, 3.6), layout="constrained")
xs = range(len(recipes))
for k, (role, label) in enumerate((("input", "activations"), ("grad_output", "gradients"))):
    ax.bar([x + 0.4 * k for x in xs], [errors[n, role]["median_rel_error"] * 100 for n in recipes], 0.4, label=label)
ax.set_xticks([x + 0.2 for x in xs], list(recipes), rotation=15)
ax.set_ylabel("median error of one value (%)")
ax.set_title("what a trip through FP8 does to one value, per recipe (emulated)")
ax.legend()
plt.show()

# %%
grad_zeroed = {n: errors[n, "grad_output"]["underflow"] for n in recipes}
check(grad_zeroed["tensorwise, E4M3 grads"] > 2 * grad_zeroed["tensorwise"],
      "with one scale per tensor, E4M3 gradients should lose at least twice as many values to zero as E5M2 ones")
check(all(grad_zeroed[n] < grad_zeroed["tensorwise, E4M3 grads"] for n in ("rowwise", "blockwise", "mxfp8")),
      "finer scales should let E4M3 gradients keep more values than one E4M3 scale per tensor")
check(max(errors[n, r]["median_rel_error"] for n in recipes for r in caught) < 0.05,
      "every recipe should keep the typical value within 5%: E4M3's 3 mantissa bits round by at most 1/16")
check(all(0.01 < errors[n, "input"]["median_rel_error"] < 0.03 for n in recipes),
      "a typical activation should come back within about 2% (between 1% and 3%) in every recipe")
check(errors["tensorwise", "grad_output"]["median_rel_error"] > 1.5 * errors["blockwise", "grad_output"]["median_rel_error"],
      "E5M2 gradients (tensorwise) should come back with well over the error of E4M3 ones (blockwise): one mantissa bit less")
print("E5M2 keeps the gradients' range at the price of a mantissa bit; finer E4M3 scales keep both")

# %% [markdown]
# **What you should see:** a typical activation comes back within about 2% in every recipe: that
# is E4M3's 3 mantissa bits. The gradients tell the recipes apart. Tensorwise stores them in E5M2,
# one mantissa bit less, so their error is about twice as large; give them E4M3 with one scale per
# tensor instead and the smallest gradients (below 2^-9 of the tensor's largest) become **zero**,
# the "zeroed" column. With a scale per row, per 1 x 128 tile or per 32 values, E4M3 keeps them
# and its extra bit too: DeepSeek-V3's choice, E4M3 everywhere with small blocks. This model is
# tiny and its gradients span only a few decades; in a large model they span more, and the zeroed
# share grows.
#
# ### Training in FP8, side by side with bf16
#
# Now every Linear layer but the output head runs its three matmuls in FP8 (forward, gradient of
# the input, gradient of the weight), each operand quantized under the recipe; embeddings, norms
# and the head stay in bf16, as in real FP8 runs. Same seed, same batches, same optimizer as the
# bf16 run of section 4, whose first `FP8_STEPS` steps are the reference. On this CPU the FP8
# matmuls are **emulated**: the numbers are FP8's, the speed is not.

# %%
fp8_runs = {recipe: train("fp8", FP8_STEPS, recipe=recipe) for recipe in RECIPES}
bf16_ref = losses["bf16"][:FP8_STEPS]
tail8 = max(3, FP8_STEPS // 6)
ref_tail = sum(bf16_ref[-tail8:]) / tail8
gap = {r: (sum(ls[-tail8:]) / tail8 - ref_tail) / ref_tail for r, (ls, _, _) in fp8_runs.items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
plots.plot_curves(ax1, {"bf16": bf16_ref, **{f"fp8 {r}": ls for r, (ls, _, _) in fp8_runs.items()}}, smooth=5,
                  title="training loss (FP8 emulated)")
plots.plot_curves(ax2, {f"{r} - bf16": [a - b for a, b in zip(ls, bf16_ref)] for r, (ls, _, _) in fp8_runs.items()},
                  smooth=5, refs={"no difference": 0.0}, ylabel="loss difference", title="FP8 (emulated) minus bf16, step by step")
plt.show()
print(f"mean loss of the last {tail8} steps: bf16 {ref_tail:.4f}  (FP8 emulated on {torch.device('cpu')})")
for r, g in gap.items():
    print(f"  fp8 {r:<11} {ref_tail * (1 + g):.4f}   relative gap {g:+.2%}   (DeepSeek-V3 at 671B: within 0.25%)")

# %%
check(all(abs(g) < 0.03 for g in gap.values()),
      "every FP8 recipe should end within 3% of bf16's loss on this task (the run-to-run noise of so few steps)")
check(all(fp8_runs[r][0] != bf16_ref for r in RECIPES), "an FP8 run's losses equal bf16's: did the FP8 layers run?")
print(f"largest gap {max(abs(g) for g in gap.values()):.2%} over {FP8_STEPS} steps (FP8 emulated on the CPU)")

# %% [markdown]
# **What you should see:** the FP8 curves lie on the bf16 curve, their differences noise around
# zero, and every relative gap a fraction of a percent to a few percent: at this size and this
# few steps the noise of a different rounding is larger than any recipe's bias. DeepSeek-V3's
# 0.25% is measured on runs a billion times larger, where the recipe's bias shows and the noise
# averages away; the tensorwise recipes are where such runs diverge first (an outlier-heavy
# tensor flushes its small values, as the table above showed).
#
# ### A 14-bit accumulator
#
# FP8 products are exact (two 4-bit significands give at most 8 bits), so a GEMM's error comes
# from the adding. DeepSeek-V3 found that the H800's FP8 tensor cores keep only about **14 bits**
# of the running sum, not fp32's 24: the bits that do not fit are dropped at every addition, and
# over a long inner dimension (K = 4096 in their models) the worst output was off by nearly 2%.
# Their fix: every 128 products, move the partial sum into an fp32 register and restart the short
# accumulator from zero. We emulate both (`course_lib.precision.accumulate`): products added 4 at
# a time into an accumulator cut to 14 bits, with and without the promotion every 128, for
# positive inputs (the worst case: the sum only grows).

# %%
g = torch.Generator().manual_seed(SEED)
acc_rows = []
for k in ((128, 512, 1024) if SMOKE else (128, 512, 1024, 2048, 4096)):
    a = fake_quantize(torch.rand(16, k, generator=g), "e4m3")
    b = fake_quantize(torch.rand(k, 16, generator=g), "e4m3")
    acc_rows.append({"K": k, "14-bit": accumulation_error(a, b, bits=14),
                     "14-bit, fp32 every 128": accumulation_error(a, b, bits=14, promote_every=128),
                     "fp32 (24-bit)": accumulation_error(a, b, bits=24)})
print(f"{'K':>6}" + "".join(f"{name:>25}" for name in acc_rows[0] if name != "K") + "   (emulated)")
for row in acc_rows:
    print(f"{row['K']:>6}" + "".join(f"{row[n]:>25.4%}" for n in row if n != "K"))
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
for name in ("14-bit", "14-bit, fp32 every 128", "fp32 (24-bit)"):
    ax.loglog([r["K"] for r in acc_rows], [r[name] for r in acc_rows], "o-", label=name)
ax.set_xlabel("inner dimension K")
ax.set_ylabel("worst relative error of an output")
ax.set_title("accumulating FP8 products (emulated)")
ax.legend()
plt.show()

# %%
last = acc_rows[-1]
check(last["14-bit"] > 5 * last["14-bit, fp32 every 128"],
      "promoting to fp32 every 128 products should cut the 14-bit accumulator's error more than fivefold")
check(all(r["14-bit"] < s["14-bit"] for r, s in zip(acc_rows, acc_rows[1:])),
      "the 14-bit accumulator's error should grow with K: each addition drops bits")
check(last["fp32 (24-bit)"] < 1e-4, "an fp32 accumulator should stay within 0.01% at every K here")
if last["K"] == 4096:
    check(0.01 < last["14-bit"] < 0.04, "at K = 4096 the 14-bit accumulator's worst error should be about 2% "
          "(between 1% and 4%), DeepSeek-V3's figure")
print(f"K = {last['K']}: 14 bits {last['14-bit']:.2%}, promoted every 128 {last['14-bit, fp32 every 128']:.3%}")

# %% [markdown]
# **What you should see:** the 14-bit line climbs with K, to about 2% at K = 4096 (DeepSeek-V3's
# figure); promoting every 128 products keeps it near the level of a 128-long sum, flat in K (more
# than five times lower at the longest K); fp32 stays far below both. On an H100 or H200 the same experiment runs on the tensor cores themselves;
# here the adder is emulated, so the numbers show the size of the effect, not one chip's rounding.
#
# The trainer runs all of this from a config: `train.precision = "fp8"` with `[fp8] recipe =
# "tensorwise"` (or `rowwise`, `delayed`, `blockwise`, `mxfp8`). On a GPU it uses torchao's
# Float8Linear (tensorwise, rowwise: real FP8 matmuls, and with `fp8.fsdp_all_gather = true` FSDP2
# all-gathers the weights in FP8, half of bf16's bytes); `fp8.keep` names the layers that stay in
# bf16.
#
# %% [markdown]
# ## Where next
#
# * **Lab 04**: the other big memory lever, activation checkpointing, and gradient accumulation
#   (whose `loss / k` makes the small-gradient problem of section 3 worse under fp16).
# * **Exercise 15**: write section 8's 1 x 128 blockwise FP8 quantizer yourself, scales and all.
# * **Lab 05**: training stability: clipping, spike detection and non-finite guards, built on the
#   same "unscale, then clip" order.
