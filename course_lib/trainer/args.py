"""The trainer's command line (``python -m course_lib.train``, ``course train``), without torch.

The parser and the flag-to-override mapping live here, apart from the training loop
(:mod:`course_lib.train`, which imports torch at the top), so that ``--check-config``
(:mod:`course_lib.trainer.check_config`) and anything else that reads a trainer command line - a launcher
test's fake ``torchrun``, for one - can parse it without paying torch's import.
"""
from __future__ import annotations

import argparse

DESCRIPTION = ("The kit's trainer: model, data, precision, accumulation, stabilizer, schedule, checkpoints, "
               "metrics; one process or every rank of torchrun / deepspeed / accelerate.")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``python -m course_lib.train`` and ``course train``."""
    parser = parser or argparse.ArgumentParser(prog="python -m course_lib.train", description=DESCRIPTION)
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
    parser.add_argument("--check-config", action="store_true",
                        help="only check: load the TOML and --set overrides, validate them, and check the layout "
                             "against the world size this process was started with (WORLD_SIZE from torchrun, "
                             "deepspeed or accelerate; 1 without a launcher): dp x tp x pp x cp = ranks, the "
                             "global batch, train.strategy with tp/pp/cp. Prints the layout and exits 0, or "
                             "exits 2 with the error. Builds no model, joins no process group, writes nothing")
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser


def cli_overrides(args: argparse.Namespace) -> list[str]:
    """The ``section.key=value`` overrides of a parsed command line: every ``--set``, then the
    flags that stand for a config key (--max-steps, --seed, --save-every, --no-progress, --profile)."""
    overrides = list(args.set)
    for flag, key in ((args.max_steps, "train.max_steps"), (args.seed, "train.seed"),
                      (args.save_every, "checkpoint.save_every")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    if args.no_progress:
        overrides.append("train.progress=false")
    if args.profile:
        overrides.append("profile.enabled=true")
    return overrides
