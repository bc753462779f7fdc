# %% [markdown]
# # Lab 04 — Activation checkpointing, offloading and gradient accumulation
#
# A training step keeps, between its forward and its backward pass, every tensor that backward
# will need: the **activations**. Lab 01 counted them; this lab trades them away and measures
# what each trade costs:
#
# 1. five memory strategies on one model: **activation checkpointing** (keep less in forward,
#    recompute it in backward: none, full, selective, every k-th block) and **offloading** (park
#    what is kept in host memory), gradients proven unchanged;
# 2. their memory, measured and estimated, with full and sliding-window attention;
# 3. their step time, and the memory-vs-time trade-off;
# 4. what a sliding-window mask really costs when the attention kernel is dense;
# 5. where offloaded bytes go, counted tensor by tensor;
# 6. a **memory leak** common in tutorial training loops: tensors kept alive across steps, measured
#    next to its fix;
# 7. **gradient accumulation**: k micro-batches give exactly the gradient of one big batch, if the
#    losses are averaged the right way; two ways to get it wrong;
# 8. the same trade-offs at the scale of a 7B model, from the estimators.
#
# Library pieces: `course_lib.model.TinyGPT` (its `set_memory_strategy` switches strategies on one
# set of weights), `course_lib.measure` (saved-activation bytes, step timers), `course_lib.estimate`.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
SEED = 0
SEQ_LEN = 256  # tokens per sequence
BATCH = 8  # sequences per batch
D_MODEL = 128
N_LAYERS = 4
WINDOW = 32  # sliding-window attention: each token sees itself and WINDOW - 1 tokens before it
EVERY_K = 2  # "every k" checkpoints blocks 0, k, 2k, ...
TIMED_ROUNDS = 7  # timed steps per strategy (interleaved, median reported)
LEAK_STEPS = 6  # steps of each loop in the memory-leak experiment
ACCUM = 4  # micro-batches per optimizer step in the accumulation experiments

# %%
import gc
import statistics
import math
import weakref

import matplotlib.pyplot as plt
import torch
from torch.utils.flop_counter import FlopCounterMode

import course_lib
from course_lib.kit.predict import show_prediction
from course_lib import estimate, measure
from course_lib.kit.checks import check, check_close
from course_lib.data import BatchStream, MarkovTask
from course_lib.estimate import format_bytes
from course_lib.model import ModelConfig, TinyGPT
from course_lib.model.layers import sliding_window_mask

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    SEQ_LEN, BATCH, D_MODEL, WINDOW, TIMED_ROUNDS, LEAK_STEPS = 128, 4, 64, 16, 3, 3
VOCAB, N_HEADS = 64, 4
# One thread: the model is small, and one thread makes timings repeatable on a shared machine.
torch.set_num_threads(1)
MiB = 2**20

# %% [markdown]
# ## 1. One model, five memory strategies
#
# Every strategy below runs on the *same* TinyGPT weights; `model.set_memory_strategy(...)` only
# changes what forward keeps for backward:
#
# | strategy | keeps for backward | pays in backward |
# | --- | --- | --- |
# | none | every activation autograd saves | nothing |
# | full | each block's input only | one more forward of every block |
# | selective | everything except the attention core | one more forward of the attention core |
# | every k | block inputs for blocks 0, k, 2k, ...; everything for the others | one more forward of those blocks |
# | offload | everything, but in host (CPU) memory | copies back from the host |
#
# All checkpointing here is PyTorch's non-reentrant `torch.utils.checkpoint.checkpoint(...,
# use_reentrant=False)`. Two attention patterns: full causal, and a sliding window in which each
# token sees itself and the `WINDOW - 1` tokens before it.

# %%
STRATEGIES = {
    "none": dict(),
    "full": dict(checkpointing="full"),
    "selective": dict(checkpointing="selective"),
    f"every {EVERY_K}": dict(checkpointing="selective", checkpoint_every=EVERY_K),
    "offload": dict(offload_activations=True),
}
ATTENTION = {"full causal": None, f"window {WINDOW}": WINDOW}


def make_model(window=None):
    """A fresh TinyGPT (GPT-2 style) with the lab's sizes; the same seed gives the same weights."""
    torch.manual_seed(SEED)
    return TinyGPT(ModelConfig.preset("tiny", vocab_size=VOCAB, block_size=SEQ_LEN, n_layers=N_LAYERS,
                                      d_model=D_MODEL, n_heads=N_HEADS, attention_window=window))


task = MarkovTask(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=SEED)
x, y = task.get_batch(list(range(BATCH)))
models = {name: make_model(window) for name, window in ATTENTION.items()}
BASE_CFG = models["full causal"].cfg  # no window, no checkpointing, no offloading
print(f"TinyGPT: {N_LAYERS} blocks, d_model {D_MODEL}, {N_HEADS} heads, "
      f"{models['full causal'].num_params():,} parameters; batch {BATCH} x {SEQ_LEN} tokens, fp32")


def gradients(model, strategy):
    """Gradients of one forward + backward on (x, y) under `strategy`, by parameter name."""
    model.set_memory_strategy(**STRATEGIES[strategy])
    model.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}

# %% [markdown]
# Correctness first: recomputation must give the *same* gradients, not nearly the same. In fp32
# on a CPU the recomputed forward runs the same kernels on the same inputs, so we expect zero
# difference.

