"""``course doctor``: what this machine and install can do, and what to fix when they can't.

Everything is probed, nothing assumed: versions from the installed packages, devices from torch,
backends from ``torch.distributed``, DeepSpeed's accelerator and op builders from DeepSpeed itself,
the Jupyter kernel from jupyter_client's kernel-spec search path.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys
from pathlib import Path

from course_lib.kit import catalog
from course_lib.kit import notebooks

KERNEL_NAME = "course-kit"
PINNED_TORCH = "2.13.0"
FIX_SETUP = "run `./kit setup` from the repository root (it creates .venv and installs everything)"
PACKAGES = ("torch", "deepspeed", "jupyterlab", "ipykernel", "ipywidgets", "matplotlib",
            "papermill", "nbval", "jupytext", "tensorboard", "safetensors", "tqdm")
DS_OPS = ("CPUAdamBuilder", "FusedAdamBuilder")


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _device_info() -> dict:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cpu_cores": cores, "cpu": platform.processor() or platform.machine(),
            "cuda_available": torch.cuda.is_available(), "cuda_devices": [],
            "cpu_bf16_autocast": False}
    try:  # a real bf16 matmul under autocast proves support instead of trusting a flag
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.ones(4, 4) @ torch.ones(4, 4)
        info["cpu_bf16_autocast"] = out.dtype == torch.bfloat16
    except RuntimeError:
        pass
    for i in range(torch.cuda.device_count() if info["cuda_available"] else 0):
        props = torch.cuda.get_device_properties(i)
        info["cuda_devices"].append({
            "index": i, "name": props.name, "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "bf16": props.major >= 8, "fp16": props.major >= 6})
    return info


def _backends() -> dict:
    import torch.distributed as dist

    return {"distributed": dist.is_available(), "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}


def _deepspeed_info(load_ops: bool) -> dict:
    """DeepSpeed's accelerator and whether its ops are compatible, built, and (optionally) load."""
    out: dict = {"importable": False, "accelerator": None, "backend": None, "ops": {}, "error": ""}
    try:
        import contextlib
        import io
        import warnings

        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            from deepspeed.accelerator import get_accelerator

            acc = get_accelerator()
        out.update(importable=True, accelerator=acc.device_name(),
                   backend=acc.communication_backend_name())
        from torch.utils.cpp_extension import _get_build_directory

        for op in DS_OPS:
            builder = acc.create_op_builder(op)
            if builder is None:
                out["ops"][op] = {"compatible": False, "built": False, "loads": None}
                continue
            compatible = bool(builder.is_compatible(verbose=False))
            build_dir = Path(_get_build_directory(builder.name, False))
            built = compatible and any(build_dir.glob("*.so"))
            loads = None
            if load_ops and compatible:
                from course_lib.parallel.deepspeed.op_locks import guard

                try:
                    with guard():  # a stale build lock fails the load (reported below), no endless wait
                        builder.load(verbose=False)
                    loads = True
                except Exception:  # noqa: BLE001 - any build/load failure is the answer
                    loads = False
            out["ops"][op] = {"compatible": compatible, "built": bool(built), "loads": loads}
    except Exception as exc:  # noqa: BLE001 - doctor reports, it does not crash
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _op_locks() -> list[dict]:
    """Build locks in torch's JIT-op folder (course_lib/parallel/deepspeed/op_locks.py): held, waiting to
    become stale, or stale (a killed build's: every DeepSpeed start would wait on it forever)."""
    from course_lib.parallel.deepspeed.op_locks import find_locks

    try:
        return [lock.to_dict() | {"line": lock.describe()} for lock in find_locks()]
    except OSError as exc:  # an unreadable folder is reported, not a crash
        return [{"path": "", "op": "", "stale": False, "line": f"cannot read the op build folder: {exc}"}]


def clear_stale_locks() -> list[str]:
    """Delete the stale op build locks (``course doctor --clear-stale-locks``); returns their paths."""
    from course_lib.parallel.deepspeed.op_locks import clear_stale

    return [str(lock.path) for lock in clear_stale()]


def _kernel_info() -> dict:
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        specs = KernelSpecManager().find_kernel_specs()
    except Exception as exc:  # noqa: BLE001
        return {"registered": False, "error": str(exc)}
    if KERNEL_NAME not in specs:
        return {"registered": False, "error": ""}
    spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    python = spec.argv[0] if spec.argv else ""
    return {"registered": True, "python": python, "python_exists": Path(python).exists(),
            "error": ""}


def _labs(root: Path | None, has_cuda: bool) -> list[dict]:
    root = root or Path.cwd()
    names = sorted(p.stem for p in (root / "labs").glob("[0-9][0-9]_*.py"))
    rows = []
    for name in names:
        info = catalog.LABS.get(name)
        run = notebooks.recorded_run(root / "labs" / f"{name}.ipynb")
        rows.append({"lab": name,
                     "verdict": catalog.verdict(info, has_cuda=has_cuda) if info
                     else "unknown: add it to course_lib/kit/catalog.py",
                     "full_size_seconds": run.get("full_size_seconds"),
                     "measured_on": run.get("measured_on", "")})
    return rows


