"""Communication volume and time: ZeRO/DDP per step, ring collectives, tensor-parallel traffic,
and an alpha-beta time model fitted to measurements (lab 00).

Sources:
- Ring collectives (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention): with n ranks and a
  buffer of S bytes, each rank sends (n-1)/n S in a reduce-scatter or all-gather and 2(n-1)/n S in
  an all-reduce (= reduce-scatter + all-gather), in n-1 resp. 2(n-1) steps.
- ZeRO paper (Rajbhandari et al. 2020), Sec. 7: data parallelism and ZeRO stages 1-2 move 2 Psi
  elements per rank per step, stage 3 moves 3 Psi (parameters gathered in forward and backward).
- Megatron tensor parallelism (Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022, Sec. 4.2.2):
  two all-reduces of the s x b x h activation per layer in forward and two in backward; sequence
  parallelism swaps each for an all-gather + reduce-scatter pair of the same volume.
- Ring attention (Liu et al. 2023, context parallelism): K/V blocks travel the ring, cp-1 hops
  forward, K/V plus their gradient accumulators cp-1 hops backward.
- Alpha-beta model (Hockney 1994): time = alpha + bytes / bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from course_lib.validate import check_bool, check_choice, check_count, check_int, check_number

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")

# (collective, count) moved per step; each entry is one pass over all Psi parameters.
_STRATEGY_COLLECTIVES = {
    "ddp": (("reduce-scatter", 1), ("all-gather", 1)),  # a ring all-reduce of the gradients
    "zero1": (("reduce-scatter", 1), ("all-gather", 1)),  # grads reduce-scattered, updated params gathered
    "zero2": (("reduce-scatter", 1), ("all-gather", 1)),
    "zero3": (("reduce-scatter", 1), ("all-gather", 2)),  # params gathered for forward and for backward
}


def _ring_fraction(collective: str, n_ranks: int | None) -> float:
    """Fraction of the full buffer one rank sends: (n-1)/n per phase; 1 per phase when n is None."""
    phase = 1.0 if n_ranks is None else (n_ranks - 1) / n_ranks
    return 2 * phase if collective == "all-reduce" else phase


def ring_steps(collective: str, n_ranks: int) -> int:
    """Latency-bound steps of a ring collective: 2(n-1) for all-reduce, n-1 otherwise."""
    check_choice("collective", collective, COLLECTIVES)
    check_int("n_ranks", n_ranks, 1)
    return (2 if collective == "all-reduce" else 1) * (n_ranks - 1)


def ring_bytes_per_rank(collective: str, size_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends in a ring `collective` over a buffer of `size_bytes` (the full,
    unsharded tensor: the all-reduce buffer, reduce-scatter input, all-gather output).

    all-reduce 2(n-1)/n S; reduce-scatter and all-gather (n-1)/n S. Bytes per rank (float).
    """
    check_choice("collective", collective, COLLECTIVES)
    check_number("size_bytes", size_bytes, 0)
    check_int("n_ranks", n_ranks, 1)
    return _ring_fraction(collective, n_ranks) * size_bytes


@dataclass(frozen=True)
class CommVolume:
    """Elements (not bytes) each rank sends per optimizer step, and the collectives behind them."""

    elements_per_rank: float
    collectives: tuple
    strategy: str
    world_size: int | None
    unit: str = "elements sent per rank per step"

    def bytes_per_rank(self, bytes_per_element: float = 2) -> float:
        """The volume in bytes (2 for bf16/fp16 gradients and parameters, 4 for fp32)."""
        check_number("bytes_per_element", bytes_per_element, 0, lo_open=True)
        return self.elements_per_rank * bytes_per_element


def comm_elements_per_step(num_params, strategy: str, *, world_size: int | None = None) -> CommVolume:
    """Elements each data-parallel rank sends per step for "ddp" | "zero1" | "zero2" | "zero3".

    With `world_size=None` the large-N form of the ZeRO paper (Sec. 7): 2 Psi for ddp/zero1/zero2,
    3 Psi for zero3. With a world size n the exact ring factor (n-1)/n per collective pass.
    Gradient accumulation does not change it (one synchronisation per optimizer step), except that
    ZeRO-3 re-gathers parameters for every micro-batch (multiply its all-gathers accordingly).
    """
    check_count("num_params", num_params)
    check_choice("strategy", strategy, STRATEGIES)
    if world_size is not None:
        check_int("world_size", world_size, 1)
    passes = _STRATEGY_COLLECTIVES[strategy]
    elements = sum(count * _ring_fraction(name, world_size) * num_params for name, count in passes)
    return CommVolume(float(elements), passes, strategy, world_size)


