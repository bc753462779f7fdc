"""The training loop that composes the kit: model, data, precision, accumulation, stabilizer,
schedule, checkpoints, metrics. Read it top to bottom.

    python -m course_lib.train --config labs/configs/tiny-cpu.toml --max-steps 100 --out runs/tiny
    torchrun --nproc-per-node 2 -m course_lib.train --config ... --set train.strategy=ddp
    course train --config ... --save-every 20 --resume auto --inject-fault grad_scale@50=10

Each optimizer step makes exactly one device-to-host transfer (the stabilizer reads the loss and
every gradient norm at once); the learning rate, timings and metrics are host values.
``DIR/metrics.jsonl`` gets one row per optimizer step; checkpoints go to ``DIR/checkpoints/``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from course_lib import train_config
from course_lib.train_config import ConfigError


@dataclass
class TrainResult:
    """What a run did: optimizer steps completed, the step it resumed from (0 = fresh), the last
    logged loss (nats/token), skipped steps, and where its files are."""

    steps: int
    resumed_from: int
    final_loss: float | None
    skipped_steps: int
    out_dir: Path


def _device(cfg: dict, info) -> torch.device:
    wanted = cfg["train"]["device"]
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but CUDA is not available; use 'auto' or 'cpu'")
    if info.device.type == "cuda" or (wanted != "cpu" and torch.cuda.is_available()):
        return info.device if info.device.type == "cuda" else torch.device("cuda", 0)
    return torch.device("cpu")


def _peak_flops(cfg: dict, device: torch.device) -> float:
    """FLOP/s per device for MFU: the config's, a datasheet's (CUDA), or this CPU's measured peak."""
    if cfg["train"]["peak_flops"] > 0:
        return cfg["train"]["peak_flops"]
    if device.type == "cuda":
        from course_lib.estimate import hardware

        name = torch.cuda.get_device_name(device).lower()
        dtype = {"fp32": "tf32", "bf16": "bf16", "fp16": "fp16"}[cfg["train"]["precision"]]
        for key, acc in hardware.ACCELERATORS.items():  # first entry of the chip family (e.g. h100)
            if key.split("-")[0] in name:
                return acc.peak_flops(dtype)
        return 0.0  # unknown GPU: MFU is reported as n/a rather than guessed
    from course_lib.measure import cpu_matmul_peak_flops

    dtype = torch.bfloat16 if cfg["train"]["precision"] == "bf16" else torch.float32
    # n=1024: smaller matmuls measure thread start-up, not the arithmetic peak (256 gave 2 GFLOP/s
    # here against 59 at 1024).
    return cpu_matmul_peak_flops(1024, dtype=dtype, repeats=3).flops_per_second


