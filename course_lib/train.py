"""The training loop that composes the kit: model, data, precision, accumulation, stabilizer,
schedule, checkpoints, metrics. Read it top to bottom.

    python -m course_lib.train --config labs/configs/tiny-cpu.toml --max-steps 100 --out runs/tiny
    torchrun --nproc-per-node 2 -m course_lib.train --config ... --set train.strategy=ddp
    course train --config ... --save-every 20 --resume auto --inject-fault grad_scale@50=10

How the step spreads over ranks is the strategy's business (:mod:`course_lib.parallel.strategy`):
this loop reads the same whatever the strategy. Each optimizer step makes exactly one
device-to-host transfer (the stabilizer reads the loss, every gradient norm and the fp16 loss
scale at once); the learning rate, timings and metrics are host values.
``DIR/metrics.jsonl`` gets one row per optimizer step; checkpoints go to ``DIR/checkpoints/``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from course_lib.model.moe import update_expert_bias
from course_lib.parallel.expert_parallel.dispatch import all_reduce_load
from course_lib.trainer import config as train_config
from course_lib.trainer import profiling, utilization
from course_lib.trainer import startup as train_setup
from course_lib.trainer.args import build_parser, cli_overrides  # noqa: F401 - build_parser re-exported
from course_lib.trainer.check_config import check_cli
from course_lib.trainer.config import ConfigError
from course_lib.trainer.cpu_peak import Peak
from course_lib.trainer.mfu import MfuGuard, model_flops_per_token
from course_lib.trainer.progress import StepBar, Throughput, append_event, run_summary, step_row
# Start-up facts live in trainer.startup; their names stay importable from here (course_lib.train.
# choose_device, rank_seed), and train() calls _peak_flops through this module so that tests can
# monkeypatch course_lib.train._peak_flops to skip measuring the CPU's peak.
from course_lib.trainer.startup import choose_device, rank_seed  # noqa: F401 - re-exported
from course_lib.trainer.startup import distributed as _distributed
from course_lib.trainer.startup import peak_flops as _peak_flops
from course_lib.trainer.startup import stabilizer as _stabilizer
from course_lib.watch import control as watch_control


@dataclass
class TrainResult:
    """What a run did: optimizer steps completed, the step it resumed from (0 = fresh), the last
    finite logged loss (nats/token; None if there was none), skipped steps, roll-backs, where its
    files are, and the trained ``model`` (this rank's plain module, for inspection)."""

    steps: int
    resumed_from: int
    final_loss: float | None
    skipped_steps: int
    out_dir: Path
    rollbacks: int = 0
    model: Any = field(default=None, repr=False)
    device: str = "cpu"          # where this rank computed, e.g. "cuda:1"
    backend: str | None = None   # process-group backend (None: one process)
    strategy: Any = field(default=None, repr=False)  # the strategy (e.g. strategy.full_weights())
    stopped_by: str | None = None  # signal that stopped the run early after a checkpoint (course_lib.watch)
    val_loss: float | None = None  # nats/token on data.val_path after the last step (rank 0; OUT/val.json)
    peak: Any = None  # the MFU peak (trainer.cpu_peak.Peak): FLOP/s per device and where it came from
    init_from: str | None = None  # model.init_from: the weights the run began from (None: random)


def train(cfg: dict, out_dir: str | Path, *, resume: bool = False, faults: list[str] = (),
          info=None) -> TrainResult:
    """Run the loop described by ``cfg`` (from :func:`course_lib.trainer.config.load`).

    ``resume=True`` continues from the newest valid checkpoint under ``out_dir/checkpoints`` (a
    fresh start only when there is none at all; checkpoints that exist but cannot be loaded stop
    the run with CheckpointLoadError). ``faults``: ``KIND@STEP[=VALUE]`` strings injected by the
    stabilizer. ``info``: a :class:`DistInfo` (default: join the group torchrun describes)."""
    from course_lib.data import tasks as data_lib
    from course_lib.data import tokens as token_data
    from course_lib.trainer.metrics import MetricsLog
    from course_lib.model import TinyGPT
    from course_lib.parallel.checkpointing import TrainState
    from course_lib.parallel import resume_guard
    from course_lib.parallel.registry import make_strategy
    from course_lib.schedules import make_scheduler, schedule_from_config
    from course_lib.trainer.wandb_log import WandbLog

    t, d, ck = cfg["train"], cfg["data"], cfg["checkpoint"]
    info, device = _distributed(cfg, info)
    train_setup.check_world(cfg, info)  # the ranks that started fit train.strategy and the mesh
    out_dir = Path(out_dir)
    train_setup.check_out_dir(out_dir)  # a file where the run folder goes: a config error, not a traceback

    # ---- everything that can fail on bad input is built before the first file is written
    torch.manual_seed(t["seed"])  # same initial weights on every rank
    mcfg = train_config.build_model_config(cfg)
    model = TinyGPT(mcfg).to(device)
    # From here each rank draws its own random numbers (dropout masks): replicas that drew the
    # same masks on different data would be correlated for no reason. Checkpoints keep each rank's
    # generator, so a resume continues every rank's own stream.
    torch.manual_seed(rank_seed(t["seed"], info.rank))
    faults, stalls = watch_control.trainer_faults(faults, info.world_size, t["max_steps"])
    stabilizer = _stabilizer(cfg, faults, out_dir, info.rank, model)
    strategy = make_strategy(t["strategy"], info, device, cfg)
    init_from = cfg["model"].get("init_from") or None
    init_read = bool(init_from) and not (resume and train_setup.holds_checkpoints(out_dir, ck["mirror"], strategy))
    if init_read:
        # Fine-tuning: every rank reads the same weights. A resume beside checkpoints takes every
        # weight from them (or refuses): the source is not read, and may be gone.
        from course_lib.model.init_source import load_init_state

        try:
            model.load_state_dict(load_init_state(init_from, mcfg), strict=True)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"model.init_from = {init_from!r}: {exc}") from None
    fp8 = _fp8_convert(cfg, model, device)  # train.precision = "fp8": Linear layers swapped before any wrapper
    train_setup.check_faults_reach(stabilizer, strategy, t["strategy"])  # an engine may keep p.grad
    # Counted on the whole model, before a strategy keeps its share of it (expert parallelism
    # keeps E / ep experts per rank: a rank's own count would understate every token's FLOPs).
    flops_per_token = model_flops_per_token(model, d["seq_len"])
    strategy.setup(model, train_setup.adamw(cfg["optim"]))
    if t["compile"]:
        # Compile what forward is called on (the wrapper); checkpoints keep using strategy.model,
        # whose parameter names carry no "_orig_mod." prefix. The first steps pay the compilation.
        strategy.module = torch.compile(strategy.module)
    # TP/PP peers share a batch: the sampler follows the data-parallel coordinates, not the rank.
    stream = data_lib.stream_from_config(cfg, dp_rank=strategy.dp_rank, dp_size=strategy.dp_size, device=device)
    scheduler = make_scheduler(strategy.optimizer, schedule_from_config(cfg))
    policy = strategy.precision_policy(t["precision"])
    wandb_log = WandbLog(cfg, out_dir, enabled=strategy.is_writer)  # [wandb]; its run id is checkpointed
    state = TrainState(strategy.model, strategy.optimizer, scheduler, policy, stream,
                       {"stabilizer": stabilizer, **wandb_log.stateful()})

    if ck["mirror"]:  # a mirror in (or above) the checkpoint folder would upload onto itself
        train_setup.check_mirror_apart(ck["mirror"], out_dir / "checkpoints")
    if not resume:  # a fresh run never prunes an earlier run's checkpoints, nor truncates its metrics
        train_setup.check_fresh_folder(out_dir, strategy)
    if ck["mirror"] and not resume:  # a fresh run never uploads over a mirror's checkpoints
        train_setup.check_fresh_mirror(ck["mirror"], strategy)

    # ---- files start here
    checkpoints = strategy.checkpointer(out_dir / "checkpoints", every_steps=ck["save_every"] or None,
                                        keep_last=ck["keep_last"], async_save=ck["async_save"],
                                        mirror=ck["mirror"] or None, format=ck["format"])
    start, last_loss = 0, None  # last_loss: the last *finite* logged loss
    if resume:  # refuses a folder of checkpoints this format cannot read (never a silent step 0)
        loaded = resume_guard.resume(checkpoints, state, t["strategy"])
        if loaded is not None:
            start, last_loss = loaded.step, loaded.metrics.get("loss")
        elif init_from and not init_read:  # holds_checkpoints saw some: a resume loads one or refuses
            raise ConfigError(f"--resume auto found checkpoints under {out_dir} at start-up but loaded none, and "
                              f"model.init_from was not read; run again")
    if strategy.is_writer:
        _write_run_files(out_dir, cfg, strategy)
        if fp8 is not None:  # which layers run FP8, by which path, and whether it is emulated
            from course_lib.precision.fp8_model import describe

            (out_dir / "fp8.json").write_text(json.dumps(fp8, indent=2) + "\n")
            print(describe(fp8), flush=True)
    # Rows are buffered (train.metrics_flush_s) and always flushed before a checkpoint is taken:
    # a crash loses only rows the resumed run rewrites anyway. A roll-back reopens the log.
    open_log = functools.partial(MetricsLog, out_dir / "metrics.jsonl", tensorboard=t["tensorboard"],
                                 enabled=strategy.is_writer, flush_every_s=t["metrics_flush_s"], sinks=[wandb_log])
    log = open_log(resume_step=start)

    tokens_per_step = t["micro_batch"] * t["grad_accum"] * d["seq_len"] * strategy.dp_size
    peak = _agreed_peak(Peak.of(_peak_flops(cfg, device)), info)  # config, datasheet, doctor's stamp or start-up
    if strategy.is_writer:  # which peak every MFU of this run divides by, and why that one
        (out_dir / "mfu_peak.json").write_text(json.dumps(dataclasses.asdict(peak), indent=2) + "\n")
    throughput = Throughput(tokens_per_step, flops_per_token,
                            MfuGuard(peak.flops, info.world_size, configured=peak.source == "config",
                                     warn=strategy.is_writer, source=peak.source))  # an unreliable peak logs None
    bar = StepBar(enabled=t["progress"] and strategy.is_writer, start=start, max_steps=t["max_steps"],
                  log_every=t["log_every"], throughput=throughput)
    skipped, rollbacks = 0, 0
    step, saved_at = start, start
    moe_balance = model.cfg.moe_bias_update_rate is not None
    # A step's time runs from the end of the previous row to the end of its own, so logging and
    # checkpoint policy are inside it: the tokens/s logged is what an outside stopwatch sees.
    t_last = time.perf_counter()
    bar.restart(start, t_last)
    control = watch_control.RunControl.start(cfg, info, device, out_dir, stalls)  # watchdog, signals
    profiler = profiling.start(cfg, info, device, out_dir)  # --profile: a few steps, summary in OUT/profile/
    sampler = utilization.start(cfg, info, device)  # CPU/GPU utilization columns: a thread, no device sync
    try:
        while step < t["max_steps"]:
            # ---- the step: forward/backward, one verdict, then the update it allows
            control.step_start(step)  # heartbeat; stop vote launched
            batches = [next(stream) for _ in range(t["grad_accum"])]
            local = strategy.forward_backward(batches, autocast=policy.autocast, backward=policy.backward,
                                              on_loss=lambda loss: stabilizer.on_loss(loss, step))
            mean_loss = strategy.global_mean(local)  # every rank decides on the same number
            aux = _aux_losses(strategy, mcfg)  # {"z_loss": mean over ranks} with model.z_loss > 0
            policy.unscale_(strategy.optimizer)  # clip and measure true gradients, never scaled ones
            scale = policy.scale_tensor()
            extra = control.extra(scale)  # [scale?, stop flag]
            decision = stabilizer.after_backward(  # the one host read of the step
                _grads_to_check(strategy), mean_loss, step, optimizer=strategy.optimizer, scaler=policy.scaler,
                batch=batches[-1], extra=extra + list(aux.values()), reduce_sq=strategy.reduce_grad_sq)
            aux = {k: v if math.isfinite(v) else None  # host values, read with the rest; None: NaN/Inf
                   for k, v in zip(aux, decision.extra[len(extra):])}
            decision.extra = decision.extra[:len(extra)]
            lr = scheduler.get_last_lr()[0] * decision.lr_factor
            if decision.rollback:
                loaded = _roll_back(strategy, policy, checkpoints, state)
                if loaded is not None:
                    stabilizer.note_rollback(step)
                    append_event(out_dir, {**decision.log_row(), "event": "rollback", "rolled_back_to": loaded.step,
                                           "reason": decision.reason}, enabled=strategy.is_writer)
                    log.close()
                    log = open_log(resume_step=loaded.step)
                    step, saved_at, skipped, rollbacks = loaded.step, loaded.step, skipped + 1, rollbacks + 1
                    bar.restart(step, time.perf_counter())
                    continue
                if strategy.is_writer:
                    warnings.warn(f"step {step}: roll-back asked for ({decision.reason}) but no checkpoint "
                                  f"exists yet; the step is skipped instead", RuntimeWarning, stacklevel=2)
            if decision.overflow:
                strategy.optimizer_step(policy, found_inf=True)  # fp16: no step, the scale halves
            elif decision.skip or decision.rollback:
                strategy.skip_step(policy)
            else:
                strategy.optimizer_step(policy, lr_factor=decision.lr_factor, found_inf=False)
            if moe_balance:  # DeepSeek-V3's bias from this step's loads, summed over every rank routing them
                update_expert_bias(strategy.model, getattr(strategy, "expert_load_reduce", all_reduce_load))
            strategy.zero_grad()
            scheduler.step()
            step += 1

            # ---- the hooks: metrics row, events, profiler, checkpoint, progress bar, stop vote
            now = time.perf_counter()
            seconds, t_last = now - t_last, now
            row = step_row(decision, step, lr, seconds, throughput, scaled=scale is not None, strategy=strategy,
                           max_grad_norm=cfg["stability"]["max_grad_norm"], sampler=sampler)
            if decision.rollbacks_accepted:
                append_event(out_dir, {**decision.log_row(), "event": "level_accepted",
                                       "after_rollbacks": decision.rollbacks_accepted}, enabled=strategy.is_writer)
            log.write({**row, **aux})  # z_loss beside loss (which includes it)
            profiler.step(row)  # after the row: the summary quotes this step's MFU
            skipped += bool(decision.skip)
            if decision.loss is not None and math.isfinite(decision.loss):
                last_loss = decision.loss
            if checkpoints.should_save(step):
                log.flush()  # every row the checkpoint covers is on disk before it exists
                checkpoints.save(step, state, _ckpt_metrics(last_loss))
                saved_at = step
            bar.update(step, now, last_loss, lr)  # every log_every steps, rates over that window
            if control.should_stop(decision.extra[-1], step):  # a rank was signalled: all stop here
                break
        if saved_at != step:  # the end state, always (a finished run resumed again saves nothing)
            log.flush()
            checkpoints.save(step, state, _ckpt_metrics(last_loss))
    finally:
        bar.close()
        log.close()
        checkpoints.close()  # waits for an async save: the last checkpoint is never lost
        control.close()
        sampler.stop()
        profiler.close()
    control.finish()  # signalled: every rank's checkpoint is complete before any rank exits
    val_loss = token_data.end_of_run_validation(cfg, strategy, device, out_dir, step)  # data.val_path, rank 0
    # strategy.model: this rank's trained module (under tensor/pipeline parallelism its shard or
    # stage; the dense ``model`` it was cut from is not trained).
    return TrainResult(step, start, last_loss, skipped, out_dir, rollbacks, strategy.model, str(device),
                       info.backend, strategy, stopped_by=control.stopped_by, val_loss=val_loss, peak=peak,
                       init_from=init_from)


