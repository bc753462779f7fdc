# %% [markdown]
# # Lab 06 — Learning-rate schedules
#
# The learning rate is the one hyperparameter every run changes on purpose while it trains:
# small at first (**warmup**, while Adam's statistics and the weights settle), large while the
# model makes progress, small at the end (**decay**, which lets the loss settle into a minimum
# instead of bouncing around it). This lab:
#
# 1. plots every schedule in `course_lib.schedules`: linear, cosine and constant after warmup,
#    and warmup-stable-decay (WSD) with its decay shapes;
# 2. compares the three warmup indexing conventions the literature uses, step by step;
# 3. shows a bug seen in tutorial code (a schedule reading an undefined `total_steps`), next to ours;
# 4. trains TinyGPT with cosine, WSD and a constant rate and compares the loss curves;
# 5. resumes a run, wrongly and rightly, and shows what a scheduler must restore.
#
# Vocabulary: `step` is the 0-based index of an **optimizer step** (not a micro-batch, not a
# token); `T` = `total_steps`, `W` = `warmup_steps`.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
SEED = 0
RUN_STEPS = 300  # optimizer steps of each TinyGPT run in sections 4 and 5
MAX_LR = 2e-2  # peak learning rate of those runs (AdamW); high enough that decay visibly matters
EVAL_EVERY = 10  # steps between evaluations on held-out sequences

# %%
import copy
import math
import warnings

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.labs import plots
from course_lib.kit.checks import check
from course_lib.data import BatchStream, MarkovTask
from course_lib.model import ModelConfig, TinyGPT
from course_lib.schedules import Schedule, lr_at, make_scheduler

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    RUN_STEPS, EVAL_EVERY = 60, 4
VOCAB, SEQ_LEN, BATCH, EVAL_SEQS = (32, 32, 8, 32) if SMOKE else (64, 64, 16, 64)
# The model is tiny: one thread is as fast as several here, and makes every run repeatable.
torch.set_num_threads(1)


def same(a, b):
    """Equal learning rates, up to float rounding (a LambdaLR computes base_lr * factor)."""
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0) for x, y in zip(a, b))

# %% [markdown]
# ## 1. Every schedule
#
# A `Schedule` is a validated, pure function from step to learning rate. All of these warm up
# linearly for `W` steps to `max_lr`, then:
#
# * **linear** falls in a straight line to `min_lr` at step `T`;
# * **cosine** follows half a cosine wave from `max_lr` to `min_lr` at step `T`;
# * **constant** stays at `max_lr`;
# * **WSD** (warmup-stable-decay) stays at `max_lr` until the last `decay_steps` steps, then
#   decays with a shape of its own: linear, cosine or `1 - sqrt` (Hägele et al. 2024).
#
# The schedule's sizes here are fixed (not shrunk by `SMOKE`): plotting costs nothing.

# %%
T, W, PEAK, FLOOR = 1000, 100, 1e-3, 1e-4
common = dict(max_lr=PEAK, total_steps=T, warmup_steps=W)
schedules = {
    "linear": Schedule(**common, kind="linear", min_lr=FLOOR),
    "cosine": Schedule(**common, kind="cosine", min_lr=FLOOR),
    "constant": Schedule(**common, kind="constant"),
    "wsd linear": Schedule(**common, kind="wsd", min_lr=FLOOR, decay_steps=200, decay_shape="linear"),
    "wsd cosine": Schedule(**common, kind="wsd", min_lr=FLOOR, decay_steps=200, decay_shape="cosine"),
    "wsd 1-sqrt": Schedule(**common, kind="wsd", min_lr=FLOOR, decay_steps=200, decay_shape="sqrt"),
}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained", sharey=True)
plots.plot_schedules(ax1, {k: schedules[k] for k in ("linear", "cosine", "constant")},
                     title=f"warmup {W} steps, then decay to step {T}")
plots.plot_schedules(ax2, {"cosine (for comparison)": schedules["cosine"],
                           **{k: v for k, v in schedules.items() if k.startswith("wsd")}},
                     styles={"cosine (for comparison)": ":"}, title="warmup-stable-decay, last 200 steps decay")
plt.show()

