# %% [markdown]
# # Exercise 02 — The ZeRO stage table
#
# Data parallelism keeps a full copy of the model state on every rank. ZeRO (Rajbhandari et al.
# 2020) shards it over the `dp` data-parallel ranks, one component per stage:
#
# | stage | sharded over dp | ZeRO paper name |
# | --- | --- | --- |
# | 0 | nothing (plain data parallelism) | baseline |
# | 1 | optimizer state | P_os |
# | 2 | optimizer state, gradients | P_os+g |
# | 3 | optimizer state, gradients, parameters | P_os+g+p |
#
# You will compute, with your own code, the table of the ZeRO paper (Rajbhandari et al., 2020,
# Figure 1): **what is sharded, the memory
# per rank, and the communication volume per step** for each stage.
#
# Conventions: mixed-precision Adam as in the ZeRO paper: 2 bytes of parameters, 2 of gradients
# and K = 12 of optimizer state per parameter. Communication is counted as **bytes one rank sends
# per optimizer step** with ring collectives over `dp` ranks, 2-byte elements.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes (everything here is instant)

# %%
import math

import course_lib
from course_lib import estimate
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)

SMOKE = course_lib.smoke(SMOKE)


def how_far(got, want: float, dp: int = 0) -> str:
    """How `got` compares with `want`, in words: the factor, named when it is a usual slip."""
    if not isinstance(got, (int, float)) or not want:
        return ""
    ratio = got / want
    named = {dp: "dp", 1 / dp: "1/dp", dp / (dp - 1): "dp/(dp - 1)", (dp - 1) / dp: "(dp - 1)/dp"} if dp > 1 else {}
    for factor, name in named.items():
        if math.isclose(ratio, factor, rel_tol=1e-9):
            return f" (too {'large' if ratio > 1 else 'small'} by a factor of {name})"
    return f" ({ratio:.4g} x the expected)"


def check_bytes(got, want: float, what: str, hint: str = "", dp: int = 0) -> None:
    """Fail, in words, unless byte count `got` equals `want` (to 1 part in 10^9: ZeRO divides exactly)."""
    ok = isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6)
    check(ok, f"{what}: expected {want:,.1f} bytes, got {got!r}{'' if ok else how_far(got, want, dp)}. {hint}".strip())

# %% [markdown]
# ## Part 1: what each stage shards
#
# Return the set of components stage `stage` shards, from `{"optimizer", "grads", "params"}`.

# %%
def sharded(stage: int) -> set:
    """Components ZeRO stage `stage` (0-3) shards over the data-parallel ranks."""
    ### BEGIN SOLUTION The table above answers it: what does each stage add to the one before? Can you write it without one if per stage?
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    return set(["optimizer", "grads", "params"][:stage])
    ### END SOLUTION


# %% tags=["points:2"]
record("sharded", [sorted(sharded(z)) for z in range(4)])
check(sharded(0) == set(), "stage 0 is plain data parallelism: every rank holds everything")
check(sharded(1) == {"optimizer"}, f"stage 1 shards the optimizer state only, got {sharded(1)}")
check(sharded(3) == {"optimizer", "grads", "params"}, f"stage 3 shards all three, got {sharded(3)}")
for stage in range(4):
    print(f"ZeRO-{stage}: shards {sorted(sharded(stage)) or 'nothing'}")

# %% tags=["points:1"]
### BEGIN HIDDEN TESTS
record("hidden.sharded", [sorted(sharded(z)) for z in range(4)])
check(sharded(2) == {"optimizer", "grads"}, "stage 2 shards optimizer state and gradients")
check(all(sharded(z) <= sharded(z + 1) for z in range(3)), "each stage keeps what the previous one shards")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 2: memory per rank
#
# A sharded component is split evenly: each rank holds 1/dp of it (keep the fraction, do not
# round). Return bytes per rank as a dict with `"params"`, `"grads"`, `"optimizer"`, `"total"`.
# Use your `sharded`.

# %%
def zero_bytes_per_rank(num_params: int, stage: int, dp: int, *, param_bytes: float = 2,
                        grad_bytes: float = 2, optimizer_bytes: float = 12) -> dict:
    """Model-state bytes one rank holds under ZeRO stage `stage` over `dp` ranks."""
    ### BEGIN SOLUTION How many bytes would one rank hold for each component with no sharding at all? What changes for a component your sharded(stage) names?
    shards = sharded(stage)
    out = {}
    for name, per_param in (("params", param_bytes), ("grads", grad_bytes), ("optimizer", optimizer_bytes)):
        full = num_params * per_param
        out[name] = full / dp if name in shards else full
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
    ### END SOLUTION


