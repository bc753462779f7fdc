# %% [markdown]
# # Exercise 09 — ZeRO-1: shard the optimizer state
#
# With AdamW in fp32, every parameter costs 4 bytes of weight, 4 of gradient and **8 of optimizer
# state** (the two moments). Plain data parallelism keeps all of it on every rank and every rank
# performs the same optimizer step: `N` identical copies of the largest item. ZeRO stage 1 gives
# each parameter one **owner** rank: only the owner keeps that parameter's optimizer state and
# steps it, then sends the new values to everyone. Per rank the state drops from `8 Ψ` to
# `8 Ψ / N` bytes for `Ψ` parameters, and the result does not change by a single bit: each element
# of the update is the same arithmetic on the same numbers, whichever rank computes it.
#
# You will write `ShardedOptimizer(params, optimizer_cls, **kwargs)`, a `torch.optim.Optimizer`
# that wraps any torch optimizer class. The checks compare it, bit for bit, with the plain
# optimizer on 2 and 4 ranks, with parameter sizes that do not split evenly, a parameter that never
# gets a gradient, and a parameter group added in the middle of training.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
STEPS = 5  # optimizer steps per scenario

# %%
import importlib

import matplotlib.pyplot as plt

import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.labs import exercise09_zero1_optimizer as exercise_runs

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    STEPS = 4

# %% [markdown]
# ## Part 1: your `ShardedOptimizer`
#
# Spawned ranks can only run code they can import, so the next cell *writes your class to a file*
# (`ex09_zero1.py`, next to this notebook). Edit the class inside the cell, run the cell, then run
# the checks below it.
#
# The contract:
#
# * Gradients arrive **already averaged** over ranks (by a DDP wrapper, or an all-reduce before
#   `step()`): every rank has the same `p.grad`.
# * **Ownership.** Give each whole parameter to one rank, greedily: taking a group's parameters
#   largest first, the rank that owns the fewest elements so far gets the next one (ties: the
#   lowest rank). Every rank sees the same
#   parameters in the same order, so every rank computes the same owners without communicating.
# * **Local optimizer.** Each rank builds the real `optimizer_cls(..., **kwargs)` over the
#   parameters *it owns*, one local group per group of yours (possibly an empty one, so group
#   indices stay aligned). Only the owner ever creates state for a parameter.
# * `self.param_groups` (what `torch.optim.Optimizer.__init__` builds from `params`) keeps **all**
#   parameters and the hyperparameters: an lr scheduler writes the learning rate there, so copy
#   the hyperparameters of each group into its local group before stepping.
# * `step()`: step the local optimizer; afterwards every rank holds every updated parameter, each
#   sent by its owner with one collective per parameter, in the same order on every rank.
# * `add_param_group(group)` must work mid-training: `torch.optim.Optimizer.__init__` calls it for
#   each initial group **before** your local optimizer exists, and you may call it later.

