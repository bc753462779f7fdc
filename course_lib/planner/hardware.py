"""GPU names an engineer types, and the links between GPUs, each number with its source.

Two tables:

* ``GPU_ALIASES``: friendly names ("a100-80gb", "h100") -> keys of
  :data:`course_lib.estimate.ACCELERATORS` (peak FLOP/s and memory live there, with sources).
* ``INTERCONNECTS``: per-GPU link bandwidth **in bytes per second, per direction**, inside a node
  (NVLink/NVSwitch or PCIe) and between nodes (the node's InfiniBand/Ethernet NICs divided by its
  GPUs, i.e. what one GPU's share of a ring gets when every GPU talks across nodes at once).

These are datasheet (nominal) numbers. NCCL's measured "bus bandwidth" is typically 70-90% of them;
the planner does not hide that in a fudge factor: pass ``--intra-node-gbps``/``--inter-node-gbps``
with what ``nccl-tests`` measured on your cluster to replace them.
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.estimate import ACCELERATORS

#: Friendly name -> ACCELERATORS key. Lower-case; "-sxm" spellings are the same chips.
GPU_ALIASES: dict[str, str] = {
    "a100": "a100-sxm4-80gb", "a100-80gb": "a100-sxm4-80gb", "a100-sxm-80gb": "a100-sxm4-80gb",
    "a100-40gb": "a100-sxm4-40gb", "a100-sxm-40gb": "a100-sxm4-40gb",
    "h100": "h100-sxm5-80gb", "h100-80gb": "h100-sxm5-80gb", "h100-sxm": "h100-sxm5-80gb",
    "h100-pcie": "h100-pcie-80gb", "h800": "h800-sxm5-80gb", "h800-80gb": "h800-sxm5-80gb",
    "h200": "h200-sxm-141gb", "h200-141gb": "h200-sxm-141gb",
    "v100": "v100-sxm2-32gb", "v100-32gb": "v100-sxm2-32gb",
}


def gpu_names() -> list[str]:
    """Every accepted --gpu value (aliases and the full ACCELERATORS keys), sorted."""
    return sorted(set(GPU_ALIASES) | set(ACCELERATORS))


def resolve_gpu(name: str) -> str | None:
    """The ACCELERATORS key for ``name`` (an alias or a key, any case); None when unknown."""
    key = name.strip().lower()
    if key in ACCELERATORS:
        return key
    return GPU_ALIASES.get(key)


@dataclass(frozen=True)
class Interconnect:
    """Per-GPU bandwidth in **bytes/s per direction**: inside a node and between nodes."""

    name: str
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    source: str


GB = 1e9  # link bandwidths are decimal (GB/s, Gb/s), unlike memory sizes (GiB)

INTERCONNECTS: dict[str, Interconnect] = {
    "a100-nvlink-hdr": Interconnect(
        "DGX A100-like: NVLink 3 + 8x HDR InfiniBand", 300 * GB, 8 * 200e9 / 8 / 8,
        "NVIDIA A100 datasheet: NVLink 600 GB/s per GPU (both directions -> 300 GB/s each way); "
        "DGX A100 user guide: 8x 200 Gb/s HDR InfiniBand per node for compute -> 25 GB/s per GPU"),
    "h100-nvlink-ndr": Interconnect(
        "DGX H100-like: NVLink 4 + 8x NDR InfiniBand", 450 * GB, 8 * 400e9 / 8 / 8,
        "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU (-> 450 GB/s each way); DGX H100 user guide: "
        "8x 400 Gb/s NDR ConnectX-7 per node -> 50 GB/s per GPU"),
    "h800-nvlink-ndr": Interconnect(
        "H800 nodes: NVLink at 400 GB/s + 8x NDR InfiniBand", 200 * GB, 8 * 400e9 / 8 / 8,
        "DeepSeek-V3 (arXiv 2412.19437) Sec. 3.1: H800 nodes of 8 GPUs on NVLink/NVSwitch, InfiniBand between "
        "nodes; H800 NVLink 400 GB/s per GPU (-> 200 GB/s each way); Sec. 3.2.2: IB 50 GB/s per GPU"),
    "pcie-100gbe": Interconnect(
        "PCIe Gen4 servers + one 100 GbE NIC per node", 32 * GB, 100e9 / 8 / 8,
        "PCIe 4.0 x16: 32 GB/s each way (PCI-SIG); 100 Gb/s Ethernet = 12.5 GB/s per node, "
        "shared by 8 GPUs -> 1.56 GB/s per GPU"),
}


def default_interconnect(gpu_key: str) -> str:
    """The preset a cluster of ``gpu_key`` GPUs most likely has (SXM boards come in NVLink nodes)."""
    if gpu_key.startswith("h800"):
        return "h800-nvlink-ndr"
    if gpu_key.startswith(("h100-sxm", "h200")):
        return "h100-nvlink-ndr"
    if gpu_key.startswith(("a100", "v100")):
        return "a100-nvlink-hdr"
    return "pcie-100gbe"
