"""The trainer's start-up facts (course_lib.train): where a rank computes, whether the ranks that
started fit the config, its random stream, the peak MFU divides by, the stabilizer and the
optimizer. Everything here runs once, before the first step; nothing here writes a file.

Checks that need the started ranks (world size, backend, devices) live here rather than in
``train_config.validate``, which runs before any rank exists.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from course_lib.trainer.config import ConfigError


def choose_device(wanted: str, local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """Where this rank computes: ``wanted`` is ``train.device`` ("auto", "cpu" or "cuda").
    "cpu" always wins; "cuda" needs a GPU for every local rank and takes ``cuda:LOCAL_RANK``;
    "auto" does the same when the node has a GPU per local rank, else every rank uses the CPU
    (never a mix of devices in one job, never every rank on cuda:0)."""
    if wanted == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough = count >= max(local_world_size, local_rank + 1)
    if wanted == "cuda" and not enough:
        raise ConfigError(f"train.device = 'cuda' needs a GPU per local rank: {local_world_size} ranks "
                          f"on this node, {count} GPUs visible; use 'auto' or 'cpu', or start fewer ranks "
                          f"per node")
    return torch.device("cuda", local_rank) if enough else torch.device("cpu")


def distributed(cfg: dict, info):
    """Join (or read) the process group so that the device follows ``train.device`` and the
    local rank: a CPU run uses gloo even on a GPU node, a GPU run uses cuda:LOCAL_RANK.
    Returns ``(DistInfo, torch.device)``."""
    from course_lib.parallel.ranks.launch import init_distributed

    wanted = cfg["train"]["device"]
    if info is None:
        info = init_distributed(backend="gloo" if wanted == "cpu" and not os.environ.get("COURSE_BACKEND")
                                else None)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    device = choose_device(wanted, info.local_rank, local_world)
    if info.backend == "nccl" and device.type != "cuda":
        raise ConfigError("train.device = 'cpu' cannot use the nccl backend (unset COURSE_BACKEND or "
                          "set it to gloo)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return info, device


def check_world(cfg: dict, info) -> None:
    """ConfigError unless the ranks that started (``info.world_size``, a count of processes) fit
    ``train.strategy`` and the parallel layout (:func:`course_lib.trainer.check_config.check_world`, which
    ``--check-config`` runs without ranks)."""
    from course_lib.trainer.check_config import check_world as check

    check(cfg, info.world_size, has_group=info.backend is not None)


def check_out_dir(out_dir: Path) -> None:
    """ConfigError unless ``out_dir`` (``--out``, the run folder) is a folder or can be made one:
    an existing file there, or a file where one of its parent folders should be, is refused before
    anything is written (``mkdir`` would fail later with a NotADirectoryError traceback)."""
    for p in (out_dir, *out_dir.parents):
        if p.is_symlink() and not p.exists():
            raise ConfigError(f"--out {str(out_dir)!r}: {str(p)!r} is a link to nothing; choose another --out")
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == out_dir else f"cannot be made: {str(p)!r} is a file"
                raise ConfigError(f"--out {str(out_dir)!r} {where}, not a folder; the run folder (metrics.jsonl, "
                                  f"checkpoints/) must be a folder: choose another --out")
            return


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s random stream after the (shared) weight initialisation."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % (2**63 - 1)


def peak_flops(cfg: dict, device: torch.device):
    """The peak MFU divides by (a :class:`~course_lib.trainer.cpu_peak.Peak`: FLOP/s per device and
    where it came from): the config's ``train.peak_flops``, a datasheet's (CUDA; 0.0 for an unknown
    GPU, MFU then logs as absent), or on a CPU the peak ``course doctor --measure-peak`` stamped
    into the venv; without a stamp, a measurement at start-up, labelled as the fallback it is (a
    busy machine makes it low, and MFU high)."""
    from course_lib.trainer.cpu_peak import MEASURE_HINT, Peak, stamped_peak

    if cfg["train"]["peak_flops"] > 0:
        return Peak(cfg["train"]["peak_flops"], "config", "train.peak_flops from the config")
    if device.type == "cuda":
        from course_lib.estimate import hardware

        name = torch.cuda.get_device_name(device).lower()
        # fp32 runs on TF32 tensor cores only when torch is allowed to (set_float32_matmul_precision
        # "high"/"medium"); otherwise the matmuls are true fp32 and MFU divides by the fp32 peak.
        fp32 = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
        # fp8: MFU against the bf16 peak, as torchtitan reports it (FP8's peak is twice that, and
        # the layers kept in bf16 could never reach it)
        dtype = {"fp32": fp32, "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}[cfg["train"]["precision"]]
        for key, acc in hardware.ACCELERATORS.items():  # first entry of the chip family (e.g. h100)
            if key.split("-")[0] in name:
                return Peak(acc.peak_flops(dtype), "datasheet", f"{key} datasheet, dense {dtype}")
        return Peak(0.0, "datasheet", f"no datasheet for {name!r}: set train.peak_flops")
    # fp16 on a CPU is a loss-scaling demonstration whose matmuls run on the fp32 units: fp32's peak.
    # fp8 on a CPU is emulated: its GEMMs run on the fp32 units (kit) or torch's CPU scaled_mm
    dtype = torch.bfloat16 if cfg["train"]["precision"] == "bf16" else torch.float32
    threads = torch.get_num_threads()
    flops, detail = stamped_peak(dtype, threads)
    if flops:
        return Peak(flops, "stamp", detail)
    rate, used = max((_measured_cpu_peak(dt, threads), dt) for dt in _peak_dtypes(dtype))
    return Peak(rate, "start-up", f"{str(used).removeprefix('torch.')} on {threads} thread(s), measured at "
                f"start-up: a fallback that a busy machine makes low (and MFU high); {detail}; {MEASURE_HINT}")


def _peak_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    from course_lib.trainer.cpu_peak import cpu_peak_dtypes

    return cpu_peak_dtypes(dtype)


_CPU_PEAKS: dict[tuple, float] = {}  # (dtype, threads) -> FLOP/s: the chip does not change within a process


def _measured_cpu_peak(dtype: torch.dtype, threads: int) -> float:
    """This CPU's matmul peak (FLOP/s) for ``dtype`` on ``threads`` threads, measured once per
    process (0.24 to 0.5 s of matmuls, mfu.cpu_peak_sizes): a notebook or test that trains many
    times pays it once. The best of interleaved passes, so a busy moment costs one timing."""
    key = (dtype, threads)
    if key not in _CPU_PEAKS:
        from course_lib.trainer.mfu import robust_cpu_peak_flops

        _CPU_PEAKS[key] = robust_cpu_peak_flops(dtype)
    return _CPU_PEAKS[key]


def stabilizer(cfg: dict, faults, out_dir: Path, rank: int, model):
    """The stabilizer from ``[stability]``; faults checked against the model and the run length
    now (a typo in a parameter name must fail at start-up, not at step 500)."""
    from course_lib.stability import Stabilizer

    st, max_steps = cfg["stability"], cfg["train"]["max_steps"]
    try:
        stab = Stabilizer(max_grad_norm=st["max_grad_norm"] or None, spike_policy=st["spike_policy"],
                          detect_loss_spikes=st["detect_spikes"], detect_grad_spikes=st["detect_spikes"],
                          lr_factor=st["lr_factor"], lr_steps=st["lr_steps"],
                          max_consecutive_bad=st["max_consecutive_bad"], max_rollbacks=st["max_rollbacks"],
                          rollback_limit=st["rollback_limit"], diag_dir=out_dir / "diagnostics",
                          faults=list(faults), rank=rank)
        stab.faults.validate(model)
    except ValueError as exc:
        raise ConfigError(f"--inject-fault: {exc}") from None
    late = [str(f) for f in stab.faults.faults if f.step >= max_steps]
    if late:
        raise ConfigError(f"--inject-fault: {', '.join(late)} is at or after train.max_steps ({max_steps}) "
                          f"and would never fire; steps count from 0")
    return stab


def check_faults_reach(stab, strategy, strategy_name: str) -> None:
    """ConfigError for injected faults the built ``strategy`` cannot deliver (see
    :func:`course_lib.stability.faults.check_reachable`)."""
    from course_lib.stability.faults import check_reachable

    try:
        check_reachable(stab.faults.faults, strategy_name, grads_visible=strategy.grads_visible)
    except ValueError as exc:
        raise ConfigError(f"--inject-fault: {exc}") from None


def check_fresh_mirror(url: str, strategy) -> None:
    """Collective, for a run that does not resume and has ``checkpoint.mirror``: ConfigError on
    every rank, before the run writes anything, when the mirror already holds checkpoints (the
    new run's uploads would replace them under the same step names) or cannot be listed. Rank 0
    looks (:func:`course_lib.checkpoint.tiers.check_fresh_mirror`; it creates a missing
    ``file://`` root whose parent exists, the only write here, outside the run folder) and
    broadcasts its verdict."""
    from course_lib.checkpoint.mirror import as_mirror
    from course_lib.checkpoint.tiers import check_fresh_mirror as check

    error = None
    if strategy.info.rank == 0:
        try:
            check(as_mirror(url))
        except Exception as exc:  # noqa: BLE001 - the others wait for the verdict: tell them
            error = f"{exc}; nothing was written"
    error = strategy.broadcast_object(error)
    if error is not None:
        raise ConfigError(error)


def check_fresh_folder(out_dir: Path, strategy) -> None:
    """Collective, for a run that does not resume: ConfigError on every rank, before the run writes
    anything, when ``out_dir/checkpoints`` already holds checkpoints (any format) or quarantined
    ones (``.corrupt-*``). A fresh run there would start from step 0, rewrite ``metrics.jsonl`` and
    let retention (``checkpoint.keep_last``) delete the earlier run's checkpoints. Rank 0 looks
    and broadcasts its verdict (the folder may be on rank 0's disk only)."""
    from course_lib.checkpoint import io as cio

    error = None
    if strategy.info.rank == 0:
        root = Path(out_dir) / "checkpoints"
        try:
            held = sorted(p.name for p in cio.list_checkpoint_dirs(root)) + cio.quarantined(root)
        except OSError as exc:  # cannot tell what it holds: never start over blind
            held, error = [], f"--out {out_dir}: cannot list {root} ({exc}); nothing was written"
        if held:
            shown = ", ".join(held[-5:]) + (f" (and {len(held) - 5} more)" if len(held) > 5 else "")
            error = (f"--out {out_dir} already holds an earlier run's checkpoints ({len(held)}: {shown}). A run "
                     f"without --resume would start from step 0 there, rewrite metrics.jsonl and let "
                     f"checkpoint.keep_last delete them. Continue that run with --resume auto, or start a new "
                     f"one with a new --out folder (or move {root} away first); nothing was written")
    error = strategy.broadcast_object(error)
    if error is not None:
        raise ConfigError(error)


def holds_checkpoints(out_dir: Path, mirror_url: str, strategy) -> bool:
    """Collective: whether ``--resume auto`` will load a checkpoint or refuse, rather than start
    from step 0 - true when ``out_dir/checkpoints`` holds a checkpoint folder of any format or a
    quarantined one, or the mirror (``mirror_url``; "" for none) lists one
    (``docs/CHECKPOINTS.md`` rules 4 to 6: each of those ends in a load or a refusal, never a fresh
    start). A mirror that cannot be listed counts as holding none. Rank 0 looks and broadcasts."""
    from course_lib.checkpoint import io as cio

    held = False
    if strategy.info.rank == 0:
        root = Path(out_dir) / "checkpoints"
        try:
            held = bool(cio.list_checkpoint_dirs(root) or cio.quarantined(root))
        except OSError:
            held = False  # the resume itself reports the folder; the init source is read meanwhile
        if not held and mirror_url:
            from course_lib.checkpoint.mirror import as_mirror

            try:
                held = bool(as_mirror(mirror_url).list())
            except Exception:  # noqa: BLE001 - unlistable: the resume refuses or warns on its own
                held = False
    return bool(strategy.broadcast_object(held))


def check_mirror_apart(url: str, root: Path) -> None:
    """ConfigError when ``checkpoint.mirror`` (``url``) is the local checkpoint folder ``root`` or a
    folder inside or above it (:func:`course_lib.checkpoint.mirror.check_apart`): every upload
    would copy a checkpoint onto itself or prune the run's own folders. Every rank computes the
    same answer from the config and ``--out`` (no file is read), so no collective is needed."""
    from course_lib.checkpoint.mirror import check_apart

    try:
        check_apart(url, root)
    except ValueError as exc:
        raise ConfigError(f"{exc}; nothing was written") from None


def adamw(optim: dict) -> Callable[[Any], torch.optim.Optimizer]:
    """``model -> AdamW`` from ``[optim]`` (lr, betas, eps, weight decay on the model's decayed
    group only), for ``strategy.setup``: the strategy decides which module it is built on."""
    fused = {"fused": True} if optim["fused"] else {}  # one kernel for the whole update, not one per tensor
    return lambda m: torch.optim.AdamW(m.param_groups(optim["weight_decay"]), lr=optim["lr"],
                                       betas=(optim["beta1"], optim["beta2"]), eps=optim["eps"], **fused)
