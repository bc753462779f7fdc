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

from course_lib import train_config
from course_lib.train_config import ConfigError
from course_lib.watch import control as watch_control
from course_lib import profiling, utilization
from course_lib.mfu import MfuGuard


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


def _distributed(cfg: dict, info):
    """Join (or read) the process group so that the device follows ``train.device`` and the
    local rank: a CPU run uses gloo even on a GPU node, a GPU run uses cuda:LOCAL_RANK."""
    from course_lib.parallel.launch import init_distributed

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


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s random stream after the (shared) weight initialisation."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % (2**63 - 1)


def _peak_flops(cfg: dict, device: torch.device) -> float:
    """FLOP/s per device for MFU: the config's, a datasheet's (CUDA), or this CPU's measured peak."""
    if cfg["train"]["peak_flops"] > 0:
        return cfg["train"]["peak_flops"]
    if device.type == "cuda":
        from course_lib.estimate import hardware

        name = torch.cuda.get_device_name(device).lower()
        # fp32 runs on TF32 tensor cores only when torch is allowed to (set_float32_matmul_precision
        # "high"/"medium"); otherwise the matmuls are true fp32 and MFU divides by the fp32 peak.
        fp32 = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
        dtype = {"fp32": fp32, "bf16": "bf16", "fp16": "fp16"}[cfg["train"]["precision"]]
        for key, acc in hardware.ACCELERATORS.items():  # first entry of the chip family (e.g. h100)
            if key.split("-")[0] in name:
                return acc.peak_flops(dtype)
        return 0.0  # unknown GPU: MFU is reported as n/a rather than guessed
    from course_lib.mfu import robust_cpu_peak_flops

    dtype = torch.bfloat16 if cfg["train"]["precision"] == "bf16" else torch.float32
    return robust_cpu_peak_flops(dtype)  # best of interleaved passes: a busy moment costs one timing


def _stabilizer(cfg: dict, faults, out_dir: Path, rank: int, model):
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


