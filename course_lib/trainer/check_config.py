"""``python -m course_lib.train --check-config``: what the trainer refuses at start-up, checked for
the world size a launcher started it with, without a model, a process group or torch.

A launcher (torchrun, DeepSpeed's launcher, ``accelerate launch``, srun + torchrun) tells each rank
the world in its environment (``WORLD_SIZE``, ``RANK``). :func:`check_args` runs, on the trainer's
own command line:

* ``train_config.load``: the TOML and ``--set`` overrides, every key, type and range, the model
  shape against tp / pp / cp, ``train.strategy`` against tp / pp / cp (what composes);
* :func:`check_world`, the check the trainer runs when its ranks have started
  (``train_setup.check_world`` calls it): one process for ``single``, a process group for every
  other strategy, and dp x tp x pp x cp = the ranks started;
* the rank mesh the model-parallel strategies build (``parallel.mesh.mesh_layout``),

and returns the layout and the global batch that world would run (sequences per optimizer step =
micro_batch x grad_accum x dp). Not checked without ranks: the devices (``train.device`` against
the GPUs of a node), the backend, DeepSpeed's own parser (``parallel.deepspeed.config.validate_ds_config``,
which imports DeepSpeed), and the checkpoints ``--resume auto`` would load.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping

from course_lib.trainer import config as train_config
from course_lib.trainer.args import cli_overrides
from course_lib.trainer.config import ConfigError


def check_world(cfg: dict, world_size: int, *, has_group: bool) -> None:
    """ConfigError unless ``world_size`` ranks (a count of processes) fit ``train.strategy`` and
    the parallel layout: one process for "single", a process group (``has_group``) for the others,
    and exactly dp x tp x pp x cp ranks under tensor/pipeline/context parallelism."""
    strategy = cfg["train"]["strategy"]
    if world_size > 1 and strategy == "single":
        raise ConfigError(f"{world_size} ranks but train.strategy = 'single'; set "
                          "train.strategy = 'ddp' (--set train.strategy=ddp)")
    if world_size == 1 and strategy != "single" and not has_group:
        raise ConfigError(f"train.strategy = {strategy!r} needs a process group: start with "
                          f"torchrun --nproc-per-node N (or course_lib.parallel.run_ranks)")
    if strategy == "single" and cfg["checkpoint"]["format"] == "sharded" and not has_group:
        # DCP saves collectively: without a group the run would train every step, then fail at its first save
        raise ConfigError("checkpoint.format = 'sharded' with train.strategy = 'single' needs a process group "
                          "(DCP saves collectively): start it with torchrun --nproc-per-node 1, or use "
                          "checkpoint.format = 'full' or 'auto'")
    ep, pp = cfg["parallel"]["ep"], cfg["parallel"]["pp"]
    if world_size % ep:
        raise ConfigError(f"parallel.ep = {ep} must divide the world size ({world_size} ranks started): the ranks "
                          f"form world / ep expert-data-parallel replicas of ep ranks each; start a multiple of "
                          f"{ep} ranks, or choose ep among the divisors of {world_size}")
    if pp > 1 and world_size % pp == 0 and (world_size // pp) % ep:
        stage = world_size // pp
        raise ConfigError(f"parallel.ep = {ep} must divide the {stage} ranks of a pipeline stage ({world_size} ranks "
                          f"/ parallel.pp = {pp}): each stage folds its experts over its own dp x tp ranks; choose "
                          f"ep among the divisors of {stage}")
    mp = train_config.model_parallel_size(cfg)
    if mp > 1:  # tensor/pipeline parallel: the ranks must tile the mesh exactly, known only now
        par = cfg["parallel"]
        dp = par["dp"] or max(1, world_size // mp)
        if dp * mp != world_size:
            raise ConfigError(f"{world_size} ranks started, but parallel.dp x tp x pp x cp = {dp} x {par['tp']} "
                              f"x {par['pp']} x {par['cp']} = {dp * mp}; start {dp * mp} ranks, or a multiple of "
                              f"tp * pp * cp = {mp} with parallel.dp = 0 (= world / (tp * pp * cp))")


def launch_layout(cfg: dict, world_size: int, *, has_group: bool = True) -> dict:
    """The layout a validated ``cfg`` runs on ``world_size`` ranks (ConfigError if it cannot):
    {world_size, dp, tp, pp, cp, strategy, micro_batch, grad_accum, global_batch (sequences per
    optimizer step), seq_len, tokens_per_step, max_steps}."""
    check_world(cfg, world_size, has_group=has_group)
    par, t = cfg["parallel"], cfg["train"]
    dp = world_size
    if train_config.model_parallel_size(cfg) > 1:
        from course_lib.parallel.mesh import mesh_layout  # torch-free: the sizes, not the groups

        try:
            dp = mesh_layout(world_size, tp=par["tp"], pp=par["pp"], cp=par["cp"], dp=par["dp"]).dp
        except ValueError as exc:
            raise ConfigError(f"parallel.dp/tp/pp/cp do not fit the {world_size} ranks started: {exc}") from None
    global_batch = t["micro_batch"] * t["grad_accum"] * dp  # cp and tp ranks share their replica's sequences
    return {"world_size": world_size, "dp": dp, "tp": par["tp"], "pp": par["pp"], "cp": par["cp"],
            "strategy": t["strategy"], "micro_batch": t["micro_batch"], "grad_accum": t["grad_accum"],
            "global_batch": global_batch, "seq_len": cfg["data"]["seq_len"],
            "tokens_per_step": global_batch * cfg["data"]["seq_len"], "max_steps": t["max_steps"]}


def world_from_env(env: Mapping[str, str]) -> tuple[int, bool]:
    """(world size, started by a launcher) from a rank's environment: ``WORLD_SIZE`` as torchrun,
    DeepSpeed's launcher and accelerate set it; (1, False) without one."""
    text = env.get("WORLD_SIZE")
    if text is None:
        return 1, False
    try:
        world = int(text)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE = {text!r} in the environment is not a whole number") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE = {world} in the environment: a launcher starts at least one rank")
    return world, True


def check_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict:
    """Load and validate the config of a parsed trainer command line (``--config``, ``--set`` and
    the flags that stand for keys), then :func:`launch_layout` for the world in ``env`` (default:
    this process's environment). Returns the layout; raises ConfigError."""
    env = os.environ if env is None else env
    cfg = train_config.load(args.config, cli_overrides(args))
    if args.inject_fault:  # rare here; parsing them needs course_lib.stability (torch)
        from course_lib.stability import parse_faults
        from course_lib.watch.control import split_stalls

        try:
            parse_faults(split_stalls(args.inject_fault)[0])
        except ValueError as exc:
            raise ConfigError(f"--inject-fault: {exc}") from None
    world, launched = world_from_env(env)
    return {**launch_layout(cfg, world, has_group=launched), "config": args.config}


def describe(layout: dict) -> str:
    """One line for a person: the ranks, the layout and the global batch."""
    return (f"config ok for {layout['world_size']} rank(s): dp {layout['dp']} x tp {layout['tp']} x pp {layout['pp']} "
            f"x cp {layout['cp']}, train.strategy = {layout['strategy']!r}, global batch {layout['global_batch']} "
            f"sequences (micro_batch {layout['micro_batch']} x grad_accum {layout['grad_accum']} x dp {layout['dp']}) "
            f"= {layout['tokens_per_step']:,} tokens per step, {layout['max_steps']} steps")


def check_cli(args: argparse.Namespace) -> int:
    """``--check-config``: 0 and the layout line (printed by rank 0 only), or 2 and the error."""
    try:
        layout = check_args(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(describe(layout), flush=True)
    return 0
