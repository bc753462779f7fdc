# %% [markdown]
# # Exercise 11 — The 1F1B pipeline schedule
#
# Pipeline parallelism cuts the model into `pp` **stages** of consecutive layers, one per rank,
# and splits each global batch into `m` **micro-batches**. Stage `s` runs the forward of
# micro-batch `i` once stage `s-1` has sent it the activation, and its backward once stage `s+1`
# has sent back the gradient of that activation.
#
# A schedule is simply the order in which each stage does its work. The simplest one, GPipe, runs
# all `m` forwards and then all `m` backwards, so every stage keeps the activations of all `m`
# micro-batches alive at once. **1F1B** (one forward, one backward) starts each backward as early
# as it can, which frees that micro-batch's activations: stage `s` then never holds more than
# `pp - s` micro-batches. It takes the same time as GPipe, with a fraction of the memory.
#
# You will write the list of actions of one stage. The checks run every stage's list together in
# a simulator that finds deadlocks without starting a process, compare it with 1F1B, then execute
# it on 2 gloo ranks with a real model and compare the loss and every gradient with one process.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
PP_SHOW, M_SHOW = 4, 8  # the pipeline drawn in Part 4
M_RUN = [1, 4]  # micro-batch counts executed on 2 ranks in Part 5

# %%
import matplotlib.pyplot as plt

import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.labs import exercise11_one_f_one_b as exercise_runs

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    M_RUN = [2]

# %% [markdown]
# ## Part 1: the actions of one stage
#
# A stage's schedule is a list of `(action, micro_batch)` pairs, run top to bottom. Six actions:
#
# | action | what the stage does | which stages |
# | --- | --- | --- |
# | `recv_activation` | wait for stage `s-1`'s output for this micro-batch | all but the first |
# | `forward` | run its layers; keep what backward will need | all |
# | `send_activation` | send the output to stage `s+1` (does not wait) | all but the last |
# | `recv_grad` | wait for the gradient of that output from stage `s+1` | all but the last |
# | `backward` | backpropagate through its layers; frees the micro-batch | all |
# | `send_grad` | send the gradient of its input to stage `s-1` (does not wait) | all but the first |
#
# Sends never wait; receives block until the message is there. Between two neighbours, messages
# of one kind arrive **in the order they were sent**.
#
# The contract of `one_f_one_b(pp, micro_batches, stage)`:
#
# * Around each forward: `recv_activation` just before it (unless `stage == 0`),
#   `send_activation` just after it (unless `stage == pp - 1`); write this in `forward_actions`.
#   Around each backward: `recv_grad` just before (unless last), `send_grad` just after (unless
#   first); write this in `backward_actions`.
# * **Warm-up**: the forwards that can run before the first gradient could possibly come back
#   from the last stage (never more than `m`). How many is that for the last stage? For the first?
# * **Steady state**: then alternate one forward (the next micro-batch) and one backward (the
#   oldest micro-batch still waiting for one) until every forward has run.
# * **Cool-down**: the backwards still missing, oldest first.
#
# Your function only computes lists, so it can live in the notebook: the checks call it here and
# send the finished lists to the ranks.

# %%
def forward_actions(pp, stage, i):
    """The actions around the forward of micro-batch i on `stage`."""
    ### BEGIN SOLUTION The table above says which stages have a neighbour before them and which after: where does the data for this forward come from, and where does its output go?
    first, last = stage == 0, stage == pp - 1
    return ([] if first else [("recv_activation", i)]) + [("forward", i)] \
        + ([] if last else [("send_activation", i)])
    ### END SOLUTION


def backward_actions(pp, stage, i):
    """The actions around the backward of micro-batch i on `stage`."""
    ### BEGIN SOLUTION The mirror image of forward_actions: which way do gradients travel, and which stages have no neighbour on that side?
    first, last = stage == 0, stage == pp - 1
    return ([] if last else [("recv_grad", i)]) + [("backward", i)] \
        + ([] if first else [("send_grad", i)])
    ### END SOLUTION