def train(cfg: dict, out_dir: str | Path, *, resume: bool = False, faults: list[str] = (),
          info=None) -> TrainResult:
    """Run the loop described by ``cfg`` (from :func:`course_lib.train_config.load`).

    ``resume=True`` continues from the newest valid checkpoint under ``out_dir/checkpoints`` (a
    fresh start only when there is none at all; checkpoints that exist but cannot be loaded stop
    the run with CheckpointLoadError). ``faults``: ``KIND@STEP[=VALUE]`` strings injected by the
    stabilizer. ``info``: a :class:`DistInfo` (default: join the group torchrun describes)."""
    from course_lib import data as data_lib
    from course_lib import token_data
    from course_lib.estimate.flops import palm_flops_per_token
    from course_lib.metrics import MetricsLog
    from course_lib.model import TinyGPT
    from course_lib.parallel.checkpointing import TrainState
    from course_lib.parallel import resume_guard
    from course_lib.parallel.registry import make_strategy
    from course_lib.schedules import Schedule, make_scheduler
    from course_lib.wandb_log import WandbLog

    t, d, o, s, ck = (cfg[k] for k in ("train", "data", "optim", "schedule", "checkpoint"))
    info, device = _distributed(cfg, info)
    if info.world_size > 1 and t["strategy"] == "single":
        raise ConfigError(f"{info.world_size} ranks but train.strategy = 'single'; set "
                          "train.strategy = 'ddp' (--set train.strategy=ddp)")
    if info.world_size == 1 and t["strategy"] != "single" and info.backend is None:
        raise ConfigError(f"train.strategy = {t['strategy']!r} needs a process group: start with "
                          f"torchrun --nproc-per-node N (or course_lib.parallel.run_ranks)")
    mp = train_config.model_parallel_size(cfg)
    if mp > 1:  # tensor/pipeline parallel: the ranks must tile the mesh exactly, known only now
        par = cfg["parallel"]
        dp = par["dp"] or max(1, info.world_size // mp)
        if dp * mp != info.world_size:
            raise ConfigError(f"{info.world_size} ranks started, but parallel.dp x tp x pp x cp = {dp} x {par['tp']} "
                              f"x {par['pp']} x {par['cp']} = {dp * mp}; start {dp * mp} ranks, or a multiple of "
                              f"tp * pp * cp = {mp} with parallel.dp = 0 (= world / (tp * pp * cp))")
    out_dir = Path(out_dir)

    # ---- everything that can fail on bad input is built before the first file is written
    torch.manual_seed(t["seed"])  # same initial weights on every rank
    model = TinyGPT(train_config.build_model_config(cfg)).to(device)
    # From here each rank draws its own random numbers (dropout masks): replicas that drew the
    # same masks on different data would be correlated for no reason. Checkpoints keep each rank's
    # generator, so a resume continues every rank's own stream.
    torch.manual_seed(rank_seed(t["seed"], info.rank))
    faults, stalls = watch_control.trainer_faults(faults, info.world_size, t["max_steps"])
    stabilizer = _stabilizer(cfg, faults, out_dir, info.rank, model)
    strategy = make_strategy(t["strategy"], info, device, cfg)
    if not strategy.grads_visible:  # the engine keeps the gradients: nothing could inject into p.grad
        bad = [str(f) for f in stabilizer.faults.faults if f.kind in ("grad_scale", "inf_grad")]
        if bad:
            raise ConfigError(f"--inject-fault: {', '.join(bad)} writes into p.grad, but train.strategy = "
                              f"{t['strategy']!r} keeps the gradients inside its engine here; use nan_loss "
                              f"or loss_shift (or, for deepspeed, parallel.zero_stage = 0 with fp32)")
    fused = {"fused": True} if o["fused"] else {}  # one kernel for the whole update, not one per tensor
    strategy.setup(model, lambda m: torch.optim.AdamW(m.param_groups(o["weight_decay"]), lr=o["lr"],
                                                      betas=(o["beta1"], o["beta2"]), eps=o["eps"], **fused))
    if t["compile"]:
        # Compile what forward is called on (the wrapper); checkpoints keep using strategy.model,
        # whose parameter names carry no "_orig_mod." prefix. The first steps pay the compilation.
        strategy.module = torch.compile(strategy.module)
    dataset = data_lib.dataset_from_config(cfg)
    # TP/PP peers share a batch: the sampler follows the data-parallel coordinates, not the rank.
    stream = data_lib.BatchStream(dataset, t["micro_batch"], rank=strategy.dp_rank,
                                  world_size=strategy.dp_size, seed=t["seed"], device=device)
    schedule = Schedule(o["lr"], t["max_steps"], warmup_steps=s["warmup_steps"], kind=s["kind"],
                        min_lr=o["min_lr"], warmup_convention=s["warmup_convention"],
                        decay_steps=(s["decay_steps"] or None) if s["kind"] == "wsd" else None)
    scheduler = make_scheduler(strategy.optimizer, schedule)
    policy = strategy.precision_policy(t["precision"])
    wandb_log = WandbLog(cfg, out_dir, enabled=strategy.is_writer)  # [wandb]; its run id is checkpointed
    state = TrainState(strategy.model, strategy.optimizer, scheduler, policy, stream,
                       {"stabilizer": stabilizer, **wandb_log.stateful()})

    # ---- files start here
    checkpoints = strategy.checkpointer(out_dir / "checkpoints", every_steps=ck["save_every"] or None,
                                        keep_last=ck["keep_last"], async_save=ck["async_save"],
                                        mirror=ck["mirror"] or None, format=ck["format"])
    start, last_loss = 0, None  # last_loss: the last *finite* logged loss
    if resume:  # refuses a folder of checkpoints this format cannot read (never a silent step 0)
        loaded = resume_guard.resume(checkpoints, state, t["strategy"])
        if loaded is not None:
            start, last_loss = loaded.step, loaded.metrics.get("loss")
    if strategy.is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        for name, text in strategy.run_files().items():  # e.g. DeepSpeed's generated ds_config.json
            (out_dir / name).write_text(text)
    # Rows are buffered (train.metrics_flush_s) and always flushed before a checkpoint is taken:
    # a crash loses only rows the resumed run rewrites anyway.
    log = MetricsLog(out_dir / "metrics.jsonl", resume_step=start, tensorboard=t["tensorboard"],
                     enabled=strategy.is_writer, flush_every_s=t["metrics_flush_s"], sinks=[wandb_log])

    mcfg = model.cfg
    tokens_per_step = t["micro_batch"] * t["grad_accum"] * d["seq_len"] * strategy.dp_size
    flops_per_token = palm_flops_per_token(model.num_params(), n_layers=mcfg.n_layers,
                                           n_heads=mcfg.n_heads, head_dim=mcfg.head_dim,
                                           seq_len=d["seq_len"])
    mfu_guard = MfuGuard(_peak_flops(cfg, device), info.world_size, configured=t["peak_flops"] > 0,
                         warn=strategy.is_writer)  # never above 100%: an unreliable peak logs None
    bar = _progress(t, start, strategy.is_writer)
    skipped, rollbacks = 0, 0
    step, saved_at = start, start
    # A step's time runs from the end of the previous row to the end of its own, so logging and
    # checkpoint policy are inside it: the tokens/s logged is what an outside stopwatch sees.
    t_last = time.perf_counter()
    bar_step, bar_time = start, t_last
    control = watch_control.RunControl.start(cfg, info, device, out_dir, stalls)  # watchdog, signals
    profiler = profiling.start(cfg, info, device, out_dir)  # --profile: a few steps, summary in OUT/profile/
    sampler = utilization.start(cfg, info, device)  # CPU/GPU utilization columns: a thread, no device sync
    try:
        while step < t["max_steps"]:
            control.step_start(step)  # heartbeat; stop vote launched
            batches = [next(stream) for _ in range(t["grad_accum"])]
            local = strategy.forward_backward(batches, autocast=policy.autocast, backward=policy.backward,
                                              on_loss=lambda loss: stabilizer.on_loss(loss, step))
            mean_loss = strategy.global_mean(local)  # every rank decides on the same number
            policy.unscale_(strategy.optimizer)  # clip and measure true gradients, never scaled ones
            scale = policy.scale_tensor()
            decision = stabilizer.after_backward(  # the one host read of the step
                # grads_module: where this rank's gradients live (ZeRO under tp/pp: its range of them)
                getattr(strategy, "grads_module", strategy.model) if strategy.grads_visible else None, mean_loss, step, optimizer=strategy.optimizer, scaler=policy.scaler,
                batch=batches[-1], extra=control.extra(scale),  # [scale?, stop flag]
                reduce_sq=strategy.reduce_grad_sq)
            lr = scheduler.get_last_lr()[0] * decision.lr_factor
            if decision.rollback:
                strategy.zero_grad()
                strategy.skip_step(policy)
                # Roll back everything but the data position: replaying the same batches would
                # replay the same spike. Rank 0 picks the checkpoint, every rank loads that one.
                loaded = checkpoints.load(state, restore_data=False)
                if loaded is not None:
                    stabilizer.note_rollback(step)
                    _append_event(out_dir, strategy, {**decision.log_row(), "event": "rollback",
                                                      "rolled_back_to": loaded.step, "reason": decision.reason})
                    log.close()
                    log = MetricsLog(out_dir / "metrics.jsonl", resume_step=loaded.step,
                                     tensorboard=t["tensorboard"], enabled=strategy.is_writer,
                                     flush_every_s=t["metrics_flush_s"], sinks=[wandb_log])
                    step, saved_at, skipped, rollbacks = loaded.step, loaded.step, skipped + 1, rollbacks + 1
                    bar_step, bar_time = step, time.perf_counter()
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
            strategy.zero_grad()
            scheduler.step()
            step += 1
            now = time.perf_counter()
            seconds, t_last = now - t_last, now
            tokens_per_s = tokens_per_step / seconds
            row = {**decision.log_row(), "step": step, "lr": lr, "tokens_per_s": tokens_per_s,
                   "mfu": mfu_guard.mfu(tokens_per_s * flops_per_token),
                   "step_seconds": seconds}
            if scale is not None:
                row["loss_scale"] = decision.extra[0]  # the scale this step's backward used
            if not strategy.grads_visible:  # the engine measured (and clipped) inside its step
                row["grad_norm"] = norm = strategy.grad_norm_after_step()
                clip = cfg["stability"]["max_grad_norm"]
                row["clipped"] = bool(norm is not None and clip > 0 and norm > clip and not decision.skip)
            if decision.rollbacks_accepted:
                _append_event(out_dir, strategy, {**decision.log_row(), "event": "level_accepted",
                                                  "after_rollbacks": decision.rollbacks_accepted})
            row.update(sampler.columns())
            log.write(row)
            profiler.step(row)  # after the row: the summary quotes this step's MFU
            skipped += bool(decision.skip)
            if decision.loss is not None and math.isfinite(decision.loss):
                last_loss = decision.loss
            if checkpoints.should_save(step):
                log.flush()  # every row the checkpoint covers is on disk before it exists
                checkpoints.save(step, state, _ckpt_metrics(last_loss))
                saved_at = step
            if bar is not None and (step % t["log_every"] == 0 or step == t["max_steps"]):
                # Redrawn every log_every steps, with rates over that window (saves and slow steps
                # included), not one step's.
                window_tok_s = tokens_per_step * (step - bar_step) / max(now - bar_time, 1e-9)
                window_mfu = mfu_guard.mfu(window_tok_s * flops_per_token)
                bar.set_postfix(loss=f"{last_loss:.3f}" if last_loss is not None else "n/a",
                                lr=f"{lr:.2e}", tok_s=f"{window_tok_s:,.0f}",
                                mfu="n/a" if window_mfu is None else f"{window_mfu:.1%}",
                                refresh=False)
                bar.update(step - bar.n)
                bar_step, bar_time = step, now
            if control.should_stop(decision.extra[-1], step):  # a rank was signalled: all stop here
                break
        if saved_at != step:  # the end state, always (a finished run resumed again saves nothing)
            log.flush()
            checkpoints.save(step, state, _ckpt_metrics(last_loss))
    finally:
        if bar is not None:
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
                       info.backend, strategy, stopped_by=control.stopped_by, val_loss=val_loss)


