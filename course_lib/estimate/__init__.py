"""Closed-form estimators: will it fit, how long will it take, what does it cost to talk.

Torch-free (standard library only), so labs, the CLI and the autograder can import it anywhere.
Every function documents its unit (bytes vs GiB, per rank vs total) and its source; where the
literature disagrees the assumption is an argument naming the source (recipe="mixed-adam" vs
"mixed-adam-fp32-grads", attention="eager" vs "flash", relative_to="ideal" vs "total", ...).

Modules: shapes (ModelShape, presets, parameter counts) - memory (model state, ZeRO) -
ds_estimator (DeepSpeed's estimator) - activations (Korthikanti et al.) - flops (FLOPs, MFU,
days) - hardware (peak FLOP/s table) - comm (collectives, ZeRO/TP traffic, alpha-beta) -
pipeline (bubble) - moe (mixture-of-experts: total vs active parameters, FLOPs, expert-parallel
all-to-all bytes, EP x expert-DP memory, routing spike) - units (GB vs GiB formatting) - cli
(`course estimate`).
"""

from .activations import (
    ActivationBreakdown,
    StageActivations,
    activation_breakdown_per_layer,
    activation_bytes_first_stage,
    activation_bytes_per_layer,
    first_stage_activation_breakdown,
    output_backward_transient_bytes,
)
from .comm import (
    AlphaBetaFit,
    CommVolume,
    ContextParallelComm,
    TensorParallelComm,
    collective_time,
    comm_elements_per_step,
    cp_comm_bytes_per_layer,
    fit_alpha_beta,
    ring_bytes_per_rank,
    ring_steps,
    tp_comm_bytes_per_layer,
    ZeroCommBytes,
    zero_comm_bytes_per_step,
)
from .ds_estimator import DeepSpeedEstimate, deepspeed_zero2_estimate, deepspeed_zero3_estimate
from .flops import flops_per_token, mfu, model_flops_per_iteration, palm_flops_per_token, training_days
from .hardware import ACCELERATORS, Accelerator, accelerator
from .memory import (GRAD_ACCUMULATION, RECIPES, ModelStateBytes, PrecisionRecipe, StepPeak, accumulated_grad_bytes,
                     engine_accumulation, model_state_bytes, resolve_recipe, training_step_peak_bytes)
from .moe import (MLA, MOE_PRESETS, AllToAllBytes, MoEShape, MoEStateBytes, RoutingSpike, alltoall_bytes_per_layer,
                  alltoall_bytes_per_token, expected_tokens_off_rank, expert_activation_bytes, expert_data_parallel,
                  moe_flops_per_token, moe_model_state_bytes, moe_preset, routing_spike)
from .pipeline import bubble_fraction
from .shapes import PRESETS, ModelShape, default_d_ff
from .units import BYTE_UNITS, bytes_to, format_bytes, format_seconds, format_si

__all__ = [
    "ACCELERATORS", "Accelerator", "ActivationBreakdown", "AlphaBetaFit", "BYTE_UNITS", "CommVolume", "ContextParallelComm",
    "DeepSpeedEstimate", "ModelShape", "ModelStateBytes", "PRESETS", "PrecisionRecipe", "RECIPES",
    "StageActivations", "StepPeak", "TensorParallelComm", "accelerator", "activation_breakdown_per_layer",
    "activation_bytes_first_stage", "activation_bytes_per_layer", "bubble_fraction", "bytes_to",
    "collective_time", "comm_elements_per_step", "cp_comm_bytes_per_layer", "deepspeed_zero2_estimate", "deepspeed_zero3_estimate",
    "default_d_ff", "first_stage_activation_breakdown", "fit_alpha_beta", "flops_per_token", "format_bytes", "format_seconds",
    "format_si", "mfu", "model_flops_per_iteration", "model_state_bytes", "output_backward_transient_bytes",
    "palm_flops_per_token",
    "resolve_recipe", "ring_bytes_per_rank", "ring_steps", "tp_comm_bytes_per_layer", "training_days",
    "training_step_peak_bytes", "accumulated_grad_bytes", "engine_accumulation", "GRAD_ACCUMULATION",
    "ZeroCommBytes", "zero_comm_bytes_per_step",
    "MLA", "MOE_PRESETS", "AllToAllBytes", "MoEShape", "MoEStateBytes", "RoutingSpike", "alltoall_bytes_per_layer",
    "alltoall_bytes_per_token", "expected_tokens_off_rank", "expert_activation_bytes", "expert_data_parallel",
    "moe_flops_per_token", "moe_model_state_bytes", "moe_preset", "routing_spike",
]