def _mfu_peak() -> dict:
    """The CPU peak the trainer's MFU divides by (trainer/cpu_peak.py): the stamp's path, its fp32
    and bf16 figures on 1 thread and on every core, when it was measured, or why there is none."""
    import torch

    from course_lib.trainer import cpu_peak

    path = cpu_peak.stamp_path()
    stamp, why = cpu_peak.read_stamp(path)
    if stamp is None:
        return {"path": str(path), "stamped": False, "why": why}
    cores = stamp["cores"]
    rates = {f"{dt}_{t}": cpu_peak.peak_from_stamp(stamp, dtype, t)
             for dt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)) for t in sorted({1, cores})}
    return {"path": str(path), "stamped": True, "measured_at": stamp.get("measured_at"),
            "load_1min": stamp.get("load_1min"), "cores": cores, "gflops": {
                k: None if v is None else round(v / 1e9, 1) for k, v in rates.items()}}


def measure_peak() -> dict:
    """``course doctor --measure-peak``: time fp32 and bf16 matmuls on 1, 2, 4, ... threads up to
    every core and stamp the best rates into the venv (trainer/cpu_peak.py), where the trainer's
    MFU reads them. Run it on a quiet machine; a figure already stamped is only ever raised.
    Returns the stamp written."""
    from course_lib.trainer import cpu_peak

    return cpu_peak.write_stamp(cpu_peak.measure())


def gather(*, load_ops: bool = False, root: Path | None = None) -> dict:
    """Probe the machine and install. ``load_ops=True`` also builds/loads DeepSpeed's ops (the
    first time takes about a minute per op on 2 cores; cached in ``TORCH_EXTENSIONS_DIR``)."""
    report: dict = {"python": platform.python_version(), "executable": sys.executable,
                    "versions": {p: _version(p) for p in PACKAGES}}
    if report["versions"]["torch"]:
        report["device"] = _device_info()
        report["backends"] = _backends()
        report["op_locks"] = _op_locks()  # before loading any op: a stale lock is the answer, not a hang
        report["deepspeed"] = _deepspeed_info(load_ops) if report["versions"]["deepspeed"] else {}
        report["labs"] = _labs(root, report["device"]["cuda_available"])
        report["mfu_peak"] = _mfu_peak()
    report["kernel"] = _kernel_info()
    report["problems"] = problems(report)
    return report


def problems(report: dict) -> list[dict]:
    """What is broken, each with the fix spelled out. Empty means the install is healthy."""
    found = []
    missing = [p for p, v in report["versions"].items() if v is None]
    if missing:
        found.append({"problem": f"packages not installed: {', '.join(missing)}", "fix": FIX_SETUP})
    torch_v = report["versions"].get("torch") or ""
    if torch_v and not torch_v.startswith(PINNED_TORCH):
        found.append({"problem": f"torch {torch_v} is installed; the labs were measured with "
                                 f"{PINNED_TORCH}",
                      "fix": f"pip install torch=={PINNED_TORCH} (or {FIX_SETUP})"})
    if report.get("backends") and not report["backends"]["gloo"]:
        found.append({"problem": "torch.distributed has no gloo backend: no lab can start ranks",
                      "fix": f"install an official torch {PINNED_TORCH} wheel ({FIX_SETUP})"})
    ds = report.get("deepspeed") or {}
    if report["versions"].get("deepspeed") and not ds.get("importable"):
        found.append({"problem": f"deepspeed is installed but does not import: {ds.get('error')}",
                      "fix": "pip install --no-build-isolation --force-reinstall deepspeed==0.19.8"})
    for op, state in ds.get("ops", {}).items():
        if state.get("loads") is False:
            found.append({"problem": f"DeepSpeed op {op} fails to build/load",
                          "fix": "check that gcc and the Python headers are installed, then "
                                 "`course doctor --load-ops` again"})
    for lock in report.get("op_locks", []):
        if lock.get("stale"):
            found.append({"problem": f"stale build lock of op '{lock['op']}': {lock['path']} ({lock['age_s']:.0f} s "
                                     f"old, no process on this machine holds it): every DeepSpeed run that loads "
                                     f"'{lock['op']}' waits on it forever",
                          "fix": f"rm {lock['path']}   (or: course doctor --clear-stale-locks)"})
    kernel = report["kernel"]
    if not kernel.get("registered"):
        found.append({"problem": f"Jupyter kernel '{KERNEL_NAME}' is not registered",
                      "fix": f"{sys.executable} -m ipykernel install --sys-prefix --name "
                             f"{KERNEL_NAME} --display-name 'Python (course kit)'"})
    elif not kernel.get("python_exists"):
        found.append({"problem": f"kernel '{KERNEL_NAME}' points at a missing interpreter "
                                 f"{kernel.get('python')}",
                      "fix": "delete .venv/.course-kit-installed and run `./kit setup`"})
    return found


