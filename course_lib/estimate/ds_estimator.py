"""DeepSpeed's own model-state memory estimator, reproduced without importing DeepSpeed or torch.

Source: `estimate_zero2_model_states_mem_needs` in deepspeed/runtime/zero/stage_1_and_2.py and
`estimate_zero3_model_states_mem_needs` in deepspeed/runtime/zero/stage3.py (read in DeepSpeed
0.19.8; the tests compare against the installed functions when DeepSpeed imports). Re-derived
from that source, including its `int()` truncations, so the numbers agree to the byte.

Things the DeepSpeed docs do not say (or say wrongly):

- The `_all_cold` / `_all_live` printers divide by 2**30 but label the result "GB": their "GB"
  is GiB. Format our bytes with `units.format_bytes(x, "GiB")` to compare with their printout.
- The ZeRO-2 docs example (t5-3b, 8 GPUs: "15.93GB" per GPU without offload) comes from an older
  formula (4 + 16/n_gpus bytes/param); the current code gives 2 + 18/n_gpus (11.29 GiB there).
- The CPU column is per node (it scales with GPUs per node), not per CPU.
- The ZeRO-3 GPU figure includes 4 bytes x `largest_layer_params` for gathering the biggest layer.
"""

from __future__ import annotations

from typing import NamedTuple

from course_lib.validate import check_bool, check_count, check_int, check_number


class DeepSpeedEstimate(NamedTuple):
    """DeepSpeed's estimate, both in **bytes**: per GPU, and per node of CPU RAM."""

    gpu_bytes_per_gpu: int
    cpu_bytes_per_node: int


def _check_common(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor) -> None:
    check_count("total_params", total_params)
    check_int("num_gpus_per_node", num_gpus_per_node, 1)
    check_int("num_nodes", num_nodes, 1)
    check_number("additional_buffer_factor", additional_buffer_factor, 0, lo_open=True)


def deepspeed_zero2_estimate(total_params, *, num_gpus_per_node: int = 1, num_nodes: int = 1,
                             offload_optimizer: bool = False,
                             additional_buffer_factor: float = 1.5) -> DeepSpeedEstimate:
    """ZeRO-1/2 model-state memory as DeepSpeed estimates it, in bytes.

    Without offload each GPU holds fp16/bf16 params (2 B/param) plus 18 B/param sharded over all
    GPUs (fp16 grads 2 + fp32 grads 4 + fp32 params 4 + Adam 8); the CPU needs 4 B/param per GPU
    process to load the model, times `additional_buffer_factor`. With `offload_optimizer` the GPU
    keeps only the 2 B/param weights and the CPU holds max(4 x n_gpus, 16) B/param x factor.
    Returns DeepSpeedEstimate(gpu_bytes_per_gpu, cpu_bytes_per_node).
    """
    _check_common(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    check_bool("offload_optimizer", offload_optimizer)
    total_gpus = num_nodes * num_gpus_per_node
    if offload_optimizer:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return DeepSpeedEstimate(gpu_bytes_per_gpu=int(gpu), cpu_bytes_per_node=int(cpu))


def deepspeed_zero3_estimate(total_params, largest_layer_params, *, num_gpus_per_node: int = 1,
                             num_nodes: int = 1, offload_param: bool = False,
                             offload_optimizer: bool = False, zero_init: bool = True,
                             additional_buffer_factor: float = 1.5) -> DeepSpeedEstimate:
    """ZeRO-3 model-state memory as DeepSpeed estimates it, in bytes.

    Every GPU needs 4 B x `largest_layer_params` to gather the largest layer. Without offload it
    also holds 18 B/param sharded over all GPUs; `offload_optimizer` keeps only the 2 B/param
    fp16 shard on the GPU (16 B/param x factor / num_nodes on the CPU), and `offload_param` too
    moves that to the CPU (18 B/param x factor / num_nodes). `zero_init=False` (model built on
    the CPU, then partitioned) needs at least 4 B/param per GPU process on the CPU.

    DeepSpeed's estimator has no row for `offload_param=True` without `offload_optimizer=True`
    (its function silently ignores `offload_param` there), so that combination is a ValueError.
    Returns DeepSpeedEstimate(gpu_bytes_per_gpu, cpu_bytes_per_node).
    """
    _check_common(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    check_count("largest_layer_params", largest_layer_params)
    if largest_layer_params > total_params:
        raise ValueError(f"largest_layer_params must be <= total_params ({total_params}), "
                         f"got {largest_layer_params}")
    for name, value in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer),
                        ("zero_init", zero_init)):
        check_bool(name, value)
    if offload_param and not offload_optimizer:
        raise ValueError("offload_param=True requires offload_optimizer=True: DeepSpeed's estimator "
                         "models offload_param only together with offload_optimizer")
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if offload_optimizer and offload_param:
        gpu = largest_layer_memory
        # Same operation order as DeepSpeed, so the float rounding (and the int()) agree exactly.
        if zero_init:
            cpu = total_params * 18 * gpus_factor * additional_buffer_factor
        else:
            cpu = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
    elif offload_optimizer:
        gpu = largest_layer_memory + int(2 * total_params / total_gpus)
        if zero_init:
            cpu = total_params * 16 * gpus_factor * additional_buffer_factor
        else:
            cpu = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer_params if zero_init else total_params
        cpu = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return DeepSpeedEstimate(gpu_bytes_per_gpu=int(gpu), cpu_bytes_per_node=int(cpu))
