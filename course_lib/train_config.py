"""Training configuration: a TOML file plus command-line overrides, validated before anything runs.

    [train]   max_steps, seed, micro_batch, grad_accum, precision, strategy, device, compile, log_every, ...
    [data]    task, seq_len, vocab_size, path
    [model]   preset plus any ModelConfig field (n_layers, d_model, checkpointing, ...)
    [optim]   lr, min_lr, weight_decay, beta1, beta2, eps, fused
    [schedule] kind, warmup_steps, warmup_convention, decay_steps
    [stability] max_grad_norm, spike_policy, lr_factor, lr_steps, max_consecutive_bad, detect_spikes,
              max_rollbacks, rollback_limit
    [checkpoint] save_every, keep_last, async_save, mirror, format
    [parallel] bucket_mb, reshard_after_forward, cpu_offload, zero_stage, offload_optimizer,
              offload_param (read by the strategy named in train.strategy)

Every unknown section or key, wrong type or out-of-range value is a ``ConfigError`` naming it
(with a "did you mean" for typos), raised before any file is written or model is built.
"""
from __future__ import annotations

import copy
import difflib
import sys
from pathlib import Path
from typing import Any

from course_lib.parallel.registry import strategy_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


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
        "precision": (str, "fp32", ("fp32", "bf16", "fp16")),
        "strategy": (str, "single", strategy_names()),  # course_lib.parallel.registry
        "device": (str, "auto", ("auto", "cpu", "cuda")),
        "log_every": (int, 10, (1, None)),         # progress-bar refresh, in steps
        "progress": (bool, True, None),
        "metrics_flush_s": (float, 1.0, (0.0, None)),  # seconds between metrics.jsonl writes; 0 = every row
        "tensorboard": (bool, False, None),
        "peak_flops": (float, 0.0, (0.0, None)),   # FLOP/s per device for MFU; 0 = look up/measure
        "compile": (bool, False, None),            # torch.compile the model (fused kernels; first steps compile)
    },
    "data": {
        "task": (str, "markov", ("markov", "copy", "reverse", "sort", "text", "random")),
        "seq_len": (int, 64, (2, None)),
        "vocab_size": (int, 64, (2, 65536)),       # markov and sequence tasks; text is bytes (256)
        "path": (str, "", None),                   # text task: a local file ("" = bundled notes)
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
    },
    "model": {"preset": (str, "tiny", None)},      # plus any ModelConfig field, checked there
}


def defaults() -> dict[str, dict[str, Any]]:
    """The default configuration as nested dicts (a fresh copy)."""
    return {sec: {k: spec[1] for k, spec in keys.items()} for sec, keys in SCHEMA.items()}


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_value(where: str, value: Any, kind: type, constraint: Any) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is not bool and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where} must be {kind.__name__}, got {type(value).__name__} {value!r}")
    if isinstance(constraint, tuple) and constraint and isinstance(constraint[0], str):
        if value not in constraint:
            raise ConfigError(f"{where} must be one of {', '.join(constraint)}; got {value!r}")
    elif isinstance(constraint, tuple):
        lo, hi = constraint
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ConfigError(f"{where} must be {span}, got {value!r}")
    return value


def validate(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Merge ``raw`` over the defaults and check every key, type and range. Returns a new dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a table of sections, got {type(raw).__name__}")
    cfg = defaults()
    for section, values in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"unknown config section [{section}]{_suggest(section, SCHEMA)}; "
                              f"sections: {', '.join(SCHEMA)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table, got {type(values).__name__}")
        for key, value in values.items():
            where = f"{section}.{key}"
            if section == "model" and key != "preset":
                cfg["model"][key] = value  # ModelConfig checks the rest (see build_model_config)
                continue
            if key not in SCHEMA[section]:
                raise ConfigError(f"unknown config key {where}{_suggest(key, SCHEMA[section])}; "
                                  f"keys of [{section}]: {', '.join(SCHEMA[section])}")
            kind, _, constraint = SCHEMA[section][key]
            cfg[section][key] = _check_value(where, value, kind, constraint)
    _cross_checks(cfg)
    build_model_config(cfg)  # model keys are checked now, not after files exist
    return cfg