# %% [markdown]
# The ZeRO paper's Figure 1 uses a 7.5B-parameter model on 64 ranks and prints
# **120 GB, 31.4 GB, 16.6 GB and 1.88 GB** per rank for the four stages (GB = 10^9 bytes).

# %% tags=["points:2"]
figure_1 = {0: 120, 1: 31.4, 2: 16.6, 3: 1.88}
record("figure_1", [zero_bytes_per_rank(7_500_000_000, z, 64) for z in range(4)])
for stage, published in figure_1.items():
    got = zero_bytes_per_rank(7_500_000_000, stage, 64)
    check(abs(got["total"] / 1e9 - published) < 0.01 * published,
          f"ZeRO paper Figure 1, stage {stage} (7.5B params, 64 ranks): expected {published} GB per rank, "
          f"got {got['total'] / 1e9:.2f} GB ({got['total'] / 1e9 / published:.3g} x the published value)")
    want = estimate.model_state_bytes(7_500_000_000, recipe="mixed-adam", zero_stage=stage, dp=64)
    for key, value in (("params", want.params), ("grads", want.grads), ("optimizer", want.optimizer)):
        check_bytes(got[key], value, what=f"stage {stage} (7.5B params, 64 ranks): {key} per rank",
                    hint=f"does ZeRO-{stage} shard {key}? The table above says which stage starts to", dp=64)
print("Figure 1 reproduced: " + ", ".join(
    f"ZeRO-{z} {zero_bytes_per_rank(7_500_000_000, z, 64)['total'] / 1e9:.2f} GB" for z in range(4)))

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
# ZeRO paper Table 1 (7.5B, K = 12): per-device GB for P_os / P_os+g / P_os+g+p at several dp.
table_1 = {4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 1024: (30.1, 15.1, 0.12)}
for dp, published in table_1.items():
    for stage, want in zip((1, 2, 3), published):
        got = zero_bytes_per_rank(7_500_000_000, stage, dp)["total"] / 1e9
        check(abs(got - want) <= 0.01 * want + 0.005, f"Table 1, dp={dp}, stage {stage}: {want} GB, got {got:.3f}")
for n, stage, dp in [(1_500_000_000, 2, 16), (175_000_000_000, 3, 1024), (123, 1, 1), (7_000_000_000, 3, 3)]:
    want = estimate.model_state_bytes(n, recipe="mixed-adam", zero_stage=stage, dp=dp)
    got = zero_bytes_per_rank(n, stage, dp)
    for key in ("params", "grads", "optimizer", "total"):
        check_bytes(got[key], getattr(want, key), what=f"N={n} stage {stage} dp={dp}: {key}")
record("hidden.bytes", [zero_bytes_per_rank(7_500_000_000, s, dp) for dp in table_1 for s in (1, 2, 3)]
       + [zero_bytes_per_rank(n, s, dp) for n, s, dp in [(1_500_000_000, 2, 16), (175_000_000_000, 3, 1024), (123, 1, 1), (7_000_000_000, 3, 3)]]
       + [zero_bytes_per_rank(1000, 2, 4, param_bytes=4, grad_bytes=4, optimizer_bytes=8)])