@dataclass(frozen=True)
class ZeroCommBytes:
    """Data-parallel / ZeRO traffic of one optimizer step, **bytes sent per rank**, split by
    collective: the gradient reduction and the parameter all-gathers."""

    reduce: float          # gradient all-reduce (DDP) or reduce-scatter (ZeRO), bytes per rank
    gather: float          # parameter all-gathers, bytes per rank
    scales: float          # FP8 scale traffic (an amax all-reduce per gathered tensor), bytes per rank
    unit: str = "bytes sent per rank per step"

    @property
    def total(self) -> float:
        """reduce + gather + scales, bytes per rank."""
        return self.reduce + self.gather + self.scales


def zero_comm_bytes_per_step(num_params, strategy: str, *, world_size: int, reduce_bytes_per_element: float = 2,
                             gather_bytes_per_element: float = 2, micro_batches: int = 1,
                             fp8_tensors: int = 0) -> ZeroCommBytes:
    """Bytes each data-parallel rank sends per optimizer step, gradients and parameters apart, so
    that each can travel in its own precision (ring collectives over ``world_size`` ranks).

    * reduce: DDP all-reduces the gradients, 2(n-1)/n Psi g; ZeRO-1/2/3 reduce-scatter them,
      (n-1)/n Psi g (g = ``reduce_bytes_per_element``: 2 bf16, 4 fp32);
    * gather: ZeRO-1/2 all-gather the updated weights once, (n-1)/n Psi w; ZeRO-3 (FSDP)
      all-gathers them for forward and again for backward of every micro-batch,
      2 x micro_batches x (n-1)/n Psi w (w = ``gather_bytes_per_element``: 2 for bf16, **1 for
      FP8 all-gather** - torchao's ``enable_fsdp_float8_all_gather``, Megatron's
      ``--fp8-param-gather``: the weight shard is cast to float8 before the gather);
    * scales: with FP8 gathers and tensorwise scaling each gathered weight needs its global
      amax: one fp32 all-reduce per weight tensor per gather (torchao's
      ``precompute_float8_dynamic_scale_for_fsdp`` batches them into one), 2(n-1)/n x 4 bytes x
      ``fp8_tensors`` per gather.

    ZeRO-2's per-micro-batch reduce-scatters (DeepSpeed) are the caller's: pass the step's
    reduce as micro_batches x one. Bytes per rank (floats)."""
    check_count("num_params", num_params)
    check_choice("strategy", strategy, STRATEGIES)
    check_int("world_size", world_size, 1)
    check_number("reduce_bytes_per_element", reduce_bytes_per_element, 0, lo_open=True)
    check_number("gather_bytes_per_element", gather_bytes_per_element, 0, lo_open=True)
    check_int("micro_batches", micro_batches, 1)
    check_int("fp8_tensors", fp8_tensors, 0)
    phase = (world_size - 1) / world_size
    reduce = (2 if strategy == "ddp" else 1) * phase * num_params * reduce_bytes_per_element
    gathers = 0 if strategy == "ddp" else (2 * micro_batches if strategy == "zero3" else 1)
    gather = gathers * phase * num_params * gather_bytes_per_element
    scales = gathers * 2 * phase * 4 * fp8_tensors
    return ZeroCommBytes(float(reduce), float(gather), float(scales))


@dataclass(frozen=True)
class TensorParallelComm:
    """Tensor-parallel activation traffic of one layer and one micro-batch (forward + backward)."""

    collectives: dict
    message_bytes: float
    bytes_per_rank: float
    unit: str = "bytes sent per rank per layer per micro-batch"