def _cross_checks(cfg: dict) -> None:
    o, s, t = cfg["optim"], cfg["schedule"], cfg["train"]
    if o["lr"] <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {o['lr']}")
    if o["min_lr"] > o["lr"]:
        raise ConfigError(f"optim.min_lr ({o['min_lr']}) must be <= optim.lr ({o['lr']})")
    if s["warmup_steps"] > t["max_steps"]:
        raise ConfigError(f"schedule.warmup_steps ({s['warmup_steps']}) must be <= train.max_steps "
                          f"({t['max_steps']})")
    if s["kind"] == "wsd" and s["decay_steps"] > t["max_steps"] - s["warmup_steps"]:
        raise ConfigError("schedule.decay_steps must be <= train.max_steps - schedule.warmup_steps")
    if cfg["data"]["task"] in ("copy", "reverse", "sort") and cfg["data"]["seq_len"] % 2:
        raise ConfigError(f"data.seq_len must be even for the {cfg['data']['task']} task")
    path = cfg["data"]["path"]
    if path and cfg["data"]["task"] != "text":
        raise ConfigError(f"data.path is only read by the text task; data.task is {cfg['data']['task']!r}")
    if path and not Path(path).is_file():
        raise ConfigError(f"data.path: no such file {path!r} (a UTF-8 text file; \"\" = the bundled notes)")
    if cfg["checkpoint"]["format"] == "sharded" and cfg["checkpoint"]["mirror"]:
        raise ConfigError("checkpoint.mirror works with full checkpoints only; sharded (DCP) "
                          "checkpoints stay in the run folder")
    if t["strategy"] == "deepspeed" and (o["fused"] or t["compile"]):
        key = "optim.fused" if o["fused"] else "train.compile"
        raise ConfigError(f"{key} does not apply to train.strategy = 'deepspeed': the engine builds its own "
                          f"optimizer and wraps the model (set {key} = false)")
    par = cfg["parallel"]
    if t["strategy"] == "deepspeed" and par["offload_param"] != "none" and par["zero_stage"] != 3:
        raise ConfigError(f"parallel.offload_param = {par['offload_param']!r} needs parallel.zero_stage = 3 "
                          f"(got {par['zero_stage']}): only ZeRO-3 partitions the parameters it could offload")
    if t["strategy"] == "deepspeed" and par["offload_optimizer"] != "none" and par["zero_stage"] == 0:
        raise ConfigError("parallel.offload_optimizer needs parallel.zero_stage >= 1 (ZeRO-Offload "
                          "moves the partitioned optimizer state; stage 0 does not partition it)")
    if cfg["stability"]["spike_policy"] == "rollback" and cfg["checkpoint"]["save_every"] == 0:
        raise ConfigError("stability.spike_policy = 'rollback' needs checkpoint.save_every > 0 "
                          "(there must be a checkpoint to roll back to)")


def vocab_size_of(cfg: dict) -> int:
    """Token vocabulary the data produces: 256 for bytes, data.vocab_size otherwise."""
    return 256 if cfg["data"]["task"] == "text" else cfg["data"]["vocab_size"]


def build_model_config(cfg: dict):
    """The ModelConfig for ``cfg``: preset + overrides, vocabulary and context sized to the data."""
    from course_lib.model import ModelConfig

    overrides = {k: v for k, v in cfg["model"].items() if k != "preset"}
    overrides.setdefault("vocab_size", vocab_size_of(cfg))
    overrides.setdefault("block_size", cfg["data"]["seq_len"])
    try:
        mcfg = ModelConfig.preset(cfg["model"]["preset"], **overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[model]: {exc}") from None
    if mcfg.vocab_size < vocab_size_of(cfg):
        raise ConfigError(f"model.vocab_size ({mcfg.vocab_size}) is smaller than the data's "
                          f"vocabulary ({vocab_size_of(cfg)})")
    if mcfg.block_size < cfg["data"]["seq_len"]:
        raise ConfigError(f"model.block_size ({mcfg.block_size}) must be >= data.seq_len "
                          f"({cfg['data']['seq_len']})")
    return mcfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is parsed as TOML (numbers,
    booleans, quoted or bare strings)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()  # a bare word such as bf16 or cosine
    return section, key, value


def load(path: str | Path | None, overrides: list[str] = ()) -> dict[str, dict[str, Any]]:
    """Read ``path`` (TOML; None = defaults only), apply ``section.key=value`` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    raw = copy.deepcopy(raw)
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})[key] = value
    return validate(raw)
