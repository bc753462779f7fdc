# %% [markdown]
# # Exercise 15 — FP8 in 1 x 128 tiles: DeepSeek-V3's blockwise quantizer
#
# FP8's E4M3 format holds magnitudes from 2^-9 to 448 only, so a tensor is divided by a **scale**
# before it is cast, and multiplied by it again after. Lab 03 (section 8) showed that one scale
# per tensor lets a single outlier push every small value of the tensor towards zero. DeepSeek-V3
# trained in FP8 with a scale per **1 x 128 tile**: each row of an activation or gradient tensor
# is cut into runs of 128 consecutive values, and every run gets its own scale. You will write
# that quantizer and its inverse.
#
# The contract of `quantize_blockwise(x, block=128) -> (values, scales)`:
#
# * `x`: a 2-D float tensor `(rows, cols)`; `cols` need not be a multiple of `block` (the last
#   tile of a row is then shorter);
# * `scales`: float32, one per tile, shape `(rows, number of tiles per row)`; each tile's scale is
#   the one that puts the tile's **largest magnitude exactly on E4M3's largest value, 448**; a tile
#   of zeros gets scale 1 (its values are zero whatever the scale);
# * `values`: `torch.float8_e4m3fn`, the shape of `x`: each value divided by its tile's scale,
#   rounded to the nearest E4M3 number (torch's cast does the rounding), never past ±448;
# * do not change `x`.
#
# `dequantize_blockwise(values, scales, block=128)` returns the float32 tensor they stand for:
# each stored value times its own tile's scale.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes (this exercise is small either way)

# %%
import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.labs import exercise15_fp8_blockwise as exercise_runs

SMOKE = course_lib.smoke(SMOKE)
torch.set_num_threads(1)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

# %% [markdown]
# Before writing code: a row of 256 values has how many 1 x 128 tiles? If its first tile's largest
# magnitude is 1000, what is that tile's scale, and what does the value 1000 become once stored?

