"""``course ckpt``: a run's checkpoints out of the kit.

    course ckpt list RUN                                   every checkpoint, and what --resume auto does
    course ckpt consolidate RUN [--step N] [--with-optimizer] [--trust-pickles] --out FILE.safetensors
    course ckpt export-hf RUN|FILE.safetensors [--step N] [--trust-pickles] --out DIR

Without ``--step`` the newest checkpoint by save sequence (the order a resume uses) that verifies
is taken; each newer one passed over is named on stderr with the reason. One the storage cannot
read (permissions) is an error, never passed over. Nothing is unpickled beyond tensors and plain
data: DeepSpeed's ``.pt`` files are read with ``weights_only=True`` plus the three classes DeepSpeed
pickles, and refused otherwise unless ``--trust-pickles`` is given.

Exit codes: 0 done, 1 (``list``) some checkpoint does not verify, 2 bad input (no checkpoint, a
corrupt one, a step that does not exist, an output that exists, a model no HF class expresses,
``transformers`` missing): the message names it and nothing is written.
"""
from __future__ import annotations

import argparse
import sys


def add_ckpt_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``ckpt`` and its three actions to ``subparsers``; returns its parser."""
    p = subparsers.add_parser("ckpt", help="list a run's checkpoints, consolidate one into a file, export to "
                                           "Hugging Face transformers")
    sub = p.add_subparsers(dest="ckpt_command", required=True)
    ls = sub.add_parser("list", help="every checkpoint in a run folder: step, format, layout, size, verifies; "
                                     "what --resume auto would do (the checkpoint it loads, or its refusal and "
                                     "exit code)")
    ls.add_argument("run", help="the run folder (course train --out RUN), or its checkpoints/ folder")
    ls.set_defaults(func=run_list)
    c = sub.add_parser("consolidate", help="one .safetensors file of full weights (any format, any world size), "
                                           "its model config beside it; model.init_from reads it")
    c.add_argument("run", help="the run folder")
    c.add_argument("--step", type=int, help="the step to take (default: the newest checkpoint by save sequence "
                                             "that verifies; newer ones passed over are named on stderr)")
    c.add_argument("--out", required=True, help="FILE.safetensors (FILE.json is written beside it)")
    c.add_argument("--with-optimizer", action="store_true",
                   help="also FILE.optim.pt: the AdamW state by parameter name, full tensors (torch's "
                        "set_optimizer_state_dict loads it into one process); full and sharded checkpoints")
    _trust_flag(c)
    c.set_defaults(func=run_consolidate)
    e = sub.add_parser("export-hf", help="a folder transformers loads with from_pretrained (LlamaForCausalLM, "
                                         "Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM or "
                                         "GPT2LMHeadModel)")
    e.add_argument("run", help="the run folder, or a consolidated FILE.safetensors")
    e.add_argument("--step", type=int, help="the step to take (default: the newest checkpoint by save sequence "
                                             "that verifies; newer ones passed over are named on stderr)")
    e.add_argument("--out", required=True, help="the folder to create (must not exist)")
    _trust_flag(e)
    e.set_defaults(func=run_export)
    return p


def _trust_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust-pickles", action="store_true",
                        help="DeepSpeed folders only: unpickle DeepSpeed's .pt files in full, as DeepSpeed does "
                             "(runs any code a forged file names). Without it they are read with "
                             "torch.load(weights_only=True) admitting only the three plain classes DeepSpeed "
                             "pickles, and a file that asks for more is refused. Only for checkpoints you wrote")


def _fail(action: str, exc: BaseException) -> int:
    print(f"course ckpt {action}: {exc}", file=sys.stderr)
    return 2


def _report_skipped(action: str, info: dict) -> None:
    """One stderr line per newer checkpoint passed over (it does not verify), naming it and why:
    the output is an older step than the newest, and the user must know."""
    for name, why in info.get("skipped", []):
        print(f"course ckpt {action}: passed over {name} (newer than {info.get('checkpoint')}, does not verify): "
              f"{why}", file=sys.stderr)


def run_list(args: argparse.Namespace) -> int:
    from course_lib.ckpt.listing import rows, table
    from course_lib.ckpt.runs import CkptError

    try:
        listed, resume = rows(args.run)
    except CkptError as exc:
        return _fail("list", exc)
    print(table(listed))
    print(resume)
    return 0 if all(r["verifies"] for r in listed) else 1


def run_consolidate(args: argparse.Namespace) -> int:
    from course_lib.ckpt.runs import CkptError
    from course_lib.ckpt.write import consolidate

    try:
        out, side, info = consolidate(args.run, args.out, args.step, with_optimizer=args.with_optimizer,
                                      trust_pickles=args.trust_pickles)
    except CkptError as exc:
        return _fail("consolidate", exc)
    _report_skipped("consolidate", info)
    ranks = f", saved by {info['world_size']} ranks" if info.get("world_size") else ""
    where = f"{info['checkpoint']} step {info['step']} ({info['format']}{ranks})" if "checkpoint" in info else info["source"]
    extra = f" and {info['optimizer']}" if info.get("optimizer") else ""
    print(f"wrote {out}, {side}{extra}: {where}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from course_lib.ckpt.runs import CkptError
    from course_lib.ckpt.write import export_hf

    try:
        out, cls, info = export_hf(args.run, args.out, args.step, trust_pickles=args.trust_pickles)
    except (CkptError, ImportError) as exc:
        return _fail("export-hf", exc)
    _report_skipped("export-hf", info)
    where = f"{info['checkpoint']} step {info['step']}" if "checkpoint" in info else info["source"]
    print(f"wrote {out} ({cls}, from {where}); load it with transformers.{cls}.from_pretrained({str(out)!r})")
    return 0