# %% tags=["nbval-check-output"]
probe = [0, 50, 99, 100, 300, 550, 800, 900, 999, 1000, 1500]
print(f"{'step':>5} " + " ".join(f"{name:>11}" for name in schedules))
for step in probe:
    print(f"{step:>5} " + " ".join(f"{s(step):>11.3e}" for s in schedules.values()))
area = {name: sum(s.values()) / (PEAK * T) for name, s in schedules.items()}
print("\nsum of lr over the run, as a fraction of max_lr x T:")
print("      " + " ".join(f"{a:>11.3f}" for a in area.values()))

# %%
for name, s in schedules.items():
    check(same([s(W - 1), s(W)], [PEAK, PEAK]),
          f"{name}: warmup should end at max_lr (step W-1) and the next phase start there (step W)")
    after = s.values(T + 1)[W:]
    check(all(b <= a for a, b in zip(after, after[1:])), f"{name}: after warmup the lr must never rise")
    check(s(T + 500) == s(T), f"{name}: beyond total_steps the lr should hold, not climb back up")
    if name != "constant":
        check(math.isclose(s(T), FLOOR), f"{name}: the lr should reach min_lr exactly at step T")
check(math.isclose(schedules["cosine"](W + (T - W) // 2), (PEAK + FLOOR) / 2),
      "cosine: halfway through the decay the lr should be halfway between max_lr and min_lr")
check(all(schedules["wsd linear"](s) == PEAK for s in range(W, T - 200)),
      "WSD: the lr should stay at max_lr for the whole stable phase")
wsd_areas = [a for name, a in area.items() if name.startswith("wsd")]
check(area["constant"] > max(wsd_areas) and min(wsd_areas) > max(area["cosine"], area["linear"]),
      "the sum of lr should be largest for constant, then the WSDs, then cosine and linear")
print("every schedule warms up to max_lr, never rises afterwards, and holds after step T")

# %% [markdown]
# **What you should see:** on the left, three ways down from the same peak; cosine stays high
# longer than linear early on and lands more gently. On the right, WSD holds the peak and decays
# only in the last 200 steps, each shape on its own path. The "sum of lr" row (how far, roughly,
# the optimizer may travel) is largest for constant, then the WSDs, then cosine and linear. WSD's
# appeal: the stable phase does not depend on `T`, so a run can be extended, or branched into a
# short decay at any point, without restarting; a cosine's whole curve is fixed by `T`.
#
# ## 2. Warmup: three indexing conventions
#
# "Warm up linearly over `W` steps" sounds exact; it is not. Three formulas are in use for the
# warmup factor at step `it` (0-based):
#
# | convention | factor | where |
# | --- | --- | --- |
# | `(it+1)/W` | reaches 1 at the last warmup step | **ours (default)** |
# | `it/W` | starts at 0; reaches 1 at step `W` | Hugging Face `get_*_schedule_with_warmup` |
# | `(it+1)/(W+1)` | never reaches 1 inside warmup | nanoGPT |

# %% tags=["nbval-check-output"]
WARM = 5
conventions = {c: Schedule(max_lr=1.0, total_steps=20, warmup_steps=WARM, kind="cosine", warmup_convention=c)
               for c in ("(it+1)/W", "it/W", "(it+1)/(W+1)")}
print(f"W = {WARM}, max_lr = 1: the lr of each optimizer step")
print(f"{'step':>4} " + " ".join(f"{c:>13}" for c in conventions))
for step in range(WARM + 3):
    print(f"{step:>4} " + " ".join(f"{s(step):>13.4f}" for s in conventions.values()))

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
plots.plot_schedules(ax, conventions, steps=WARM + 4, markers=True,
                     styles={"it/W": "--", "(it+1)/(W+1)": ":"}, title=f"the first steps, W = {WARM}")
ax.axvline(WARM - 0.5, color="gray", linewidth=0.8)
ax.text(WARM - 0.4, 0.05, "decay starts", fontsize=8, color="gray")
plt.show()
first = {c: s(0) for c, s in conventions.items()}
check(first["it/W"] == 0.0, "it/W should give the very first step a learning rate of exactly 0")
check(conventions["(it+1)/W"](WARM - 1) == 1.0, "(it+1)/W should reach max_lr at the last warmup step")
check(all(conventions["(it+1)/(W+1)"](s) < 1.0 for s in range(WARM)),
      "(it+1)/(W+1) should stay below max_lr throughout warmup")

# %% [markdown]
# **What you should see:** three ramps, shifted by about one step from each other. The differences look tiny, and over
# a long run they are; but they decide whether step 0 learns anything. With `it/W`, step 0 runs
# at lr 0: a full forward and backward pass whose update is thrown away. Not quite thrown away,
# though: the optimizer still counts it.

# %%
torch.manual_seed(SEED)
layer = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(layer.parameters(), lr=conventions["it/W"](0), weight_decay=0.0)
before = layer.weight.detach().clone()
layer(torch.randn(8, 4)).pow(2).mean().backward()
opt.step()
state = opt.state[layer.weight]
print(f"after a step at lr 0: weights changed: {not torch.equal(before, layer.weight)}; Adam's step count: "
      f"{int(state['step'])}; |first moment| = {state['exp_avg'].norm():.2e}; "
      f"|second moment| = {state['exp_avg_sq'].norm():.2e}")
check(torch.equal(before, layer.weight) and int(state["step"]) == 1 and state["exp_avg"].norm() > 0,
      "a step at lr 0 should leave the weights alone but still move Adam's moments and step count")

# %% [markdown]
# **What you should see:** the weights did not move, but Adam's moments now hold that batch's
# gradient and its step counter (which drives the bias correction) says 1. Harmless in
# practice, but it makes runs under different conventions differ from step 1 on, which is why
# comparing numbers with another codebase starts with matching its convention:
# `Schedule(..., warmup_convention="it/W")` reproduces Hugging Face's.
#
# ## 3. A failure mode: a schedule reading an undefined `total_steps`
#
# Tutorial code sometimes has a cosine schedule of this shape (shown in full below): its decay branch divides
# by `total_steps`, which the function neither defines nor receives.

# %% tags=["nbval-check-output"]
def flawed_lr(step, warmup_steps=100, max_lr=1e-3, min_lr=1e-4):
    """The flawed schedule (its shape, bug included): `total_steps` is never defined."""
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    progress = (step - warmup_steps) / (total_steps - warmup_steps)  # noqa: F821 - the bug
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


crashed_at = None
for step in range(200):  # the steps of a run, until it crashes
    try:
        flawed_lr(step)
    except NameError as exc:
        crashed_at, error = step, exc
        break
print(f"step 50: {flawed_lr(50):.2e}   (warmup: works)")
print(f"step {crashed_at}: NameError: {error}   (first step after warmup: crashes)")
check(crashed_at == 100, f"the flawed schedule should run through warmup (steps 0-99) and crash at step 100, "
      f"the first decay step; it crashed at {crashed_at}")

# %% [markdown]
# It runs fine through warmup and crashes at the first decay step: possibly hours into a run.
# Worse, in a notebook or a script with globals the name may exist, left over from something
# else. Say an earlier experiment set `total_steps = 300`, and this run is 1000 steps long:

# %% tags=["nbval-check-output"]
total_steps = 300  # a leftover global from an earlier, shorter experiment
for step in (150, 300, 500, 700, 999):
    print(f"step {step:>4}: flawed {flawed_lr(step):.2e}   ours (T=1000) {schedules['cosine'](step):.2e}")
leftover = [flawed_lr(s) for s in range(T)]
del total_steps

# %%
check(leftover[300] == FLOOR and max(leftover[301:]) > 0.9 * PEAK,
      "with the leftover global the flawed schedule should reach its floor at step 300 and then climb "
      "back towards max_lr: cos(pi * progress) rises again once progress > 1")
fig, ax = plt.subplots(figsize=(7, 3.5))
plots.plot_schedules(ax, {"flawed, leftover total_steps=300": leftover,
                         "ours, total_steps=1000": schedules["cosine"]},
                     steps=T, title="the same cosine, one reading a leftover global")
plt.show()

# %% [markdown]
# **What you should see:** the flawed version silently uses the wrong horizon: it reaches its floor
# at step 300, then (because nothing clamps `progress` at 1) the cosine climbs back up to the
# peak and oscillates. No error, just a run that mysteriously gets worse. Ours takes every size
# as an argument and checks it before the first step; a missing or impossible value is an error
# that names the argument:

# %% tags=["nbval-check-output"]
bad_arguments = {
    "no total_steps": dict(max_lr=1e-3, warmup_steps=100),
    "total_steps=0": dict(max_lr=1e-3, total_steps=0),
    "total_steps=1000.0 (a float)": dict(max_lr=1e-3, total_steps=1000.0),
    "warmup longer than the run": dict(max_lr=1e-3, total_steps=1000, warmup_steps=2000),
    "min_lr above max_lr": dict(max_lr=1e-3, total_steps=1000, min_lr=1e-2),
    "negative max_lr": dict(max_lr=-1e-3, total_steps=1000),
}
refused = {}
for what, kwargs in bad_arguments.items():
    try:
        Schedule(**kwargs)
    except (TypeError, ValueError) as exc:
        refused[what] = exc
        print(f"{what:<29} {type(exc).__name__}: {exc}")
try:
    lr_at(-1, max_lr=1e-3, total_steps=1000)
except ValueError as exc:
    refused["step -1"] = exc
    print(f"{'step -1':<29} {type(exc).__name__}: {exc}")

# %%
check(set(refused) == set(bad_arguments) | {"step -1"},
      f"every bad argument should be refused; accepted: {sorted(set(bad_arguments) - set(refused))}")
check("total_steps" in str(refused["no total_steps"]),
      "a missing total_steps should be an error that names total_steps")

# %% [markdown]
# ## 4. WSD vs cosine on a real run
#
# Now train TinyGPT on the synthetic Markov task (its best possible loss is known exactly) three
# times from the same initial weights on the same batches, changing only the schedule: cosine to
# `max_lr / 10`, WSD (stable, then the last 20% decaying linearly to the same floor) and constant.
# Every `EVAL_EVERY` steps we measure the loss on held-out sequences.

# %%
task = MarkovTask(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=SEED)
cfg = ModelConfig.preset("tiny", vocab_size=VOCAB, block_size=SEQ_LEN)
held_out = task.get_batch(list(range(10**9, 10**9 + EVAL_SEQS)))  # far from the training indices
WARMUP = RUN_STEPS // 20


def new_run(schedule):
    """Fresh model, optimizer and data stream: identical for every schedule (same seed)."""
    torch.manual_seed(SEED)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=schedule.max_lr, weight_decay=0.1)
    return model, opt, BatchStream(task, BATCH, seed=SEED)


def train(model, opt, scheduler, stream, first, last, save_at=None):
    """Optimizer steps first .. last-1. Returns a log and, if save_at is given, the full state as it
    was before step save_at: everything a resumed run needs."""
    log, saved = {"step": [], "lr": [], "loss": [], "eval_step": [], "eval": []}, None
    for step in range(first, last):
        if step == save_at:
            saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                   "scheduler": scheduler.state_dict(), "data": stream.state_dict()})
        x, y = next(stream)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        log["step"].append(step)
        log["lr"].append(opt.param_groups[0]["lr"])  # the lr this step used
        log["loss"].append(loss.item())
        opt.step()
        scheduler.step()
        if (step + 1) % EVAL_EVERY == 0:
            with torch.no_grad():
                log["eval_step"].append(step + 1)
                log["eval"].append(model(*held_out)[1].item())
    return log, saved


