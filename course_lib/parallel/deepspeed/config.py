"""The DeepSpeed config the ``deepspeed`` strategy runs with, built from the trainer's config.

Pure functions, so a test (or a learner) can look at the generated JSON without starting ranks:

* :func:`build_ds_config` maps ``[train]``, ``[optim]``, ``[stability]`` and ``[parallel]`` onto
  DeepSpeed's keys (batch sizes, precision, clipping, optimizer, ZeRO stage and offload);
* :func:`validate_ds_config` runs DeepSpeed's own parser (``deepspeed.runtime.config.DeepSpeedConfig``)
  over it, and turns any rejection into a :class:`~course_lib.trainer.config.ConfigError` naming the
  *trainer* key responsible (a learner edits ``parallel.zero_stage``, never ``zero_optimization``).

What is deliberately *not* in the DeepSpeed config:

* **No ``scheduler`` section.** Every strategy's learning rate comes from the kit's own
  :mod:`course_lib.schedules` (a ``LambdaLR`` over :class:`~course_lib.schedules.Schedule`), so the
  curves of ``single``, ``ddp`` and ``deepspeed`` are the same function. DeepSpeed's ``WarmupCosineLR``
  is not: its warmup is log-shaped by default, its floor is a ratio, and none of the kit's three
  warmup conventions or WSD exists there. The trainer's scheduler drives the param groups of the
  optimizer DeepSpeed steps (see :class:`~course_lib.parallel.deepspeed.engine.DeepSpeedStrategy`).
* **No loss scaling or autocast on the trainer's side**: the ``bf16``/``fp16`` sections make DeepSpeed
  cast and scale itself; the strategy hands the trainer an fp32 precision policy.
* **FP8 is not a DeepSpeed section.** ``train.precision = "fp8"`` swaps the model's Linear layers for
  FP8 ones (:func:`course_lib.precision.fp8_model.convert_for_training`) before the engine is built;
  their weights stay fp32 parameters and they quantize inside their own forward and backward. The
  engine therefore runs its fp32 path (no ``bf16`` section: casting the weights to bf16 would change
  what the FP8 layers quantize, and DeepSpeed's bf16 optimizer would keep other masters than one
  FP8 process does), and the strategy hands the trainer the fp8 policy's bf16 autocast for the
  layers kept in high precision, exactly as one FP8 process runs.

Clipping: with ZeRO >= 1 (or bf16) the gradients live inside DeepSpeed's buffers, not in
``p.grad``, so DeepSpeed clips (``gradient_clipping = stability.max_grad_norm``). With fp32 ZeRO-0 the
gradients are in ``p.grad`` after the last micro-batch's backward, the trainer's stabilizer measures
and clips them as for every other strategy, and ``gradient_clipping`` is 0 (never clip twice).
"""
from __future__ import annotations

import copy
import re
from typing import Any

from course_lib.validate import ConfigError


def engine_clips(cfg: dict) -> bool:
    """True when DeepSpeed (not the trainer's stabilizer) clips, because it keeps the gradients out
    of ``p.grad``: any ZeRO stage >= 1, and bf16/fp16 at stage 0 (their optimizers accumulate into
    fp32 copies). fp8 is DeepSpeed's fp32 path (see :func:`build_ds_config`)."""
    return cfg["parallel"]["zero_stage"] >= 1 or cfg["train"]["precision"] not in ("fp32", "fp8")


def _device_type(device: Any) -> str:
    return device.type if hasattr(device, "type") else str(device).split(":")[0]