fp32 = zero_bytes_per_rank(1000, 2, 4, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
check(fp32 == {"params": 4000, "grads": 1000, "optimizer": 2000, "total": 7000}, "fp32 Adam, stage 2, dp 4")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 3: communication per step
#
# A ring all-reduce is a reduce-scatter followed by an all-gather, and each of the two sends
# half of its bytes; exercise 00 (part 2) counts what one rank sends in a ring all-reduce.
#
# Per optimizer step, with N parameters (ZeRO paper Sec. 7):
#
# * **stage 0** all-reduces the gradients;
# * **stages 1 and 2** reduce-scatter the gradients (each rank needs only its shard's sum) and
#   all-gather the updated parameters: the same volume as stage 0;
# * **stage 3** also has to all-gather the parameters for the forward *and again* for the
#   backward pass (it dropped them in between): one reduce-scatter and two all-gathers.
#
# Return the bytes one rank sends per step, elements of `bytes_per_element` bytes.

# %%
def zero_comm_bytes_per_rank(num_params: int, stage: int, dp: int, bytes_per_element: float = 2) -> float:
    """Bytes one rank sends per optimizer step under ZeRO stage `stage` over `dp` ranks (ring)."""
    ### BEGIN SOLUTION How many bytes does one rank send in one reduce-scatter (or all-gather) of all N elements (exercise 00, part 2)? How many of them does each stage make per step?
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    passes = 3 if stage == 3 else 2
    return passes * (dp - 1) / dp * num_params * bytes_per_element
    ### END SOLUTION


# %% tags=["points:2"]
n7 = estimate.ModelShape.preset("llama2-7b").num_params()
record("comm_7b", [zero_comm_bytes_per_rank(n7, z, 8) for z in range(4)] + [zero_comm_bytes_per_rank(n7, 2, 1)])
for stage in range(4):
    got = zero_comm_bytes_per_rank(n7, stage, 8)
    want = estimate.comm_elements_per_step(n7, "ddp" if stage == 0 else f"zero{stage}", world_size=8).bytes_per_rank(2)
    check_bytes(got, want, what=f"Llama 2 7B, stage {stage}, dp=8: bytes sent per rank per step",
                hint="Count the collectives this stage makes per step, then what one rank sends in each: "
                     "in a ring a rank never sends the chunk it keeps", dp=8)
check(abs(zero_comm_bytes_per_rank(n7, 3, 8) / zero_comm_bytes_per_rank(n7, 0, 8) - 1.5) < 1e-12,
      "ZeRO-3 moves 1.5x the data of plain data parallelism (ZeRO paper Sec. 7.2.2): one extra all-gather")
check(zero_comm_bytes_per_rank(n7, 2, 1) == 0, "a single rank has no one to talk to: 0 bytes")
print("per rank per step, dp = 8: " + ", ".join(
    f"ZeRO-{z} {estimate.format_bytes(zero_comm_bytes_per_rank(n7, z, 8), 'GB', 1)}" for z in range(4)))

# %% [markdown]
# ## Part 4: the table
#
# Llama 2 7B on 8 data-parallel ranks, bytes per rank, GB = 10^9 bytes:

# %% tags=["points:1"]
n_ranks = 8
print(f"Llama 2 7B ({n7:,} parameters), dp = {n_ranks}, mixed-precision Adam")
print(f"{'stage':<7}{'shards':<28}{'params':>9}{'grads':>9}{'optimizer':>11}{'total':>9}{'sent/step':>11}")
table = {}
for stage in range(4):
    mem = zero_bytes_per_rank(n7, stage, n_ranks)
    comm = zero_comm_bytes_per_rank(n7, stage, n_ranks)
    table[stage] = (mem, comm)
    print(f"ZeRO-{stage:<2}{', '.join(sorted(sharded(stage))) or '-':<28}{mem['params'] / 1e9:>9.1f}"
          f"{mem['grads'] / 1e9:>9.1f}{mem['optimizer'] / 1e9:>11.1f}{mem['total'] / 1e9:>9.1f}{comm / 1e9:>11.1f}")
record("table", [table[z] for z in range(4)])
check(table[1][0]["total"] < table[0][0]["total"] and table[1][1] == table[0][1],
      "stage 1 should cut memory without adding communication")

# %% [markdown]
# **What you should see:** stages 1 and 2 are free memory savings (same bytes on the wire as plain
# data parallelism); stage 3 saves the most and is the only one that costs communication, 1.5x.
# With more ranks every sharded column shrinks, while the bytes sent per rank stay almost constant.

# %% tags=["points:2"]
### BEGIN HIDDEN TESTS
for n, stage, dp, e in [(1_500_000_000, 3, 16, 2), (175_000_000_000, 1, 1024, 2), (1000, 3, 3, 4), (10, 0, 2, 4)]:
    want = estimate.comm_elements_per_step(n, "ddp" if stage == 0 else f"zero{stage}", world_size=dp)
    check_bytes(zero_comm_bytes_per_rank(n, stage, dp, bytes_per_element=e), want.bytes_per_rank(e),
                what=f"N={n} stage {stage} dp={dp} {e}-byte elements")
record("hidden.comm", [zero_comm_bytes_per_rank(n, s, dp, bytes_per_element=e) for n, s, dp, e in
                       [(1_500_000_000, 3, 16, 2), (175_000_000_000, 1, 1024, 2), (1000, 3, 3, 4), (10, 0, 2, 4)]]
       + [zero_comm_bytes_per_rank(10**9, 2, 10**6)])
big = zero_comm_bytes_per_rank(10**9, 2, 10**6)
check(abs(big - 2 * 10**9 * 2) / (4 * 10**9) < 1e-5, "for large dp the volume approaches 2N elements (ZeRO Sec. 7)")
### END HIDDEN TESTS