def one_f_one_b(pp, micro_batches, stage):
    """The 1F1B order of `stage` (0-based) in a pipeline of `pp` stages and `micro_batches` micro-batches."""
    ### BEGIN SOLUTION How many forwards can this stage run before the first gradient can come back to it? After that, what alternates, and what is left at the end?
    m = micro_batches
    warmup = min(pp - stage - 1, m)
    actions = []
    for i in range(warmup):
        actions += forward_actions(pp, stage, i)
    for k in range(m - warmup):  # steady state: the next forward, then the oldest backward
        actions += forward_actions(pp, stage, warmup + k) + backward_actions(pp, stage, k)
    for i in range(m - warmup, m):  # cool-down
        actions += backward_actions(pp, stage, i)
    return actions
    ### END SOLUTION

# %% [markdown]
# ## Part 2: checked without starting a process
#
# For each pipeline below the check builds every stage's list and:
#
# 1. checks each list is well formed (every micro-batch has its forward, backward and messages,
#    each once, in a possible order);
# 2. runs all the lists together in a simulator: sends are queued, a receive waits for the next
#    message from its neighbour. If every stage ends up waiting, that is a **deadlock**, reported
#    with who waits for what. Forward takes 1 time unit, backward 2, messages none;
# 3. counts the micro-batches each stage holds at once (forward done, backward not yet): at most
#    `min(m, pp - stage)`;
# 4. compares with 1F1B as written in the contract.

# %% tags=["points:3"]
print("your stage lists for pp=2, m=3:")
for s in range(2):
    print(f"  stage {s}:", " ".join(f"{op}({i})" for op, i in one_f_one_b(2, 3, s)))

PIPELINES = [(2, 1), (2, 4), (4, 8), (6, 8)]
pure_rows = [exercise_runs.check_schedule_fn(one_f_one_b, pp, m) for pp, m in PIPELINES]
record("pure", [[r["pp"], r["micro_batches"], r["makespan"], r["ideal"], r["peak_in_flight"]] for r in pure_rows])
record("pure.lists", [r["lists"] for r in pure_rows])  # the stage lists themselves: 1F1B is one order
print(f"\n{'pp':>3} {'m':>3} {'time units':>10} {'ideal (m+pp-1)x3':>17}  in flight per stage (bound min(m, pp-s))")
for r in pure_rows:
    bound = [min(r["micro_batches"], r["pp"] - s) for s in range(r["pp"])]
    print(f"{r['pp']:>3} {r['micro_batches']:>3} {r['makespan']:>10g} {r['ideal']:>17g}  {r['peak_in_flight']} ({bound})")
check(all(r["makespan"] == r["ideal"] for r in pure_rows), "1F1B should take (m + pp - 1) x (forward + backward)")
print("no deadlock, within memory, and the 1F1B order in every pipeline")

# %% [markdown]
# **What you should see:** every pipeline takes `(m + pp - 1) × 3` time units: `m` micro-batches
# of work per stage plus `pp - 1` idle slots (the bubble), the same as GPipe. The stages hold
# `pp - s` micro-batches at most: the first stage the most, the last stage one.

# %% [markdown]
# ## Part 3: what a deadlock looks like
#
# Here is a broken order, written by hand, for 2 stages and 1 micro-batch: stage 0 waits for the
# gradient *before* it sends the activation that stage 1 needs to produce that gradient.

# %%
broken = [[("forward", 0), ("recv_grad", 0), ("send_activation", 0), ("backward", 0)],
          [("recv_activation", 0), ("forward", 0), ("backward", 0), ("send_grad", 0)]]
result = exercise_runs.simulate(broken)
print("deadlock:", result["deadlock"])
print("computed before it stuck:", [(f"stage {s}", op, i) for s, op, i, _, _ in result["events"]])

# %% [markdown]
# **What you should see:** stage 0 waits for stage 1 and stage 1 for stage 0: a cycle. On real
# ranks both processes would block forever in `recv`; the simulator finds it in microseconds,
# which is why the checks simulate before they start any process. 1F1B cannot deadlock: a stage
# only waits for data whose producer comes earlier in its neighbour's list, and sends never wait.

# %% [markdown]
# ## Part 4: the timeline
#
# The simulated timeline of GPipe (the library's order) and of your 1F1B for `pp` stages and `m`
# micro-batches; each box is one forward (blue) or backward (orange), numbered by micro-batch.

# %% tags=["points:2"]
def draw(ax, lists, title):
    sim = exercise_runs.simulate(lists)
    for s, op, i, start, end in sim["events"]:
        ax.barh(s, end - start, left=start, color="C0" if op == "forward" else "C1", edgecolor="white")
        ax.text((start + end) / 2, s, str(i), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(lists)), [f"stage {s}" for s in range(len(lists))])
    ax.invert_yaxis()
    ax.set_title(f"{title}: {sim['makespan']:g} time units, in flight per stage {sim['peak_in_flight']}", fontsize=9)
    return sim