# %%
def quantize_blockwise(x, block=128):
    """(values in E4M3, float32 scales with one per 1 x block tile) for a 2-D tensor x."""
    ### BEGIN SOLUTION Picture a row as its tiles, one beside the other: can you give the tensor a shape in which each tile is its own axis, so that one reduction finds every tile's largest magnitude? What must happen to a row whose length is not a whole number of tiles, and to a tile whose largest magnitude is zero?
    rows, cols = x.shape
    tiles = -(-cols // block)
    padded = torch.nn.functional.pad(x.float(), (0, tiles * block - cols))  # zeros never raise a tile's amax
    t = padded.reshape(rows, tiles, block)
    amax = t.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (t / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(rows, tiles * block)[:, :cols], scales
    ### END SOLUTION


def dequantize_blockwise(values, scales, block=128):
    """The float32 tensor that (values, scales) from quantize_blockwise stand for."""
    ### BEGIN SOLUTION Each stored value needs the scale of the tile it sits in: which tile is column c in, and how can every column get its tile's scale at once, the last, shorter tile included?
    per_value = scales.repeat_interleave(block, dim=1)[:, : values.shape[1]]
    return values.float() * per_value
    ### END SOLUTION

# %% [markdown]
# ## Part 1: one row, two tiles
#
# A row of 256 values: the first tile holds an outlier of 1000 among values near 1, the second
# tile only values near 1.

# %% tags=["points:2"]
# test: one row of two tiles, one of them with an outlier
row = torch.linspace(-1.0, 1.0, 256).reshape(1, 256) * torch.cat([torch.ones(128), torch.full((128,), 0.9)])
row[0, 5] = 1000.0
one = exercise_runs.compare(quantize_blockwise, dequantize_blockwise, row, 128, "one row")
record("one_row", [one["scales"], one["values"], one["back"]], rtol=1e-6)
print(f"scales of the two tiles: {one['scales'].flatten().tolist()}")
print(f"the outlier 1000 is stored as {one['values'][0, 5].item():g}; the second tile's largest, "
      f"{row[0, 128:].abs().max().item():g}, as {one['values'][0, 128:].abs().max().item():g}")
check(one["scales"].shape == (1, 2), "a row of 256 values should have two tiles of 128, so two scales")
check(one["values"][0, 5].item() == E4M3_MAX and one["values"][0, 128:].abs().max().item() == E4M3_MAX,
      "each tile's largest magnitude should be stored as E4M3's largest number, 448")

# %% [markdown]
# **What you should see:** two different scales, about 2.23 and about 0.002; both
# tiles' largest values stored as 448. With one scale for the whole row, the second tile would
# have been divided by 2.23 too.
#
# ## Part 2: the round trip, against one scale per tensor
#
# Four rows of 512 activations, with one hot channel (values near 1000) in each row's first tile.
# The check compares your tiles with the library's, then measures what a trip through FP8 costs:
# the median error of one value, and the share of values that came back as zero, next to what one
# scale for the whole tensor zeroes.

# %% tags=["points:2"]
# test: round trip of activations with a hot channel
acts = exercise_runs.outlier_rows(4, 512)
trip = exercise_runs.compare(quantize_blockwise, dequantize_blockwise, acts, 128, "activations")
record("roundtrip", [trip["scales"], trip["back"]], rtol=1e-6)
one_scale = exercise_runs.tensorwise_zeroed(acts)
print(f"median error of one value: {trip['median_error']:.2%}; zeroed: {trip['zeroed']:.2%} in 1 x 128 tiles, "
      f"{one_scale:.2%} with one scale for the tensor")
check(trip["median_error"] < 1 / 16, "a value's error should stay below 1/16: E4M3's 3 mantissa bits round by at most that")
check(trip["zeroed"] < one_scale / 2, "1 x 128 tiles should zero less than half as many values as one scale for the "
      "whole tensor: only the hot channel's own tile should lose its smallest values")

# %%
fig, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
ax.semilogy(trip["scales"][0].tolist(), "o-", label="row 0")
ax.semilogy(trip["scales"][1].tolist(), "s--", label="row 1")
ax.set(xlabel="tile", ylabel="scale", title="one scale per 1 x 128 tile: the hot channel's tile stands out")
ax.legend()
plt.show()

# %% [markdown]
# **What you should see:** a median error around 2% (E4M3's rounding), and several times fewer
# values zeroed in tiles than with one scale for the tensor: only the hot channel's own tile still
# loses its smallest values. In the plot, the first tile of each row has a scale hundreds of times
# the others'.
#
# ## Part 3: ragged rows, zero tiles, other block sizes
#
# Real tensors are not all multiples of 128. Three rows of 300 values (tiles of 128, 128 and 44),
# the second row all zeros, the last 44 values of the third row zeros; then the same tensor in
# tiles of 32 (the block size of MXFP8, here with ordinary float scales).

# %% tags=["points:2"]
# test: ragged tiles, tiles of zeros, and a block of 32
ragged = torch.randn(3, 300, generator=torch.Generator().manual_seed(3)) * 5
ragged[1] = 0.0
ragged[2, 256:] = 0.0
r128 = exercise_runs.compare(quantize_blockwise, dequantize_blockwise, ragged, 128, "300 columns, block 128")
r32 = exercise_runs.compare(quantize_blockwise, dequantize_blockwise, ragged, 32, "300 columns, block 32")
record("ragged", [r128["scales"], r128["back"], r32["scales"], r32["back"]], rtol=1e-6)
print(f"block 128: scales {tuple(r128['scales'].shape)}, zero row's scales {r128['scales'][1].tolist()}")
print(f"block 32:  scales {tuple(r32['scales'].shape)}")
check(r128["scales"].shape == (3, 3) and r32["scales"].shape == (3, 10),
      "300 columns make 3 tiles of up to 128 and 10 tiles of up to 32")
check(torch.equal(r128["back"][1], torch.zeros(300)), "a row of zeros should come back as zeros, not NaN")

# %% [markdown]
# **What you should see:** 3 x 3 and 3 x 10 scales, the zero row with scales of 1 and values of
# 0, and no NaN anywhere.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
# test: random shapes, bf16 input, huge and tiny magnitudes, negative outliers, one column
g_h = torch.Generator().manual_seed(15)
hidden = []
for rows, cols, block, scale in ((1, 1, 128, 1.0), (5, 129, 128, 1e-6), (2, 400, 64, 1e20), (7, 33, 16, 3.0)):
    x_h = torch.randn(rows, cols, generator=g_h) * scale
    x_h[0, -1] = -50 * scale  # a negative outlier at the end of the last, shorter tile
    got = exercise_runs.compare(quantize_blockwise, dequantize_blockwise, x_h, block, f"hidden: {rows} x {cols}, block {block}")
    hidden.append([got["scales"], got["back"]])
x_bf = (torch.randn(4, 256, generator=g_h) * 7).to(torch.bfloat16)
got_bf = exercise_runs.compare(quantize_blockwise, dequantize_blockwise, x_bf, 128, "hidden: bf16 input")
hidden.append([got_bf["scales"], got_bf["back"]])
record("hidden", hidden, rtol=1e-6)
check(all(torch.isfinite(h[1]).all() for h in hidden), "hidden: every round trip must be finite")
### END HIDDEN TESTS