def _split_stamps(stamps: list[str]) -> tuple[str, list[str]]:
    """Split each lab's machine stamp ("2 CPU cores, load 1.9, no GPU, torch X, date") into what
    every timed lab shares (printed once) and what is its own (printed on its line, e.g. "load 1.9"):
    thirteen full stamps on one line were unreadable. Untimed labs ("") have no parts."""
    parts = [s.split(", ") if s else [] for s in stamps]
    timed = [p for p in parts if p]
    if not timed:
        return "", ["" for _ in stamps]
    common = [x for x in timed[0] if all(x in p for p in timed)]
    return ", ".join(common), [", ".join(x for x in p if x not in common) for p in parts]


def _format_peak(peak: dict | None) -> list[str]:
    """The report's MFU-peak line: the stamped figures, or how to stamp them."""
    if not peak:
        return []
    if not peak["stamped"]:
        return [f"MFU peak    not stamped ({peak['why']}): the trainer measures it at start-up instead, "
                "which a busy machine makes low (MFU high); run `course doctor --measure-peak` on a quiet machine"]
    by_dtype: dict[str, list[str]] = {}
    for key, v in peak["gflops"].items():
        dt, t = key.split("_")
        if v is not None:
            by_dtype.setdefault(dt, []).append(f"{v:,.1f} ({t} thread{'s' if t != '1' else ''})")
    figures = "; ".join(f"{dt} {', '.join(parts)}" for dt, parts in by_dtype.items())
    load = peak.get("load_1min")
    busy = (f"; the machine was busy then (load {load:.1f} on {peak['cores']} cores), so these are low: "
            "measure again when it is quiet (a stamp is only ever raised)") if busy_load(load, peak["cores"]) else ""
    return [f"MFU peak    GFLOP/s {figures}; stamped {peak['measured_at']} ({peak['path']}){busy}"]


def busy_load(load: float | None, cores: int) -> bool:
    """Whether a 1-minute load average of ``load`` on ``cores`` cores means a peak measured then
    is low: more than half the cores were already taken."""
    return load is not None and load > cores / 2


def format_report(report: dict) -> str:
    """Human-readable report (sizes in GiB = 2**30 bytes)."""
    lines = [f"Python      {report['python']}  ({report['executable']})"]
    for pkg, v in report["versions"].items():
        lines.append(f"{pkg:<12}{v or 'NOT INSTALLED'}")
    dev = report.get("device")
    if dev:
        lines.append("")
        lines.append(f"CPU         {dev['cpu_cores']} cores usable ({dev['cpu']}); "
                     f"bf16 autocast on CPU: {'yes' if dev['cpu_bf16_autocast'] else 'no'}; "
                     "fp16 loss scaling on CPU: demonstration only (slow)")
        if dev["cuda_devices"]:
            for d in dev["cuda_devices"]:
                lines.append(f"CUDA {d['index']}      {d['name']}, {d['memory_bytes'] / 2**30:.1f} GiB, "
                             f"sm_{d['capability']}, bf16: {'yes' if d['bf16'] else 'no'}, "
                             f"fp16: {'yes' if d['fp16'] else 'no'}")
        else:
            lines.append("CUDA        no CUDA device (labs use CPU + gloo)")
        b = report["backends"]
        lines.append("backends    " + ", ".join(f"{k}: {'yes' if b[k] else 'no'}"
                                                for k in ("gloo", "nccl", "mpi")))
        ds = report.get("deepspeed") or {}
        if ds.get("importable"):
            ops = "; ".join(
                f"{op}: " + ("incompatible" if not s["compatible"] else
                             "loads" if s["loads"] else "fails to load" if s["loads"] is False else
                             "built" if s["built"] else "compatible, compiles on first use (~1 min)")
                for op, s in ds["ops"].items())
            lines.append(f"deepspeed   accelerator {ds['accelerator']}, comm backend {ds['backend']}; {ops}")
    for lock in report.get("op_locks", []):
        lines.append(f"op lock     {lock['line']}")
    lines.extend(_format_peak(report.get("mfu_peak")))
    k = report["kernel"]
    lines.append(f"kernel      '{KERNEL_NAME}': " + (
        f"registered ({k['python']})" if k.get("registered") else "NOT registered"))
    if report.get("labs"):
        lines.append("")
        lines.append("labs")
        common, own = _split_stamps([row.get("measured_on", "") for row in report["labs"]])
        for row, extra in zip(report["labs"], own):
            secs = row.get("full_size_seconds")
            took = (f"full size {secs / 60:4.1f} min" if secs is not None else "full size not timed yet")
            took += f" ({extra})" if extra else ""
            lines.append(f"  {row['lab']:<32}{took:<34} {row['verdict']}")  # the space: a long stamp fills the column
        lines.append("  (full-size times as recorded by `course labs run NN --in-place` or `--record-time`"
                     + (f"; measured on {common}" if common else "")
                     + ("; load: the 1-minute load average as the run ended, above the core count the lab "
                        "shared the CPU)" if any("load " in e for e in own) else ")"))
    lines.append("")
    if report["problems"]:
        lines.append(f"{len(report['problems'])} problem(s):")
        for p in report["problems"]:
            lines.append(f"  - {p['problem']}\n    fix: {p['fix']}")
    else:
        lines.append("verdict     install is healthy")
    return "\n".join(lines)