def _ckpt_metrics(last_loss: float | None) -> dict:
    """What a checkpoint records: the last finite loss, or nothing (never NaN, never None)."""
    return {"loss": last_loss} if last_loss is not None else {}


def _append_event(out_dir: Path, strategy, row: dict) -> None:
    """Rare events (roll-backs, accepted levels) go to events.jsonl: metrics.jsonl is rewound."""
    if strategy.is_writer:
        with open(out_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def _progress(t: dict, start: int, is_main: bool):
    if not (t["progress"] and is_main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=t["max_steps"], initial=start, desc="train", unit="step", dynamic_ncols=True)


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------

def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``python -m course_lib.train`` and ``course train``."""
    parser = parser or argparse.ArgumentParser(prog="python -m course_lib.train",
                                               description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="TOML config (labs/configs/*.toml); defaults if omitted")
    parser.add_argument("--out", default="runs/train", help="output folder (metrics.jsonl, checkpoints/)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps (overrides train.max_steps)")
    parser.add_argument("--seed", type=int, help="overrides train.seed")
    parser.add_argument("--save-every", type=int, help="checkpoint every N steps (checkpoint.save_every)")
    parser.add_argument("--resume", choices=["auto", "never"], default="never",
                        help="auto: continue from the newest valid checkpoint in --out")
    parser.add_argument("--inject-fault", action="append", default=[], metavar="KIND@STEP[=VALUE]",
                        help="grad_scale@500=10, nan_loss@30, inf_grad@40[=param.name], loss_shift@60=3, "
                             "stall@5=60:1 (rank 1 sleeps 60 s at step 5); repeatable")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value, e.g. --set train.precision=bf16")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler around a few steps ([profile] keys): traces and summary in OUT/profile/")
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """Validate everything, train, print a one-line summary. Exit codes: 2 for a config error
    (nothing written), 3 when checkpoints exist but none can be resumed from, 4 when a DeepSpeed op's
    build lock is stale or held too long (parallel/op_locks.py), 75 when SIGUSR1/SIGTERM
    stopped the run after a checkpoint, 86 when the watchdog aborted a hung job (course_lib.watch)."""
    from course_lib.checkpoint import CheckpointLoadError
    from course_lib.parallel.op_locks import OpLockError
    from course_lib.stability import parse_faults

    overrides = list(args.set)
    for flag, key in ((args.max_steps, "train.max_steps"), (args.seed, "train.seed"),
                      (args.save_every, "checkpoint.save_every")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    if args.no_progress:
        overrides.append("train.progress=false")
    if args.profile:
        overrides.append("profile.enabled=true")
    try:
        cfg = train_config.load(args.config, overrides)
        try:
            parse_faults(watch_control.split_stalls(args.inject_fault)[0])  # malformed: config error, no file
        except ValueError as exc:
            raise ConfigError(f"--inject-fault: {exc}") from None
        result = train(cfg, args.out, resume=args.resume == "auto", faults=args.inject_fault)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except CheckpointLoadError as exc:
        print(f"cannot resume: {exc}", file=sys.stderr)
        return 3
    except OpLockError as exc:  # a JIT op's build lock left by a killed build (course doctor names it)
        print(f"cannot start: {exc}", file=sys.stderr)
        return 4
    from course_lib.parallel.launch import is_main

    if is_main():
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        done = result.steps - result.resumed_from
        origin = f"resumed from step {result.resumed_from}" if result.resumed_from else "from scratch"
        what = (f"nothing to do: already at step {result.steps}" if done == 0 and result.resumed_from
                else f"trained {done} steps ({origin})")
        where = f"on {result.device}" + (f" ({result.backend})" if result.backend else "")
        print(f"{what} {where}, final loss {loss} nats/token, {result.skipped_steps} skipped, "
              f"{result.rollbacks} rolled back; metrics in {result.out_dir / 'metrics.jsonl'}"
              + (f"; validation loss {result.val_loss:.4f} nats/token" if result.val_loss is not None else ""),
              flush=True)
        if result.stopped_by:
            print(f"stopped by {result.stopped_by} after step {result.steps}, checkpoint saved: continue with "
                  f"--resume auto (exit {watch_control.STOP_EXIT_CODE})", flush=True)
    return watch_control.STOP_EXIT_CODE if result.stopped_by else 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    code = main()
    if "RANK" in os.environ:  # under torchrun: leave without gloo's exit-time crash
        from course_lib.parallel.launch import teardown

        teardown(code)
    sys.exit(code)
