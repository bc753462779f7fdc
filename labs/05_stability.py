# %% [markdown]
# # Lab 05 — Training stability
#
# A long training run fails in a handful of ways: the loss **spikes** and does not come back,
# a **NaN** appears and spreads to every weight, or the run never gets going because its first
# steps wrecked the initial weights. This lab measures each failure on TinyGPT and the guard
# against it:
#
# 1. **gradient clipping**, and the **clip rate** that tells you when clipping is hiding a problem;
# 2. **warmup**: the same high learning rate with and without it;
# 3. **NaN and Inf**: caught, the step skipped, a diagnostic bundle written, the run aborted when
#    it keeps happening;
# 4. **spike detection**: a popular rolling mean/std detector next to ours, on a curve with planted spikes;
# 5. **initialisation**: six init schemes, layer by layer and in training;
# 6. **bounded embeddings**;
# 7. **a gradient explosion mid-run**: gradients x10 at one step, caught and recovered, next to an
#    unprotected run;
# 8. **architecture levers**: QK-norm and z-loss, the model changes frontier runs make so that the
#    logits cannot grow out of control in the first place.
#
# Every training run here is the kit's trainer, `course_lib.train.train(cfg, out_dir, faults=...)`,
# the same as `python -m course_lib.train --config labs/configs/tiny-cpu.toml --inject-fault ...`
# on the command line. The guards live in `course_lib.stability` (the `Stabilizer`, which the
# trainer calls once per step). Every run here uses sequences of 32 tokens, half the config's 64:
# each effect shows as clearly, and the lab runs in half the time.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
SEED = 0
BASE_STEPS = 60  # the config's own run (sections 1, 3, 6)
HIGH_LR, WARMUP_RUN_STEPS, WARMUP = 3e-2, 60, 30  # section 2: 10x the config's LR (and section 8)
INIT_STEPS, INIT_LAYERS = 30, 2  # section 5: training curves per init scheme
FAULT_STEP, FAULT_RUN_STEPS, SAVE_EVERY = 60, 90, 25  # section 7 (SAVE_EVERY: for the rollback run)
RESUME_CHECK_STEPS = 5  # section 7: steps replayed from a checkpoint to show the resume is exact
EMBED_BOUND = 0.5  # section 6
Z_LOSS, LOGIT_EVERY, PROVOKED_WARMUP = 1e-3, 10, 10  # section 8: z-loss coefficient, steps between the
# logit measurements, the provoked run's warmup (the config's)

# %%
import json
import math
import random
import shutil
import statistics
import tempfile
import warnings
from collections import deque
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.labs import plots
from course_lib.trainer import config as train_config
from course_lib.checkpoint import CheckpointManager
from course_lib.kit.checks import check, check_close
from course_lib.kit.scratch import fresh
from course_lib.data import BatchStream, MarkovTask
from course_lib.trainer.metrics import read_rows
from course_lib.model import INIT_SCHEMES, ModelConfig, TinyGPT
from course_lib.stability import NonFiniteError
from course_lib.stability import SpikeDetector
from course_lib.stability import ClipController, GradientMonitor
from course_lib.train import train

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    BASE_STEPS, INIT_STEPS, INIT_LAYERS = 40, 16, 2  # sections 2 and 8 keep their size: their effects need it
    FAULT_STEP, FAULT_RUN_STEPS, SAVE_EVERY, RESUME_CHECK_STEPS = 30, 50, 12, 5
torch.set_num_threads(1)  # a tiny model: one thread is as fast, and every run repeats exactly
CONFIG = Path(course_lib.__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"
LAB_SETS = ("data.seq_len=32",)  # on top of the config in every run of this lab
RUNS = Path(tempfile.mkdtemp(prefix="lab05-"))  # scratch: metrics, checkpoints, diagnostics
RESUMED_FROM = {}  # run name -> the step it resumed from (0: it started fresh)


def run(name, steps, *sets, faults=(), resume=False):
    """Train with the kit's trainer: tiny-cpu.toml plus `section.key=value` overrides, injected
    `faults`; `resume=True` continues from the newest checkpoint in the run's folder. Returns the
    run's metrics.jsonl rows (row i is optimizer step i, 0-based, and has "step": i + 1)."""
    overrides = [f"train.max_steps={steps}", f"train.seed={SEED}", "train.progress=false",
                 "train.peak_flops=1e12",  # MFU is not shown here: skip measuring this CPU's peak
                 *LAB_SETS, *sets]
    with warnings.catch_warnings(record=True) as caught:  # one line per run instead of a stderr block
        warnings.simplefilter("always", RuntimeWarning)
        out = RUNS / name if resume else fresh(RUNS / name)  # a re-run cell starts its run afresh
        result = train(train_config.load(CONFIG, overrides), out, faults=list(faults), resume=resume)
    RESUMED_FROM[name] = result.resumed_from
    for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)):
        print(f"[{name}] the trainer warned: {message}")
    return read_rows(RUNS / name / "metrics.jsonl")


cfg0 = train_config.load(CONFIG, list(LAB_SETS))
print(f"config: {cfg0['data']['task']} task, vocab {cfg0['data']['vocab_size']}, seq {cfg0['data']['seq_len']}, "
      f"batch {cfg0['train']['micro_batch']}, lr {cfg0['optim']['lr']}, warmup {cfg0['schedule']['warmup_steps']}, "
      f"max_grad_norm {cfg0['stability']['max_grad_norm']}, spike policy {cfg0['stability']['spike_policy']!r}")

# %% [markdown]
# ## 1. Gradient clipping and the clip rate
#
# Clipping measures the **global** norm of all gradients together (one long vector) and, when it
# exceeds `max_norm`, multiplies every gradient by `max_norm / norm`: the step keeps its direction,
# its length is capped. `ClipController` does that and also counts how often it fires. First, one
# batch, compared with PyTorch's `clip_grad_norm_`:

# %%
task = MarkovTask(vocab_size=cfg0["data"]["vocab_size"], seq_len=cfg0["data"]["seq_len"], seed=SEED)
x0, y0 = next(BatchStream(task, cfg0["train"]["micro_batch"], seed=SEED))


def fresh_grads(seed=SEED):
    torch.manual_seed(seed)
    net = TinyGPT(ModelConfig.preset("tiny", vocab_size=task.vocab_size, block_size=task.seq_len))
    net(x0, y0)[1].backward()
    return net


