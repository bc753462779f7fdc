# %% [markdown]
# # Exercise 05 — Clipping analysis and a gradient-explosion policy
#
# Two pieces of a training run's safety net, written by you and checked against the real thing:
#
# 1. **Clipping, made computational** (a classic exercise). You compute the global
#    gradient norm and the clip coefficient yourself, check them against
#    `torch.nn.utils.clip_grad_norm_`, then measure how often clipping fires in two real training
#    runs of the kit's trainer, and what that does to the step size.
# 2. **A gradient-explosion policy.** Given the gradient norms of the steps so far and this step's
#    norm, decide: apply the step (`"continue"`), apply it with a lower learning rate
#    (`"lower_lr"`), or leave it out (`"skip"`). The checks plant spikes in a noisy history and in
#    a real run; the grader plants other faults.
#
# Lab 05 shows the library's versions (`course_lib.stability`); try this first.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
RUN_STEPS = 80  # optimizer steps of the real training runs in parts 1c and 2c

# %%
import math
import random
import tempfile
from pathlib import Path

import torch

import course_lib
from course_lib.trainer import config as train_config
from course_lib.kit.checks import check, check_close
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.trainer.metrics import read_rows
from course_lib.train import train

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    RUN_STEPS = 40
torch.set_num_threads(1)  # a tiny model: one thread is as fast, and every run repeats exactly
CONFIG = Path(course_lib.__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"
RUNS = Path(tempfile.mkdtemp(prefix="ex05-"))


def run_trainer(name: str, *sets: str, faults=()) -> list[dict]:
    """Train TinyGPT with the kit's trainer (labs/configs/tiny-cpu.toml plus `section.key=value`
    overrides); return its metrics.jsonl rows, one per optimizer step."""
    overrides = [f"train.max_steps={RUN_STEPS}", "train.progress=false",
                 "train.peak_flops=1e12",  # MFU is not used here: skip measuring this CPU's peak
                 *sets]
    train(train_config.load(CONFIG, overrides), RUNS / name, faults=list(faults))
    return read_rows(RUNS / name / "metrics.jsonl")


def model_with_grads(seed: int = 0, scale: float = 1.0) -> torch.nn.Module:
    """A small MLP with gradients from one random batch (times `scale`)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                              torch.nn.Tanh(), torch.nn.Linear(64, 8))
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    (scale * torch.nn.functional.mse_loss(net(x), y)).backward()
    return net

# %% [markdown]
# ## Part 1a: the global gradient norm
#
# `clip_grad_norm_` does not look at each gradient tensor separately: it treats **all** of them
# as one long vector and takes its L2 norm. Write it. Return a Python float.

# %%
def global_grad_norm(grads: list) -> float:
    """L2 norm of all tensors in `grads` taken together as one vector."""
    ### BEGIN SOLUTION Picture every element of every tensor laid end to end in one vector: what is its length? Try two tensors, [3.] and [[4.]], by hand: the answer is 5, not 3 + 4
    return math.sqrt(sum(float(g.detach().double().pow(2).sum()) for g in grads))
    ### END SOLUTION


# %% tags=["points:2"]
net = model_with_grads(seed=0)
grads = [p.grad for p in net.parameters()]
mine = global_grad_norm(grads)
record("part1a.norm", mine, rtol=1e-5)
theirs = float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=float("inf")))  # measures only
check(isinstance(mine, float), f"return a Python float (use float(...)), got {type(mine).__name__}")
check(mine != sum(float(g.norm()) for g in grads),
      "that is the sum of the per-tensor norms; the global norm is the square root of the sum of "
      "the *squared* elements of all tensors")
check_close(mine, theirs, what="global gradient norm of the MLP", rtol=1e-5,
            hint=f"yours is {mine / theirs:.4g} x torch's. The norm of all tensors laid end to end as one vector"
            if isinstance(mine, float) and theirs else "")
print(f"global gradient norm {mine:.6f} (torch: {theirs:.6f}) over {len(grads)} tensors")

# %% tags=["points:2"]
### BEGIN HIDDEN TESTS
for seed, scale in [(1, 1.0), (2, 1e4), (3, 1e-6)]:
    net_h = model_with_grads(seed=seed, scale=scale)
    record(f"part1a.hidden.{seed}", global_grad_norm([p.grad for p in net_h.parameters()]), rtol=1e-5)
    want = float(torch.nn.utils.clip_grad_norm_(net_h.parameters(), float("inf")))
    check_close(global_grad_norm([p.grad for p in net_h.parameters()]), want, rtol=1e-5, atol=0,
                what=f"global norm, seed {seed}, gradients x{scale:g}")
record("part1a.hidden.small", [global_grad_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]),
                                global_grad_norm([torch.zeros(5)])])
check(global_grad_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == 5.0, "norm of (3, 4) is 5")
check(global_grad_norm([torch.zeros(5)]) == 0.0, "zero gradients have norm 0")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 1b: the clip coefficient
#
# Clipping multiplies every gradient by one number, the **clip coefficient**: `1` when the
# global norm is at most `max_norm`; otherwise the number that brings the global norm down to
# `max_norm`. torch adds `eps = 1e-6` to the norm wherever it divides by it, so a zero norm
# cannot divide by zero. The direction of the update is unchanged; only its length is capped.
# Write the coefficient, then `clip_gradients_`, which clips a list of gradients in place and
# returns `(total_norm_before, coefficient)`.

# %%
def clip_coefficient(total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """The factor clipping multiplies every gradient by (1.0: no clipping)."""
    ### BEGIN SOLUTION Multiplying every element by c multiplies the global norm by c: which c turns a norm of 4 into 1? Where does eps go?
    if total_norm <= max_norm:
        return 1.0
    return min(1.0, max_norm / (total_norm + eps))
    ### END SOLUTION


def clip_gradients_(grads: list, max_norm: float) -> tuple:
    """Clip `grads` in place to global norm `max_norm`; return (norm before, coefficient)."""
    ### BEGIN SOLUTION Your two functions give the coefficient; how do you change a tensor in place, without autograd recording it?
    norm = global_grad_norm(grads)
    coef = clip_coefficient(norm, max_norm)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef)
    return norm, coef
    ### END SOLUTION


# %% tags=["points:2"]
print(f"{'max_norm':>9} {'norm before':>12} {'coefficient':>12} {'norm after':>11} {'torch after':>12}")
for max_norm in (0.01, 0.05, 0.2, 1.0, 10.0):
    mine_net, ref_net = model_with_grads(seed=0), model_with_grads(seed=0)
    mine_grads = [p.grad for p in mine_net.parameters()]
    before, coef = clip_gradients_(mine_grads, max_norm)
    ref_before = float(torch.nn.utils.clip_grad_norm_(ref_net.parameters(), max_norm))
    after = global_grad_norm(mine_grads)
    record(f"part1b.clip.{max_norm}", [before, coef, mine_grads], rtol=1e-5, atol=1e-9)
    print(f"{max_norm:>9g} {before:>12.5f} {coef:>12.5f} {after:>11.5f} "
          f"{global_grad_norm([p.grad for p in ref_net.parameters()]):>12.5f}")
    check_close(before, ref_before, what=f"max_norm={max_norm}: the norm before clipping", rtol=1e-5)
    check(abs(after - min(before, max_norm)) <= 1e-4 * max(max_norm, 1e-3),
          f"max_norm={max_norm}: after clipping the global norm should be min(norm, max_norm) = "
          f"{min(before, max_norm):.5f}, got {after:.5f}")
    for (name, p), q in zip(mine_net.named_parameters(), ref_net.parameters()):
        check_close(p.grad, q.grad, what=f"max_norm={max_norm}: clipped gradient of {name}", rtol=1e-5,
                    atol=1e-9, hint="every tensor is multiplied by the same coefficient; no tensor is clipped on its own")
record("part1b.no_scale_up", clip_coefficient(0.5, 1.0))
check(clip_coefficient(0.5, 1.0) == 1.0, "a norm below max_norm must not be scaled up: coefficient 1.0")
print("your clipping matches torch.nn.utils.clip_grad_norm_")

# %% [markdown]
# **What you should see:** the coefficient is 1 (no clipping) once `max_norm` exceeds the
# norm; below that, the gradients keep their direction and come out with norm exactly `max_norm`.

# %% tags=["points:2"]
### BEGIN HIDDEN TESTS
record("part1b.hidden.coefs", [clip_coefficient(0.0, 1.0), clip_coefficient(4.0, 1.0), clip_coefficient(1e6, 0.5),
                               clip_coefficient(2.0, 2.0)], rtol=1e-12)
check(clip_coefficient(0.0, 1.0) == 1.0, "zero norm: coefficient 1")
check_close(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6), what="coefficient at norm 4, max 1", rtol=1e-12)
check_close(clip_coefficient(1e6, 0.5), 0.5 / (1e6 + 1e-6), what="coefficient at norm 1e6", rtol=1e-12)
check(clip_coefficient(2.0, 2.0) == 1.0, "a norm equal to max_norm is not clipped")
big, ref = model_with_grads(seed=5, scale=1e3), model_with_grads(seed=5, scale=1e3)
norm, coef = clip_gradients_([p.grad for p in big.parameters()], 0.3)
torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
record("part1b.hidden.big", [norm, coef, [p.grad for p in big.parameters()]], rtol=1e-5, atol=1e-12)
for p, q in zip(big.parameters(), ref.parameters()):
    check_close(p.grad, q.grad, what="hidden: clipped gradients of a x1000 batch", rtol=1e-5, atol=1e-12)
check(coef < 1e-3 and isinstance(norm, float), "a x1000 batch should be clipped hard")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 1c: clipping analysis on a real run
#
# How often does clipping fire in a real run, and how much does it shrink the steps? Write
# `clip_stats(grad_norms, max_norm)` returning a dict with
#
# * `"clip_rate"`: the fraction of steps whose norm exceeds `max_norm`;
# * `"mean_coef"`: the mean clip coefficient over all steps (1.0 when nothing is clipped).
#
# Then we train TinyGPT with the kit's trainer (`max_grad_norm = 1.0`), which logs every step's
# global gradient norm *before* clipping and whether it clipped, and ask what other thresholds
# would have done with the same norms.

# %%
def clip_stats(grad_norms: list, max_norm: float) -> dict:
    """Clip rate and mean clip coefficient of a run's (pre-clipping) global gradient norms."""
    ### BEGIN SOLUTION The two definitions above are each one pass over the norms: does a norm exactly equal to max_norm count as clipped?
    coefs = [clip_coefficient(n, max_norm) for n in grad_norms]
    return {"clip_rate": sum(n > max_norm for n in grad_norms) / len(grad_norms),
            "mean_coef": sum(coefs) / len(coefs)}
    ### END SOLUTION


# %% tags=["points:2"]
rows = run_trainer("config")
norms = [r["grad_norm"] for r in rows]
logged = sum(r["clipped"] for r in rows) / len(rows)
late = norms[len(norms) // 2:]
print(f"{'max_norm':>9} {'clip rate':>10} {'2nd half':>9} {'mean coef':>10}")
table = {}
for max_norm in (0.25, 0.5, 1.0, 2.0, 4.0):
    table[max_norm] = clip_stats(norms, max_norm)
    print(f"{max_norm:>9} {table[max_norm]['clip_rate']:>10.0%} {clip_stats(late, max_norm)['clip_rate']:>9.0%} "
          f"{table[max_norm]['mean_coef']:>10.3f}")
print(f"the trainer (max_norm 1.0) clipped {logged:.0%} of its {len(rows)} steps")
record("part1c.table", [table, clip_stats(late, 1.0)], rtol=1e-6)
check(abs(table[1.0]["clip_rate"] - logged) < 1e-9,
      f"at max_norm 1.0 your clip rate {table[1.0]['clip_rate']:.3f} should equal the fraction of steps the "
      f"trainer clipped ({logged:.3f}); count the norms strictly above max_norm")
rates = [t["clip_rate"] for t in table.values()]
coefs = [t["mean_coef"] for t in table.values()]
check(rates == sorted(rates, reverse=True), "a larger max_norm can only clip less often")
check(coefs == sorted(coefs) and all(0 < c <= 1 for c in coefs),
      "the mean coefficient lies in (0, 1] and grows towards 1 as max_norm grows")

# %% [markdown]
# **What you should see:** your numbers match the trainer's own record at 1.0. The gradient norm
# is largest in the first steps, so a threshold a little above the settled norm clips only
# there (compare the "2nd half" column); a threshold below it clips nearly every step, and the
# mean coefficient then says how much clipping shrinks every update: clipping has quietly become
# a learning-rate cut. The library's `ClipController` warns when that happens (lab 05): the fix
# is a lower LR or a longer warmup, not a tighter clip.
#
# *Think:* the offline table assumes the norms would be the same under another threshold. Why is
# that only approximately true? And why is `mean_coef` an exact LR cut for SGD but only a rough
# one for Adam, which divides each update by a running average of the gradient's size?

# %% tags=["points:1"]
### BEGIN HIDDEN TESTS
s = clip_stats([0.5, 2.0, 4.0, 1.0], 1.0)
record("part1c.hidden", [s, clip_stats([0.1] * 7, 1.0)], rtol=1e-9)
check(s["clip_rate"] == 0.5, "two of four norms exceed 1.0 (1.0 itself is not clipped)")
check_close(s["mean_coef"], (1 + 1 / (2 + 1e-6) + 1 / (4 + 1e-6) + 1) / 4, what="mean coefficient", rtol=1e-9)
check(clip_stats([0.1] * 7, 1.0) == {"clip_rate": 0.0, "mean_coef": 1.0}, "nothing clipped")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 2: a gradient-explosion policy
#
# Clipping caps the size of a bad step but still takes it. A gradient ten times larger than
# usual usually means a bad batch or the start of a divergence; it is safer to **skip** it. A
# moderately large one can be taken with a **lower learning rate**. Write
# `decide(history, grad_norm)`:
#
# * `history`: the global gradient norms of the earlier steps, oldest first, *including* earlier
#   spikes (they happened) and possibly `nan`/`inf` from earlier broken steps;
# * `grad_norm`: this step's norm. Return `"skip"`, `"lower_lr"` or `"continue"`.
#
# The rules:
#
# 1. a non-finite `grad_norm` (NaN or Inf): `"skip"` (a NaN update would destroy the weights);
# 2. the reference is the **typical** norm of the last `WINDOW` *finite* values of `history`;
#    with fewer than `MIN_HISTORY` finite values there is no reference yet: `"continue"`;
# 3. `ratio = grad_norm / typical`: above `SKIP_RATIO` `"skip"`; above `LOWER_LR_RATIO`
#    `"lower_lr"`; otherwise `"continue"`.
#
# "Typical" must not be moved by one or two earlier spikes in the window: a spike that raised
# the reference would hide the next one. Do not modify `history`.

# %%
WINDOW, MIN_HISTORY, LOWER_LR_RATIO, SKIP_RATIO = 20, 8, 2.0, 5.0


def decide(history, grad_norm: float) -> str:
    """'skip', 'lower_lr' or 'continue' for a step with global gradient norm `grad_norm`."""
    ### BEGIN SOLUTION The rules give the order. For 'typical', try a window of [1, 1, 1, 1, 1, 1, 1, 10] by hand: which statistic still says about 1, and which one is dragged up by the spike? Lab 05, section 4 compares detectors built on two kinds of reference
    import statistics

    if not math.isfinite(grad_norm):
        return "skip"
    recent = [h for h in history if math.isfinite(h)][-WINDOW:]
    if len(recent) < MIN_HISTORY:
        return "continue"
    ratio = grad_norm / statistics.median(recent)
    if ratio > SKIP_RATIO:
        return "skip"
    if ratio > LOWER_LR_RATIO:
        return "lower_lr"
    return "continue"
    ### END SOLUTION


# %% tags=["points:2"]
rng = random.Random(0)
calm = [0.8 * math.exp(-i / 200) + 0.2 + rng.gauss(0, 0.02) for i in range(60)]
check(decide(calm, calm[-1]) == "continue", "a norm like the recent ones: 'continue'")
check(decide(calm, 10 * calm[-1]) == "skip", "a norm 10x the recent ones (a classic 'gradients x10' explosion): 'skip'")
check(decide(calm, 3 * calm[-1]) == "lower_lr", "a norm 3x the recent ones: 'lower_lr'")
check(decide(calm, float("nan")) == "skip", "a NaN norm: 'skip'")
check(decide(calm[:5], 100.0) == "continue",
      f"with only 5 earlier norms (fewer than MIN_HISTORY={MIN_HISTORY}) there is no reference yet: 'continue'")
before = list(calm)
decide(calm, 1.0)
record("part2.single", [decide(calm, calm[-1]), decide(calm, 10 * calm[-1]), decide(calm, 3 * calm[-1]),
                        decide(calm, float("nan")), decide(calm[:5], 100.0), calm])
check(calm == before, "decide must not modify the history it is given")
print("single decisions are right")

# %% [markdown]
# ## Part 2b: planted spikes
#
# Now a whole run: a noisy, slowly falling gradient norm with spikes planted at known steps.
# Every step is judged against the steps before it, as a trainer would do. Planted: x10 and x8
# spikes (should be skipped), a x3 bump (lower LR), and a x12 spike only four steps after the
# x10 one, while that one is still in the window.

# %% tags=["points:2"]
trace = [0.9 * math.exp(-i / 300) + 0.3 + rng.gauss(0, 0.02) for i in range(300)]
planted = {60: (10, "skip"), 64: (12, "skip"), 150: (3, "lower_lr"), 230: (8, "skip")}
for step, (factor, _) in planted.items():
    trace[step] *= factor
decisions = [decide(trace[:i], trace[i]) for i in range(len(trace))]
flagged = {i: d for i, d in enumerate(decisions) if d != "continue"}
record("part2b.decisions", decisions)
print(f"{'step':>5} {'norm':>7} {'decision':>10} {'expected':>10}")
for i in sorted(set(flagged) | set(planted)):
    print(f"{i:>5} {trace[i]:>7.3f} {decisions[i]:>10} {planted.get(i, (None, 'continue'))[1]:>10}")
for step, (factor, want) in planted.items():
    check(decisions[step] == want, f"step {step} (norm x{factor}): expected '{want}', got '{decisions[step]}'"
          + (". The x10 spike four steps earlier is still in the window: a mean-based reference is "
             "dragged up by it and hides this one" if step == 64 else ""))
check(set(flagged) == set(planted), f"false alarms at steps {sorted(set(flagged) - set(planted))}: "
      "ordinary noise should give 'continue'")
print("every planted spike caught, no false alarm")

# %% [markdown]
# **What you should see:** exactly the four planted steps flagged. Step 64 is the interesting
# one: with a *mean* over the window, the x10 value at step 60 pulls the reference up, and a x12
# spike right after it looks only about twice as large as "usual".
#
# ## Part 2c: a real run
#
# The kit's trainer can break one step on purpose: `grad_scale@S=10` multiplies every gradient
# by 10 at optimizer step `S`. It logs the norm it measured *before* its own spike detector acts.
# Your policy reads the run's log after the fact: it should skip the faulty step and nothing
# else.

# %% tags=["points:2"]
FAULT = RUN_STEPS // 2
rows = run_trainer("fault", faults=[f"grad_scale@{FAULT}=10"])
norms = [r["grad_norm"] for r in rows]
real = [decide(norms[:i], norms[i]) for i in range(len(norms))]
record("part2c.decisions", real)
print(f"fault at optimizer step {FAULT} (metrics row {FAULT + 1}): norm {norms[FAULT]:.3f}; the 20 before "
      f"range from {min(norms[FAULT - 20:FAULT]):.3f} to {max(norms[FAULT - 20:FAULT]):.3f}")
print("your decisions other than 'continue':", {rows[i]["step"]: d for i, d in enumerate(real) if d != "continue"})
check(real[FAULT] == "skip", f"the x10 step (row {FAULT + 1}) should be skipped, got '{real[FAULT]}'")
check([i for i, d in enumerate(real) if d == "skip"] == [FAULT],
      "only the faulty step should be skipped: ordinary steps of a real run are not explosions")
check(rows[FAULT]["skipped"], "the trainer's own detector skipped that step too")

# %% [markdown]
# **What you should see:** your policy and the trainer's detector agree on the faulty step. Early
# in a real run the norm changes quickly (warmup, then the loss falling fast); a `"lower_lr"`
# there is harmless, but a skip would throw away a good step, which is why the policy needs
# `MIN_HISTORY` and a ratio well above the noise.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
base = [1.0 + 0.01 * ((7 * i) % 5) for i in range(30)]
# earlier broken steps left NaN / Inf in the history: ignored, not a reason to stop judging
check(decide(base[:10] + [float("nan"), float("inf")] + base[10:20], 1.02) == "continue", "NaN/Inf in history")
check(decide(base[:10] + [float("nan")] * 3 + base[10:20], 11.0) == "skip", "NaN in history, then a spike")
check(decide(base[:6] + [float("nan")] * 5, 50.0) == "continue", "only 6 finite values: no reference yet")
# several earlier spikes in the window must not hide a new one
spiky = base[:20]
for k in (3, 9, 15, 18):
    spiky[k] = 100.0
check(decide(spiky, 10.0) == "skip", "four x100 spikes in the window must not hide a x10 spike")
check(decide(base[:19] + [1000.0], 1.0) == "continue", "a normal step right after a spike")
check(decide(base[:19] + [1000.0], 3.0) == "lower_lr", "a x3 step right after a spike")
check(decide(base, float("-inf")) == "skip" and decide(base, float("inf")) == "skip", "infinite norms")
# scale-free: a big model's norms are small numbers
check(decide([1e-4 * b for b in base], 1e-3) == "skip", "norms around 1e-4: x10 is a spike")
check(decide([1e-4 * b for b in base], 1.05e-4) == "continue", "norms around 1e-4: normal step")
# a persistent level change is accepted within the window, and never skipped
hist = list(base[:20])
level = []
for _ in range(30):
    level.append(decide(hist, 3.0))
    hist.append(3.0)
check("skip" not in level and level[0] == "lower_lr" and level[-1] == "continue",
      f"a new level 3x higher: lower_lr at first, continue once the window is mostly new values; got {level}")
# a slowly falling norm is training going well
fall = [2.0 * 0.99**i for i in range(200)]
check(all(decide(fall[:i], fall[i]) == "continue" for i in range(len(fall))), "a slowly falling norm")
hist_t = tuple(base)
check(decide(hist_t, 9.0) == "skip", "history as a tuple")
# the last WINDOW finite values only: old history does not count
old_then_new = [10.0] * 100 + [1.0] * 20
check(decide(old_then_new, 6.0) == "skip", "only the last WINDOW values form the reference")
# planted faults in a longer noisy run, other seed
rng_h = random.Random(7)
tr = [0.5 + rng_h.gauss(0, 0.01) for _ in range(400)]
plan = {40: float("nan"), 41: 20.0, 100: 2.6, 101: 2.7, 300: float("inf"), 350: 6.0}
for k, v in plan.items():
    tr[k] = v if not math.isfinite(v) else v * 0.5
want = {40: "skip", 41: "skip", 100: "lower_lr", 101: "lower_lr", 300: "skip", 350: "skip"}
got = {i: decide(tr[:i], tr[i]) for i in range(len(tr))}
nan, inf = float("nan"), float("inf")
record("part2.hidden", [decide(base[:10] + [nan, inf] + base[10:20], 1.02), decide(base[:10] + [nan] * 3 + base[10:20], 11.0),
                        decide(base[:6] + [nan] * 5, 50.0), decide(spiky, 10.0), decide(base[:19] + [1000.0], 1.0),
                        decide(base[:19] + [1000.0], 3.0), decide(base, -inf), decide(base, inf),
                        decide([1e-4 * b for b in base], 1e-3), decide([1e-4 * b for b in base], 1.05e-4), level,
                        [decide(fall[:i], fall[i]) for i in range(len(fall))], decide(hist_t, 9.0),
                        decide(old_then_new, 6.0), got])
check({i: d for i, d in got.items() if d != "continue"} == want, f"hidden planted faults: {want}")
### END HIDDEN TESTS
