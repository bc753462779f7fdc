# %% [markdown]
# # Exercise 01 — The memory budget of a 7B model trained with AdamW
#
# You will write the functions that budget GPU memory for training, then answer the question
# every budget starts with: **for a 7B model trained with AdamW in mixed precision, which
# component dominates?** (Lab 01 walks through the same numbers; try this first.)
#
# Conventions: bytes (not GB) everywhere; one GPU, no sharding; bf16 weights and gradients; Adam
# in mixed precision keeps an fp32 master copy of the weights plus two fp32 moments.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes (everything here is instant)

# %%
import math

import course_lib
from course_lib import estimate
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)

SMOKE = course_lib.smoke(SMOKE)


def check_bytes(got, want: float, what: str, hint: str = "") -> None:
    """Fail, in words, unless byte count `got` equals `want` (to 1 part in 10^9), saying how far off."""
    ok = isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6)
    far = f" ({got / want:.4g} x the expected)" if not ok and isinstance(got, (int, float)) and want else ""
    check(ok, f"{what}: expected {want:,.1f} bytes, got {got!r}{far}. {hint}".strip())

LLAMA2_7B = estimate.ModelShape.preset("llama2-7b")  # 32 layers, d_model 4096, 32 heads
N_7B = LLAMA2_7B.num_params()
print(f"Llama 2 7B: {N_7B:,} parameters")

# %% [markdown]
# ## Part 1: model state
#
# Return the bytes of parameters, gradients and optimizer state for `num_params` parameters, as a
# dict with keys `"params"`, `"grads"`, `"optimizer"`. Parameters and gradients are bf16. The
# optimizer state is everything Adam keeps in fp32: a master copy of the weights and two moments.

# %%
def model_state_bytes(num_params: int) -> dict:
    """Bytes of bf16 params, bf16 grads and fp32 optimizer state (master + 2 moments)."""
    ### BEGIN SOLUTION How many bytes does one bf16 number take, and one fp32 number? How many fp32 numbers does mixed-precision Adam keep per parameter (the conventions above name them)?
    return {"params": 2 * num_params, "grads": 2 * num_params, "optimizer": (4 + 4 + 4) * num_params}
    ### END SOLUTION


# %% tags=["points:2"]
state = model_state_bytes(N_7B)
record("part1.state_7b", state)
ref = estimate.model_state_bytes(N_7B, recipe="mixed-adam")  # the ZeRO paper's 2 + 2 + 12
check(set(state) == {"params", "grads", "optimizer"},
      f"return a dict with keys params, grads, optimizer; got keys {sorted(state)}")
check(state["params"] == ref.params, f"bf16 parameters take 2 bytes each: expected {ref.params:,.0f} bytes, got "
      f"{state['params']:,}")
check(state["grads"] == ref.grads, f"bf16 gradients take 2 bytes each: expected {ref.grads:,.0f}, got {state['grads']:,}")
check(state["optimizer"] != 8 * N_7B, "8 bytes per parameter counts Adam's two moments only: mixed precision also "
      "keeps an fp32 master copy of the weights (4 more bytes per parameter)")
check(state["optimizer"] == ref.optimizer, f"the optimizer state should be {ref.optimizer / N_7B:g} bytes per "
      f"parameter (ZeRO paper, Sec. 3.1), got {state['optimizer'] / N_7B:g}")
print(f"model state: {sum(state.values()) / N_7B:g} bytes per parameter = "
      f"{estimate.format_bytes(sum(state.values()), 'GB', 1)}")

# %% [markdown]
# **What you should see:** 16 bytes per parameter, a little over 100 GB for Llama 2 7B: more than
# one 80 GB GPU before a single activation is stored.

# %% tags=["points:2"]
### BEGIN HIDDEN TESTS
for name in ("gpt2-small", "llama2-13b", "gpt3-175b"):
    n = estimate.ModelShape.preset(name).num_params()
    got = model_state_bytes(n)
    record(f"part1.hidden.{name}", got)
    want = estimate.model_state_bytes(n, recipe="mixed-adam")
    check((got["params"], got["grads"], got["optimizer"]) == (want.params, want.grads, want.optimizer),
          f"{name}: model state should be {want.params:,.0f} / {want.grads:,.0f} / {want.optimizer:,.0f} bytes")
