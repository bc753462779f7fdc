"""Strategy names -> implementations, without importing torch (the config validator lists them).

A new parallel form adds one line here and one module that subclasses
:class:`course_lib.parallel.strategy.Strategy`.
"""
from __future__ import annotations

import importlib
from typing import Any

STRATEGIES: dict[str, tuple[str, str, str]] = {  # name -> (module, class, one-line description)
    "single": ("course_lib.parallel.strategy", "Single", "one process, the reference"),
    "ddp": ("course_lib.parallel.data_parallel.torch_ddp", "TorchDDP",
            "torch DistributedDataParallel: replicated weights, bucketed gradient all-reduce"),
    "ddp-scratch": ("course_lib.parallel.data_parallel.scratch_ddp", "ScratchDDP",
                    "the from-scratch BucketedDDP in place of torch DDP: the same numbers"),
    "zero1": ("course_lib.parallel.data_parallel.zero_strategy", "Zero1",
              "the from-scratch ZeRO-1: optimizer state sharded, gradients reduce-scattered"),
    "zero2": ("course_lib.parallel.data_parallel.zero_strategy", "Zero2",
              "the from-scratch ZeRO-2: as zero1, and each rank keeps only its own gradients"),
    "fsdp-scratch": ("course_lib.parallel.data_parallel.fsdp_scratch_strategy", "FSDPScratch",
                     "the from-scratch ZeRO-3 (SimpleFSDP): weights sharded, gathered per layer"),
    "fsdp": ("course_lib.parallel.data_parallel.fsdp2", "FSDP2",
             "torch FSDP2 fully_shard per block: parallel.reshard_after_forward, parallel.cpu_offload"),
    "deepspeed": ("course_lib.parallel.deepspeed.engine", "DeepSpeedStrategy",
                  "the DeepSpeed engine, ZeRO stage parallel.zero_stage (0-3), optional CPU offload"),
}

#: ``checkpoint.format`` values (besides "auto") each ``train.strategy`` can save and load when
#: parallel.tp = pp = cp = 1, and why the others cannot; the config validator refuses the rest
#: before anything is written (the strategies' ``checkpoint_formats`` say the same; a test holds
#: them together). Under tp/pp/cp > 1 trainer.config decides (full, or sharded for fsdp x tp).
CHECKPOINT_FORMATS: dict[str, tuple[tuple[str, ...], str]] = {
    # "sharded" needs a process group of one (torchrun --nproc-per-node 1): trainer.check_config
    # refuses it at start-up without one, before anything is written
    "single": (("full", "sharded"), ""),
    "ddp": (("full", "sharded"), ""),
    "ddp-scratch": (("full", "sharded"), ""),
    "zero1": (("full",), "its optimizer shards are flat tensors, not DTensors: they are consolidated into a "
                         "full file"),
    "zero2": (("full",), "its optimizer shards are flat tensors, not DTensors: they are consolidated into a "
                         "full file"),
    "fsdp-scratch": (("full",), "its flat padded shards are not DTensors: they are saved in the unsharded layout"),
    "fsdp": (("sharded",), "its DTensor shards save through DCP only (consolidate_sharded makes a full file)"),
    "deepspeed": (("deepspeed",), "the engine writes its own partitioned checkpoints (deepspeed_to_state_dict "
                                  "converts one to a plain state dict)"),
}

#: Not a ``train.strategy`` name: chosen by :func:`make_strategy` when ``parallel.tp * parallel.pp
#: * parallel.cp > 1``; ``train.strategy`` then names its data-parallel dimension, one of
#: :data:`MODEL_PARALLEL_DP`.
MODEL_PARALLEL = ("course_lib.parallel.composed.model_parallel", "ModelParallel",
                  "tensor (parallel.tp) x pipeline (parallel.pp) parallel, data parallel over the rest")
#: Chosen for ``train.strategy = "fsdp"`` with model parallelism (tp > 1, pp = 1: trainer.config).
FSDP_MODEL_PARALLEL = ("course_lib.parallel.composed.fsdp_tp", "FSDPTensorParallel",
                       "FSDP2 over dp on a DTensor tensor-parallel (parallel.tp) model, one device mesh")

