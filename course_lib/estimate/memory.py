"""Bytes of model state (parameters, gradients, optimizer state) per rank, with ZeRO sharding.

The literature disagrees on bytes per parameter, so the recipe is an explicit, named argument:

| recipe | params + grads + master + optimizer | B/param | source |
| --- | --- | --- | --- |
| ``mixed-adam`` | 2 + 2 + 4 + 8 | 16 | ZeRO paper (Rajbhandari et al. 2020), Sec. 3.1: (2 + 2 + K)Psi, K = 12 |
| ``mixed-adam-fp32-grads`` | 2 + (2+4) + 4 + 8 | 20 | Ultra-Scale Playbook: fp32 gradient accumulation adds 4N |
| ``fp32-adam`` | 4 + 4 + 0 + 8 | 16 | Ultra-Scale Playbook: full precision, m_params + m_grad + m_opt |
| ``fp32-sgd-momentum`` | 4 + 4 + 0 + 4 | 12 | one fp32 momentum buffer (torch.optim.SGD, momentum > 0) |
| ``seed`` | 2 + 2 + 0 + 8 | 12 | a widely quoted rule of thumb; it leaves out the fp32 master copy |
| ``fp8-params-adam`` | 1 + 2 + 4 + 8 | 15 | FP8 weights kept and gathered in FP8 (Megatron ``--fp8-param-gather``), bf16 grads, fp32 master + Adam |

FP8 *compute* alone (torchao's float8 linears, Transformer Engine without ``--fp8-param-gather``)
keeps the weights in bf16/fp32 and casts them per matmul: the model state is the bf16 recipe's;
the saving is in the all-gathers (``comm.zero_comm_bytes_per_step`` with a 1-byte gather) and in
the activations the FP8 linears save.

ZeRO stages shard over the data-parallel degree `dp` exactly as the ZeRO paper's Figure 1:
stage 1 shards the optimizer state (master weights and moments, the paper's K), stage 2 also the
gradients, stage 3 also the parameters. The division is exact (no padding to alignment, no
communication buffers), so results are fractional bytes; real engines add buckets and padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.validate import check_choice, check_count, check_int, check_number
from .units import format_bytes


@dataclass(frozen=True)
class PrecisionRecipe:
    """Bytes per parameter of each model-state component.

    - `param_bytes`: the weights the forward pass reads (2 for bf16/fp16, 4 for fp32);
    - `grad_bytes`: gradients, including any fp32 accumulation buffer;
    - `master_bytes`: an fp32 master copy of the weights kept by the optimizer (mixed precision);
    - `optimizer_bytes`: optimizer moments (Adam: fp32 momentum + variance = 8).
    """

    param_bytes: float
    grad_bytes: float
    master_bytes: float
    optimizer_bytes: float
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes"):
            check_number(field, getattr(self, field), 0)

    @property
    def bytes_per_param(self) -> float:
        """Total bytes of model state per parameter without sharding."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


RECIPES: dict[str, PrecisionRecipe] = {
    "mixed-adam": PrecisionRecipe(
        2, 2, 4, 8, "mixed-adam",
        "Rajbhandari et al. 2020 (ZeRO), Sec. 3.1: fp16 params 2 + fp16 grads 2 + K=12 "
        "(fp32 params, momentum, variance)"),
    "mixed-adam-fp32-grads": PrecisionRecipe(
        2, 6, 4, 8, "mixed-adam-fp32-grads",
        "Ultra-Scale Playbook (Tazi et al. 2025), memory of weights/grads/optimizer: bf16 2+2, fp32 params 4, "
        "Adam 8, plus 4 for fp32 gradient accumulation = 20"),
    "fp32-adam": PrecisionRecipe(
        4, 4, 0, 8, "fp32-adam", "Ultra-Scale Playbook: full precision m_params 4 + m_grad 4 + m_opt (4+4) = 16"),
    "fp32-sgd-momentum": PrecisionRecipe(
        4, 4, 0, 4, "fp32-sgd-momentum", "fp32 weights and grads plus one fp32 momentum buffer (torch.optim.SGD)"),
    "bf16-adam-no-master": PrecisionRecipe(
        2, 2, 0, 8, "bf16-adam-no-master", "a widely quoted 2 + 2 + 8 rule of thumb; omits the fp32 master copy the ZeRO paper counts"),
    "fp8-params-adam": PrecisionRecipe(
        1, 2, 4, 8, "fp8-params-adam",
        "FP8 (E4M3) weights stored and all-gathered in FP8 (Megatron-LM --fp8-param-gather with Transformer "
        "Engine; torchao's FSDP float8 all-gather moves the same 1 byte per parameter): params 1 + bf16 grads 2 + "
        "fp32 master 4 + Adam 8 = 15"),
}