record("part1.hidden.one", model_state_bytes(1))
check(model_state_bytes(1) == {"params": 2, "grads": 2, "optimizer": 12}, "one parameter: 2 + 2 + 12 bytes")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 2: activations of one transformer layer
#
# Korthikanti et al. 2022 (Table 2) count the bytes one layer keeps for backward, per micro-batch,
# with 2-byte activations, dropout, a GELU MLP of width 4h, and the attention scores stored.
# Their accounting, in words (lab 01, section 1 walks through it):
#
# * `recompute="none"`: **34 bytes for every token and every hidden unit** (every tensor of size
#   s x b x h: matmul and norm inputs, GELU, dropout masks), plus **5 bytes for every attention
#   score** (softmax output 2 bytes, dropout mask 1, dropout output 2); each of the `a` heads
#   scores every query of a sequence against every key;
# * `recompute="selective"`: the attention scores are recomputed in backward instead of stored;
# * `recompute="full"`: only the layer's input is kept, in 2-byte activations.
#
# s = sequence length, b = micro-batch, h = hidden size, a = attention heads.

# %%
def activation_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                               recompute: str = "none") -> float:
    """Bytes of activations one layer saves for backward (Korthikanti et al. 2022, Table 2)."""
    ### BEGIN SOLUTION How many numbers does one s x b x h tensor hold? How many attention scores does one layer hold for b sequences? Try s=2, b=1, h=4, a=2 by hand, then write one branch per recompute mode
    s, b, h, a = seq_len, micro_batch, d_model, n_heads
    if recompute == "none":
        return s * b * h * (34 + 5 * a * s / h)
    if recompute == "selective":
        return 34 * s * b * h
    if recompute == "full":
        return 2 * s * b * h
    raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    ### END SOLUTION


# %% tags=["points:2"]
kw = dict(seq_len=4096, micro_batch=1, d_model=4096, n_heads=32)
record("part2.per_mode", {m: activation_bytes_per_layer(**kw, recompute=m) for m in ("none", "selective", "full")})
record("part2.micro_batch_2", activation_bytes_per_layer(**{**kw, "micro_batch": 2}))
for mode in ("none", "selective", "full"):
    check_bytes(activation_bytes_per_layer(**kw, recompute=mode),
                estimate.activation_bytes_per_layer(**kw, recompute=mode),
                what=f"bytes per layer, recompute={mode!r}, s=4096 b=1 h=4096 a=32",
                hint="Which of the tensors the list above names does this mode keep, and how many "
                     "elements does each have?")
check(activation_bytes_per_layer(**{**kw, "micro_batch": 2}) == 2 * activation_bytes_per_layer(**kw),
      "activations grow linearly with the micro-batch: doubling b should double the bytes")
print("per layer: " + ", ".join(f"{m} {estimate.format_bytes(activation_bytes_per_layer(**kw, recompute=m), 'MiB', 0)}"
                                for m in ("none", "selective", "full")))

# %% tags=["points:2"]
### BEGIN HIDDEN TESTS
# GPT-3 175B as Korthikanti et al. train it (Table 3): s=2048, h=12288, a=96.
for s, b, h, a in [(2048, 1, 12288, 96), (1024, 8, 768, 12), (8192, 2, 8192, 64), (512, 3, 96, 6)]:
    for mode in ("none", "selective", "full"):
        record(f"part2.hidden.{s}-{b}-{h}-{a}-{mode}", activation_bytes_per_layer(s, b, h, a, recompute=mode))
        want = estimate.activation_bytes_per_layer(seq_len=s, micro_batch=b, d_model=h, n_heads=a, recompute=mode)
        check_bytes(activation_bytes_per_layer(s, b, h, a, recompute=mode), want,
                    what=f"s={s} b={b} h={h} a={a} recompute={mode}")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 3: the whole budget, and which part dominates
#
# `memory_budget` returns bytes for `"params"`, `"grads"`, `"optimizer"` and `"activations"`
# (all `shape.n_layers` layers; leave out the small embedding and output-layer terms), using your
# two functions. `dominant_component` returns the key of the largest entry.