def _agreed_peak(peak: Peak, info) -> Peak:
    """The peak every rank divides by. A peak measured at start-up is each rank's own, taken while
    the other ranks were busy doing the same: the ranks agree on the highest (the one least lowered
    by the others; one tiny all-reduce), so every rank logs an MFU and none logs it from a peak its
    neighbours pushed down. Configured, datasheet and stamped peaks are already the same everywhere."""
    if peak.source != "start-up" or info.world_size == 1 or info.backend is None:
        return peak
    import torch.distributed as dist

    rate = torch.tensor([peak.flops], dtype=torch.float64)
    if info.backend == "nccl":
        rate = rate.cuda()
    dist.all_reduce(rate, op=dist.ReduceOp.MAX)
    return dataclasses.replace(peak, flops=float(rate.item()),
                               detail=peak.detail + f"; the highest of {info.world_size} ranks' measurements")


def _aux_losses(strategy, mcfg) -> dict:
    """The auxiliary loss terms this step's forwards added (``model.z_loss`` > 0: {"z_loss": ...}),
    each averaged over the data-parallel ranks, on the device; {} when the model adds none."""
    if not mcfg.z_loss:
        return {}
    from course_lib.model import TinyGPT

    model = next(m for m in strategy.model.modules() if isinstance(m, TinyGPT))
    return {k: strategy.global_mean(v) for k, v in model.pop_aux_losses().items()}


