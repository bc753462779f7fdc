"""Argument validation shared by the whole library (torch-free: the estimators use it too), and the
table of the trainer's configuration keys with the error a bad one raises (``ConfigError``).

Every public estimator validates its arguments *before* doing any arithmetic, so a wrong input
fails with a message that names the argument and the accepted range instead of producing a
plausible-looking but meaningless number. Booleans are rejected where a number is expected
(``True`` is an ``int`` in Python, and ``dp=True`` is always a bug).
"""

from __future__ import annotations

import math
from typing import Any, Iterable


def check_int(name: str, value, lo: int | None = None, hi: int | None = None, hi_name: str | None = None) -> int:
    """Return `value` if it is an int in [lo, hi]; TypeError / ValueError naming `name` otherwise.

    `hi_name` names where the upper bound comes from ("n_heads"), so the message says why.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = hi if hi_name is None else f"{hi_name}={hi}"
        raise ValueError(f"{name} must be {_range_text(lo, bound)}, got {value}")
    return value


def check_number(name: str, value, lo: float | None = None, hi: float | None = None,
                 *, lo_open: bool = False) -> float:
    """Return `value` if it is a finite int/float in the range; TypeError / ValueError otherwise.

    `lo_open=True` makes the lower bound exclusive (e.g. a bandwidth must be > 0).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    if too_low or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {_range_text(lo, hi, lo_open)}, got {value}")
    return value


def check_count(name: str, value, lo: float = 0) -> float:
    """A count that may be written as a float (``7.5e9`` parameters) but must be whole and >= lo."""
    check_number(name, value, lo)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be a whole number (a count), got {value}")
    return value


def check_choice(name: str, value, choices: Iterable) -> None:
    """ValueError naming `name` and listing the accepted values when `value` is not one of them."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}; got {value!r}")


def check_bool(name: str, value) -> bool:
    """TypeError naming `name` unless `value` is exactly True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_divides(divisor_name: str, divisor: int, dividend_name: str, dividend: int) -> None:
    """ValueError unless `divisor` divides `dividend` (e.g. tp must divide n_heads)."""
    if dividend % divisor:
        raise ValueError(
            f"{divisor_name} ({divisor}) must divide {dividend_name} ({dividend}); "
            f"accepted {divisor_name} values are the divisors of {dividend}"
        )


def _range_text(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}"


# ---------------------------------------------------------------------------------------------
# The trainer's configuration table. ``course_lib.trainer.config`` loads and cross-checks a TOML
# against it; the layers below the trainer (strategies, checkpoints, the watchdog) read the same
# keys and raise the same error, so the error type, the table and its defaults live here, below
# all of them (docs/ARCHITECTURE.md, "Layers run one way").
# ---------------------------------------------------------------------------------------------

