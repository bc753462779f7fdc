"""Peak dense FLOP/s and memory of common accelerators, each with its source.

All FLOP/s are **dense** (no 2:4 structured sparsity). NVIDIA's Hopper datasheets print the
sparse figure with a footnote; the dense peak is half of it, which is what MFU must divide by
(PaLM Appendix B, Llama 3 paper Sec. 3.3). `None` means the format has no matrix-unit support on
that chip. Memory: datasheets print "80GB", but HBM capacities are binary - an A100 80GB has
81,920 MiB = 80 GiB - so the table stores the printed number as GiB (`memory_gib`). What a
program can allocate is less (an H100 80GB shows 81,559 MiB in `nvidia-smi`, an H200 143,771 MiB
for its "141GB", and the CUDA context takes more): measure it with `torch.cuda.mem_get_info`.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.validate import check_choice

DTYPES = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: peak dense FLOP/s per precision (None = unsupported) and memory in GiB."""

    name: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None
    memory_gib: float
    source: str

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes (memory_gib x 2**30), before anything is allocated."""
        return self.memory_gib * 2**30

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Peak dense FLOP/s for `dtype` ("bf16", "fp16", "tf32", "fp32"); ValueError if unsupported."""
        check_choice("dtype", dtype, DTYPES)
        value = getattr(self, dtype)
        if value is None:
            supported = [d for d in DTYPES if getattr(self, d) is not None]
            raise ValueError(f"{self.name} has no {dtype} matrix throughput; supported dtypes: {supported}")
        return value


_NV = "NVIDIA {} datasheet"
ACCELERATORS: dict[str, Accelerator] = {
    "v100-sxm2-32gb": Accelerator(
        "NVIDIA V100 SXM2 32GB", None, 125e12, None, 15.7e12, 32,
        _NV.format("Tesla V100") + ": Tensor Performance 125 TFLOPS (fp16), Single-Precision 15.7 TFLOPS"),
    "a100-sxm4-40gb": Accelerator(
        "NVIDIA A100 SXM4 40GB", 312e12, 312e12, 156e12, 19.5e12, 40,
        _NV.format("A100") + ": BF16/FP16 Tensor Core 312, TF32 156, FP32 19.5 TFLOPS (dense)"),
    "a100-sxm4-80gb": Accelerator(
        "NVIDIA A100 SXM4 80GB", 312e12, 312e12, 156e12, 19.5e12, 80,
        _NV.format("A100") + ": BF16/FP16 Tensor Core 312, TF32 156, FP32 19.5 TFLOPS (dense)"),
    "h100-sxm5-80gb": Accelerator(
        "NVIDIA H100 SXM5 80GB", 989.5e12, 989.5e12, 494.5e12, 67e12, 80,
        _NV.format("H100") + " (SXM): BF16/FP16 1,979 and TF32 989 TFLOPS with sparsity, halved; FP32 67"),
    "h100-pcie-80gb": Accelerator(
        "NVIDIA H100 PCIe 80GB", 756.5e12, 756.5e12, 378e12, 51e12, 80,
        _NV.format("H100") + " (PCIe): BF16/FP16 1,513 and TF32 756 TFLOPS with sparsity, halved; FP32 51"),
    "h800-sxm5-80gb": Accelerator(
        "NVIDIA H800 SXM5 80GB", 989.5e12, 989.5e12, 494.5e12, 67e12, 80,
        "NVIDIA H800 (SXM), the H100's export variant: the same tensor cores (BF16/FP16 1,979 and TF32 989 TFLOPS with "
        "sparsity, halved; FP32 67), 80GB, NVLink cut to 400 GB/s (DeepSeek-V3, arXiv 2412.19437, Sec. 3.1 and 3.2.2)"),
    "h200-sxm-141gb": Accelerator(
        "NVIDIA H200 SXM 141GB", 989.5e12, 989.5e12, 494.5e12, 67e12, 141,
        _NV.format("H200") + " (SXM): BF16/FP16 1,979 and TF32 989 TFLOPS with sparsity, halved; FP32 67; 141GB"),
    "tpu-v4": Accelerator(
        "Google TPU v4", 275e12, None, None, None, 32,
        "PaLM (Chowdhery et al. 2022) Appendix B: 275 peak TFLOP/s bf16; Google Cloud TPU v4 docs: 32 GiB HBM"),
    "mi250x": Accelerator(
        "AMD Instinct MI250X", 383e12, 383e12, None, 95.7e12, 128,
        "AMD Instinct MI250X datasheet: FP16/BF16 383 TFLOPS, FP32 Matrix 95.7 TFLOPS, 128GB HBM2e"),
    "mi300x": Accelerator(
        "AMD Instinct MI300X", 1307.4e12, 1307.4e12, 653.7e12, 163.4e12, 192,
        "AMD Instinct MI300X datasheet: FP16/BF16 1307.4, TF32 653.7, FP32 Matrix 163.4 TFLOPS (dense), 192GB"),
}


def accelerator(name: str) -> Accelerator:
    """Look up an accelerator by key (see ACCELERATORS); ValueError listing the keys otherwise."""
    check_choice("name", name, ACCELERATORS)
    return ACCELERATORS[name]