# %%
print(f"{'attention':<13}{'strategy':<11}{'max |grad - grad without checkpointing|':>40}")
for att, model in models.items():
    reference = gradients(model, "none")
    for strategy in STRATEGIES:
        grads = gradients(model, strategy)
        worst = max((grads[n] - reference[n]).abs().max().item() for n in reference)
        print(f"{att:<13}{strategy:<11}{worst:>40.1e}")
        for n in reference:
            check_close(grads[n], reference[n], rtol=0, atol=1e-7, what=f"{att}, {strategy}: gradient of {n}",
                        hint="recomputation must reproduce the forward exactly; a difference means the "
                        "recomputed forward saw other inputs or other random numbers")

# %% [markdown]
# **What you should see:** a column of zeros. Checkpointing and offloading change *where* the
# tensors backward needs come from, never their values.
#
# ## 2. Memory: measured and estimated
#
# Measured: `measure.saved_activation_bytes` runs one forward under a saved-tensor hook that sees
# every tensor autograd keeps, and counts each storage once (parameters left out). That is what a
# step holds for backward at the end of forward, where memory peaks; on a GPU it is the
# activation part of `torch.cuda.max_memory_allocated`.
#
# Estimated: Korthikanti et al.'s per-layer formula (`estimate.activation_bytes_per_layer`) with
# TinyGPT's deviations from the paper's assumptions passed as keywords
# (`measure.tinygpt_activation_kwargs`: fp32, no dropout, fused attention, PyTorch's LayerNorm),
# plus the embedding, the output layer and the int64 token ids. "every k" is `ceil(L/k)` layers of
# `full` plus the rest of `none`. The window needs one more term, explained in section 4.
#
# Offloading hides its tensors from that hook: `save_on_cpu` is a saved-tensor hook too, and the
# innermost one takes every saved tensor. What it parks in host memory we count with a subclass
# that records each tensor its pack hook receives, at its own size (what it copies on a GPU;
# section 5 says what happens on a CPU):

# %%
class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """`save_on_cpu` that also records each tensor its pack hook receives."""

    def __init__(self):
        super().__init__(pin_memory=False)
        offload, self.seen = self.pack_hook, []

        def pack(t):
            self.seen.append(t)  # held until the counter is dropped
            return offload(t)

        self.pack_hook = pack

    def copied_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.seen)


def host_bytes(model):
    """Bytes save_on_cpu takes for host memory (copies, on a GPU) in one forward of (x, y), as
    TinyGPT's offload switch does."""
    model.set_memory_strategy()  # the counter does the offloading, around the whole forward like TinyGPT
    counter = CountingSaveOnCpu()
    with counter:
        model(x, y)
    return counter.copied_bytes()


# %%
tiny_kwargs = measure.tinygpt_activation_kwargs(BASE_CFG, seq_len=SEQ_LEN, micro_batch=BATCH)
per_layer = {m: estimate.activation_bytes_per_layer(**{**tiny_kwargs, "recompute": m})
             for m in ("none", "selective", "full")}
stage = estimate.first_stage_activation_breakdown(n_layers=N_LAYERS, vocab_size=VOCAB, **tiny_kwargs)
token_ids = 8 * SEQ_LEN * BATCH * 2 + 8 * SEQ_LEN  # int64 inputs and targets, learned-position ids
MASK_BYTES = 4 * SEQ_LEN**2  # the fp32 copy of a [T, T] mask SDPA keeps per layer (section 4)
N_CKPT = math.ceil(N_LAYERS / EVERY_K)  # blocks 0, k, 2k, ...


def layer_modes(strategy):
    """What each of the N_LAYERS blocks does under `strategy`: "none", "selective" or "full"."""
    if strategy == "full":
        return ["full"] * N_LAYERS
    if strategy == "selective":
        return ["selective"] * N_LAYERS
    if strategy.startswith("every"):
        return ["full" if i % EVERY_K == 0 else "none" for i in range(N_LAYERS)]
    return ["none"] * N_LAYERS


def estimated_bytes(strategy, window):
    """Estimated bytes kept on the compute device for backward, one forward of (x, y)."""
    if strategy == "offload":
        return 0.0  # every saved tensor goes to host memory
    modes = layer_modes(strategy)
    mask = MASK_BYTES * modes.count("none") if window else 0  # only a stored attention core keeps it
    return sum(per_layer[m] for m in modes) + mask + stage.embedding + stage.output + token_ids


memory, host = {}, {}
print(f"{'':<24}{'on the device':^37}{'host memory':>13}")
print(f"{'attention':<13}{'strategy':<11}{'measured MiB':>13}{'estimated MiB':>15}{'ratio':>9}{'MiB':>13}")
for att, model in models.items():
    for strategy, kw in STRATEGIES.items():
        model.set_memory_strategy(**kw)
        got = measure.saved_activation_bytes(model, x, y).total_bytes
        want = estimated_bytes(strategy, ATTENTION[att])
        memory[att, strategy] = got
        host[att, strategy] = host_bytes(model) if strategy == "offload" else 0
        ratio = f"{got / want:9.5f}" if want else f"{'-':>9}"
        print(f"{att:<13}{strategy:<11}{got / MiB:>13.2f}{want / MiB:>15.2f}{ratio}{host[att, strategy] / MiB:>13.2f}")
        check(abs(got - want) <= 8, f"{att}, {strategy}: measured {got:,} bytes but the estimate says "
              f"{want:,.0f}; the accounting above no longer describes what TinyGPT saves")