def _fp8_convert(cfg: dict, model, device) -> dict | None:
    """``train.precision = "fp8"``: swap the model's Linear layers for FP8 ones (``[fp8]``: recipe,
    backend, the layers kept in high precision) in place, before the strategy wraps the model, and
    return the conversion's report (None for other precisions)."""
    if cfg["train"]["precision"] != "fp8":
        return None
    from course_lib.precision.fp8_model import convert_for_training

    f8 = cfg["fp8"]
    return convert_for_training(model, recipe=f8["recipe"], backend=f8["backend"], keep=f8["keep"],
                                fsdp_all_gather=f8["fsdp_all_gather"], device=device)


def _grads_to_check(strategy):
    """The module whose gradients the stabilizer measures and clips: where this rank's gradients
    live (ZeRO under tp/pp: its range of them), or None when an engine keeps them to itself."""
    return getattr(strategy, "grads_module", strategy.model) if strategy.grads_visible else None


def _roll_back(strategy, policy, checkpoints, state):
    """Drop this step's gradients and load the checkpoint the stabilizer's roll-back goes to (the
    Loaded checkpoint, or None when none exists yet). Everything but the data position is rolled
    back: replaying the same batches would replay the same spike. Rank 0 picks the checkpoint,
    every rank loads that one."""
    strategy.zero_grad()
    strategy.skip_step(policy)
    return checkpoints.load(state, restore_data=False)