class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range; the message names it."""


# (type, default, constraint) per key. A constraint is a tuple of choices or a (lo, hi) range
# where None means unbounded; bools and strings without choices have None.
SCHEMA: dict[str, dict[str, tuple[type, Any, Any]]] = {
    "train": {
        "max_steps": (int, 100, (1, None)),
        "seed": (int, 0, (0, None)),
        "micro_batch": (int, 16, (1, None)),       # sequences per rank per micro-batch
        "grad_accum": (int, 1, (1, None)),         # micro-batches per optimizer step
        "precision": (str, "fp32", ("fp32", "bf16", "fp16", "fp8")),  # fp8: see [fp8]
        "strategy": (str, "single", None),         # choices: course_lib.parallel.registry (trainer.config adds them)
        "device": (str, "auto", ("auto", "cpu", "cuda")),
        "log_every": (int, 10, (1, None)),         # progress-bar refresh, in steps
        "progress": (bool, True, None),
        "metrics_flush_s": (float, 1.0, (0.0, None)),  # seconds between metrics.jsonl writes; 0 = every row
        "tensorboard": (bool, False, None),
        "peak_flops": (float, 0.0, (0.0, None)),   # FLOP/s per device for MFU; 0 = look up/measure
        "compile": (bool, False, None),            # torch.compile the model (fused kernels; first steps compile)
        "util_sample_s": (float, 1.0, (0.0, None)),  # seconds between CPU/GPU utilization samples (course_lib.trainer.utilization); 0 = off
        # seconds a rank may go without a heartbeat (one per step) before every rank dumps its
        # stacks to OUT/hang/ and the job exits 86 (course_lib.watch); must exceed the slowest
        # step including a checkpoint save; 0 = no watchdog
        "watchdog_s": (float, 0.0, (0.0, None)),
        "checkpoint_on_signal": (bool, True, None),  # SIGUSR1/SIGTERM: checkpoint at the next step, exit 75
    },
    "data": {
        "task": (str, "markov", ("markov", "copy", "reverse", "sort", "text", "random", "tokens")),
        "seq_len": (int, 64, (2, None)),
        "vocab_size": (int, 64, (2, 2**32)),       # markov, sequence, random, tokens; text is bytes (256)
        "path": (str, "", None),                   # text: a UTF-8 file ("" = bundled notes); tokens: the token file
        "dtype": (str, "uint16", ("uint16", "uint32")),  # tokens: the ids' type in data.path (course_lib.data.tokens)
        "val_path": (str, "", None),               # tokens: held-out token file, same dtype ("" = none)
    },
    "optim": {
        "lr": (float, 3e-3, (0.0, None)),
        "min_lr": (float, 3e-4, (0.0, None)),
        "weight_decay": (float, 0.1, (0.0, None)),
        "beta1": (float, 0.9, (0.0, 1.0)),
        "beta2": (float, 0.95, (0.0, 1.0)),
        "eps": (float, 1e-8, (0.0, None)),
        "fused": (bool, False, None),              # AdamW as one fused kernel per step (torch's fused=True)
    },
    "schedule": {
        "kind": (str, "cosine", ("linear", "cosine", "constant", "wsd")),
        "warmup_steps": (int, 10, (0, None)),
        "warmup_convention": (str, "(it+1)/W", ("it/W", "(it+1)/W", "(it+1)/(W+1)")),
        "decay_steps": (int, 0, (0, None)),        # wsd only; 0 = 20% of max_steps
    },
    "stability": {
        "max_grad_norm": (float, 1.0, (0.0, None)),  # 0 = no clipping
        "spike_policy": (str, "skip", ("warn", "skip", "lower_lr", "rollback")),
        "detect_spikes": (bool, True, None),
        "lr_factor": (float, 0.1, (0.0, 1.0)),
        "lr_steps": (int, 50, (1, None)),
        "max_consecutive_bad": (int, 3, (1, None)),
        "max_rollbacks": (int, 3, (1, None)),      # consecutive roll-backs for one spike, then...
        "rollback_limit": (str, "accept", ("accept", "error")),  # ...take the new level, or stop
    },
    "checkpoint": {
        "save_every": (int, 0, (0, None)),         # steps; 0 = only at the end
        "keep_last": (int, 3, (1, None)),
        "async_save": (bool, True, None),
        "mirror": (str, "", None),                 # fsspec URL of a second tier; "" = none
        "format": (str, "auto", ("auto", "full", "sharded")),  # auto = what the strategy needs
    },
    "parallel": {
        "bucket_mb": (float, 25.0, (0.0, None)),   # ddp-scratch, zero1: MiB per gradient bucket; 0 = one bucket
        "reshard_after_forward": (bool, True, None),  # fsdp: True = ZeRO-3-like, False = ZeRO-2-like
        "cpu_offload": (bool, False, None),        # fsdp: parameters, gradients and optimizer on the CPU
        "zero_stage": (int, 2, (0, 3)),            # deepspeed: ZeRO stage
        "offload_optimizer": (str, "none", ("none", "cpu")),  # deepspeed: optimizer state + step on the CPU
        "offload_param": (str, "none", ("none", "cpu")),      # deepspeed: parameters on the CPU (stage 3)
        # Model parallelism (course_lib.parallel.composed.model_parallel, with train.strategy = "ddp"
        # as the data-parallel dimension): ranks = dp * tp * pp * cp, tp innermost (mesh.py).
        "dp": (int, 0, (0, None)),                 # data-parallel replicas; 0 = world / (tp * pp * cp)
        "tp": (int, 1, (1, None)),                 # tensor-parallel ranks per layer (heads, MLP, vocab split)
        "pp": (int, 1, (1, None)),                 # pipeline stages (contiguous runs of blocks)
        "pp_schedule": (str, "1f1b", ("1f1b", "gpipe", "interleaved")),  # micro-batches = train.grad_accum
        "virtual_stages": (int, 1, (1, None)),     # stages per pipeline rank; > 1 needs "interleaved"
        # blocks per stage: "even" | "balanced" (ends count their embedding / head) | an array of
        # pp * virtual_stages ints (course_lib.estimate.stage_split)
        "pp_split": (list, "even", ("even", "balanced")),
        "sequence_parallel": (bool, False, None),  # tp > 1: norms/residual split along the sequence
        "cp": (int, 1, (1, None)),                 # context parallel: ring attention, each rank 2 of 2*cp sequence pieces
        # expert parallel: each MoE layer's experts sharded over ep ranks, tokens moved by all-to-all
        # (course_lib.parallel.expert_parallel.in_trainer); ep divides the world and model.moe_experts
        "ep": (int, 1, (1, None)),
    },
    "profile": {  # torch.profiler around chosen steps (course_lib.trainer.profiling; --profile); files in OUT/profile/
        "enabled": (bool, False, None),
        "wait": (int, 5, (0, None)),               # steps run unprofiled first (counted from this process's first step)
        "warmup": (int, 1, (0, None)),             # steps recorded then discarded (profiler start-up)
        "active": (int, 3, (1, None)),             # steps recorded and summarised
        "top_ops": (int, 15, (1, None)),           # operators listed in the summary
    },
    "wandb": {  # Weights & Biases beside metrics.jsonl (course_lib.trainer.wandb_log); optional package
        "mode": (str, "disabled", ("disabled", "offline", "online")),  # offline: no network, files in OUT/wandb/
        "project": (str, "course-kit", None),
        "name": (str, "", None),                   # "" = the output folder's name
    },
    "fp8": {  # read when train.precision = "fp8" (course_lib.precision.fp8_model)
        # tensorwise | rowwise (torchao or the kit) | delayed | blockwise | mxfp8 (the kit's own)
        "recipe": (str, "tensorwise", ("tensorwise", "rowwise", "delayed", "blockwise", "mxfp8")),
        "backend": (str, "auto", ("auto", "torchao", "kit")),  # auto: torchao where installed and it has the recipe
        # Linear layers left in high precision, by name, dotted part or pattern (embeddings and norms
        # are not Linear layers and always stay): the output head and an MoE router by default
        "keep": (list, ["lm_head", "router"], None),
        "fsdp_all_gather": (bool, False, None),    # fsdp + torchao tensorwise: all-gather weights in FP8
    },
    "model": {
        "preset": (str, "tiny", None),             # plus any ModelConfig field, checked there
        # weights to start from (fine-tuning): a Hugging Face model folder or a `course ckpt
        # consolidate` file; checked against the model at config time (course_lib.model.init_source)
        "init_from": (str, "", None),
    },
}


def defaults() -> dict[str, dict[str, Any]]:
    """The default configuration as nested dicts (a fresh copy)."""
    return {sec: {k: spec[1] for k, spec in keys.items()} for sec, keys in SCHEMA.items()}