# %% [markdown]
# **What you should see:** estimate and measurement agree to a few bytes (cross-entropy keeps
# one fp32 scalar the formula leaves out) for every strategy. Full checkpointing keeps a small
# fraction of `none`; every k lands in between; selective saves almost nothing;
# offload keeps nothing on the device and sends *more* than `none` keeps to host memory (section 5).
#
# Why so little for selective? It was invented (Korthikanti et al.) to drop the `a x s x s`
# attention scores, the largest tensor of an eager attention. PyTorch's fused attention (flash
# attention on a GPU, its CPU counterpart here) never stores them: it keeps one fp32
# log-sum-exp per head and query and recomputes the scores in backward anyway. Selective has
# nothing large left to drop. The estimator shows what it would save on an eager attention:

# %%
eager = {m: estimate.activation_bytes_per_layer(**{**tiny_kwargs, "attention": "eager", "recompute": m})
         for m in ("none", "selective")}
print(f"one layer, eager attention: none {eager['none'] / MiB:.2f} MiB, selective {eager['selective'] / MiB:.2f} MiB "
      f"({1 - eager['selective'] / eager['none']:.0%} less)")
print(f"one layer, fused attention: none {per_layer['none'] / MiB:.2f} MiB, selective "
      f"{per_layer['selective'] / MiB:.2f} MiB ({1 - per_layer['selective'] / per_layer['none']:.1%} less)")

# %% [markdown]
# ## 3. Time: what the memory costs
#
# Each strategy runs `TIMED_ROUNDS` forward + backward steps on the same batch, interleaved round by
# round, after one warm-up step. A busy moment on a shared machine slows every strategy of that
# round alike, so each overhead is the median over rounds of *this round's* time divided by *this
# round's* `none` time, and the table prints the lowest and highest of those ratios: the spread
# tells you how much of a difference is noise. The estimate is the extra FLOPs of recomputation
# (`estimate.model_flops_per_iteration` with `recompute=`): full adds one forward of every block,
# about a third of a step's block FLOPs.

# %%
timers = {(att, s): measure.StepTimer(tokens_per_step=BATCH * SEQ_LEN, warmup=1)
          for att in models for s in STRATEGIES}
for _ in range(TIMED_ROUNDS + 1):
    for (att, strategy), timer in timers.items():
        model = models[att]
        model.set_memory_strategy(**STRATEGIES[strategy])
        model.zero_grad(set_to_none=True)
        with timer:
            model(x, y)[1].backward()
seconds = {key: timer.result().seconds_per_step for key, timer in timers.items()}
rounds = {key: timer.all_seconds[timer.warmup:] for key, timer in timers.items()}
paired = {(att, s): sorted(a / b for a, b in zip(rounds[att, s], rounds[att, "none"])) for att, s in rounds}
overhead = {key: statistics.median(r) - 1 for key, r in paired.items()}  # this round vs this round's none

shape = measure.tinygpt_shape(BASE_CFG, seq_len=SEQ_LEN)
flops = {m: estimate.model_flops_per_iteration(shape, batch=BATCH, recompute=m) for m in ("none", "selective", "full")}
flop_overhead = {"none": 0.0, "offload": 0.0, "full": flops["full"] / flops["none"] - 1,
                 "selective": flops["selective"] / flops["none"] - 1,
                 f"every {EVERY_K}": N_CKPT / N_LAYERS * (flops["full"] / flops["none"] - 1)}
print(f"{'strategy':<11}" + "".join(f"{att + ' ms':>16}{'overhead':>10}{'spread':>14}" for att in models)
      + f"{'estimated (FLOPs)':>19}")
for strategy in STRATEGIES:
    row = f"{strategy:<11}"
    for att in models:
        lo, hi = paired[att, strategy][0] - 1, paired[att, strategy][-1] - 1
        row += f"{seconds[att, strategy] * 1e3:>16.1f}{overhead[att, strategy]:>+10.0%}{f'{lo:+.0%}..{hi:+.0%}':>14}"
    print(row + f"{flop_overhead[strategy]:>+19.0%}")

# %%
labels = list(STRATEGIES)
fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
width = 0.38
for i, att in enumerate(models):
    xs = [j + (i - 0.5) * width for j in range(len(labels))]
    color = f"C{i}"
    axes[0].bar(xs, [memory[att, s] / MiB for s in labels], width, color=color, label=f"{att}: on the device")
    axes[0].bar(xs, [host[att, s] / MiB for s in labels], width, fill=False, hatch="//", edgecolor=color,
                label=f"{att}: sent to host memory")
    axes[1].bar(xs, [seconds[att, s] * 1e3 for s in labels], width, color=color, label=att)
    axes[2].scatter([seconds[att, s] * 1e3 for s in labels], [memory[att, s] / MiB for s in labels],
                    marker="os"[i], s=50, color=color, label=att)
    for s in labels if i == 0 else ():
        axes[2].annotate(s, (seconds[att, s] * 1e3, memory[att, s] / MiB), fontsize=8,
                         xytext=(4, 4), textcoords="offset points")
for ax, title, ylabel in [(axes[0], "kept for backward (hatched: in host memory)", "MiB"),
                          (axes[1], "forward + backward time (median)", "ms per step")]:
    ax.set_xticks(range(len(labels)), labels)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylim(0, 1.45 * max(max(memory.values()), max(host.values())) / MiB)
axes[0].legend(fontsize=7, ncol=2, loc="upper center")
axes[1].legend(fontsize=8)
axes[2].set_xlabel("ms per step")
axes[2].set_ylabel("MiB kept on the device for backward")
axes[2].set_title("the trade-off: lower left is better")
axes[2].grid(alpha=0.3)
axes[2].legend(fontsize=8)
plt.show()

# %%
print(f"full checkpointing: {memory['full causal', 'full'] / memory['full causal', 'none']:.1%} of the memory "
      f"for {overhead['full causal', 'full']:+.0%} time (FLOP estimate {flop_overhead['full']:+.0%})")
