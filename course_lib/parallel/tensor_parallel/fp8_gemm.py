"""FP8 GEMMs in the tensor-parallel Linear layers: the kit's Fp8Linear math, on a weight shard.

``train.precision = "fp8"`` swaps the dense model's Linear layers for
:class:`~course_lib.precision.fp8_linear.Fp8Linear` before the model is cut; a column- or
row-parallel layer cut from one (``from_linear``) takes its recipe (:meth:`ShardGemm.take_fp8_from`)
and runs its local GEMM through :func:`~course_lib.precision.fp8_linear.fp8_linear` instead of
``F.linear``. What changes against one process is only which ranks hold which part of each operand:

    column-parallel  W [out/N, in]  - the ``out`` axis is split: the weight's rows in the forward,
                     the output gradient's features in the input-gradient GEMM (contraction) and
                     its rows in the weight-gradient GEMM
    row-parallel     W [out, in/N]  - the ``in`` axis is split: the weight's columns and the
                     input's features in the forward (contraction), the rows of W^T and of x^T in
                     the backward GEMMs

so a scale whose block runs along the split axis - the tensorwise and delayed amax of every split
operand, a rowwise scale along the contraction of the forward (row-parallel) or of the input
gradient (column-parallel) - is max-reduced over the tp group, and 1 x 128 / 128 x 128 / 1 x 32
tiles of the whole axis that straddle two shards take the amax of both pieces
(:class:`~course_lib.precision.fp8_linear.Split` with ``contiguous=True``). Everything else (a
row's scale along unsplit features, a tile inside a shard) is local. The result: every rank's FP8
operands are one process's values, element for element; the partial sums of the contraction then
add up over tp (``g`` forward, ``f`` backward) in another order than one process's, so outputs and
gradients agree within fp32 rounding (bit-equal where nothing is summed across ranks).

Delayed scaling records the reduced amax, so its history is the same on every tp rank. Under
sequence parallelism the column layer's input is gathered before the GEMM and the row layer's
output reduce-scattered after it: the GEMMs see every token, as without it. Context parallelism
adds the token axis (``token_group``, set by ``fp8_linear.set_token_group``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.precision.fp8_linear import Fp8Linear, Split, fp8_linear
from course_lib.precision.recipes import AmaxHistory


def check_linear_kind(linear: nn.Linear) -> None:
    """Refuse a Linear subclass whose forward a tensor-parallel layer would silently replace by
    ``F.linear`` (torchao's Float8Linear: its FP8 would be lost). ``nn.Linear`` and the kit's
    Fp8Linear (whose recipe the layer takes over) pass."""
    if type(linear) is nn.Linear or isinstance(linear, Fp8Linear):
        return
    raise TypeError(f"a tensor-parallel layer cannot be cut from a {type(linear).__module__}."
                    f"{type(linear).__name__}: its forward would be replaced by F.linear (in high precision); "
                    f"cut it from a torch.nn.Linear or the kit's Fp8Linear (fp8.backend = 'kit')")


class ShardGemm:
    """Mixin of the column- and row-parallel layers: their local GEMM, in high precision or in FP8.
    ``split_axis``: the axis the weight is cut along ("out" for column-, "in" for row-parallel);
    the layer provides ``group`` (its tp group)."""

    split_axis: str
    fp8_recipe = None   # a precision.recipes.Recipe: the GEMMs run in FP8 (take_fp8_from)
    fp8_history = None  # delayed scaling: {role: AmaxHistory}, the same on every tp rank
    token_group = None  # context parallelism: the ranks holding the other tokens (set_token_group)

    def take_fp8_from(self, linear: nn.Linear) -> None:
        """Run the GEMMs as ``linear`` does: its recipe when it is an Fp8Linear (a fresh amax history
        for delayed scaling), high precision otherwise."""
        check_linear_kind(linear)
        if isinstance(linear, Fp8Linear):
            self.fp8_recipe = linear.recipe
            self.fp8_history = ({role: AmaxHistory(linear.recipe.history) for role in linear.history}
                                if linear.history is not None else None)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` on this rank's shard: ``F.linear``, or FP8 with the scales of the
        split axis (and of the tokens under cp) reduced over the ranks that hold them."""
        if self.fp8_recipe is None:
            return F.linear(x, weight, bias)
        splits = {self.split_axis: Split(self.group, contiguous=True)}
        if self.token_group is not None:
            splits["tokens"] = Split(self.token_group)
        return fp8_linear(x, weight, bias, self.fp8_recipe, self.fp8_history, splits)
