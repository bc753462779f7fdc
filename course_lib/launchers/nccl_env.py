"""The NCCL environment block of a GPU job: ``export`` lines, each with a comment saying why.

Every value uses ``${VAR:-default}`` so a person can override it from the environment without
editing the script. CPU clusters get no block: gloo reads none of these variables.
"""
from __future__ import annotations

from course_lib.launchers.cluster import Cluster

# (variable, default, what it does): one comment line each in the generated script.
_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("NCCL_DEBUG", "WARN",
     "NCCL log level: WARN prints only problems; INFO shows the transport and interface it picked"),
    ("NCCL_IB_DISABLE", "0",
     "0 uses InfiniBand/RoCE when present; 1 forces TCP sockets (nodes without IB)"),
    ("NCCL_SOCKET_IFNAME", "^lo,docker",
     "network interfaces for NCCL's sockets; ^ excludes: never loopback or docker bridges"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
     "a failed or timed-out collective aborts the process instead of hanging, so torchrun can restart it"),
    ("TORCH_NCCL_BLOCKING_WAIT", "0",
     "0: errors come from the watchdog above (1 would block the host on every wait and cost speed)"),
    ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "600",
     "seconds the watchdog may be stuck before the rank is killed (the collective timeout is init_distributed's timeout_s)"),
)


def nccl_exports(cluster: Cluster, socket_ifname: str | None = None) -> str:
    """The block as script text ("" for a CPU cluster). ``socket_ifname`` (e.g. "ib0", "eth0")
    replaces the default ``^lo,docker`` exclusion when the right interface is known."""
    if not cluster.on_gpus:
        return ""
    lines = ["# NCCL settings (GPU clusters only)"]
    for var, default, why in _SETTINGS:
        if var == "NCCL_SOCKET_IFNAME" and socket_ifname:
            default = socket_ifname
        lines += [f"# {var}: {why}", f'export {var}="${{{var}:-{default}}}"']
    return "\n".join(lines) + "\n"