print(f"{'max_norm':>9} {'norm before':>12} {'coefficient':>12} {'norm after':>11} {'torch norm after':>17}")
for max_norm in (0.1, 0.5, 1.0, 2.0):
    ours, ref = fresh_grads(), fresh_grads()
    stats = GradientMonitor().measure(ours)
    clipped, coef = ClipController(max_norm).clip_(stats.grads, stats.total_norm)
    torch_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    after = GradientMonitor().measure(ours).total_norm
    print(f"{max_norm:>9} {stats.total_norm:>12.4f} {coef:>12.4f} {after:>11.4f} "
          f"{GradientMonitor().measure(ref).total_norm:>17.4f}")
    check_close(stats.total_norm, torch_norm, what=f"global norm (max_norm {max_norm})", rtol=1e-5)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        check_close(p.grad, q.grad, what=f"clipped gradient of {name} (max_norm {max_norm})", rtol=1e-5, atol=1e-10)

# %% [markdown]
# **What you should see:** the same norm and the same clipped gradients as PyTorch; below the
# norm the gradients come out with norm exactly `max_norm`, above it they are untouched.
#
# How often does clipping fire in a real run? The trainer logs, per step, the global norm
# *before* clipping and whether it clipped. We train with the config (`max_grad_norm = 1.0`) and
# replay the logged norms through `ClipController`s with other thresholds and a 20-step window,
# which warns when more than half the recent steps were clipped.