kinds = {"cosine": dict(kind="cosine", min_lr=MAX_LR / 10),
         "WSD": dict(kind="wsd", min_lr=MAX_LR / 10),
         "constant": dict(kind="constant")}
logs, resume_state = {}, None
RESUME = RUN_STEPS // 2  # section 5 resumes the cosine run from here
for name, kw in kinds.items():
    sched = Schedule(max_lr=MAX_LR, total_steps=RUN_STEPS, warmup_steps=WARMUP, **kw)
    model, opt, stream = new_run(sched)
    logs[name], saved = train(model, opt, make_scheduler(opt, sched), stream, 0, RUN_STEPS,
                              save_at=RESUME if name == "cosine" else None)
    resume_state = saved if name == "cosine" else resume_state
wsd_start = RUN_STEPS - Schedule(max_lr=MAX_LR, total_steps=RUN_STEPS, warmup_steps=WARMUP, **kinds["WSD"]).decay_steps
check(wsd_start % EVAL_EVERY == 0, f"choose EVAL_EVERY so that it divides {wsd_start}, the step WSD's decay starts")

# %%
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), layout="constrained", sharex=True,
                               gridspec_kw={"height_ratios": [2, 1]})
plots.plot_curves(ax1, {n: (lg["eval_step"], lg["eval"]) for n, lg in logs.items()}, ylabel="held-out loss",
                  styles={"constant": "--"},
                  refs={"best possible loss (entropy rate)": task.entropy_rate()},
                  title=f"TinyGPT, {RUN_STEPS} steps, peak lr {MAX_LR:g}")