check(memory["full causal", "full"] < 0.25 * memory["full causal", "none"],
      "full checkpointing should keep far less than a quarter of what no checkpointing keeps")
check(memory["full causal", "full"] < memory["full causal", f"every {EVERY_K}"] < memory["full causal", "none"],
      "checkpointing every k-th block should land between none and full")
check(0 < overhead["full causal", "full"] < 3 * flop_overhead["full"],  # x3: a busy CPU slows the recompute too
      f"recomputing every block in backward should cost extra time of the order of the FLOP estimate "
      f"({flop_overhead['full']:+.0%}); measured {overhead['full causal', 'full']:+.0%}")

# %% [markdown]
# **What you should see:** the memory bars fall from none to full, with "every k" in between;
# full's time rises by an amount of the order of the FLOP estimate (on a CPU the norms, GELU and
# softmax, which the FLOP count leaves out, weigh more than on a GPU). Read every other time
# difference against its spread column: where the spread straddles zero, the machine, not the
# strategy, made the difference. Offload has nothing to copy on a CPU (its hooks run, the tensors
# stay in the same memory: section 5), so its bar is none's up to that noise. Window and full causal
# keep nearly the same memory; section 4 shows the one mask they differ by.
#
# ## 4. What a sliding window costs with a dense mask
#
# The window is a boolean `[T, T]` mask (True = may attend), here for `T = 8`, window 3:

# %% tags=["nbval-check-output"]
demo = sliding_window_mask(8, 3, "cpu")
for row in demo.int().tolist():
    print(" ".join("x" if v else "." for v in row))
print(f"{int(demo.sum())} of {8 * 9 // 2} causal pairs kept")

# %% [markdown]
# PyTorch's `scaled_dot_product_attention` takes the mask as a dense tensor. Its fused CPU kernel
# turns the boolean mask into an fp32 one (0 or -inf) and keeps that copy for backward, once per
# layer that stores its attention core: the `4 T^2` bytes per layer in section 2's estimate.
# And it computes every score of the `T x T` square, even the upper triangle that
# `is_causal=True` skips, before throwing the masked ones away.

# %%
extra = memory[f"window {WINDOW}", "none"] - memory["full causal", "none"]
kept = float(sliding_window_mask(SEQ_LEN, WINDOW, "cpu").sum()) / (SEQ_LEN * (SEQ_LEN + 1) / 2)
window_vs_causal = sorted(a / b for a, b in zip(rounds[f"window {WINDOW}", "none"], rounds["full causal", "none"]))
window_ratio, window_lo, window_hi = statistics.median(window_vs_causal), window_vs_causal[0], window_vs_causal[-1]
print(f"window {WINDOW} at T = {SEQ_LEN}: {kept:.1%} of the causal scores are used; it keeps "
      f"{extra:,} bytes more than full causal (= {N_LAYERS} layers x 4 x {SEQ_LEN}^2 = "
      f"{N_LAYERS * MASK_BYTES:,}); its step takes {window_ratio:.2f}x full causal's (spread {window_lo:.2f}..{window_hi:.2f})")
check(extra == N_LAYERS * MASK_BYTES, "with no checkpointing, the window should cost exactly one fp32 "
      "[T, T] mask per layer more than full causal attention")

# %% [markdown]
# **What you should see:** the window uses a small fraction of the scores but costs *more* memory,
# and it saves no work: the dense mask computes every score and then throws most away, so its time
# is full causal's up to the mask's own work and the machine's noise (the spread). A custom
# attention pattern written as a dense mask is a correctness tool, not an optimisation. The savings need a kernel that skips masked blocks without computing
# them: flash-attn's `window_size`, FlexAttention's block masks, or (at inference) a rolling KV
# cache. Exercise 04 builds a custom pattern of its own and checkpoints it.
#
# ## 5. Offloading, tensor by tensor
#
# `offload_activations=True` wraps TinyGPT's forward in `torch.autograd.graph.save_on_cpu`: every
# tensor autograd saves is sent to host memory in forward (on a GPU, a copy) and back in backward.
# Section 2 found
# nothing left on the device, and more in host memory than `none` keeps. What are those bytes?

# %%
model = models["full causal"]
model.set_memory_strategy()  # the counter does the offloading (as in host_bytes above)
param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
counter = CountingSaveOnCpu()
with counter:
    _, loss = model(x, y)
copies = [t.numel() * t.element_size() for t in counter.seen]
is_param = [t.untyped_storage().data_ptr() in param_storages for t in counter.seen]
unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
          for t, p in zip(counter.seen, is_param) if not p}
offloaded = {"saved tensors": len(copies),
             "bytes sent to host": sum(copies),
             "  of which weights": sum(c for c, p in zip(copies, is_param) if p),
             "  of which activations": sum(c for c, p in zip(copies, is_param) if not p),
             "distinct activation storages": sum(unique.values())}
del counter, loss
for name, value in offloaded.items():
    print(f"{name:<30}{value:>14,}" + (f"  = {value / MiB:.2f} MiB" if name != "saved tensors" else ""))
check(offloaded["distinct activation storages"] == memory["full causal", "none"],
      "save_on_cpu should receive every activation that no checkpointing keeps on the device")
check(offloaded["bytes sent to host"] == host["full causal", "offload"],
      "the same forward should copy the same bytes as in section 2")
dup = offloaded["  of which activations"] / offloaded["distinct activation storages"]
for link, gbs in [("PCIe 4.0 x16", 25), ("PCIe 5.0 x16", 50)]:  # usable GB/s, about 80% of the link's peak
    print(f"on a GPU over {link} (~{gbs} GB/s): {2 * offloaded['bytes sent to host'] / (gbs * 1e9) * 1e3:.2f} ms "
          "of copies per step (there in forward, back in backward)")