def resolve_recipe(recipe) -> PrecisionRecipe:
    """A PrecisionRecipe from a recipe name (see RECIPES) or an existing PrecisionRecipe."""
    if isinstance(recipe, PrecisionRecipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a recipe name or a PrecisionRecipe, got {type(recipe).__name__}")
    check_choice("recipe", recipe, RECIPES)
    return RECIPES[recipe]


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state memory **per rank, in bytes** (floats: ZeRO divides exactly, without padding).

    `optimizer` is what the ZeRO paper calls the optimizer state (K*Psi): the fp32 master weights
    plus the moments; the two parts are also given separately.
    """

    params: float
    grads: float
    master_weights: float
    optimizer_states: float
    num_params: float
    recipe: str
    zero_stage: int
    dp: int
    unit: str = "bytes per rank"

    @property
    def optimizer(self) -> float:
        """Master weights + optimizer moments, bytes per rank."""
        return self.master_weights + self.optimizer_states

    @property
    def total(self) -> float:
        """params + grads + optimizer, bytes per rank."""
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        """Plain dict (bytes per rank) for JSON output."""
        return {
            "unit": self.unit, "recipe": self.recipe, "zero_stage": self.zero_stage, "dp": self.dp,
            "num_params": self.num_params, "params": self.params, "grads": self.grads,
            "master_weights": self.master_weights, "optimizer_states": self.optimizer_states,
            "optimizer": self.optimizer, "total": self.total,
        }

    def format(self, unit: str = "GiB", digits: int = 2) -> str:
        """One line, every number with its unit, e.g. for a notebook print."""
        def fmt(x: float) -> str:
            return format_bytes(x, unit, digits)
        return (f"params {fmt(self.params)}, grads {fmt(self.grads)}, optimizer {fmt(self.optimizer)}, "
                f"total {fmt(self.total)} per rank (ZeRO-{self.zero_stage}, dp={self.dp}, recipe {self.recipe})")


def model_state_bytes(num_params, *, recipe="mixed-adam", zero_stage: int = 0, dp: int = 1,
                      tp: int = 1, tp_replicated=0) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state held by **one rank**.

    Follows the ZeRO paper (Rajbhandari et al. 2020, Sec. 5 and Figure 1): with Psi parameters,
    data-parallel degree Nd and K bytes of optimizer state per parameter,
    stage 0: (2 + 2 + K)Psi; stage 1: 2Psi + 2Psi + K*Psi/Nd; stage 2: 2Psi + (2 + K)Psi/Nd;
    stage 3: (2 + 2 + K)Psi/Nd - here with the recipe's byte counts in place of 2, 2 and K.
    `num_params` is the parameter count the data-parallel group replicates (for tp/pp, pass the
    parameters on one rank, e.g. `ModelShape.params_on_busiest_rank`). Returns ModelStateBytes.

    Or let the estimator do the tensor-parallel split: `tp` > 1 with `num_params` the whole model and
    `tp_replicated` of those parameters held whole by every TP rank (norms, row-parallel biases,
    and a position table the TP plan does not shard); each TP rank then holds
    ``(num_params - tp_replicated) / tp + tp_replicated``, which ZeRO shards over `dp` as above
    (FSDP x TP: every TP shard cut again over the dp ranks). `ModelStateBytes.num_params` is
    that per-TP-rank count.
    """
    check_count("num_params", num_params)
    check_int("zero_stage", zero_stage, 0, 3)
    check_int("dp", dp, 1)
    check_int("tp", tp, 1)
    check_count("tp_replicated", tp_replicated)
    if tp_replicated > num_params:
        raise ValueError(f"tp_replicated ({tp_replicated}) cannot exceed num_params ({num_params})")
    if tp > 1:
        num_params = (num_params - tp_replicated) / tp + tp_replicated
    r = resolve_recipe(recipe)
    shard = 1.0 / dp
    return ModelStateBytes(
        params=num_params * r.param_bytes * (shard if zero_stage >= 3 else 1.0),
        grads=num_params * r.grad_bytes * (shard if zero_stage >= 2 else 1.0),
        master_weights=num_params * r.master_bytes * (shard if zero_stage >= 1 else 1.0),
        optimizer_states=num_params * r.optimizer_bytes * (shard if zero_stage >= 1 else 1.0),
        num_params=num_params, recipe=r.name, zero_stage=zero_stage, dp=dp,
    )


@dataclass(frozen=True)
class StepPeak:
    """Where one training step peaks, bytes per rank: at the **start of backward** (weights and
    optimizer state, no gradients yet, every saved activation, the output layer's transients) or
    in the **optimizer step** (all model states plus the optimizer's temporaries)."""

    backward_start: float
    optimizer_step: float
    unit: str = "bytes per rank"

    @property
    def peak(self) -> float:
        """The larger of the two moments, bytes per rank."""
        return max(self.backward_start, self.optimizer_step)

    @property
    def where(self) -> str:
        """"backward start" or "optimizer step": which moment sets the peak."""
        return "backward start" if self.backward_start >= self.optimizer_step else "optimizer step"


#: How a strategy holds the gradient between micro-batches, for ``training_step_peak_bytes``:
#: "local" - each rank sums its micro-batches' gradients into full, unsharded tensors and
#: communicates once after the last (torch DDP under ``no_sync``, this kit's zero1/zero2, FSDP2
#: with gradient sync off); "sharded" - every micro-batch's gradient is reduce-scattered at once
#: and only the rank's shard is accumulated (DeepSpeed ZeRO-2/3, FSDP2's default).
GRAD_ACCUMULATION = ("local", "sharded")


def engine_accumulation(zero_stage: int) -> str:
    """How the engines the planner writes for accumulate at ``zero_stage``: "local" for stages 0-1
    (DDP and ZeRO-1 reduce once per step), "sharded" for 2-3 (DeepSpeed reduce-scatters every
    micro-batch). The kit's own zero2 / fsdp strategies accumulate locally: pass "local" for them."""
    check_int("zero_stage", zero_stage, 0, 3)
    return "sharded" if zero_stage >= 2 else "local"


def accumulated_grad_bytes(states: ModelStateBytes, accumulation: str = "local") -> float:
    """Bytes per rank of the gradient sum that lives between micro-batches (from the second
    micro-batch's backward on): the full local gradients for ``accumulation = "local"``
    (whatever the ZeRO stage keeps after the step's reduce-scatter), the shard the stage keeps
    (``states.grads``) for "sharded"."""
    check_choice("accumulation", accumulation, GRAD_ACCUMULATION)
    if accumulation == "sharded":
        return states.grads
    full = states.grads * (states.dp if states.zero_stage >= 2 else 1)
    return full


def training_step_peak_bytes(states: ModelStateBytes, activation_bytes: float, *, transient_bytes: float = 0.0,
                             optimizer_temp_bytes: float = 0.0, grad_accum: int = 1,
                             accumulation: str = "local", reduce_bucket_bytes: float = 0.0) -> StepPeak:
    """The peak allocated bytes of one training step per rank, from its parts.

    ``states``: :func:`model_state_bytes`; ``activation_bytes``: saved activations (e.g.
    ``activation_bytes_first_stage``); ``transient_bytes``: the output layer's gradients at the start
    of backward (``activations.output_backward_transient_bytes``); ``optimizer_temp_bytes``: what
    the optimizer step allocates while it runs (0 by default; see below).

    **Gradients at the start of backward.** With one micro-batch per step and ``zero_grad(
    set_to_none=True)`` there are none yet, so that moment counts ``states.total - states.grads``.
    With ``grad_accum`` > 1 (micro-batches per optimizer step; pipeline micro-batches too) the
    gradients summed so far are live when the second and later micro-batches start their backward:
    :func:`accumulated_grad_bytes` of ``accumulation`` ("local": full tensors until the step's one
    reduce, as DDP, this kit's ZeRO-1/2 and FSDP2 without sync do; "sharded": the ZeRO shard, as
    DeepSpeed's ZeRO-2/3 reduce-scatter every micro-batch). ``reduce_bucket_bytes``: the bucket a
    bucketed reduce-scatter fills during backward (DeepSpeed ZeRO-2's ``reduce_bucket_size``
    elements times the gradient's bytes), live on top of it.

    Measured (fp32, GPT-2 small and a Llama-style 0.3B model, micro-batch 1-16, recompute
    none/selective/full, on an H100; benchmarks/RESULTS-gpu.md): within 3% of
    ``torch.cuda.max_memory_allocated`` in 15 of 17 configurations (within 1% in 14), and within 8%
    in all. The two outliers are full recompute at micro-batch 1, where activations are small and
    the peak comes later in the step (0.16-0.23 GiB more; it varied between runs and was the same
    with fused and foreach AdamW). Under accumulation (H200, GPT-2 small, micro-batch 4, fp32,
    grad_accum 4 and 16): this kit's zero1 and zero2 within 1% with the live gradients, 8.7-8.8%
    short without them."""
    check_number("activation_bytes", activation_bytes, 0)
    check_number("transient_bytes", transient_bytes, 0)
    check_number("optimizer_temp_bytes", optimizer_temp_bytes, 0)
    check_int("grad_accum", grad_accum, 1)
    check_number("reduce_bucket_bytes", reduce_bucket_bytes, 0)
    live = accumulated_grad_bytes(states, accumulation) if grad_accum > 1 else 0.0
    return StepPeak(backward_start=states.total - states.grads + live + activation_bytes + transient_bytes
                    + reduce_bucket_bytes,
                    optimizer_step=states.total + optimizer_temp_bytes)