#: Chosen with ``parallel.ep > 1`` (experts sharded over parallel.ep ranks, tokens through all-to-all),
#: ``train.strategy`` name -> (module, class, description): the data-parallel dimension around the
#: experts. trainer.config refuses ep with the other strategies, naming why. With tp/pp > 1 the
#: strategy is MODEL_PARALLEL, its experts course_lib.parallel.composed.experts ("ddp", "zero1", "zero2").
EXPERT_PARALLEL_STRATEGIES: dict[str, tuple[str, str, str]] = {
    "ddp": ("course_lib.parallel.expert_parallel.in_trainer", "ExpertParallelDDP",
            "torch DDP over the non-expert weights, expert gradients reduced over the expert-DP group"),
    "ddp-scratch": ("course_lib.parallel.expert_parallel.in_trainer", "ExpertParallelScratchDDP",
                    "the from-scratch BucketedDDP over the non-expert weights, experts reduced over expert-DP"),
    "zero1": ("course_lib.parallel.expert_parallel.zero_in_trainer", "ExpertParallelZero1",
              "the from-scratch ZeRO-1: dense state sharded over every rank, expert slices' over expert-DP"),
    "zero2": ("course_lib.parallel.expert_parallel.zero_in_trainer", "ExpertParallelZero2",
              "the from-scratch ZeRO-2: as zero1, and each rank keeps only the gradients it owns"),
    "fsdp": ("course_lib.parallel.expert_parallel.in_trainer", "ExpertParallelFSDP",
             "FSDP2: experts DTensors on an (edp, ep) mesh, sharded over edp; the rest over every rank"),
    "fsdp-scratch": ("course_lib.parallel.expert_parallel.fsdp_scratch_in_trainer", "ExpertParallelFSDPScratch",
                     "the from-scratch ZeRO-3 (SimpleFSDP) over the dense weights, expert slices whole and "
                     "reduced over expert-DP"),
    "deepspeed": ("course_lib.parallel.deepspeed.experts", "ExpertParallelDeepSpeed",
                  "DeepSpeed ZeRO 0-2: the kit's expert slices marked as DeepSpeed expert params, reduced by "
                  "the engine over its expert-DP groups"),
}
#: ``train.strategy`` names that run with ``parallel.ep > 1``.
EXPERT_PARALLEL_DP = tuple(EXPERT_PARALLEL_STRATEGIES)

#: The ``train.strategy`` names that compose with tp/pp/cp > 1 (modes of
#: :mod:`course_lib.parallel.composed.dp`), name -> what the data-parallel dimension does.
MODEL_PARALLEL_DP: dict[str, str] = {
    "ddp": "replicated weights and optimizer, one flattened gradient all-reduce over the dp ranks",
    "zero1": "ZeRO-1 over the dp ranks: optimizer state sharded, gradients reduce-scattered",
    "zero2": "ZeRO-2 over the dp ranks: as zero1, and each rank keeps only its range of the gradients",
    "fsdp": "torch FSDP2 over the dp ranks on a DTensor tensor-parallel model (one device mesh; pp = 1)",
}


def strategy_names() -> tuple[str, ...]:
    """The names ``train.strategy`` accepts."""
    return tuple(STRATEGIES)


def make_strategy(name: str, info: Any, device: Any, cfg: dict | None = None):
    """Build the strategy called ``name`` for this rank (``info``: DistInfo, ``device``: where
    the model computes, ``cfg``: the validated trainer config, None for the defaults).
    ValueError naming the accepted names otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {name!r}")
    module, cls, _ = STRATEGIES[name]
    par = (cfg or {}).get("parallel", {})
    if par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1) > 1:  # train.strategy: the dp dimension
        if name not in MODEL_PARALLEL_DP:  # trainer.config refuses it first, with the layouts
            raise ValueError(f"strategy {name!r} does not compose with parallel.tp/pp/cp > 1; use one of "
                             f"{', '.join(MODEL_PARALLEL_DP)}")
        module, cls, _ = FSDP_MODEL_PARALLEL if name == "fsdp" else MODEL_PARALLEL
    elif par.get("ep", 1) > 1:  # experts sharded over parallel.ep ranks
        if name not in EXPERT_PARALLEL_DP:  # trainer.config refuses it first, saying why
            raise ValueError(f"strategy {name!r} does not run with parallel.ep > 1; use one of "
                             f"{', '.join(EXPERT_PARALLEL_DP)}")
        module, cls, _ = EXPERT_PARALLEL_STRATEGIES[name]
    return getattr(importlib.import_module(module), cls)(info, device, cfg)
