# %% [markdown]
# # Exercise 10 — Column- and row-parallel linear layers
#
# Tensor parallelism splits each weight matrix over `N` ranks, so no rank ever holds a whole
# layer. A linear layer `y = x Wᵀ + b`, with `W` of shape `[out, in]`, can be cut two ways:
#
# * **column-parallel**: rank `r` keeps `out/N` *rows* of `W` (its output channels). It needs the
#   whole input and produces a slice of the output.
# * **row-parallel**: rank `r` keeps `in/N` *columns* of `W` (its input channels). It reads a
#   slice of the input and produces a *partial sum* of the whole output.
#
# Put a column layer first and a row layer second (a transformer MLP: up-projection, GELU,
# down-projection) and the slice the first one produces is exactly the slice the second one
# reads: nothing travels in between. The only communication is one all-reduce in forward and one
# in backward, done by two tiny autograd functions that you will write first.
#
# The checks compare everything with the dense `nn.Linear` computed in the same process: outputs,
# the input's gradient, and every weight and bias gradient, on 2 gloo ranks.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
WIDTH = 16  # the MLP's model width (its hidden width is 4 x WIDTH)

# %%
import importlib

import matplotlib.pyplot as plt

import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.labs import exercise10_tp_linear as exercise_runs

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    WIDTH = 8

# %% [markdown]
# ## Part 1: the two conjugate operators
#
# Which communication does each layer need? Follow the values forward and the gradients back.
#
# * A column-parallel layer reads the **same** `x` on every rank, and each rank's weight slice
#   sends back only its own part of `dL/dx`. **f** sits before a column layer: what must it do to
#   `x` in forward, and to the gradient in backward, so that every rank ends with the true `dL/dx`?
# * A row-parallel layer's ranks each produce a *partial sum* of `y`. **g** sits after a row
#   layer: what must it do in forward so that every rank holds `y`? And in backward: what is the
#   derivative of a sum with respect to one of its terms?
#
# `f` and `g` are each other's transpose; lab 10, section 2 shows both at work on readable
# numbers. Spawned ranks can only run code they can import, so the
# next cell *writes your code to a file* (`ex10_tp_linear.py`, next to this notebook). Fill in the
# gaps, run the cell, then the checks below it.
#
# The contract for this part:
#
# * `CopyToTP` (f) and `ReduceFromTP` (g) subclass `torch.autograd.Function`; `forward(ctx, x,
#   group)` and `backward(ctx, grad)`, which returns one value per input of forward (`None` for
#   `group`). `copy_to_tp(x, group=None)` and `reduce_from_tp(x, group=None)` apply them.
# * `group=None` means all ranks. Pass `group=` to every collective.
# * Never change a tensor you were given: `dist.all_reduce` works in place, so reduce a clone.
# * Autograd records a `Function`'s node only when its forward returns a new tensor object: the
#   input object itself does not count, even unchanged.
#
# The layers, in the same file:
#
# * `ColumnParallelLinear(in_features, out_features, bias=True, *, group=None)`: with `N` the
#   group's size and `r = dist.get_rank(group)`, a `weight` of shape `[out/N, in]` and a `bias` of
#   shape `[out/N]`; its output is `[..., out/N]`: this rank's output channels.
# * `RowParallelLinear(in_features, out_features, bias=True, *, group=None)`: a `weight` of shape
#   `[out, in/N]` and the whole `bias`, `[out]`. Its input is this rank's `in/N` channels (what a
#   column layer hands over); its output is the whole `[..., out]` on every rank, bias included
#   exactly once.
# * `from_linear(linear, group=None)` (a classmethod of each) builds the layer and copies in this
#   rank's slice of a dense `nn.Linear`: its output channels for the column layer, its input
#   channels (and the whole bias) for the row layer. Which dimension of `linear.weight` is which?