# On a CPU, "host memory" is where the tensor already is: save_on_cpu's pack hook keeps it as it is.
probe = x.float()
_, packed = torch.autograd.graph.save_on_cpu(pin_memory=False).pack_hook(probe)
print(f"on this CPU, save_on_cpu hands back the same storage: {packed.data_ptr() == probe.data_ptr()}")
check(packed.data_ptr() == probe.data_ptr(),
      "on a CPU save_on_cpu should keep each saved tensor where it is (tensor.cpu() returns the tensor "
      "itself): the bytes counted above are handed over, not copied")

# %% [markdown]
# **What you should see:** `save_on_cpu` copies more than the distinct activations: a tensor
# saved by several operations (the normalised input read by the q, k and v projections) is copied
# once per save, and the weights the matmuls save are copied too, every step. Those copies cross
# PCIe twice per step; they are free only if they overlap with compute (`pin_memory=True` makes
# them asynchronous on a GPU). On this CPU, device and host are the same memory: `tensor.cpu()`
# returns the tensor itself, so the bytes counted above are what `save_on_cpu` is *handed* (and
# what it would copy on a GPU); here not one of them moves (the last line), and offloading saves
# nothing (its time in section 3 is about that of none). An offloader can do better than this one: skip the parameters (they stay
# on the device anyway) and copy each storage once.

# %%
print(f"activation bytes copied / distinct activation bytes = {dup:.2f}")
check(dup > 1, "the q, k and v projections save the same input three times, so save_on_cpu should copy "
      "more activation bytes than there are distinct activation storages")

# %% [markdown]
# ## 6. A memory leak: tensors kept alive across steps
#
# Many tutorial loops log the loss with `losses.append(loss)`. `loss` is a tensor with a `grad_fn`:
# keeping it keeps its whole autograd graph alive, and whatever that graph still holds. How much
# is that? We count two things exactly:
#
# * **saved-tensor bytes still alive**: a saved-tensor hook keeps a *weak* reference to every
#   tensor autograd saves; after the step we sum the storages (each once, weights left out) whose
#   references are still alive. A weak reference does not keep anything alive by itself.
#   (Python's `tracemalloc` cannot do this: tensor memory is allocated by PyTorch's C++ allocator.)
# * **graph nodes alive**: the autograd nodes reachable from what the loop kept.

# %%
class SavedTensorWatch(torch.autograd.graph.saved_tensors_hooks):
    """Weakly remembers every tensor autograd saves; `alive_bytes()` sums the live storages."""

    def __init__(self, skip=()):
        self.refs, self.skip = [], {t.untyped_storage().data_ptr() for t in skip}

        def pack(t):
            self.refs.append(weakref.ref(t))
            return t

        super().__init__(pack, lambda t: t)

    def alive_bytes(self):
        gc.collect()
        live = {}
        for ref in self.refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in self.skip:
                live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(live.values())