def build_ds_config(cfg: dict, *, world_size: int, device: Any) -> dict:
    """DeepSpeed's config dict for the validated trainer config ``cfg`` on ``world_size`` ranks
    computing on ``device`` (``"cpu"``, ``"cuda:0"`` or a ``torch.device``).

    Raises ConfigError (naming ``train.precision``) for fp16 on a CPU device: DeepSpeed's fp16
    path needs CUDA ("Type fp16 is not supported on your device")."""
    t, o, st, par = cfg["train"], cfg["optim"], cfg["stability"], cfg["parallel"]
    if t["precision"] == "fp16" and _device_type(device) != "cuda":
        raise ConfigError("train.precision = 'fp16' with train.strategy = 'deepspeed' needs a CUDA device: "
                          "DeepSpeed's fp16 optimizer and loss scaler do not run on the CPU. Use "
                          "train.precision = 'bf16' or 'fp32' here")
    stage = par["zero_stage"]
    offload_opt = par["offload_optimizer"] != "none"
    zero: dict[str, Any] = {"stage": stage}
    if offload_opt:
        zero["offload_optimizer"] = {"device": par["offload_optimizer"], "pin_memory": _device_type(device) == "cuda"}
    if par["offload_param"] != "none":
        zero["offload_param"] = {"device": par["offload_param"], "pin_memory": _device_type(device) == "cuda"}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t["micro_batch"],
        "gradient_accumulation_steps": t["grad_accum"],
        "train_batch_size": t["micro_batch"] * t["grad_accum"] * world_size,
        # ZeRO-0: the trainer's stabilizer clips p.grad; ZeRO >= 1: DeepSpeed clips its partitions.
        "gradient_clipping": float(st["max_grad_norm"]) if engine_clips(cfg) else 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o["lr"], "betas": [o["beta1"], o["beta2"]], "eps": o["eps"],
                "weight_decay": o["weight_decay"],  # per-group values (norms, biases: 0) override it
                # torch's AdamW unless the optimizer step runs on the CPU (ZeRO-Offload), where
                # DeepSpeed insists on its own vectorised DeepSpeedCPUAdam.
                "torch_adam": not offload_opt,
                "adam_w_mode": True,
            },
        },
        "zero_optimization": zero,
        "bf16": {"enabled": t["precision"] == "bf16"},
        "steps_per_print": 2**31 - 1,   # the trainer logs; DeepSpeed's own progress lines are noise
        "wall_clock_breakdown": False,
    }
    if t["precision"] == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                      "hysteresis": 2, "min_loss_scale": 1}
    return ds


# DeepSpeed key (as it appears in a parser message or a pydantic location) -> the trainer key a
# learner should change. Most specific first.
_KEY_OWNERS: tuple[tuple[str, str], ...] = (
    ("offload_optimizer", "parallel.offload_optimizer"),
    ("offload_param", "parallel.offload_param"),
    ("cpu_offload", "parallel.offload_optimizer"),
    ("zero_optimization", "parallel.zero_stage"),
    ("stage", "parallel.zero_stage"),
    ("train_micro_batch_size_per_gpu", "train.micro_batch"),
    ("micro_batch", "train.micro_batch"),
    ("gradient_accumulation_steps", "train.grad_accum"),
    ("gradient_acc", "train.grad_accum"),
    ("train_batch_size", "train.micro_batch"),
    ("bf16", "train.precision"),
    ("DeepSpeedBF16Config", "train.precision"),
    ("DeepSpeedFP16Config", "train.precision"),
    ("bfloat16", "train.precision"),
    ("fp16", "train.precision"),
    ("gradient_clipping", "stability.max_grad_norm"),
    ("weight_decay", "optim.weight_decay"),
    ("betas", "optim.beta1"),
    ("eps", "optim.eps"),
    ("lr", "optim.lr"),
    ("optimizer", "optim.lr"),
)


def trainer_key_for(message: str) -> str:
    """The trainer key a DeepSpeed parser message is about (``parallel.zero_stage`` if unsure:
    the ZeRO section is where almost every rejection comes from)."""
    for ds_key, owner in _KEY_OWNERS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(ds_key)}(?![A-Za-z0-9])", message, re.IGNORECASE):
            return owner
    return "parallel.zero_stage"


def validate_ds_config(ds: dict, *, world_size: int) -> Any:
    """Run DeepSpeed's own parser over ``ds``; returns its ``DeepSpeedConfig``. Any rejection
    becomes a ConfigError naming the trainer key responsible and quoting DeepSpeed.

    DeepSpeed reads the world size from the process group; without one (a unit test) it assumes 1,
    so the batch identity ``train_batch_size = micro x accum x world`` is checked here and the
    parser sees the one-rank batch."""
    micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps")
    if ds.get("train_batch_size") != (micro or 0) * (accum or 0) * world_size:
        raise ConfigError(f"train.micro_batch: DeepSpeed's train_batch_size ({ds.get('train_batch_size')}) must be "
                          f"train.micro_batch x train.grad_accum x ranks ({micro} x {accum} x {world_size})")
    from deepspeed import comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = copy.deepcopy(ds)
    try:  # what DeepSpeedConfig will read: 1 until deepspeed.init_distributed adopted the group
        seen = ds_comm.get_world_size() if ds_comm.is_initialized() else 1
    except Exception:
        seen = 1
    if seen != world_size:
        parsed["train_batch_size"] = (micro or 0) * (accum or 0) * seen
    try:
        return DeepSpeedConfig(parsed)
    except Exception as exc:  # AssertionError, ValueError, pydantic's ValidationError...
        text = " ".join(f"{type(exc).__name__}: {exc}".split())  # pydantic's message spans lines
        key = trainer_key_for(text)
        raise ConfigError(f"{key}: DeepSpeed rejected the config generated from it ({text[:500]})") from None