def tp_comm_bytes_per_layer(*, seq_len: int, micro_batch: int, d_model: int, tp: int,
                            bytes_per_element: float = 2, sequence_parallel: bool = False,
                            recompute: str = "none") -> TensorParallelComm:
    """Bytes each tensor-parallel rank sends for one transformer layer and micro-batch.

    Megatron layout: forward 2 all-reduces (after attention and after the MLP) of the
    s x b x h activation of `bytes_per_element` bytes, backward 2 more; with sequence parallelism
    each all-reduce becomes an all-gather + reduce-scatter of the same volume (Korthikanti Sec.
    4.2.2). Full recomputation repeats the forward's 2 (Korthikanti Sec. 5); selective
    recomputation repeats no communication. Ring volume per rank: 2(t-1)/t per all-reduce.
    """
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("d_model", d_model), ("tp", tp)):
        check_int(name, value, 1)
    check_number("bytes_per_element", bytes_per_element, 0, lo_open=True)
    check_bool("sequence_parallel", sequence_parallel)
    check_choice("recompute", recompute, ("none", "selective", "full"))
    message = seq_len * micro_batch * d_model * bytes_per_element
    n_allreduce = 4 + (2 if recompute == "full" else 0)
    if sequence_parallel:
        collectives = {"all-gather": n_allreduce, "reduce-scatter": n_allreduce}
    else:
        collectives = {"all-reduce": n_allreduce}
    sent = sum(count * ring_bytes_per_rank(name, message, tp) for name, count in collectives.items())
    return TensorParallelComm(collectives, float(message), float(sent))


@dataclass(frozen=True)
class ContextParallelComm:
    """Ring-attention (context-parallel) traffic of one attention layer and micro-batch, per rank."""

    forward_bytes: float
    backward_bytes: float
    bytes_per_rank: float
    peak_score_elements: float
    unit: str = "bytes sent per rank per layer per micro-batch"


def cp_comm_bytes_per_layer(*, seq_len: int, micro_batch: int, n_kv_heads: int, head_dim: int, cp: int,
                            v_head_dim: int | None = None, bytes_per_element: float = 2,
                            grad_bytes_per_element: float | None = None, n_heads: int | None = None,
                            layout: str = "contiguous") -> ContextParallelComm:
    """Bytes each context-parallel rank sends for one attention layer and micro-batch under ring
    attention (Liu et al. 2023; ``course_lib.parallel.context_parallel``, which is measured equal
    to this to the byte).

    Each rank holds C = seq_len / cp tokens. Only keys and values travel: with K + V =
    micro_batch x n_kv_heads x C x (head_dim + v_head_dim) x bytes_per_element, the forward
    sends its K/V block cp-1 times, the backward sends K/V again plus the dK/dV accumulators
    (``grad_bytes_per_element``, default max(e, 4): accumulated in at least fp32):
    forward (cp-1)(K+V), backward (cp-1)(K+V)(1 + g/e). The causal mask saves compute, not
    traffic. ``peak_score_elements``: the largest score block a rank holds,
    micro_batch x n_heads x (C/p)^2 with p = 1 piece per rank ("contiguous") or 2 ("zigzag"),
    against micro_batch x n_heads x seq_len^2 without context parallelism.
    """
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim), ("cp", cp)):
        check_int(name, value, 1)
    check_number("bytes_per_element", bytes_per_element, 0, lo_open=True)
    check_choice("layout", layout, ("contiguous", "zigzag"))
    pieces = 1 if layout == "contiguous" else 2
    if seq_len % (pieces * cp):
        raise ValueError(f"seq_len ({seq_len}) must be divisible by {'2 x ' if pieces == 2 else ''}cp "
                         f"({pieces * cp}) for the {layout} layout")
    v_head_dim = head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, 1)
    n_heads = n_kv_heads if n_heads is None else check_int("n_heads", n_heads, 1)
    g = max(bytes_per_element, 4) if grad_bytes_per_element is None else grad_bytes_per_element
    check_number("grad_bytes_per_element", g, 0, lo_open=True)
    chunk = seq_len // cp
    kv_elements = micro_batch * n_kv_heads * chunk * (head_dim + v_head_dim)
    forward = (cp - 1) * kv_elements * bytes_per_element
    backward = (cp - 1) * kv_elements * (bytes_per_element + g)
    piece = chunk // pieces
    return ContextParallelComm(float(forward), float(backward), float(forward + backward),
                               float(micro_batch * n_heads * piece * piece))