def graph_nodes(kept):
    """Number of distinct autograd nodes reachable from the tensors in `kept`."""
    seen, todo = set(), [t.grad_fn for t in kept if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


LOOPS = {
    "train: losses.append(loss)": "a common tutorial loop",
    "train: losses.append(loss.detach())": "its fix (call .item() when you log)",
    "train: backward(retain_graph=True) + append(loss)": "backward keeps the saved tensors",
    "eval, grad on: losses.append(loss)": "no backward ever frees them",
    "eval, no_grad: losses.append(loss.item())": "its fix",
}


def run_loop(kind, steps):
    """`steps` steps of one loop from LOOPS; returns (saved bytes alive, graph nodes alive), after each step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = BatchStream(task, BATCH, seed=SEED)
    watch, losses, alive, nodes = SavedTensorWatch(skip=list(model.parameters())), [], [], []
    with watch:
        for _ in range(steps):
            xb, yb = next(stream)
            if kind.startswith("train"):
                _, loss = model(xb, yb)
                opt.zero_grad(set_to_none=True)
                loss.backward(retain_graph="retain_graph" in kind)
                opt.step()
                losses.append(loss.detach() if "detach" in kind else loss)
            elif "no_grad" in kind:
                with torch.no_grad():
                    losses.append(model(xb, yb)[1].item())
            else:
                losses.append(model(xb, yb)[1])
            xb = yb = loss = None  # what the next step replaces anyway: only `losses` carries over
            alive.append(watch.alive_bytes())
            nodes.append(graph_nodes(losses))
    return alive, nodes


leak = {kind: run_loop(kind, LEAK_STEPS) for kind in LOOPS}
per_forward = memory["full causal", "none"]
print(f"after {LEAK_STEPS} steps; one forward saves {per_forward / MiB:.2f} MiB")
print(f"{'loop':<52}{'saved bytes alive':>18}{'graph nodes':>13}  ")
for kind, (alive, nodes) in leak.items():
    print(f"{kind:<52}{format_bytes(alive[-1], 'MiB', 2):>18}{nodes[-1]:>13}  {LOOPS[kind]}")

# %%
fig, ax = plt.subplots(figsize=(8, 4))
for i, (kind, (alive, _)) in enumerate(leak.items()):
    ax.plot(range(1, LEAK_STEPS + 1), [a / MiB for a in alive], "o-" if i % 2 == 0 else "s--", label=kind)
ax.set_xlabel("step")
ax.set_ylabel("saved-tensor MiB still alive")
ax.set_title("saved tensors each loop keeps alive (lines overlap: two rise, three stay at 0)")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %%
bug, fix = leak["train: losses.append(loss)"], leak["train: losses.append(loss.detach())"]
full_leak = leak["eval, grad on: losses.append(loss)"][0]
check(full_leak == [(i + 1) * per_forward for i in range(LEAK_STEPS)],
      "an evaluation loop under grad mode that keeps its losses should hold every step's saved "
      "activations: exactly one forward's bytes more after each step")
check(leak["train: backward(retain_graph=True) + append(loss)"][0] == full_leak,
      "retain_graph=True keeps the saved tensors after backward: kept losses should hold them all")
check(bug[0] == [0] * LEAK_STEPS and bug[1][-1] > bug[1][0] > 0 and fix == ([0] * LEAK_STEPS, [0] * LEAK_STEPS),
      "in a plain training loop backward frees the saved tensors: the kept losses should hold a growing "
      "number of graph nodes but no saved bytes, and the detached losses nothing at all")
per_step = (bug[1][-1] - bug[1][0]) / (LEAK_STEPS - 1)
print(f"the tutorial loop keeps {per_step:.0f} more graph nodes every step and no saved tensors; "
      f"the evaluation loop keeps {format_bytes(full_leak[-1], 'MiB', 1)} after {LEAK_STEPS} steps")

# %% [markdown]
# **What you should see:** two kinds of leak. In the tutorial training loop `backward()`
# already freed the saved tensors, so `losses.append(loss)` keeps "only" every step's graph: a
# growing list of nodes in host memory, and a trap (`sum(losses).backward()` would fail, and
# `torch.stack(losses).mean()` builds yet another graph). The same line in an evaluation loop that
# forgot `torch.no_grad()`, or after `backward(retain_graph=True)`, keeps every step's activations:
# a straight line up, one forward's worth per step, until the GPU runs out of memory hours into a
# run. The fixes cost nothing: `loss.detach()` (or `.item()` when you log, not every step: each
# `.item()` waits for the GPU) and `torch.no_grad()` for evaluation.
#
# **Measured on an H100** (benchmarks/RESULTS-gpu.md): with GPT-2-shaped layers one forward saves
# 460.5 MiB; the evaluation loop without `no_grad` grew `torch.cuda.memory_allocated()` by 460.52 MiB
# per step (exactly 1.000 forward's worth), and the other three loops by 0. The allocator's
# *reserved* memory (what `nvidia-smi` shows) also carries fragmentation: with sizes changing every
# step it reached 2.28x the allocated bytes, 1.52x with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
#
# ## 7. Gradient accumulation
#
# A batch too big for memory can be split into `k` micro-batches: run forward and backward on
# each, let the gradients add up in `.grad`, and step once. The loss is a *mean* over tokens, so
# each micro-batch's loss must be divided by `k` before backward: the sum of `k` means of equal
# size divided by `k` is the mean of the whole batch.

# %%
MICRO = BATCH // ACCUM


def accumulated(model, loss_weights, targets):
    """Gradients after backward of loss_i * weight_i over the len(loss_weights) micro-batches of x."""
    model.zero_grad(set_to_none=True)
    mb = BATCH // len(loss_weights)
    for i, w in enumerate(loss_weights):
        sl = slice(i * mb, (i + 1) * mb)
        (model(x[sl], targets[sl])[1] * w).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def norm(g):
    return math.sqrt(sum((v.double() ** 2).sum().item() for v in g.values()))


def rel_err(g, ref):
    return norm({n: g[n] - ref[n] for n in g}) / norm(ref)


model = make_model()
big = accumulated(model, [1.0], y)  # one batch: the reference
mean_acc = accumulated(model, [1 / ACCUM] * ACCUM, y)
sum_acc = accumulated(model, [1.0] * ACCUM, y)
print(f"one batch of {BATCH} vs {ACCUM} micro-batches of {MICRO}")
print(f"{'':<28}{'gradient norm':>14}{'rel. difference to big batch':>30}")
for name, g in [("big batch", big), ("accumulated, loss / k", mean_acc), ("accumulated, sum of losses", sum_acc)]:
    print(f"{name:<28}{norm(g):>14.5f}{rel_err(g, big):>30.2e}")
for n in big:
    check_close(mean_acc[n], big[n], rtol=1e-4, atol=1e-7, what=f"accumulated gradient of {n}",
                hint="k micro-batches with loss / k should give the big batch's gradient up to fp32 rounding")
    check_close(sum_acc[n], ACCUM * big[n], rtol=1e-4, atol=1e-6, what=f"summed gradient of {n}",
                hint="without dividing by k the accumulated gradient should be k times the big batch's")

# %% [markdown]
# **What you should see:** accumulation with `loss / k` matches the big batch to fp32 rounding
# (the sums run in another order); summing the losses gives exactly `k` times the gradient. What
# does the factor `k` do to a training step? Apply one step of SGD and of AdamW to each:

# %%
def update(grads, make_opt):
    """The parameter change of one optimizer step from the lab's initial weights with `grads`."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    make_opt(model.parameters()).step()
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])


optimizers = {"SGD lr 0.1": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "AdamW lr 1e-3": lambda ps: torch.optim.AdamW(ps, lr=1e-3)}
print(f"{'optimizer':<16}{'step size, mean':>16}{'step size, sum':>16}{'sum / mean':>12}")
ratios = {}
for name, make_opt in optimizers.items():
    u_mean, u_sum = update(mean_acc, make_opt), update(sum_acc, make_opt)
    ratios[name] = u_sum.norm().item() / u_mean.norm().item()
    print(f"{name:<16}{u_mean.norm().item():>16.3e}{u_sum.norm().item():>16.3e}{ratios[name]:>12.3f}")
