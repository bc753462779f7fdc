"""What each lab needs from the machine, so ``course doctor`` can give a verdict per lab.

``needs`` is one of:

* ``"cpu"``: everything the lab teaches runs here on CPU with gloo;
* ``"cpu-standins"``: runs on CPU, but some parts use a stand-in (gloo for NCCL, bf16 for fp16,
  saved-tensor bytes for CUDA peak memory) and say so in the notebook;
* ``"gpu"``: the lab's point needs CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

NEEDS = ("cpu", "cpu-standins", "gpu")


@dataclass(frozen=True)
class LabInfo:
    """One lab: its file stem, title, what it needs and what a CPU run replaces."""

    name: str
    title: str
    needs: str
    standins: str = ""


LABS: dict[str, LabInfo] = {info.name: info for info in [
    LabInfo("00_orientation", "Orientation: ranks, collectives and the cost of talking",
            "cpu-standins", "gloo over loopback stands in for NCCL over NVLink/InfiniBand"),
    LabInfo("01_memory", "Where the memory goes", "cpu-standins",
            "saved-tensor byte counts stand in for CUDA peak memory"),
    LabInfo("02_flops_mfu", "FLOPs, MFU and time to train", "cpu-standins",
            "the CPU's measured matmul peak stands in for a GPU's datasheet peak"),
    LabInfo("03_mixed_precision", "Mixed precision", "cpu-standins",
            "fp16 loss scaling is shown with the CPU GradScaler; CUDA runs it at full speed"),
    LabInfo("04_checkpointing_accumulation",
            "Activation checkpointing, offloading and gradient accumulation", "cpu"),
    LabInfo("05_stability", "Training stability", "cpu"),
    LabInfo("06_schedules", "Learning-rate schedules", "cpu"),
    LabInfo("07_checkpoints", "Checkpointing and fault tolerance", "cpu"),
    LabInfo("08_data_parallel", "Data parallelism: DDP by hand, buckets and overlap", "cpu-standins",
            "gloo over loopback stands in for NCCL; CPU threads stand in for overlap on CUDA streams"),
    LabInfo("09_zero_fsdp_deepspeed", "ZeRO, FSDP and DeepSpeed", "cpu-standins",
            "gloo over loopback stands in for NCCL; CPU tensor bytes stand in for CUDA memory"),
    LabInfo("10_tensor_parallel", "Tensor and sequence parallelism", "cpu-standins",
            "gloo over loopback stands in for NCCL/NVLink; CPU tensor bytes stand in for CUDA memory"),
    LabInfo("11_pipeline_parallel", "Pipeline parallelism and 3D parallelism", "cpu-standins",
            "gloo over loopback stands in for NCCL; CPU timings stand in for GPU kernels"),
    LabInfo("12_finding_bottleneck", "Finding the bottleneck: profiling, utilization, MFU and hangs", "cpu-standins",
            "gloo over loopback stands in for NCCL; CPU operator timelines stand in for GPU kernels; psutil for NVML"),
    LabInfo("13_planning_launching", "Planning and launching a real job", "cpu-standins",
            "the plans are closed-form (no GPU needed); the launched job is the plan's TinyGPT on 4 CPU ranks (gloo)"),
    LabInfo("14_capstone", "Capstone: one distributed training run, end to end", "cpu-standins",
            "2 CPU ranks over gloo stand in for GPUs with NCCL; the GPU and SLURM commands are shown, not run"),
    # taught right after lab 11 (numbered last because it was added last)
    LabInfo("15_context_parallel", "Context parallelism: ring attention for long sequences (after lab 11)",
            "cpu-standins", "gloo over loopback stands in for NCCL; CPU tensor bytes stand in for CUDA memory; "
            "the ring's overlap on GPUs is estimated, not measured"),
    LabInfo("16_experts", "Experts: mixture-of-experts and expert parallelism (after lab 15)", "cpu-standins",
            "gloo over loopback stands in for NCCL all-to-all; a tiny MoE on CPU stands in for GPU experts; "
            "DeepSeek-V3's layout is computed, not run"),
]}


def verdict(info: LabInfo, *, has_cuda: bool) -> str:
    """A one-line verdict for ``info`` on a machine with or without CUDA."""
    if info.needs not in NEEDS:
        raise ValueError(f"needs must be one of {NEEDS}, got {info.needs!r} for {info.name}")
    if has_cuda or info.needs == "cpu":
        return "runs fully here"
    if info.needs == "cpu-standins":
        return f"runs with CPU stand-ins ({info.standins})"
    return "needs a GPU"