# %%
# %%writefile ex10_tp_linear.py
"""Megatron's f and g, and column- / row-parallel linear layers (exercise 10)."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToTP(torch.autograd.Function):
    """f: where a replicated activation enters a column-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION What does f do to x in forward (Part 1's first question)? backward will need the group: where can forward leave it? Mind the contract's note on returning a new tensor object
        ctx.group = group
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION Every rank read the same x: what is the true gradient of x, given each rank's part? One value per input of forward, and never change the tensor you were given
        total = grad.contiguous().clone()  # all_reduce works in place: never on autograd's tensor
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None
        ### END SOLUTION


class ReduceFromTP(torch.autograd.Function):
    """g: after a row-parallel layer, whose ranks hold partial sums."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION Each rank holds a partial sum of y: how does every rank get the whole y, without changing the x it was given?
        total = x.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION What is the derivative of a sum with respect to one of its terms? One value per input of forward
        return grad, None
        ### END SOLUTION


def copy_to_tp(x, group=None):
    """f: put it where a replicated activation enters a column-parallel layer."""
    return CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    """g: put it after a row-parallel layer, whose ranks hold partial sums."""
    return ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output channels (rows) split over the ranks of `group`."""

    def __init__(self, in_features, out_features, bias=True, *, group=None):
        super().__init__()
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if out_features % self.tp:
            raise ValueError(f"out_features ({out_features}) must be divisible by the group size ({self.tp})")
        ### BEGIN SOLUTION The contract gives the shapes. How does nn.Linear initialise its weight and bias, and whose fan-in counts here: the shard's or the dense layer's?
        bound = 1 / math.sqrt(in_features)  # the dense layer's fan-in: every rank reads all inputs
        self.weight = nn.Parameter(torch.empty(out_features // self.tp, in_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_features // self.tp).uniform_(-bound, bound)) if bias else None
        ### END SOLUTION

    @classmethod
    def from_linear(cls, linear, group=None):
        """This rank's output channels of a dense nn.Linear: rows of its weight, entries of its bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group)
        ### BEGIN SOLUTION An output channel is which dimension of linear.weight ([out, in])? Which part of it, and of the bias, is this rank's? Copying into a Parameter must not be recorded by autograd
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.tp, dim=0)[layer.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(layer.tp, dim=0)[layer.rank])
        ### END SOLUTION
        return layer

    def forward(self, x):
        ### BEGIN SOLUTION Where on the way through this layer do f's two jobs belong? Lab 10, section 3 puts f and g into Megatron's MLP
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input channels (columns) split over the ranks of `group`;
    the input is this rank's in/N channels, the output the whole [..., out], on every rank."""

    def __init__(self, in_features, out_features, bias=True, *, group=None):
        super().__init__()
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if in_features % self.tp:
            raise ValueError(f"in_features ({in_features}) must be divisible by the group size ({self.tp})")
        ### BEGIN SOLUTION The contract gives the shapes; initialise like the column layer: whose fan-in counts?
        bound = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_features).uniform_(-bound, bound)) if bias else None
        ### END SOLUTION

    @classmethod
    def from_linear(cls, linear, group=None):
        """This rank's input channels of a dense nn.Linear: columns of its weight; the whole bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group)
        ### BEGIN SOLUTION An input channel is which dimension of linear.weight? The bias is kept whole: why is that right?
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.tp, dim=1)[layer.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        ### END SOLUTION
        return layer

    def forward(self, x):
        ### BEGIN SOLUTION Each rank computes a partial sum of y: where does g go, and where does the bias go so that it counts once, not N times?
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias
        ### END SOLUTION

# %% [markdown]
# ## Part 2: f and g on 2 ranks
#
# For a few shapes the check calls your operators directly on each rank:
#
# | operator | input on each rank | gradient arriving from above |
# | --- | --- | --- |
# | f | the same `x` on every rank | a different one on each rank |
# | g | a different `x` on each rank | the same on every rank |
#
# and compares the forward output and `x`'s gradient with what Part 1's answers require (lab 10,
# section 2 shows the same on readable numbers). It also counts the collectives each direction
# issues: one all-reduce per operator in total, nothing else.

# %% tags=["points:2"]
import ex10_tp_linear

importlib.reload(ex10_tp_linear)  # pick up your latest edit
from ex10_tp_linear import ColumnParallelLinear, RowParallelLinear, copy_to_tp, reduce_from_tp  # noqa: E402

SHAPES = [(5,), (3, WIDTH), (2, 3, WIDTH)]
op_rows = exercise_runs.check_conjugate_ops(copy_to_tp, reduce_from_tp, 2, SHAPES)
record("ops", [[str(r["shape"]), r["f forward"], r["f backward"], r["g forward"], r["g backward"]] for r in op_rows])
record("ops.outputs", [r["outputs"] for r in op_rows], rtol=1e-5, atol=1e-6)  # f(x), g(x) and x.grad per rank
print(f"{'shape':<14} {'f forward':>9} {'f backward':>10} {'g forward':>9} {'g backward':>10}   (collectives)")
for r in op_rows:
    print(f"{r['shape']:<14} {r['f forward']:>9} {r['f backward']:>10} {r['g forward']:>9} {r['g backward']:>10}")
check(len(op_rows) == len(SHAPES), "every shape should report a row")
print("f and g are conjugate: each one's backward is the other's forward")

# %% [markdown]
# **What you should see:** in every row one all-reduce for f and one for g, in opposite
# directions. That pattern is the whole point (lab 10, section 2 says why).

# %% [markdown]
# ## Part 3: the layers, equal to the dense layer
#
# Each scenario builds one dense layer (the same seed on every rank), lets your `from_linear` cut
# this rank's shard out of it, and compares with the dense math, computed in the same process:
#
# | scenario | input on each rank | compared |
# | --- | --- | --- |
# | column | the whole `x` `[2, 3, W]` | output = this rank's channels of `x Wᵀ + b`; `dL/dx` whole; weight and bias gradients = this rank's rows |
# | row | this rank's `W/2` channels of `x` | output = the whole `x Wᵀ + b`; `dL/dx` = this rank's channels; weight gradient = this rank's columns, bias gradient whole |
# | mlp | the whole `x` | column (`W → 4W`), GELU, row (`4W → W`) equal to the dense MLP, every gradient |
#
# The loss is `(y * u).sum()` with a fixed random `u`, so every output element gets its own
# gradient. Tolerance: fp32 `allclose`, relative `1e-5` (the shards add up in another order).

# %% tags=["points:3"]
SCENARIOS = [  # (name, kind, (in, out) or (width, hidden), bias, leading dims of the input)
    ("column", "column", (WIDTH, 4 * WIDTH), True, (2, 3)),
    ("row", "row", (4 * WIDTH, WIDTH), True, (2, 3)),
    ("mlp", "mlp", (WIDTH, 4 * WIDTH), True, (2, 3)),
]


def show(rows):
    print(f"{'ranks':>5}  {'scenario':<18} {'all-reduces fwd':>15} {'bwd':>4} {'params/rank':>11} "
          f"{'dense':>6} {'max error':>10}")
    for r in rows:
        print(f"{r['ranks']:>5}  {r['scenario']:<18} {r['forward']:>15} {r['backward']:>4} "
              f"{r['params_per_rank']:>11} {r['dense_params']:>6} {r['max_err']:>10.2e}")


rows = exercise_runs.check_parallel_linears(ColumnParallelLinear, RowParallelLinear, 2, SCENARIOS)
record("linears", [[r["ranks"], r["scenario"], r["forward"], r["backward"], r["params_per_rank"], r["dense_params"], r["max_err"]] for r in rows], atol=1e-4)  # errors within 1e-4 of the reference's ~0
record("linears.outputs", [r["outputs"] for r in rows], rtol=1e-5, atol=1e-6)  # y, x.grad, shard grads per rank
show(rows)
check(all(r["max_err"] < 1e-4 for r in rows), "every output and gradient should match the dense layer")
mlp = rows[-1]
check(mlp["forward"] == 1 and mlp["backward"] == 1,
      f"the MLP should need one all-reduce forward and one backward, saw {mlp['forward']} and {mlp['backward']}")
print("column, row and the Megatron MLP equal the dense layers on 2 ranks")

# %% [markdown]
# **What you should see:** errors around `1e-7` or below; the column and the row layer one
# all-reduce each, in opposite directions, and the MLP `1 / 1`: the GELU in the middle works on
# each rank's own channels, so the column layer's output goes straight into the row layer.
# Each rank holds about half the dense parameters (the row layer's bias is kept whole on both).

# %% [markdown]
# ## Part 4: who holds what
#
# The MLP's two weight matrices, dense, next to the shard each rank kept. The column layer keeps a
# horizontal band (output channels), the row layer a vertical one (input channels).

# %%
fig, axes = plt.subplots(2, 3, figsize=(9, 5))
for row_ax, layer, name in ((axes[0], 0, "column W1"), (axes[1], 1, "row W2")):
    shards = [mlp["shards"][r][layer] for r in range(2)]
    dense = mlp["dense_weights"][layer]
    vmax = dense.abs().max().item()
    for ax, mat, title in zip(row_ax, [dense] + shards, [f"{name}: dense"] + [f"rank {r}" for r in range(2)]):
        ax.imshow(mat, cmap="RdBu", vmin=-vmax, vmax=vmax)
        ax.set_title(f"{title} {list(mat.shape)}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
plt.tight_layout()
plt.show()

# %% [markdown]
# **What you should see:** in the top row each rank holds the top or bottom half of `W1`, in the
# bottom row the left or right half of `W2`; side by side they make the dense matrix again. With
# `N` ranks each holds `1/N` of both matrices, and the two all-reduces per layer move
# `batch × tokens × width` numbers each, whatever `N` is.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
# test: f, g and both layers on 4 ranks, and in tensor-parallel groups of 2
hidden_ops = exercise_runs.check_conjugate_ops(copy_to_tp, reduce_from_tp, 4, [(7,), (2, 5, 4)])
check(len(hidden_ops) == 2, "hidden: f and g on 4 ranks")
hidden = [("column, no bias, 2-D", "column", (12, 8), False, (5,)),
          ("row, no bias, 4-D", "row", (8, 12), False, (2, 2, 3)),
          ("row, bias", "row", (16, 4), True, (3,)),
          ("mlp, no bias", "mlp", (8, 24), False, (2, 3)),
          ("mlp, bias", "mlp", (4, 8), True, (1, 6)),
          # two tensor-parallel groups of 2 ranks inside 4 (a TP x DP layout): group= must be honoured
          ("row, groups of 2", "row", (16, 4), True, (3,), 2),
          ("mlp, groups of 2", "mlp", (4, 8), True, (1, 6), 2)]
hidden_rows = exercise_runs.check_parallel_linears(ColumnParallelLinear, RowParallelLinear, 4, hidden)
record("hidden.rows", [[[str(r["shape"]), r["f forward"], r["f backward"], r["g forward"], r["g backward"]] for r in hidden_ops], [[r["ranks"], r["scenario"], r["forward"], r["backward"], r["params_per_rank"], r["dense_params"], r["max_err"]] for r in hidden_rows]], atol=1e-4)
record("hidden.outputs", [[r["outputs"] for r in hidden_ops], [r["outputs"] for r in hidden_rows]], rtol=1e-5, atol=1e-6)
check(all(r["max_err"] < 1e-4 for r in hidden_rows), "hidden: 4 ranks match the dense layers")
### END HIDDEN TESTS