# %%
# %%writefile ex09_zero1.py
"""ZeRO-1: an optimizer whose state is sharded over the ranks (exercise 09)."""
import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    """Each rank keeps optimizer state for ~1/N of the parameters and steps only those."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.owner = {}  # parameter -> the rank that keeps its state and steps it
        self.owned_elements = [0] * self.world_size  # elements owned by each rank so far
        self.local_optimizer = None  # Optimizer.__init__ calls add_param_group before it exists
        # optimizer_cls's full option set (lr, betas, ...), so every group carries every option
        defaults = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs).defaults
        super().__init__(params, defaults)
        ### BEGIN SOLUTION When this line runs, every group has been through add_param_group, so every parameter has an owner. Which object does the real work, over which parameters, and how do torch optimizers accept several groups at once?
        self.local_optimizer = optimizer_cls([self._local_group(g) for g in self.param_groups], **kwargs)
        ### END SOLUTION

    def _local_group(self, group):
        """The part of `group` this rank owns: the same options, only its own parameters."""
        ### BEGIN SOLUTION A param group is a dict: which of its entries stay as they are, and which one changes? Which parameters does this rank own (self.owner)?
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self.owner[p] == self.rank]
        return local
        ### END SOLUTION

    def add_param_group(self, param_group):
        super().add_param_group(param_group)  # checks it and fills in the defaults
        group = self.param_groups[-1]
        ### BEGIN SOLUTION Try it by hand for sizes 42, 7, 49, 7 on 2 ranks: who gets what under the contract's rule? Which attributes set up in __init__ keep the tally, and what must happen when a group arrives after the local optimizer exists?
        for p in sorted(group["params"], key=lambda t: -t.numel()):  # sorted() is stable
            owner = min(range(self.world_size), key=lambda r: self.owned_elements[r])
            self.owner[p] = owner
            self.owned_elements[owner] += p.numel()
        if self.local_optimizer is not None:
            self.local_optimizer.add_param_group(self._local_group(group))
        ### END SOLUTION

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shard, then broadcast every parameter from its owner."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ### BEGIN SOLUTION Three things, in the contract's words: the options a scheduler may have changed, the step of this rank's shard, and every rank ending with every updated parameter. Which rank is the source of each parameter's new value?
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups):
            for key, value in group.items():
                if key != "params":  # an lr scheduler writes here: hand it on
                    local[key] = value
        self.local_optimizer.step()
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.data, src=self.owner[p])
        ### END SOLUTION
        return loss

# %% [markdown]
# ## Part 2: bit for bit equal to the plain optimizer, on 2 ranks
#
# In every scenario each rank builds the same parameters of a small three-layer network: shapes
# 6×7, 7, 7×7, 7, 7×6, 6 and 6 (159 elements, which neither 2 nor 4 ranks can split evenly into
# whole parameters) and a 5-element one that never gets a gradient, in two groups (the second
# without weight decay). Each step, each rank computes gradients on its share of the batch,
# the gradients are averaged with `all_reduce`, and your optimizer and the plain `AdamW` on a copy
# of the parameters both step on the same averaged gradients. `torch.equal` on every parameter,
# every step, every rank.
#
# | scenario | what it adds |
# | --- | --- |
# | adamw | `AdamW(lr=1e-2, weight_decay=0.1)`, two groups |
# | adamw, group added at step 3 | a third group (6×6 and 6, `lr=5e-3`) added after two steps |

# %% tags=["points:3"]
import ex09_zero1

importlib.reload(ex09_zero1)  # pick up your latest edit
from ex09_zero1 import ShardedOptimizer  # noqa: E402

SCENARIOS = [("adamw", "adamw", None, False),  # (name, optimizer, step that adds a group, lr schedule)
             ("adamw, group added at step 3", "adamw", 2, False)]


def show(rows):
    print(f"{'ranks':>5}  {'scenario':<30} {'rank':>4} {'state held for':>15} {'share':>6}")
    for r in rows:
        print(f"{r['ranks']:>5}  {r['scenario']:<30} {r['rank']:>4} "
              f"{r['state_elements']:>6} of {r['all_elements']:>5} {r['state_elements'] / r['all_elements']:>6.0%}")


rows2 = exercise_runs.check_sharded_optimizer(ShardedOptimizer, 2, SCENARIOS, steps=STEPS)
record("rows_2_ranks", [[r["ranks"], r["scenario"], r["rank"], r["state_elements"], r["all_elements"]] for r in rows2])
# every rank's parameters after every step: equal to the plain optimizer's, so to the last bit
record("rows_2_ranks.outputs", [[r["scenario"], r["rank"], r["outputs"]] for r in rows2], rtol=1e-6, atol=1e-8)
show(rows2)
check(len(rows2) == 2 * len(SCENARIOS), "every scenario should report one row per rank")
print("ShardedOptimizer on 2 ranks: equal to plain AdamW to the last bit; each rank holds about half the state")

# %% [markdown]
# **What you should see:** every parameter equal to the plain optimizer's, and each rank holding
# the optimizer state of roughly half the elements (whole parameters cannot split exactly). The
# 5-element parameter never gets a gradient, so nobody ever creates state for it and it is not
# counted.

# %% [markdown]
# ## Part 3: on 4 ranks

# %% tags=["points:2"]
rows4 = exercise_runs.check_sharded_optimizer(ShardedOptimizer, 4, SCENARIOS, steps=STEPS)
record("rows_4_ranks", [[r["ranks"], r["scenario"], r["rank"], r["state_elements"], r["all_elements"]] for r in rows4])
record("rows_4_ranks.outputs", [[r["scenario"], r["rank"], r["outputs"]] for r in rows4], rtol=1e-6, atol=1e-8)
show(rows4)
check(len(rows4) == 4 * len(SCENARIOS), "every scenario should report one row per rank")
print("ShardedOptimizer on 4 ranks: equal to plain AdamW to the last bit")

# %% [markdown]
# ## Part 4: the memory it saves
#
# Elements whose optimizer state each rank keeps, after the group was added (AdamW keeps two fp32
# numbers per element, 8 bytes), against the unsharded optimizer, which keeps them all on every rank.

# %%
fig, ax = plt.subplots(figsize=(7, 3))
name = SCENARIOS[1][0]
total = rows2[-1]["all_elements"]
bars = [("unsharded", total)]
bars += [(f"2 ranks: rank {r['rank']}", r["state_elements"]) for r in rows2 if r["scenario"] == name]
bars += [(f"4 ranks: rank {r['rank']}", r["state_elements"]) for r in rows4 if r["scenario"] == name]
ax.bar([b[0] for b in bars], [8 * b[1] for b in bars], color=["gray"] + ["C0"] * 2 + ["C1"] * 4)
ax.axhline(8 * total / 4, ls=":", color="C1", label="8 Ψ / 4")
ax.axhline(8 * total / 2, ls=":", color="C0", label="8 Ψ / 2")
ax.set_ylabel("AdamW state bytes per rank")
ax.tick_params(axis="x", rotation=45)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# **What you should see:** each rank near `8 Ψ / N`. With whole-parameter ownership the balance
# is only as fine as the largest parameter; production ZeRO flattens all parameters into one
# buffer and cuts it in `N` equal slices instead, at the price of parameters split across ranks.
# The cost of the saving is communication: every step each owner broadcasts its updated
# parameters (in total one model's worth of bytes, as in an all-gather), on top of the gradient
# all-reduce.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
# test: SGD (momentum, a parameter group added mid-run) and AdamW under an lr schedule, on 3 ranks
hidden = [("sgd momentum, group at step 1", "sgd", 0, False), ("adamw, lr schedule", "adamw", None, True),
          ("sgd, group at step 4", "sgd", 3, False)]
hidden_rows = exercise_runs.check_sharded_optimizer(ShardedOptimizer, 3, hidden, steps=5)
record("hidden.rows", [[r["ranks"], r["scenario"], r["rank"], r["state_elements"], r["all_elements"]] for r in hidden_rows])
record("hidden.outputs", [[r["scenario"], r["rank"], r["outputs"]] for r in hidden_rows], rtol=1e-6, atol=1e-8)
check(len(hidden_rows) == 3 * len(hidden), "hidden: every scenario reports one row per rank")
### END HIDDEN TESTS