ax1.set_ylim(task.entropy_rate() - 0.05, max(lg["eval"][min(2, len(lg["eval"]) - 1)] for lg in logs.values()))
ax1.axvline(wsd_start, color="gray", linewidth=0.8)
plots.plot_schedules(ax2, {n: lg["lr"] for n, lg in logs.items()}, styles={"constant": "--"})
ax2.axvline(wsd_start, color="gray", linewidth=0.8)
plt.show()

# %%
def eval_at(name, step):
    return logs[name]["eval"][logs[name]["eval_step"].index(step)]


print(f"held-out loss    {'at step ' + str(wsd_start) + ' (WSD decay starts)':>32} {'at the end':>11} {'change':>8}")
for name in logs:
    a, b = eval_at(name, wsd_start), logs[name]["eval"][-1]
    print(f"{name:<16} {a:>32.4f} {b:>11.4f} {b - a:>+8.4f}")
print(f"best possible: {task.entropy_rate():.4f}")

# %%
before = logs["WSD"]["eval_step"].index(wsd_start) + 1
check(logs["WSD"]["eval"][:before] == logs["constant"]["eval"][:before],
      "WSD and constant use the same lr until WSD's decay starts, so their losses should be identical up to there")
check(logs["WSD"]["eval"][-1] < logs["constant"]["eval"][-1],
      "WSD's decay should end below the constant-lr run: the decay is what settles the loss")