# %%
base = run("base", BASE_STEPS)
norms = [r["grad_norm"] for r in base]
replay = {}
for max_norm in (0.5, 0.7, 1.0, 2.0):
    ctl = ClipController(max_norm, window=20, warn_rate=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flags = [ctl.clip_([torch.zeros(1)], n)[0] for n in norms]
    replay[max_norm] = (flags, ctl.total_clipped / len(norms), len(caught), caught[0].message if caught else None)
logged_rate = sum(r["clipped"] for r in base) / len(base)
print(f"{'max_norm':>9} {'clip rate':>10} {'in the last 20%':>16} {'warnings':>9}")
for max_norm, (flags, rate, n_warn, _) in replay.items():
    tail = flags[-len(flags) // 5:]
    print(f"{max_norm:>9} {rate:>10.0%} {sum(tail) / len(tail):>16.0%} {n_warn:>9}")
print(f"\nthe trainer itself (max_norm 1.0) clipped {logged_rate:.0%} of its {len(base)} steps")
first_warning = next((w for *_, w in replay.values() if w is not None), None)
print("a warning:", first_warning)
check(replay[1.0][0] == [r["clipped"] for r in base],
      "replaying the logged norms at max_norm 1.0 should clip exactly the steps the trainer clipped")
check(all(replay[a][1] >= replay[b][1] for a, b in zip(list(replay), list(replay)[1:])),
      "a tighter threshold can only clip more often")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
plots.plot_curves(ax1, {"global grad norm (before clipping)": norms}, ylabel="norm", title="gradient norm, config run",
                  refs={f"max_norm {m}": m for m in (0.5, 1.0)})
plots.plot_curves(ax2, {f"max_norm {m}": [float(f) for f in flags] for m, (flags, *_rest) in replay.items()},
                  smooth=20, raw_alpha=0.0, ylabel="fraction clipped", title="clip rate over the last 20 steps")
plt.show()

# %% [markdown]
# **What you should see:** the gradient norm is largest in the first steps and settles lower as
# the loss falls, so clipping at 1.0 fires mostly early (the table's "last 20%" column) and then
# rarely: it is catching outliers, which is its job. A threshold below the settled norm clips
# nearly every step; the controller warns, because clipping has become a silent learning-rate cut
# that hides the real problem (an LR too high, a missing warmup, a bad init). Pick `max_norm` a
# little above the norm of a healthy run.
#
# ## 2. Warmup
#
# Adam's first steps move every weight by about the learning rate, whatever the gradient's size
# (it divides by its running gradient size, which starts at this step's). At a high LR that is
# far more than the initial weights (std 0.02) can take. Warmup ramps the LR up from near zero.
# Same LR, 10x the config's, three runs: no warmup; no warmup but clipping; warmup.

# %%
warm_runs = {
    "no warmup, no clipping": ("schedule.warmup_steps=0", "stability.max_grad_norm=0"),
    "no warmup, clip 1.0": ("schedule.warmup_steps=0", "stability.max_grad_norm=1.0"),
    f"warmup {WARMUP}, no clipping": (f"schedule.warmup_steps={WARMUP}", "stability.max_grad_norm=0"),
}
HIGH_LR_SETS = (f"optim.lr={HIGH_LR}", f"optim.min_lr={HIGH_LR / 10}", "stability.spike_policy=warn")
warm = {name: run(f"warm{i}", WARMUP_RUN_STEPS, *HIGH_LR_SETS, *sets) for i, (name, sets) in enumerate(warm_runs.items())}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
plots.plot_curves(ax1, {n: [r["loss"] for r in rows] for n, rows in warm.items()}, smooth=5,
                  title=f"loss at lr {HIGH_LR:g}", refs={"uniform guess ln(vocab)": math.log(task.vocab_size)})
plots.plot_curves(ax2, {n: [r["lr"] for r in rows] for n, rows in warm.items()}, ylabel="learning rate",
                  title="learning rate")
plt.show()

# %%
k = WARMUP
print(f"{'run':<26} {'first loss':>10} {'max of first ' + str(k):>16} {'loss at step ' + str(k):>15} "
      f"{'mean of last 10':>16}")
summary = {}
for name, rows in warm.items():
    ls = [r["loss"] for r in rows]
    summary[name] = (max(ls[:k]), ls[k - 1], statistics.fmean(ls[-10:]))
    print(f"{name:<26} {ls[0]:>10.3f} {summary[name][0]:>16.3f} {summary[name][1]:>15.3f} {summary[name][2]:>16.3f}")
no_w, warm_name = "no warmup, no clipping", f"warmup {WARMUP}, no clipping"
check(summary[warm_name][2] < summary[no_w][2] - 0.3,
      "with warmup the high-LR run should end well below (0.3 nats) the run without it")
check(summary[warm_name][1] < summary[no_w][1] - 0.3,
      f"after {k} steps the warmed-up run should already be well ahead")
print(f"warmup ended {summary[no_w][2] - summary[warm_name][2]:.2f} nats lower than no warmup; clipping alone "
      f"recovered {summary[no_w][2] - summary['no warmup, clip 1.0'][2]:.2f} nats of that")

# %% [markdown]
# **What you should see:** without warmup the loss barely moves for the first tens of steps (it
# can even rise above the uniform guess): the first full-size Adam steps scrambled the initial
# weights, and the run spends its budget climbing out. Clipping recovers part of the gap (the
# line under the table): it caps the gradient, but Adam's step size hardly depends on the
# gradient's size. With warmup the same peak LR is reached gently and the run is ahead at every
# step after the first two. Warmup is a stability device, not a
# detail of the schedule.
#
# ## 3. NaN and Inf
#
# A single NaN in a gradient, applied by the optimizer, turns every weight it touches into NaN,
# and the run is dead. The `NonFiniteGuard` inside the stabilizer checks the loss and every
# gradient norm (in the same one device read per step that the monitor makes): a non-finite step
# is **skipped**, a **diagnostic bundle** is written (step, loss, LR, per-tensor NaN/Inf counts,
# the batch) and the run aborts after `max_consecutive_bad` bad steps in a row. We inject a NaN
# loss at one step and an Inf into one weight's gradient a few steps later.

# %%
NAN_AT, INF_AT = BASE_STEPS // 2, BASE_STEPS // 2 + 5
INF_PARAM = "blocks.0.attn.out_proj.weight"
hit = run("faults", BASE_STEPS, faults=[f"nan_loss@{NAN_AT}", f"inf_grad@{INF_AT}={INF_PARAM}"])
print(f"{'step':>5} {'loss':>8} {'grad_norm':>10} {'skipped':>8} {'nonfinite':>10}")
for r in hit[NAN_AT - 2:INF_AT + 3]:
    loss = "NaN" if r["loss"] is None else f"{r['loss']:.4f}"
    norm = "inf/nan" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
    print(f"{r['step'] - 1:>5} {loss:>8} {norm:>10} {str(r['skipped']):>8} {str(r['nonfinite']):>10}")

# %%
bundles = sorted((RUNS / "faults" / "diagnostics").glob("nonfinite_step*.json"))
bundle = json.loads(bundles[-1].read_text())
bad = {name: s for name, s in bundle["grads"].items() if s["nan"] or s["inf"]}
print(f"{len(bundles)} bundles: {[b.name for b in bundles]}")
print(f"bundle of step {bundle['step']}: loss {bundle['loss']}, lr {bundle['lr']}, scaler {bundle['scaler']}")
print(f"tensors with NaN/Inf: {bad}")
print(f"batch: { {k: (v['shape'], v['dtype'], v['sha256'][:12]) for k, v in bundle['batch'].items()} }, "
      f"saved as {bundle.get('batch_file')}")
skipped = [r["step"] - 1 for r in hit if r["skipped"]]
check(skipped == [NAN_AT, INF_AT], f"exactly the two broken steps should be skipped, got {skipped}")
check([r["loss"] for r in hit[:NAN_AT]] == [r["loss"] for r in base[:NAN_AT]],
      "before the first fault the run must be identical to the clean one (same seed, same batches)")
check(all(r["loss"] is not None and math.isfinite(r["loss"]) for r in hit[NAN_AT + 1:]),
      "after a skipped NaN step every later loss must be finite: the NaN never reached the weights")
check(list(bad) == [INF_PARAM] and bad[INF_PARAM]["inf"] == 1,
      f"the Inf bundle should name exactly the tensor we broke ({INF_PARAM}), with one Inf element")
tail = max(5, BASE_STEPS // 10)
end_hit = statistics.fmean(r["loss"] for r in hit[-tail:])
gap = end_hit - statistics.fmean(r["loss"] for r in base[-tail:])
fall = statistics.fmean(r["loss"] for r in base[:tail]) - statistics.fmean(r["loss"] for r in base[-tail:])
check(abs(gap) < 0.1, f"two skipped updates should leave the run within a tenth of a nat of the clean "
      f"run's end (mean of the last {tail} losses), got {gap:+.3f}")
print(f"two skipped updates: the run ends {gap:+.4f} nats from the clean run's end (mean of the last {tail} "
      f"losses), while the clean run fell {fall:.2f} nats from its start")

# %% [markdown]
# **What you should see:** the two broken steps are logged with `skipped` and `nonfinite` and
# a NaN/None loss or gradient norm, and the run goes on as if they had not happened, two updates
# short: it ends within a tenth of a nat of the clean run (the last line; less at full size, where
# the loss has flattened out by the end, more in a short run whose loss still falls fast), small
# next to how far the run fell. The Inf bundle names the one tensor we broke: in a real run that is where you
# start looking, and the saved batch lets you replay the step. A common handler (`if not torch.isfinite(loss): save_diagnostics(...)`, then `optimizer.step()`
# as usual) writes a diagnostic and *applies the step anyway*.
#
# A run that produces only NaNs is burning money; after `max_consecutive_bad` (3 in the config)
# non-finite steps in a row the trainer stops and says what to look at:

# %%
try:
    run("dead", BASE_STEPS, faults=[f"nan_loss@{s}" for s in range(10, 14)])
    aborted = None
except NonFiniteError as exc:
    aborted = str(exc)
print(aborted)
dead_rows = read_rows(RUNS / "dead" / "metrics.jsonl")
check(aborted is not None and "3 consecutive non-finite steps (10..12)" in aborted,
      "three NaN steps in a row should abort the run with NonFiniteError naming steps 10..12")
check(len(dead_rows) == 12, f"the run should stop at the third bad step, after 12 logged steps, got {len(dead_rows)}")

# %% [markdown]
# ## 4. Spike detection: a rolling mean/std detector and ours
#
# A spike detector compares each step's loss (or gradient norm) with the recent past. The version
# many tutorials show (`MeanStdDetector` below, written small) keeps a rolling window of the last
# values and flags a value above `mean + k x std`; a flagged value is not added to the window. That last rule is the bug: after the loss *shifts*
# (a new data mix, an LR change, the aftermath of a real spike) every value is above the old
# bound, none enters the window, and **the window stops updating**: every later step is a "spike".
# With a skip policy, training silently stops. The obvious patch, adding every value, fails the
# other way: one large spike inflates the standard deviation and hides the next one.
#
# Ours (`course_lib.stability.SpikeDetector`) uses the median and the median absolute deviation, a
# spike enters the window clipped to the bound (the window always advances), and a level that
# persists `patience` (8) steps is accepted as the new normal. All three get the same window (64)
# and threshold (6), on a synthetic noisy loss curve with planted spikes and one level shift.

# %%
WINDOW, THRESHOLD, MIN_SAMPLES = 64, 6.0, 16


class MeanStdDetector:
    """The detector many tutorials show: rolling mean/std; a flagged value never enters the window."""

    def __init__(self):
        self.values = deque(maxlen=WINDOW)
        self.window_updates = []  # steps whose value entered the window

    def update(self, step, x):
        bound = math.inf
        if len(self.values) >= MIN_SAMPLES:
            bound = statistics.fmean(self.values) + THRESHOLD * statistics.pstdev(self.values)
            if x > bound:
                return True, bound  # the bug: returns before the window is updated
        self.values.append(x)
        self.window_updates.append(step)
        return False, bound


class AppendEveryValue(MeanStdDetector):
    """The obvious patch: every value enters the window, spikes included."""

    def update(self, step, x):
        bound = math.inf
        if len(self.values) >= MIN_SAMPLES:
            bound = statistics.fmean(self.values) + THRESHOLD * statistics.pstdev(self.values)
        self.values.append(x)
        self.window_updates.append(step)
        return x > bound, bound


class Ours:
    def __init__(self):
        self.det = SpikeDetector(window=WINDOW, threshold=THRESHOLD, min_samples=MIN_SAMPLES, min_ratio=1.05)
        self.window_updates = []

    def update(self, step, x):
        c = self.det.update(x)
        self.window_updates.append(step)  # ours advances on every value (a spike enters clipped)
        return c.is_spike, c.bound


rng = random.Random(SEED)
N_CURVE, SHIFT_AT, SHIFT = 1200, 700, 0.25
curve = [2.0 * math.exp(-i / 300) + 0.3 + (SHIFT if i >= SHIFT_AT else 0.0) + rng.gauss(0, 0.02)
         for i in range(N_CURVE)]
PLANTED = {150: 3.0, 300: 1.6, 320: 2.0, 500: 5.0, 530: 1.5, 900: 2.0, 1000: 1.6}
for i, factor in PLANTED.items():
    curve[i] *= factor
detectors = {"rolling mean/std, spikes kept out": MeanStdDetector(),
             "mean/std, every value appended": AppendEveryValue(), "ours (median/MAD, clipped, patience)": Ours()}
flags, bounds = {}, {}
for name, det in detectors.items():
    out = [det.update(i, v) for i, v in enumerate(curve)]
    flags[name] = [i for i, (f, _) in enumerate(out) if f]
    bounds[name] = [b for _, b in out]

# %% tags=["nbval-check-output"]
after_shift = range(SHIFT_AT, SHIFT_AT + 8)
print(f"{len(PLANTED)} planted spikes at {sorted(PLANTED)}; level +{SHIFT} from step {SHIFT_AT}")
print(f"{'detector':<40} {'found':>6} {'missed':>12} {'false alarms':>13} {'longest run':>12} {'window frozen':>14}")
table = {}
for name, det in detectors.items():
    found = [i for i in PLANTED if i in flags[name]]
    missed = [i for i in PLANTED if i not in flags[name]]
    false = [i for i in flags[name] if i not in PLANTED]
    longest = run_len = 0
    for i in range(N_CURVE):
        run_len = run_len + 1 if i in set(flags[name]) else 0
        longest = max(longest, run_len)
    updates = det.window_updates
    frozen = max(b - a - 1 for a, b in zip(updates, updates[1:] + [N_CURVE]))
    table[name] = dict(found=found, missed=missed, false=false, longest=longest, frozen=frozen)
    print(f"{name:<40} {len(found):>3}/{len(PLANTED)} {str(missed):>12} {len(false):>13} {longest:>12} "
          f"{frozen:>9} steps")

# %%
fig, axes = plt.subplots(3, 1, figsize=(12, 7), sharex=True, layout="constrained")
for ax, name in zip(axes, detectors):
    ax.plot(curve, color="gray", linewidth=0.7, label="loss (synthetic)")
    ax.plot([b if math.isfinite(b) else float("nan") for b in bounds[name]], color="tab:blue", linewidth=0.8,
            label="detection bound")
    ax.plot(list(PLANTED), [curve[i] for i in PLANTED], "o", mfc="none", color="tab:green", markersize=9,
            label="planted spike")
    ax.plot(flags[name], [curve[i] for i in flags[name]], "x", color="tab:red", markersize=4, label="flagged")
    ax.set_title(name, fontsize=10)
    ax.set_ylim(0, 3.5)
    ax.grid(alpha=0.3)
axes[0].legend(fontsize=8, ncol=4)
axes[-1].set_xlabel("step")
plt.show()

# %%
seed_name, append_name, ours_name = detectors
check(len(table[seed_name]["false"]) > 50 and table[seed_name]["frozen"] > 50,
      "the mean/std detector should freeze after the level shift and flag every step for a long time")
check(table[append_name]["missed"] != [], "appending every value should let an earlier spike mask a later one")
check(table[ours_name]["missed"] == [], "our detector should find every planted spike")
check(set(table[ours_name]["false"]) <= set(after_shift),
      "our detector may flag only the first steps after the level shift (before `patience` accepts it)")
check(table[ours_name]["frozen"] == 0, "our window should take a value at every step")

# %% [markdown]
# **What you should see:** the mean/std detector finds the planted spikes, but after the
# level shift its bound stays where it was (flat blue line), the window stops taking values, and
# it flags step after step (under a skip policy, every one of those steps is thrown away) until
# the falling curve happens to come back under the stale bound. Appending every value fixes the
# freeze but the x5 spike inflates the standard deviation for the next 64 steps, and the x1.5
# spike 30 steps later goes unseen. Ours flags every planted spike, raises the alarm for the first
# 7 steps of the shift, then accepts it as the new level (the "level shift" the trainer logs) and
# finds the later spikes at the new level.
#
# ## 5. Initialisation
#
# At step 0 nothing has been learned yet; the init decides how large the activations and the
# gradients are, layer by layer. TinyGPT has six schemes (`ModelConfig.init`): `normal` (every
# matrix N(0, 0.02), GPT-2's base), `scaled_residual` (GPT-2: the two projections that write into
# the residual stream get 0.02 / sqrt(2 x layers)), `zero_out_proj` (those projections start at
# zero: every block starts as the identity), and the `kaiming` (He-normal) init many tutorials use,
# `xavier` (Glorot-uniform) and `small` (N(0, sqrt(2 / 5d))). One forward and backward pass
# through an 8-block model with each:

# %%
ANALYSIS_LAYERS = 8
layer_stats = {}
for scheme in INIT_SCHEMES:
    torch.manual_seed(SEED)
    net = TinyGPT(ModelConfig.preset("tiny", vocab_size=task.vocab_size, block_size=task.seq_len,
                                     n_layers=ANALYSIS_LAYERS, init=scheme))
    acts = []
    hooks = [b.register_forward_hook(lambda mod, inp, out: acts.append(float(out.detach().std())))
             for b in net.blocks]
    _, loss = net(x0, y0)
    loss.backward()
    for h in hooks:
        h.remove()
    g = GradientMonitor(layer_depth=2).measure(net, loss)
    layer_stats[scheme] = dict(loss=g.loss, acts=acts, grads=[g.layer_norms[f"blocks.{i}"] for i in range(ANALYSIS_LAYERS)])
print(f"uniform guess: ln({task.vocab_size}) = {math.log(task.vocab_size):.3f} nats")
print(f"{'init':<16} {'loss at step 0':>15} {'residual std, block 1 -> ' + str(ANALYSIS_LAYERS):>28} "
      f"{'grad norm, block 1 -> ' + str(ANALYSIS_LAYERS):>26}")
for scheme, s in layer_stats.items():
    print(f"{scheme:<16} {s['loss']:>15.3f} {s['acts'][0]:>13.3f} -> {s['acts'][-1]:<10.3f} "
          f"{s['grads'][0]:>12.3g} -> {s['grads'][-1]:<10.3g}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
blocks = list(range(1, ANALYSIS_LAYERS + 1))
for i, (scheme, s) in enumerate(layer_stats.items()):
    ax1.semilogy(blocks, s["acts"], "o-", color=plots.COLORS[i], label=scheme)
    ax2.semilogy(blocks, s["grads"], "o-", color=plots.COLORS[i], label=scheme)
ax1.set(xlabel="block", ylabel="std of the residual stream after the block", title="activations at init")
ax2.set(xlabel="block", ylabel="gradient norm of the block's weights", title="gradients at init")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
plt.show()

# %%
growth = {s: v["acts"][-1] / v["acts"][0] for s, v in layer_stats.items()}
check(abs(growth["zero_out_proj"] - 1) < 1e-6, "with zero output projections every block is the identity at init: "
      "the residual stream should not change from block to block")
check(growth["scaled_residual"] < growth["normal"],
      "scaling the residual projections by 1/sqrt(2 x layers) should slow the growth of the residual stream")
check(growth["kaiming"] > 2 and layer_stats["kaiming"]["acts"][-1] > 20 * layer_stats["normal"]["acts"][-1],
      "He init (made for ReLU nets without normalisation) should make the residual stream grow large with depth")
print("residual-stream growth over the blocks: " + ", ".join(f"{s} x{g:.2f}" for s, g in growth.items()))

# %% [markdown]
# **What you should see:** every scheme starts near the uniform-guess loss (the final LayerNorm and
# the small tied embedding keep the logits small). Inside the model they differ a lot. With the
# tutorials' `kaiming` and `xavier` inits the residual stream is tens of times larger and grows block by
# block, since each block *adds* its output to the stream; the pre-norm blocks then divide by that
# size, so their gradients are an order of magnitude smaller. `normal` grows slowly with depth;
# `scaled_residual` and `zero_out_proj` keep the stream flat, which is why GPT-2 uses the scaling.
# Now train each for a few steps (an `INIT_LAYERS`-block model, the config otherwise):

# %%
init_runs = {s: run(f"init-{s}", INIT_STEPS, f"model.n_layers={INIT_LAYERS}", f'model.init="{s}"')
             for s in INIT_SCHEMES}
fig, ax = plt.subplots(figsize=(8, 4))
plots.plot_curves(ax, {s: [r["loss"] for r in rows] for s, rows in init_runs.items()}, smooth=5,
                  title=f"{INIT_LAYERS}-block TinyGPT, by init scheme", refs={"entropy rate (best possible)": task.entropy_rate()})
plt.show()
q = max(5, INIT_STEPS // 5)
print(f"{'init':<16} {'mean loss, steps ' + f'1-{q}':>20} {'mean of last ' + str(q):>15} {'clip rate':>10}")
init_tail = {}
for s, rows in init_runs.items():
    init_tail[s] = statistics.fmean(r["loss"] for r in rows[-q:])
    print(f"{s:<16} {statistics.fmean(r['loss'] for r in rows[:q]):>20.3f} {init_tail[s]:>15.3f} "
          f"{sum(r['clipped'] for r in rows) / len(rows):>10.0%}")
init_mean = {s: statistics.fmean(r["loss"] for r in rows) for s, rows in init_runs.items()}
check(all(math.isfinite(v) and v < math.log(task.vocab_size) for v in init_tail.values()),
      "every scheme should at least start to learn (loss below the uniform guess)")
check(min(init_mean["kaiming"], init_mean["xavier"]) > init_mean["scaled_residual"] + 0.05,
      "kaiming and xavier inits should learn visibly slower than GPT-2's scaled residual init")
print("mean loss over the run: " + ", ".join(f"{s} {v:.3f}" for s, v in sorted(init_mean.items(), key=lambda kv: kv[1])))

# %% [markdown]
# **What you should see:** the three GPT-style inits (`normal`, `scaled_residual`,
# `zero_out_proj`) learn at about the same speed here. `kaiming` and `xavier` are far
# behind from the first steps and barely clip (their gradients are an order of magnitude smaller,
# as the layer plot showed): their large residual stream has to be worn down before the blocks'
# contributions count. `small` keeps up with the GPT-style inits on this shallow model (its larger
# embeddings give the first steps more to work with), but its residual stream grew several-fold
# over 8 blocks (the growth line above). At 2 blocks the residual scaling makes little difference
# to the speed; it is what keeps the stream flat in a 48- or 96-block model, where that growth
# compounds.
#
# ## 6. Bounded embeddings
#
# An embedding row is updated only when its token appears. A rare token's row can take a few large
# Adam steps and grow far beyond the others; every time that token appears, its huge vector floods
# the residual stream. `ModelConfig.embedding_bound = b` passes the token embedding through
# `b x tanh(e / b)` (or a hard clamp): the identity for small values, never more than `b`.

# %%
e = torch.linspace(-3, 3, 301)
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(e, e, ":", color="gray", label="no bound")
ax.plot(e, EMBED_BOUND * torch.tanh(e / EMBED_BOUND), label=f"tanh, b = {EMBED_BOUND}")
ax.plot(e, e.clamp(-EMBED_BOUND, EMBED_BOUND), "--", label=f"clamp, b = {EMBED_BOUND}")
ax.set(xlabel="embedding value e", ylabel="what the model sees", title="bounded embedding")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Does the bound cost anything in a healthy run? We train the config with `b = EMBED_BOUND` and
# compare with the config run of section 1. Then we break a trained model on purpose: one
# token's embedding row multiplied by 30, as if it had grown out of control, and measure the loss
# at the positions where that token is the input, with several bounds put on the same weights.

# %%
bounded = run("bounded", BASE_STEPS, f"model.embedding_bound={EMBED_BOUND}")
gap_b = statistics.fmean(r["loss"] for r in bounded[-10:]) - statistics.fmean(r["loss"] for r in base[-10:])
print(f"training with embedding_bound={EMBED_BOUND} ended {gap_b:+.4f} nats from the run without it")


def trained_model(bound):
    """The config run's final weights in a model with embedding bound `bound`, output layer untied."""
    overrides = [*LAB_SETS, *([f"model.embedding_bound={bound}"] if bound else [])]
    net = TinyGPT(train_config.build_model_config(train_config.load(CONFIG, overrides)))
    CheckpointManager(RUNS / "base" / "checkpoints", writer=False).load(model=net, restore_rng=False)
    net.lm_head.weight = torch.nn.Parameter(net.tok_emb.weight.detach().clone())  # untie (see below)
    return net.eval()


def per_token_loss(net, x, y):
    logits, _ = net(x, y)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)


x1, y1 = next(BatchStream(task, 64, seed=SEED + 1))
victim = int(torch.bincount(x1.flatten()).argmax())  # the most frequent input token of this batch
at = x1 == victim
largest = float(trained_model(None).tok_emb.weight.detach().abs().max())
print(f"token {victim} is the input at {int(at.sum())} of {at.numel()} positions; the largest trained "
      f"embedding value is {largest:.3f}")
print(f"{'bound':>6} {'max |input| of the row':>23} {'loss where it is the input':>27} {'loss elsewhere':>16}")
bound_rows = {}
for bound in (None, 1.0, EMBED_BOUND, EMBED_BOUND / 2):
    net = trained_model(bound)
    with torch.no_grad():
        clean = per_token_loss(net, x1, y1)
        net.tok_emb.weight[victim] *= 30
        row = net.tok_emb.weight[victim]
        seen = float((row if bound is None else bound * torch.tanh(row / bound)).abs().max())
        broken = per_token_loss(net, x1, y1)
    bound_rows[bound] = dict(clean_at=float(clean[at].mean()), broken_at=float(broken[at].mean()),
                             clean_else=float(clean[~at].mean()), broken_else=float(broken[~at].mean()))
    b = bound_rows[bound]
    print(f"{str(bound):>6} {seen:>23.3f} {b['clean_at']:>12.3f} -> {b['broken_at']:<10.3f} "
          f"{b['clean_else']:>7.3f} -> {b['broken_else']:<7.3f}")

# %%
bounds = list(bound_rows)
check(abs(gap_b) < 0.05, "a bound above the embeddings' values should not change training (within 0.05 nats)")
check(all(abs(bound_rows[b]["clean_at"] - bound_rows[None]["clean_at"]) < 0.01 for b in bounds),
      "on healthy weights every bound here should be (nearly) the identity: same loss within 0.01")
check(all(bound_rows[a]["broken_at"] > bound_rows[b]["broken_at"] for a, b in zip(bounds, bounds[1:])),
      "the tighter the bound, the less the blown-up row should hurt the positions where its token is the input")
check(all(abs(r["broken_else"] - r["clean_else"]) < 0.05 for r in bound_rows.values()),
      "the damage should stay at the blown-up token's positions")

# %% [markdown]
# **What you should see:** training with the bound lands where training without it did, and on
# healthy weights the bound changes nothing: it only acts on values that are already abnormal.
# Blown up, the row wrecks the predictions made from its token (the loss there is several times
# its normal value; the other positions do not notice) and the tighter bounds cut that damage: a
# saturated row is `b` in every coordinate, so the closer `b` is to the healthy values, the less a
# runaway row can do; too close and it would distort healthy rows too. A few times the healthy
# maximum (the line above the table) is the usual choice.
# One caveat, which is why we untied the output layer: with **tied** embeddings (GPT-2, and
# TinyGPT by default) the same matrix is also the output layer, and a bound on the embedding
# *output* does nothing for the logits. Untied models (Llama) are where this guard applies as
# shown.
#
# ## 7. Gradients x10 at step N: does the run recover?
#
# Inject a gradient explosion (every gradient x10) at one step, `FAULT_STEP`, in the middle of a
# run, and check that the safety net catches it and the run recovers **without losing its earlier
# progress**. Four runs, identical except for the fault and the spike policy:
#
# * `clean`: no fault;
# * `warn`: the fault; the detector only logs it and the step is applied: **unprotected**;
# * `skip`: the fault; the flagged step is left out;
# * `rollback`: the fault; the trainer reloads the last checkpoint (saved every `SAVE_EVERY`
#   steps) and carries on with the *next* batches.
#
# Clipping is off in all four, so that what you see is the detector alone (clipping at 1.0 would
# cut the x10 gradient back to norm 1, section 1), and the LR is constant, so the fault hits at
# full strength as it would in the middle of a long run.
#
# Up to the fault the four runs are the same run, so we train that part once. The clean run saves
# checkpoints, and each faulty run starts from a copy of the clean run's folder cut back to the
# checkpoint it needs: the one at `FAULT_STEP` (saved after the steps before the fault), or for
# `rollback` the one at its own last save before the fault, from which it replays the steps up to
# the fault. A checkpoint holds the weights, the optimizer, the data position, the random
# generators and the stabilizer's detector windows, so a resumed run continues *exactly*: we
# check that first, by replaying a few clean steps from the checkpoint at `FAULT_STEP`.

# %%
fault = f"grad_scale@{FAULT_STEP}=10"
common = ("stability.max_grad_norm=0", 'schedule.kind="constant"', "checkpoint.async_save=false")
ROLLBACK_TO = FAULT_STEP // SAVE_EVERY * SAVE_EVERY  # the rollback run's last checkpoint before the fault
every = math.gcd(FAULT_STEP, SAVE_EVERY)  # the clean run saves at both FAULT_STEP and ROLLBACK_TO...
keep = (FAULT_RUN_STEPS - ROLLBACK_TO) // every + 2  # ...and keeps them to the end (+1: the final save)


def branch(name, upto):
    """Copy the clean run's folder to `name`, keeping only its checkpoints up to step `upto`: a
    run resumed there continues from step `upto` as if it had trained from step 0 itself."""
    shutil.copytree(RUNS / "clean", RUNS / name)
    for ckpt in (RUNS / name / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > upto:
            shutil.rmtree(ckpt)
    check((RUNS / name / "checkpoints" / f"step_{upto:09d}").is_dir(), f"the clean run should have a checkpoint at step {upto}")


fault_runs = {"clean": run("clean", FAULT_RUN_STEPS, "stability.spike_policy=warn", *common,
                           f"checkpoint.save_every={every}", f"checkpoint.keep_last={keep}")}
branch("resumed", FAULT_STEP)
resumed = run("resumed", FAULT_STEP + RESUME_CHECK_STEPS, "stability.spike_policy=warn", *common, resume=True)
check(RESUMED_FROM["resumed"] == FAULT_STEP, f"the replay should start from the checkpoint at step {FAULT_STEP}")
check([r["loss"] for r in resumed[FAULT_STEP:]] == [r["loss"] for r in fault_runs["clean"][FAULT_STEP:FAULT_STEP + RESUME_CHECK_STEPS]],
      f"resumed from its checkpoint at step {FAULT_STEP}, the clean run should repeat its next "
      f"{RESUME_CHECK_STEPS} losses bit for bit")
print(f"resumed from step {FAULT_STEP}: the next {RESUME_CHECK_STEPS} losses equal the uninterrupted run's exactly")
for policy in ("warn", "skip", "rollback"):
    extra = (f"checkpoint.save_every={SAVE_EVERY}",) if policy == "rollback" else ()
    branch(policy, ROLLBACK_TO if policy == "rollback" else FAULT_STEP)
    fault_runs[policy] = run(policy, FAULT_RUN_STEPS, f"stability.spike_policy={policy}", *common, *extra,
                             faults=[fault], resume=True)
check([RESUMED_FROM[p] for p in ("warn", "skip", "rollback")] == [FAULT_STEP, FAULT_STEP, ROLLBACK_TO],
      "each faulty run should start from the clean run's checkpoint, not train the shared steps again")
events = [json.loads(line) for line in (RUNS / "rollback" / "events.jsonl").read_text().splitlines()]
print(f"fault {fault}: gradient norm {fault_runs['warn'][FAULT_STEP]['grad_norm']:.3f} against "
      f"{fault_runs['clean'][FAULT_STEP]['grad_norm']:.3f} in the clean run")
for policy in ("warn", "skip"):
    r = fault_runs[policy][FAULT_STEP]
    print(f"{policy:>8}: step {r['step'] - 1} spike={r['spike']} skipped={r['skipped']}")
print(f"rollback: {[(e['event'], e['step'], e['rolled_back_to']) for e in events]} (event, step, back to)")

# %%
W = 30
window = range(FAULT_STEP, min(FAULT_STEP + W, FAULT_RUN_STEPS))
excess = {p: [fault_runs[p][i]["loss"] - fault_runs["clean"][i]["loss"] for i in window] for p in ("warn", "skip", "rollback")}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
plots.plot_curves(ax1, {p: [r["loss"] for r in rows] for p, rows in fault_runs.items()}, smooth=10, raw_alpha=0.1,
                  title="the whole run (mean of 10 steps)")
ax1.axvline(FAULT_STEP, color="tab:red", linewidth=0.8)
zoom = range(FAULT_STEP - 10, min(FAULT_STEP + W, FAULT_RUN_STEPS))
plots.plot_curves(ax2, {p: (list(zoom), [fault_runs[p][i]["loss"] - fault_runs["clean"][i]["loss"] for i in zoom])
                        for p in ("warn", "skip", "rollback")},
                  refs={"clean run": 0.0}, ylabel="loss minus the clean run's", xlabel="optimizer step",
                  title=f"around the fault (x10 gradients at step {FAULT_STEP})")
ax2.axvline(FAULT_STEP, color="tab:red", linewidth=0.8)
plt.show()

# %%
print(f"over the {len(window)} steps from the fault on, loss minus the clean run's:")
print(f"{'policy':>9} {'mean':>8} {'max':>8} {'final (mean of last 10)':>25}")
for p in ("warn", "skip", "rollback"):
    final = statistics.fmean(r["loss"] for r in fault_runs[p][-10:]) - statistics.fmean(r["loss"] for r in fault_runs["clean"][-10:])
    print(f"{p:>9} {statistics.fmean(excess[p]):>+8.4f} {max(excess[p]):>+8.4f} {final:>+25.4f}")
check(all(fault_runs[p][FAULT_STEP]["spike"] for p in ("warn", "skip")), "the detector should flag the x10 step")
check(fault_runs["skip"][FAULT_STEP]["skipped"] and not fault_runs["warn"][FAULT_STEP]["skipped"],
      "skip should leave the step out; warn should apply it")
check([r["loss"] for r in fault_runs["skip"][:FAULT_STEP + 1]] == [r["loss"] for r in fault_runs["clean"][:FAULT_STEP + 1]],
      "up to the fault the protected run must be identical to the clean one: no earlier progress lost")
check(len(events) == 1 and events[0]["step"] == FAULT_STEP
      and events[0]["rolled_back_to"] == ROLLBACK_TO,
      "rollback should fire once, at the fault, back to the last checkpoint before it")
check([r["step"] for r in fault_runs["rollback"]] == list(range(1, FAULT_RUN_STEPS + 1)),
      "after the rollback the metrics must hold every step exactly once")
check(max(excess["warn"]) > 0.05 and statistics.fmean(excess["warn"]) > 2 * abs(statistics.fmean(excess["skip"])),
      "unprotected, the x10 step should visibly push the loss above the clean run; skipped, it should not")
check(abs(statistics.fmean(excess["rollback"])) < 0.05, "after the rollback the run should be back in the clean run's band")

# %% [markdown]
# **What you should see:** on the left the four curves lie on top of each other (a single x10
# step does not wreck a model trained with AdamW, which divides each step by its running gradient
# size). The right panel subtracts the clean run: `skip` is exactly the clean run up to the fault
# and within a hair of it after (one batch fewer); `warn` jumps a tenth of a nat a few steps after
# the fault, and takes a few tens of steps to work it off: that is progress the unprotected run
# lost. `rollback` went back to the last checkpoint and trained on *new* batches from there (the
# batches that caused the spike are not replayed), so its difference is batch noise around zero:
# it paid with the steps since the checkpoint, and kept everything before.
#
# Which policy when? `skip` is cheap and right for one bad batch. `lower_lr` (not shown) keeps
# the step but shrinks it for a while: for a run that is drifting rather than spiking. `rollback`
# is for damage already done (a spike the detector saw too late, a loss that will not come back):
# it needs checkpoints, which is lab 07.
#
# ## 8. Architecture levers: QK-norm and z-loss
#
# Sections 1-7 guard the optimizer step: clip it, warm it up, skip it, roll it back. Frontier
# runs also change the model, so that the quantities that blow up cannot grow in the first place.
# Two kinds of logit grow without limit in a transformer:
#
# * **attention scores** `q . k / sqrt(D)`: q and k are both linear in the weights, so a score
#   grows like the *square* of their size. A few huge scores make the softmax one-hot (attention
#   entropy collapse): its gradient vanishes and the layer stops learning. **QK-norm**
#   (`model.qk_norm = true`, as in Qwen3, Gemma 3 and OLMo-2) passes each head's q and k through an
#   RMSNorm before the product, so their length no longer depends on the weights.
# * **output logits**: cross-entropy does not change when every logit of a token moves by the same
#   amount, so nothing holds the normaliser `log Z = logsumexp(logits)` in place. **z-loss**
#   (`model.z_loss = c`, PaLM used 1e-4) adds `c x mean(log Z^2)` to the loss, pulling log Z toward 0.
#
# The provoked run is section 2's high LR (10x the config's, no clipping) with the config's own
# short warmup (10 steps) instead of section 2's 30: too short for this LR. We train it three
# times, without a lever and with each, and measure both logits on one fixed batch at every
# checkpoint (saved every `LOGIT_EVERY` steps).
#
# **Predict first.** With QK-norm, a normalised q has RMS 1 per channel, so its length is fixed;
# the norm's weight (one per channel, starting at 1) can then stretch it. Before running the next
# cells: with every norm weight at 1 and the head size `D` of this model (64 channels over 4 heads),
# what is the largest score `|q . k| / sqrt(D)` QK-norm allows? And how large will the largest score
# of the run *without* it be at its end?

# %%
MY_CEILING_AT_INIT = None  # your prediction: a number (the largest |q.k|/sqrt(D) with QK-norm, weights 1)
MY_SCORE_WITHOUT = None  # your prediction: the largest attention score at the end of the run without QK-norm

# %%
PROVOKED = (*HIGH_LR_SETS, f"schedule.warmup_steps={PROVOKED_WARMUP}", "stability.max_grad_norm=0",
            f"checkpoint.save_every={LOGIT_EVERY}", f"checkpoint.keep_last={WARMUP_RUN_STEPS // LOGIT_EVERY + 1}")
run_dir = {"no lever": "provoked", "QK-norm": "qknorm", f"z-loss {Z_LOSS:g}": "zloss"}
levers = {name: run(d, WARMUP_RUN_STEPS, *PROVOKED, *extra) for (name, d), extra in
          zip(run_dir.items(), ((), ("model.qk_norm=true",), (f"model.z_loss={Z_LOSS}",)))}
x_probe, _ = next(BatchStream(task, 16, seed=SEED + 2))  # one fixed batch, never trained on


def logits_at_checkpoints(name):
    """Per checkpoint of run `name`: (step, largest |q.k|/sqrt(D) of any block, head and position,
    mean log Z of the output logits) on x_probe, and the QK-norm ceiling sqrt(D) max|w_q| max|w_k|."""
    sets = [*LAB_SETS] + (["model.qk_norm=true"] if name == "qknorm" else [])
    net = TinyGPT(train_config.build_model_config(train_config.load(CONFIG, sets))).eval()
    manager = CheckpointManager(RUNS / name / "checkpoints", writer=False)
    out = []
    for step in range(LOGIT_EVERY, WARMUP_RUN_STEPS + 1, LOGIT_EVERY):
        manager.load(model=net, restore_rng=False, only=f"step_{step:09d}")
        scores, ceilings = [], []

        def hook(attn, inputs, _):
            h = inputs[0]
            B, T, _ = h.shape
            D = attn.head_dim
            q = attn.q_proj(h).view(B, T, -1, D).transpose(1, 2)
            k = attn.k_proj(h).view(B, T, -1, D).transpose(1, 2)
            if attn.q_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
                ceilings.append(math.sqrt(D) * float(attn.q_norm.weight.abs().max() * attn.k_norm.weight.abs().max()))
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            scores.append(float(s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0).abs().max()))

        hooks = [b.attn.register_forward_hook(hook) for b in net.blocks]
        with torch.no_grad():
            logits, _ = net(x_probe)
        for h in hooks:
            h.remove()
        out.append(dict(step=step, score=max(scores), log_z=float(torch.logsumexp(logits, -1).mean()),
                        ceiling=max(ceilings) if ceilings else None))
    return out


logit_growth = {name: logits_at_checkpoints(d) for name, d in run_dir.items()}
head_dim = train_config.build_model_config(cfg0).head_dim
print(f"{'run':<14} {'loss, mean of last 10':>22} {'largest attention score':>24} {'mean log Z':>11}   (at step "
      f"{WARMUP_RUN_STEPS})")
lever_end = {}
for name, rows in levers.items():
    g = logit_growth[name][-1]
    lever_end[name] = statistics.fmean(r["loss"] - r.get("z_loss", 0.0) for r in rows[-10:])
    print(f"{name:<14} {lever_end[name]:>22.3f} {g['score']:>24.1f} {g['log_z']:>11.2f}")
print(f"(the loss column is the cross-entropy: a z-loss run logs z_loss beside a loss that includes it)")

# %%
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4), layout="constrained")
plots.plot_curves(ax1, {n: [r["loss"] - r.get("z_loss", 0.0) for r in rows] for n, rows in levers.items()}, smooth=5,
                  title=f"cross-entropy at lr {HIGH_LR:g}", refs={"config run (section 1)": statistics.fmean(
                      r["loss"] for r in base[-10:])})
for name, g in logit_growth.items():
    ax2.semilogy([p["step"] for p in g], [p["score"] for p in g], "o-", label=name)
    ax3.plot([p["step"] for p in g], [p["log_z"] for p in g], "o-", label=name)
ax2.set(xlabel="optimizer step", ylabel="largest |q . k| / sqrt(D)", title="attention logits")
ax3.set(xlabel="optimizer step", ylabel="mean log Z = logsumexp(logits)", title="output logits")
for ax in (ax2, ax3):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
plt.show()

# %%
without, with_qk = logit_growth["no lever"][-1]["score"], logit_growth["QK-norm"]
for guess, what, value in ((MY_CEILING_AT_INIT, "the QK-norm ceiling with weights 1", math.sqrt(head_dim)),
                           (MY_SCORE_WITHOUT, "the largest score without QK-norm", without)):
    print(f"{what}: you predicted {guess if guess is not None else '(nothing entered)'}, the kit says {value:.1f}")
check(all(p["score"] <= p["ceiling"] * (1 + 1e-5) for p in with_qk),
      "with QK-norm no score may exceed sqrt(D) x max|w_q| x max|w_k|: the normalised q and k have a fixed length")
check(without > 10 * max(p["score"] for p in with_qk),
      "without QK-norm the attention logits should grow at least 10x larger than with it")
check(lever_end["QK-norm"] < lever_end["no lever"] - 0.3,
      "with QK-norm the high-LR run should end well below (0.3 nats) the same run without it")
zl, none = logit_growth[f"z-loss {Z_LOSS:g}"], logit_growth["no lever"]
check(zl[-1]["log_z"] < none[-1]["log_z"], "at the end z-loss should hold log Z below the run without it")
check(zl[-1]["score"] > 10 * max(p["score"] for p in with_qk),
      "z-loss acts on the output logits only: its attention scores should grow as without a lever")

# %% [markdown]
# **What you should see:** without QK-norm the largest attention score climbs by orders of
# magnitude while the LR is high (middle panel, log scale); the softmax rows it feeds are one-hot,
# and the loss (left) falls slowly. With QK-norm the scores stay under their ceiling
# (`sqrt(D)` = 4 at init, stretched only as far as the norm weights grow) and the same LR trains
# well. z-loss acts on the *output* side only: log Z (right) stays below the run without a lever
# (in 60 steps it pulls it down only a little; its job is the slow drift of a long run), and it does
# nothing for the attention scores, whose growth is what slowed this run. Each lever targets one logit; a frontier recipe (OLMo-2, for example) uses both,
# together with the warmup, clipping and skipping of the sections above.
#
# ## Where next
#
# * **Exercise 05**: write the clipping arithmetic and your own gradient-explosion policy.
# * **Lab 06**: learning-rate schedules, warmup's big sibling.
# * **Lab 07**: the checkpoints that `rollback` and every crash recovery depend on.