@dataclass(frozen=True)
class AlphaBetaFit:
    """A fitted time model: seconds = alpha_s + seconds_per_byte x x, where x is the message size
    (collective=None) or the ring bytes each rank sends (then 1/seconds_per_byte is NCCL's "bus
    bandwidth"). alpha_s is the fixed cost of one call (all its steps), in seconds."""

    alpha_s: float
    seconds_per_byte: float
    r_squared: float
    n_points: int
    collective: str | None = None
    n_ranks: int | None = None

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """1 / seconds_per_byte in bytes/s (inf when the fit found no size dependence)."""
        return math.inf if self.seconds_per_byte == 0 else 1.0 / self.seconds_per_byte

    def predict(self, size_bytes: float) -> float:
        """Predicted seconds for one call on a message of `size_bytes` bytes."""
        check_number("size_bytes", size_bytes, 0)
        x = size_bytes if self.collective is None else ring_bytes_per_rank(self.collective, size_bytes, self.n_ranks)
        return self.alpha_s + self.seconds_per_byte * x


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float], *,
                   collective: str | None = None, n_ranks: int | None = None,
                   weighting: str = "relative") -> AlphaBetaFit:
    """Least-squares fit of seconds = alpha + beta x with alpha, beta >= 0 (a latency or a byte
    time below zero is not physical; the constrained optimum then lies on that bound).

    `sizes_bytes` are message sizes in bytes, `seconds` the measured time per call. With
    `collective` and `n_ranks`, x is the ring bytes each rank sends, so 1/beta is the bus
    bandwidth comparable across world sizes; otherwise x is the message size (algorithm
    bandwidth). Needs at least two distinct sizes.

    `weighting="relative"` (default) minimises squared *relative* errors (weights 1/seconds^2):
    timings sweep several orders of magnitude, and an absolute fit lets the largest message's
    noise swamp every small message, so it reports a latency of zero. `"absolute"` is ordinary
    least squares. `r_squared` is computed with the same weights. Returns AlphaBetaFit.
    """
    check_choice("weighting", weighting, ("relative", "absolute"))
    xs_in, ys = list(sizes_bytes), list(seconds)
    if len(xs_in) != len(ys):
        raise ValueError(f"sizes_bytes and seconds must have the same length, got {len(xs_in)} and {len(ys)}")
    for i, (x, y) in enumerate(zip(xs_in, ys)):
        check_number(f"sizes_bytes[{i}]", x, 0)
        check_number(f"seconds[{i}]", y, 0, lo_open=weighting == "relative")
    if len(set(xs_in)) < 2:
        raise ValueError("sizes_bytes must contain at least two distinct sizes to fit alpha and beta")
    if collective is not None or n_ranks is not None:
        check_choice("collective", collective, COLLECTIVES)
        check_int("n_ranks", n_ranks, 2)
        xs = [ring_bytes_per_rank(collective, x, n_ranks) for x in xs_in]
    else:
        xs = [float(x) for x in xs_in]
    ws = [1.0 / (y * y) for y in ys] if weighting == "relative" else [1.0] * len(ys)
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    beta = sxy / sxx
    alpha = my - beta * mx
    if alpha < 0 or beta < 0:
        # Two-parameter non-negative least squares: the optimum lies on one of the bounds.
        through_origin = (0.0, max(0.0, sum(w * x * y for w, x, y in zip(ws, xs, ys))
                                   / sum(w * x * x for w, x in zip(ws, xs))))
        flat = (my, 0.0)
        alpha, beta = min((through_origin, flat), key=lambda ab: _sse(ab, xs, ys, ws))
    sst = sum(w * (y - my) ** 2 for w, y in zip(ws, ys))
    sse = _sse((alpha, beta), xs, ys, ws)
    r2 = 1.0 - sse / sst if sst > 0 else (1.0 if sse == 0 else 0.0)
    return AlphaBetaFit(alpha, beta, r2, len(xs), collective, n_ranks)


def _sse(ab: tuple[float, float], xs: list[float], ys: list[float], ws: list[float]) -> float:
    a, b = ab
    return sum(w * (y - a - b * x) ** 2 for w, x, y in zip(ws, xs, ys))


def collective_time(collective: str, size_bytes: float, n_ranks: int, *, alpha_s: float,
                    bandwidth_bytes_per_s: float) -> float:
    """Seconds for one ring collective: steps x alpha_s + ring bytes per rank / bandwidth.

    `alpha_s` is the per-step latency and `bandwidth_bytes_per_s` the per-link (bus) bandwidth,
    e.g. a fit's alpha_s / ring_steps and bandwidth_bytes_per_s from `fit_alpha_beta`.
    """
    check_number("alpha_s", alpha_s, 0)
    check_number("bandwidth_bytes_per_s", bandwidth_bytes_per_s, 0, lo_open=True)
    latency = ring_steps(collective, n_ranks) * alpha_s
    return latency + ring_bytes_per_rank(collective, size_bytes, n_ranks) / bandwidth_bytes_per_s