wsd_drop = eval_at("WSD", wsd_start) - logs["WSD"]["eval"][-1]
const_drop = eval_at("constant", wsd_start) - logs["constant"]["eval"][-1]
check(wsd_drop > const_drop,
      "over WSD's decay phase its loss should fall further than the constant-lr run's over the same steps")
if not SMOKE:  # a run of 60 steps (the smoke size) is too short for this: its cosine is at low lr almost at once
    check(eval_at("WSD", wsd_start) > eval_at("cosine", wsd_start),
          "before WSD's decay starts, WSD (still at the peak lr) should sit above cosine, whose lr is already falling")
check(logs["WSD"]["eval"][-1] < logs["cosine"]["eval"][-1] + 0.02,
      "WSD should end level with (or below) cosine: a short final decay is enough")
print(f"during the last {RUN_STEPS - wsd_start} steps WSD's loss fell by {wsd_drop:.4f}, the constant run's by "
      f"{const_drop:.4f}; at the end WSD - cosine = {logs['WSD']['eval'][-1] - logs['cosine']['eval'][-1]:+.4f}")

# %% [markdown]
# **What you should see:** until WSD's decay starts (grey line) WSD *is* the constant run, and
# both sit above cosine, whose lr is already falling: a high lr makes progress but keeps the
# loss bouncing above the minimum. Then WSD's short decay drops its loss quickly to about
# where cosine ends, while the constant run stays up. This is the WSD argument: you can train at
# the peak for as long as you like and pay for the decay only at the end (or at each point where
# you want a finished model). In a very short run (the smoke-test size, 60 steps) the story tilts
# further towards WSD: cosine spends most of its run at low lr, and it need not even be ahead
# when WSD's decay starts (the cell above checks that order only at full size).
#
# ## 5. Resuming: what the scheduler must restore
#
# A scheduler is state: a step counter (`last_epoch` in PyTorch), the base lr of each param
# group, and the schedule's own parameters. Forget it on resume, and a fresh `LambdaLR` starts
# from step 0: **warmup again**, then a decay over a horizon shifted by the resume point. First
# at the level of learning rates (a cosine, `W = 100`, `T = 1000`, interrupted after 400 steps):