check(abs(ratios["SGD lr 0.1"] - ACCUM) < 1e-3 * ACCUM, "SGD's step should be k times larger when the "
      "micro-batch losses are summed instead of averaged")
check(abs(ratios["AdamW lr 1e-3"] - 1) < 0.05, "Adam divides by the gradient's own scale: its first step "
      "should hardly change when all gradients are k times larger")

# %% [markdown]
# **What you should see:** SGD takes a step `k` times too large, as if the learning rate were
# multiplied by `k`. AdamW hides the mistake: it divides each gradient by its running RMS, so a
# constant factor cancels (up to its `eps`). It still leaks out: a loss logged as that sum is `k`
# times too large, and gradient-norm clipping and spike detection see norms `k` times too large,
# so a threshold tuned at one `k` clips too often (or too rarely) at another.
#
# The second trap: **dividing by `k` is only right when every micro-batch has the same number of
# scored tokens.** With padding (targets of -100, ignored by the loss) each micro-batch's mean is
# over a different count. Pad the sequences unevenly and compare:

# %%
torch.manual_seed(SEED)
y_pad = y.clone()
lengths = torch.randint(SEQ_LEN // 8, SEQ_LEN + 1, (BATCH,))  # real tokens per sequence; the rest is padding
for row, n in enumerate(lengths.tolist()):
    y_pad[row, n:] = -100
counts = [int((y_pad[i * MICRO:(i + 1) * MICRO] != -100).sum()) for i in range(ACCUM)]
big_pad = accumulated(model, [1.0], y_pad)
naive = accumulated(model, [1 / ACCUM] * ACCUM, y_pad)
weighted = accumulated(model, [c / sum(counts) for c in counts], y_pad)
print(f"scored tokens per micro-batch: {counts}")
print(f"loss / k:                  relative gradient error {rel_err(naive, big_pad):.2e}")
print(f"loss x tokens_i / tokens:  relative gradient error {rel_err(weighted, big_pad):.2e}")
check(rel_err(weighted, big_pad) < 1e-5, "weighting each micro-batch's mean loss by its share of the scored "
      "tokens should reproduce the big batch's gradient")
check(rel_err(naive, big_pad) > 100 * rel_err(weighted, big_pad), "with unequal token counts, dividing by k "
      "should visibly differ from the big batch")

# %% [markdown]
# **What you should see:** `loss / k` is now wrong by far more than rounding: tokens in short
# micro-batches weigh more than tokens in long ones. Weighting each micro-batch's mean by its share
# of the step's scored tokens (equivalently: sum the token losses, divide by the step's token
# count) is exact again. Count the tokens before the first micro-batch's backward.
# (`course_lib.train` divides by `grad_accum`: its synthetic tasks have no padding.)
#
# What accumulation buys: memory per micro-batch. Activations scale with the micro-batch size,
# the gradient does not change, and the price is smaller matmuls run one after another:

# %%
KS = (1, 2, ACCUM)
acc_saved = {k: measure.saved_activation_bytes(model, x[:BATCH // k], y[:BATCH // k]).total_bytes for k in KS}
acc_timers = {k: measure.StepTimer(warmup=1) for k in KS}
for _ in range(TIMED_ROUNDS + 1):  # interleaved, as in section 3
    for k, timer in acc_timers.items():
        with timer:
            accumulated(model, [1 / k] * k, y)
acc_seconds = {k: timer.result().seconds_per_step for k, timer in acc_timers.items()}
print(f"{'micro-batch x k':>16}{'kept for backward':>19}{'ms per optimizer step':>23}")
for k in KS:
    print(f"{f'{BATCH // k} x {k}':>16}{format_bytes(acc_saved[k], 'MiB', 2):>19}{acc_seconds[k] * 1e3:>23.1f}")
print(f"k = {ACCUM}: {acc_saved[ACCUM] / acc_saved[1]:.2f}x the memory, "
      f"{acc_seconds[ACCUM] / acc_seconds[1]:.2f}x the time")
check(acc_saved[ACCUM] < acc_saved[1] / ACCUM * 1.1,
      f"a micro-batch {ACCUM} times smaller should keep about {ACCUM} times less for backward")
acc_flops = {}
for k in (1, ACCUM):  # the work itself, counted operator by operator (forward and backward)
    with FlopCounterMode(display=False) as counter:
        accumulated(model, [1 / k] * k, y)
    acc_flops[k] = counter.get_total_flops()
print(f"FLOPs per optimizer step: {acc_flops[1] / 1e9:.3f} G at k = 1, {acc_flops[ACCUM] / 1e9:.3f} G at k = {ACCUM}")
check(acc_flops[ACCUM] == acc_flops[1], "k micro-batches should do exactly the FLOPs of the one big batch")
time_change, memory_change = acc_seconds[ACCUM] / acc_seconds[1], acc_saved[ACCUM] / acc_saved[1]
if not SMOKE:  # a smoke run's micro-batch is one short sequence: the fixed cost per call outweighs its FLOPs
    check(abs(math.log(time_change)) < abs(math.log(memory_change)) / 2,
          f"the time per optimizer step should change far less than the memory ({memory_change:.2f}x): the "
          f"same FLOPs in smaller pieces; measured {time_change:.2f}x")

# %% [markdown]
# **What you should see:** activation memory falls in proportion to the micro-batch; the FLOPs
# per optimizer step are exactly the same, and so the time per optimizer step changes far less
# than the memory: the same FLOPs in smaller pieces (on a CPU smaller pieces can even run faster,
# their activations staying in cache). That holds while each micro-batch has enough work to
# outweigh the fixed cost of a forward and backward call (Python, operator dispatch): in a smoke
# run (`SMOKE`), a micro-batch of one short sequence does not, and the time grows toward k-fold,
# so the time is checked at full size only. On a GPU a micro-batch too small
# to fill the device costs nearly as much time as a bigger one, so accumulating many tiny
# micro-batches is slow there. Accumulation and checkpointing are the two knobs that fit a batch
# into memory; accumulation keeps the math identical, checkpointing keeps the micro-batch large.
# (These times and section 3's are taken minutes apart; on a shared machine compare times within
# one table, not across sections.)
#
# ## 8. At scale
#
# The same trade-offs for Llama 2 7B (32 layers, `s` = 4096, micro-batch 1, bf16 activations,
# SwiGLU MLP), from the estimators alone: activation memory of all layers and the FLOP overhead of
# recomputation. Eager attention stores the scores; flash attention does not.
#
# Predict first with lab 01's formula, `s b h (34 + 5 a s / h)` bytes per layer (Korthikanti et
# al.; h = 4096, a = 32 heads, b = 1): how many GiB do the 32 layers keep without recomputation,
# with eager attention? And with full recomputation, where each layer keeps only its input
# (`2 s b h` bytes in bf16)?

# %%
my_eager_gib = None  # your prediction: GiB of activations, no recomputation, eager attention
my_full_gib = None  # your prediction: GiB with full recomputation

# %% tags=["nbval-check-output"]
llama = estimate.ModelShape.preset("llama2-7b")
S, L7 = 4096, llama.n_layers
kw7 = dict(seq_len=S, micro_batch=1, d_model=llama.d_model, n_heads=llama.n_heads, mlp="swiglu",
           d_ff=llama.ffn_dim, dropout=False)
big_flops = {m: estimate.model_flops_per_iteration(llama, batch=1, seq_len=S, recompute=m)
             for m in ("none", "selective", "full")}
layer7 = {(att, m): estimate.activation_bytes_per_layer(**kw7, attention=att, recompute=m)
          for att in ("eager", "flash") for m in ("none", "selective", "full")}
rows7 = [("none, eager attention", L7 * layer7["eager", "none"], 0.0),
         ("none, flash attention", L7 * layer7["flash", "none"], 0.0),
         ("selective", L7 * layer7["eager", "selective"], big_flops["selective"] / big_flops["none"] - 1),
         ("every 4th block, flash", L7 // 4 * layer7["flash", "full"] + (L7 - L7 // 4) * layer7["flash", "none"],
          (big_flops["full"] / big_flops["none"] - 1) / 4),
         ("full", L7 * layer7["flash", "full"], big_flops["full"] / big_flops["none"] - 1)]
print(f"Llama 2 7B, s = {S}, micro-batch 1, bf16, {L7} layers (embedding and output layer left out)")
print(f"{'strategy':<26}{'activations':>14}{'extra FLOPs':>13}")
for name, nbytes, over in rows7:
    print(f"{name:<26}{format_bytes(nbytes, 'GiB', 2):>14}{over:>+13.1%}")
h100 = estimate.accelerator("h100-sxm5-80gb")
compute_s = big_flops["none"] / (0.4 * h100.peak_flops("bf16"))  # at 40% MFU
pcie_s = 2 * rows7[1][1] / 25e9  # the flash "none" bytes there and back, PCIe 4.0 x16 at ~25 GB/s
print(f"offload: 0 GiB kept on the GPU; {pcie_s:.2f} s of PCIe copies per step against {compute_s:.2f} s "
      f"of compute ({h100.name}, 40% MFU): {pcie_s / compute_s:.1f}x")
print()
formula = L7 * S * 1 * llama.d_model * (34 + 5 * llama.n_heads * S / llama.d_model)
show_prediction("no recomputation, eager attention", my_eager_gib, rows7[0][1] / 2**30, unit="GiB",
                why=f"the formula gives {formula / 2**30:.1f} GiB: it counts Megatron's GPT layer, with dropout "
                    "(a 1-byte mask per element, the s x s attention probabilities included) and a GELU MLP of "
                    "width 4h; Llama has no dropout and a SwiGLU MLP of width 11008, which the estimator counts")
show_prediction("full recomputation", my_full_gib, rows7[-1][1] / 2**30, unit="GiB",
                why=f"2 s b h x 32 layers = {2 * S * llama.d_model * L7 / 2**30:.2f} GiB: only each block's input is "
                    "kept; one block's activations are rebuilt at a time in backward (not counted here)")

# %% [markdown]
# **What you should see:** with eager attention the stored scores dominate at this length;
# selective recomputation removes them for a few percent more FLOPs, and flash attention removes
# them for free. Full recomputation shrinks what is left by another order of magnitude for about
# a third more compute, and checkpointing every 4th block buys a quarter of that saving for a
# quarter of the cost. Offloading keeps nothing on the GPU, but its copies take longer than the
# step's compute, so they cannot hide behind it: offloading every activation of every layer makes
# the step that many times slower. That is why offloaders move only the block inputs that
# checkpointing keeps (DeepSpeed's `cpu_checkpointing`) or only some layers (Megatron-Core's
# `cpu_offloading_num_layers`).
#
# ## Where next
#
# * **Exercise 04**: build a custom attention pattern (a sliding window plus global tokens),
#   checkpoint a model that uses it, prove the gradients unchanged and benchmark the strategies.
# * **Lab 05**: training stability: spikes, clipping and what to do when the loss blows up.