fig, axes = plt.subplots(2, 1, figsize=(10, 4.5), sharex=True)
gpipe = draw(axes[0], exercise_runs.gpipe_lists(PP_SHOW, M_SHOW), "GPipe")
mine_lists = [one_f_one_b(PP_SHOW, M_SHOW, s) for s in range(PP_SHOW)]
mine = draw(axes[1], mine_lists, "your 1F1B")
axes[1].set_xlabel("time (forward = 1, backward = 2)")
plt.tight_layout()
plt.show()
record("drawn", [mine["makespan"], mine["peak_in_flight"]])
record("drawn.lists", mine_lists)
check(mine["peak_in_flight"] == [min(M_SHOW, PP_SHOW - s) for s in range(PP_SHOW)],
      f"1F1B should hold min(m, pp - stage) micro-batches per stage, got {mine['peak_in_flight']}")

# %% [markdown]
# **What you should see:** both timelines end at the same time; the white gaps (the bubble) are
# the same size. GPipe holds all `m` micro-batches on every stage; 1F1B interleaves forwards and
# backwards after a short warm-up and holds `pp - s`. With `m` much larger than `pp`, that is the
# difference between memory growing with `m` and memory that does not.

# %% [markdown]
# ## Part 5: on 2 ranks, equal to one process
#
# Now the real thing: each of 2 gloo ranks builds the same small GPT (4 blocks, tied token
# table and output head), keeps its half as one stage, and runs one training step's forward and
# backward with the library's pipeline runner executing **your** lists, messages and all. Each
# rank also computes one process's gradients on the same micro-batches and compares.

# %% tags=["points:3"]
run_rows = exercise_runs.check_one_f_one_b_on_ranks(one_f_one_b, 2, M_RUN)
record("ranks", [[r["pp"], r["micro_batches"], r["loss"], r["peak_in_flight"]] for r in run_rows], rtol=1e-5, atol=1e-6)
record("ranks.outputs", [[r["lists"], r["loss"], r["grads"]] for r in run_rows], rtol=1e-5, atol=1e-6)  # lists run, loss, grads per rank
print(f"{'pp':>3} {'m':>3} {'pipeline loss':>14} {'one process':>12} {'max grad error':>15} {'in flight per stage':>20}")
for r in run_rows:
    print(f"{r['pp']:>3} {r['micro_batches']:>3} {r['loss']:>14.6f} {r['ref_loss']:>12.6f} "
          f"{r['max_err']:>15.2e} {str(r['peak_in_flight']):>20}")
check(all(abs(r["loss"] - r["ref_loss"]) < 1e-5 for r in run_rows), "the pipeline's loss should equal one process's")
print("your 1F1B order trains exactly like one process on 2 ranks")

# %% [markdown]
# **What you should see:** the same loss to 6 decimals, gradient errors around `1e-7` or below
# (the same sums in another order), and the first stage holding at most 2 micro-batches, the last
# at most 1, however many micro-batches there are.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
hidden_pure, hidden_lists = [], []
for pp in range(1, 7):
    for m in range(1, 9):
        r = exercise_runs.check_schedule_fn(one_f_one_b, pp, m)
        hidden_pure.append([r["pp"], r["micro_batches"], r["makespan"], r["peak_in_flight"]])
        hidden_lists.append(r["lists"])
hidden_rows = exercise_runs.check_one_f_one_b_on_ranks(one_f_one_b, 4, [1, 3, 8] if not SMOKE else [3, 8])
record("hidden.rows", [hidden_pure, [[r["pp"], r["micro_batches"], r["loss"], r["peak_in_flight"]] for r in hidden_rows]],
       rtol=1e-5, atol=1e-6)
record("hidden.outputs", [hidden_lists, [[r["lists"], r["loss"], r["grads"]] for r in hidden_rows]], rtol=1e-5, atol=1e-6)
check(all(r["peak_in_flight"] == [min(r["micro_batches"], 4 - s) for s in range(4)] for r in hidden_rows),
      "hidden: 4 stages hold min(m, pp - s) micro-batches")
### END HIDDEN TESTS