def _write_run_files(out_dir: Path, cfg: dict, strategy) -> None:
    """The writer rank's run description: ``config.json`` and the strategy's own files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, text in strategy.run_files().items():  # e.g. DeepSpeed's generated ds_config.json
        (out_dir / name).write_text(text)


def _ckpt_metrics(last_loss: float | None) -> dict:
    """What a checkpoint records: the last finite loss, or nothing (never NaN, never None)."""
    return {"loss": last_loss} if last_loss is not None else {}


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------

def run_cli(args: argparse.Namespace) -> int:
    """Validate everything, train, print a one-line summary (``--check-config``: validate only, see
    :mod:`course_lib.trainer.check_config`). Exit codes: 2 for a config error
    (nothing written), 3 when checkpoints exist but none can be resumed from, 4 when a DeepSpeed op's
    build lock is stale or held too long (parallel/deepspeed/op_locks.py), 75 when SIGUSR1/SIGTERM
    stopped the run after a checkpoint, 86 when the watchdog aborted a hung job (course_lib.watch)."""
    if getattr(args, "check_config", False):  # --check-config: validate for this world size, train nothing
        return check_cli(args)
    from course_lib.checkpoint import CheckpointLoadError
    from course_lib.parallel.deepspeed.op_locks import OpLockError
    from course_lib.stability import parse_faults

    overrides = cli_overrides(args)
    resume = args.resume == "auto"
    try:
        # A resume takes every weight from its checkpoints: model.init_from's source is read (and
        # checked) only when there is nothing to resume (train does it then).
        cfg = train_config.load(args.config, overrides, init_source=not resume)
        try:
            parse_faults(watch_control.split_stalls(args.inject_fault)[0])  # malformed: config error, no file
        except ValueError as exc:
            raise ConfigError(f"--inject-fault: {exc}") from None
        result = train(cfg, args.out, resume=resume, faults=args.inject_fault)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except CheckpointLoadError as exc:
        print(f"cannot resume: {exc}", file=sys.stderr)
        return 3
    except OpLockError as exc:  # a JIT op's build lock left by a killed build (course doctor names it)
        print(f"cannot start: {exc}", file=sys.stderr)
        return 4
    from course_lib.parallel.ranks.launch import is_main

    if is_main():
        for line in run_summary(result, watch_control.STOP_EXIT_CODE):
            print(line, flush=True)
    return watch_control.STOP_EXIT_CODE if result.stopped_by else 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    code = main()
    if "RANK" in os.environ:  # under torchrun: leave without gloo's exit-time crash
        from course_lib.parallel.ranks.launch import teardown

        teardown(code)
    sys.exit(code)