def train(cfg: dict, out_dir: str | Path, *, resume: bool = False, faults: list[str] = (),
          info=None) -> TrainResult:
    """Run the loop described by ``cfg`` (from :func:`course_lib.train_config.load`).

    ``resume=True`` continues from the newest valid checkpoint under ``out_dir/checkpoints`` (a
    fresh start when there is none). ``faults``: ``KIND@STEP[=VALUE]`` strings injected by the
    stabilizer. ``info``: a :class:`DistInfo` (default: read from the environment)."""
    from course_lib import data as data_lib
    from course_lib.checkpoint import CheckpointManager
    from course_lib.estimate.flops import palm_flops_per_token
    from course_lib.metrics import MetricsLog
    from course_lib.model import TinyGPT
    from course_lib.parallel.launch import init_distributed
    from course_lib.precision import make_policy
    from course_lib.schedules import Schedule, make_scheduler
    from course_lib.stability import Stabilizer, scaled_lr
    from course_lib.parallel.strategy import make_strategy

    t, d, o, s, st, ck = (cfg[k] for k in ("train", "data", "optim", "schedule", "stability", "checkpoint"))
    info = info or init_distributed()
    if info.world_size > 1 and t["strategy"] == "single":
        raise ConfigError(f"{info.world_size} ranks but train.strategy = 'single'; set "
                          "train.strategy = 'ddp' (--set train.strategy=ddp)")
    device = _device(cfg, info)

    # ---- everything that can fail on bad input is built before the first file is written
    torch.manual_seed(t["seed"])  # same initial weights on every rank
    model = TinyGPT(train_config.build_model_config(cfg)).to(device)
    options = {"vocab_size": d["vocab_size"]} if d["task"] != "text" else (
        {"path": d["path"]} if d["path"] else {})
    dataset = data_lib.make_dataset(d["task"], seq_len=d["seq_len"], seed=t["seed"], **options)
    stream = data_lib.BatchStream(dataset, t["micro_batch"], rank=info.rank,
                                  world_size=info.world_size, seed=t["seed"], device=device)
    optimizer = torch.optim.AdamW(model.param_groups(o["weight_decay"]), lr=o["lr"],
                                  betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    schedule = Schedule(o["lr"], t["max_steps"], warmup_steps=s["warmup_steps"], kind=s["kind"],
                        min_lr=o["min_lr"], warmup_convention=s["warmup_convention"],
                        decay_steps=(s["decay_steps"] or None) if s["kind"] == "wsd" else None)
    scheduler = make_scheduler(optimizer, schedule)
    policy = make_policy(t["precision"], device)
    out_dir = Path(out_dir)
    stabilizer = Stabilizer(max_grad_norm=st["max_grad_norm"] or None, spike_policy=st["spike_policy"],
                            detect_loss_spikes=st["detect_spikes"], detect_grad_spikes=st["detect_spikes"],
                            lr_factor=st["lr_factor"], lr_steps=st["lr_steps"],
                            max_consecutive_bad=st["max_consecutive_bad"],
                            diag_dir=out_dir / "diagnostics", faults=list(faults))
    strategy = make_strategy(t["strategy"], device)
    wrapped = strategy.wrap(model)

    # ---- files start here
    ckpt = CheckpointManager(out_dir / "checkpoints", every_steps=ck["save_every"] or None,
                             keep_last=ck["keep_last"], async_save=ck["async_save"],
                             mirror=ck["mirror"] or None, writer=info.is_main)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=policy, data=stream,
                 stateful={"stabilizer": stabilizer})
    start = 0
    if resume:
        loaded = ckpt.load(**state)
        start = loaded.step if loaded else 0
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    log = MetricsLog(out_dir / "metrics.jsonl", resume_step=start, tensorboard=t["tensorboard"],
                     enabled=info.is_main)

    mcfg = model.cfg
    tokens_per_step = t["micro_batch"] * t["grad_accum"] * d["seq_len"] * info.world_size
    flops_per_token = palm_flops_per_token(model.num_params(), n_layers=mcfg.n_layers,
                                           n_heads=mcfg.n_heads, head_dim=mcfg.head_dim,
                                           seq_len=d["seq_len"])
    peak = _peak_flops(cfg, device) * info.world_size
    bar = _progress(t, start, info.is_main)
    last_loss, skipped = None, 0
    step = start
    # A step's time runs from the end of the previous row to the end of its own, so logging and
    # checkpoint policy are inside it: the tokens/s logged is what an outside stopwatch sees.
    t_last = time.perf_counter()
    try:
        while step < t["max_steps"]:
            loss_sum = torch.zeros((), device=device)
            for micro in range(t["grad_accum"]):
                x, y = next(stream)
                last = micro == t["grad_accum"] - 1
                with (nullcontext() if last else strategy.no_sync(wrapped)):
                    with policy.autocast():
                        _, loss = wrapped(x, y)
                    loss = stabilizer.on_loss(loss, step)
                    policy.backward(loss / t["grad_accum"])  # mean over micro-batches, not sum
                loss_sum += loss.detach()
            mean_loss = strategy.mean_across_ranks(loss_sum / t["grad_accum"])
            policy.unscale_(optimizer)  # clip and measure true gradients, never scaled ones
            decision = stabilizer.after_backward(model, mean_loss, step, optimizer=optimizer,
                                                 scaler=policy.scaler, batch=(x, y))  # the one sync
            lr = scheduler.get_last_lr()[0] * decision.lr_factor
            if decision.rollback and ckpt.checkpoints():
                optimizer.zero_grad(set_to_none=True)
                policy.skip(optimizer)
                # Roll back everything but the data position: replaying the same batches would
                # replay the same spike.
                loaded = ckpt.load(**{**state, "data": None})
                _append_event(out_dir, info, {**decision.log_row(), "event": "rollback",
                                              "rolled_back_to": loaded.step, "reason": decision.reason})
                log.close()
                log = MetricsLog(out_dir / "metrics.jsonl", resume_step=loaded.step,
                                 tensorboard=t["tensorboard"], enabled=info.is_main)
                step, skipped = loaded.step, skipped + 1
                continue
            if decision.overflow:
                policy.step(optimizer)  # fp16: the scaler skips the step and lowers the scale
            elif decision.skip or decision.rollback:
                policy.skip(optimizer)
            else:
                with scaled_lr(optimizer, decision.lr_factor):
                    policy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            now = time.perf_counter()
            seconds, t_last = now - t_last, now
            tokens_per_s = tokens_per_step / seconds
            row = {**decision.log_row(), "step": step, "lr": lr, "tokens_per_s": tokens_per_s,
                   "mfu": tokens_per_s * flops_per_token / peak if peak else None,
                   "step_seconds": seconds}
            if policy.scaler is not None:
                row["loss_scale"] = policy.loss_scale
            log.write(row)
            skipped += bool(decision.skip)
            last_loss = decision.loss if decision.loss is not None else last_loss
            if info.is_main:  # replicas hold identical state; rank 0 writes it for all
                ckpt.maybe_save(step, **state, metrics={"loss": last_loss})
            if bar is not None:
                bar.update(1)
                if step % t["log_every"] == 0 or step == t["max_steps"]:
                    bar.set_postfix(loss=f"{last_loss:.3f}" if last_loss is not None else "nan",
                                    lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                                    mfu=f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a")
        if info.is_main and (not ck["save_every"] or step % ck["save_every"]):
            ckpt.save(step, **state, metrics={"loss": last_loss})  # the end state, always
    finally:
        if bar is not None:
            bar.close()
        log.close()
        ckpt.close()  # waits for an async save: the last checkpoint is never lost
    return TrainResult(step, start, last_loss, skipped, out_dir)


def _append_event(out_dir: Path, info, row: dict) -> None:
    """Rare events (roll-backs) go to events.jsonl: metrics.jsonl is rewound past them."""
    if info.is_main:
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
                        help="grad_scale@500=10, nan_loss@30, inf_grad@40[=param.name]; repeatable")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value, e.g. --set train.precision=bf16")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """Validate everything, train, print a one-line summary. Exit code 2 on a config error."""
    overrides = list(args.set)
    for flag, key in ((args.max_steps, "train.max_steps"), (args.seed, "train.seed"),
                      (args.save_every, "checkpoint.save_every")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    if args.no_progress:
        overrides.append("train.progress=false")
    try:
        cfg = train_config.load(args.config, overrides)
        from course_lib.stability import parse_faults

        parse_faults(args.inject_fault)  # a malformed fault is a config error, before any file
        result = train(cfg, args.out, resume=args.resume == "auto", faults=args.inject_fault)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        if "fault" in str(exc).lower():
            print(f"config error: --inject-fault: {exc}", file=sys.stderr)
            return 2
        raise
    from course_lib.parallel.launch import is_main

    if is_main():
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        print(f"trained {result.steps - result.resumed_from} steps (resumed from {result.resumed_from}), "
              f"final loss {loss} nats/token, {result.skipped_steps} skipped; metrics in "
              f"{result.out_dir / 'metrics.jsonl'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    import os

    code = main()
    if "RANK" in os.environ:  # under torchrun: leave without gloo's exit-time crash
        from course_lib.parallel.launch import teardown

        teardown(code)
    sys.exit(code)