# %% tags=["nbval-check-output"]
sched = schedules["cosine"]
STOP = 400


def fresh_optimizer():
    torch.manual_seed(SEED)
    return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=sched.max_lr)


def lrs(opt, scheduler, n):
    """The lr of the next n optimizer steps."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


opt = fresh_optimizer()
scheduler = make_scheduler(opt, sched)
lrs(opt, scheduler, STOP)  # the run so far
ckpt = copy.deepcopy({"optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()})
resumed = {"uninterrupted": lrs(opt, scheduler, 4)}

opt = fresh_optimizer()  # 1) optimizer restored, scheduler rebuilt but its state not loaded
opt.load_state_dict(ckpt["optimizer"])
resumed["rebuilt, no state"] = lrs(opt, torch.optim.lr_scheduler.LambdaLR(opt, sched.factor), 4)

opt = fresh_optimizer()  # 2) plain LambdaLR with its state loaded, optimizer state not loaded
plain = torch.optim.lr_scheduler.LambdaLR(opt, sched.factor)
plain.load_state_dict(ckpt["scheduler"])
resumed["plain LambdaLR + state"] = lrs(opt, plain, 4)

opt = fresh_optimizer()  # 3) ours: make_scheduler + load_state_dict, optimizer state not loaded
ours = make_scheduler(opt, sched)
ours.load_state_dict(ckpt["scheduler"])
resumed["ScheduleLR + state"] = lrs(opt, ours, 4)

print(f"{'step':>5} " + " ".join(f"{name:>23}" for name in resumed))
for i in range(4):
    print(f"{STOP + i:>5} " + " ".join(f"{v[i]:>23.4e}" for v in resumed.values()))

# %%
expected = [sched(STOP + i) for i in range(4)]
check(same(resumed["uninterrupted"], expected), "the uninterrupted scheduler should follow the schedule")
check(same(resumed["rebuilt, no state"], [sched(i) for i in range(4)]),
      "a scheduler rebuilt without its state should restart at step 0: that is the bug shown here")
check(not same(resumed["plain LambdaLR + state"][:1], expected[:1])
      and same(resumed["plain LambdaLR + state"][1:], expected[1:]),
      "plain LambdaLR.load_state_dict restores the counter but leaves the optimizer's lr stale for one step")
check(same(resumed["ScheduleLR + state"], expected),
      "make_scheduler's load_state_dict should set the optimizer's lr for the restored step at once")
too_small = expected[0] / resumed["rebuilt, no state"][0]
print(f"rebuilt scheduler, first resumed step: lr {too_small:.1f} times smaller than the schedule's")
check(10 <= too_small < 100 and all(a < b for a, b in zip(resumed["rebuilt, no state"], resumed["rebuilt, no state"][1:])),
      "the rebuilt scheduler's first resumed lr should be tens of times too small, and climbing (warmup again)")
print("rebuilt: warmup again; plain LambdaLR: one step at a stale lr; ours: exact from the first step")

# %% [markdown]
# **What you should see:** the rebuilt scheduler is back in warmup (its first lr, `max_lr / W`,
# tens of times smaller than it should be, 77.5x at step 400, and climbing). The plain `LambdaLR` with its state loaded is right from the second
# step, but its *first* resumed step uses whatever lr the fresh optimizer had: restoring the
# counter does not touch the optimizer until the next `step()`. That only bites when the
# optimizer's own state is not restored alongside (a new optimizer, a changed param-group
# layout), which is exactly when you need the scheduler to be right. `make_scheduler`'s
# `ScheduleLR` sets the lr on load. It also stores the schedule's parameters and warns if you
# resume under different ones, which is sometimes intended (extending a WSD run) and sometimes a
# typo:

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = fresh_optimizer()
    make_scheduler(opt, Schedule(max_lr=PEAK, total_steps=2000, warmup_steps=W, kind="cosine",
                                 min_lr=FLOOR)).load_state_dict(ckpt["scheduler"])
for w in caught:
    print(f"{w.category.__name__}: {w.message}")
check(any("total_steps" in str(w.message) for w in caught),
      "resuming under a schedule with another total_steps should warn and name total_steps")

# %% [markdown]
# Now the real run: the cosine run of section 4, saved before step `RESUME` (model, optimizer,
# scheduler and data position), resumed twice: once with the scheduler rebuilt without its
# state, once with everything restored.

# %%
cos_sched = Schedule(max_lr=MAX_LR, total_steps=RUN_STEPS, warmup_steps=WARMUP, **kinds["cosine"])
resumed_logs = {}
for how in ("rebuilt scheduler (bug)", "full state restored"):
    model, opt, stream = new_run(cos_sched)
    # A copy: optimizer.load_state_dict adopts the saved tensors as its own (no copy when dtype and
    # device match), so training would change an in-memory checkpoint in place. (torch.load from
    # a file gives fresh tensors every time.)
    state = copy.deepcopy(resume_state)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    stream.load_state_dict(state["data"])
    if how == "full state restored":
        scheduler = make_scheduler(opt, cos_sched)
        scheduler.load_state_dict(state["scheduler"])
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, cos_sched.factor)
    resumed_logs[how], _ = train(model, opt, scheduler, stream, RESUME, RUN_STEPS)

fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), layout="constrained", sharex=True)
runs_to_plot = {"uninterrupted cosine": logs["cosine"], **resumed_logs}
plots.plot_curves(ax1, {n: (lg["step"], lg["lr"]) for n, lg in runs_to_plot.items()},
                  styles={"full state restored": "--"}, xlabel="optimizer step", ylabel="learning rate",
                  title=f"resumed at step {RESUME}")
plots.plot_curves(ax2, {n: (lg["eval_step"], lg["eval"]) for n, lg in runs_to_plot.items()},
                  styles={"full state restored": "--"}, ylabel="held-out loss",
                  refs={"best possible": task.entropy_rate()})
ax2.set_ylim(task.entropy_rate() - 0.05, logs["cosine"]["eval"][min(2, len(logs["cosine"]["eval"]) - 1)])
plt.show()

# %%
tail = logs["cosine"]["loss"][RESUME:]
bug, fixed = resumed_logs["rebuilt scheduler (bug)"], resumed_logs["full state restored"]
print(f"{'':<26} {'lr at step ' + str(RESUME):>16} {'final lr':>10} {'final held-out loss':>20}")
for name, lg in runs_to_plot.items():
    i = lg["step"].index(RESUME)
    print(f"{name:<26} {lg['lr'][i]:>16.3e} {lg['lr'][-1]:>10.3e} {lg['eval'][-1]:>20.4f}")
check(fixed["loss"] == tail and same(fixed["lr"], logs["cosine"]["lr"][RESUME:]),
      "the fully restored run should repeat the uninterrupted run's losses and lrs bit for bit")
check(same(bug["lr"][:1], [cos_sched(0)]) and bug["lr"][-1] > logs["cosine"]["lr"][-1],
      "the rebuilt scheduler should restart warmup at the resume point and end at a higher lr")
print(f"full restore: {len(tail)} losses identical to the uninterrupted run; rebuilt scheduler: lr "
      f"{bug['lr'][0]:.1e} at the resume step instead of {cos_sched(RESUME):.1e}")

# %% [markdown]
# **What you should see:** the restored run lies exactly on the uninterrupted one (the dashed
# line hides nothing: its losses are equal bit for bit). The rebuilt scheduler drops the lr to
# the start of warmup, climbs back to the peak and decays over a horizon that now ends far past
# the run, so the run stops at a high lr, its loss still bouncing. What a checkpoint must hold for
# an exact resume: the model, the optimizer (Adam's moments and step counts), the **scheduler**,
# the data position, and the random-number state where anything random remains (dropout).
#
# ## Where next
#
# * **Lab 05**: stability: what a too-high peak lr, a too-short warmup and a loss spike look like,
#   and the tools that contain them.
# * **Lab 07**: checkpoints that hold all of the state above, written atomically and verified.