# %%
def memory_budget(shape: estimate.ModelShape, *, seq_len: int, micro_batch: int, recompute: str = "none") -> dict:
    """Bytes per GPU: params, grads, optimizer (mixed-precision AdamW), activations (all layers)."""
    ### BEGIN SOLUTION Your two functions already count the pieces: which of them describes one layer, and how many layers are there?
    budget = model_state_bytes(shape.num_params())
    budget["activations"] = shape.n_layers * activation_bytes_per_layer(
        seq_len, micro_batch, shape.d_model, shape.n_heads, recompute=recompute)
    return budget
    ### END SOLUTION


def dominant_component(budget: dict) -> str:
    """The key of the largest component of `budget`."""
    ### BEGIN SOLUTION Which key has the largest value? Python's max can compare the keys of a dict by something other than the keys themselves
    return max(budget, key=budget.get)
    ### END SOLUTION


# %% tags=["points:3"]
print("Llama 2 7B shape, AdamW mixed precision, micro-batch 1, one GPU, no sharding (GB = 1e9 bytes)")
print(f"{'seq':>6} {'recompute':<10}" + "".join(f"{k:>13}" for k in ("params", "grads", "optimizer", "activations"))
      + f"{'total':>10}  dominant")
for seq in (1024, 4096):
    for mode in ("none", "selective"):
        budget = memory_budget(LLAMA2_7B, seq_len=seq, micro_batch=1, recompute=mode)
        print(f"{seq:>6} {mode:<10}" + "".join(f"{budget[k] / 1e9:>13.1f}" for k in budget)
              + f"{sum(budget.values()) / 1e9:>10.1f}  {dominant_component(budget)}")

b4096 = memory_budget(LLAMA2_7B, seq_len=4096, micro_batch=1)
b4096_selective = memory_budget(LLAMA2_7B, seq_len=4096, micro_batch=1, recompute="selective")
record("part3.budget_4096", b4096)
record("part3.dominant", [dominant_component(b4096), dominant_component(b4096_selective)])
want = 32 * estimate.activation_bytes_per_layer(seq_len=4096, micro_batch=1, d_model=4096, n_heads=32)
check_bytes(b4096["activations"], want, what="activations of 32 layers at s=4096, b=1",
            hint="the per-layer count is right (part 2): how many layers does shape describe?")
check(dominant_component(b4096) == "activations",
      "at s=4096 without recomputation the stored attention scores make activations the largest "
      "component (the table above shows all four)")
check(dominant_component(b4096_selective) == "optimizer", "with selective recomputation the scores are gone and Adam's 12 bytes per parameter dominate")

# %% [markdown]
# **What you should see:** the answer depends on the sequence length and on recomputation. With
# the attention scores stored at s = 4096, activations are the largest part; recompute them (or
# use flash attention) and the optimizer state is. That is why a budget needs both numbers, and
# why ZeRO (exercise 02) shards the optimizer state first.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
cases = [("gpt2-small", 1024, 16, "none"), ("gpt2-small", 1024, 1, "full"), ("llama2-13b", 4096, 1, "selective"),
         ("llama2-70b", 4096, 1, "selective"), ("gpt3-175b", 2048, 1, "none")]
for name, seq, mb, mode in cases:
    shape = estimate.ModelShape.preset(name)
    got = memory_budget(shape, seq_len=seq, micro_batch=mb, recompute=mode)
    record(f"part3.hidden.{name}-{seq}-{mb}-{mode}", [got, dominant_component(got)])
    acts = shape.n_layers * estimate.activation_bytes_per_layer(
        seq_len=seq, micro_batch=mb, d_model=shape.d_model, n_heads=shape.n_heads, recompute=mode)
    st = estimate.model_state_bytes(shape.num_params())
    want = {"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "activations": acts}
    for key, value in want.items():
        check_bytes(got[key], value, what=f"{name} s={seq} b={mb} {mode}: {key}")
    check(dominant_component(got) == max(want, key=want.get), f"{name} s={seq} b={mb} {mode}: wrong dominant part")
record("part3.hidden.dominant_abc", dominant_component({"a": 1, "b": 3, "c": 2}))
check(dominant_component({"a": 1, "b": 3, "c": 2}) == "b", "dominant_component should return the largest key")
### END HIDDEN TESTS
