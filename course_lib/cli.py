"""The ``course`` command: doctor, notebooks, labs, estimate, train, data, launch, plan, ckpt, grade, check.

Each subcommand is a thin shell over a library module, so everything the CLI does is also callable
(and tested) from Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from course_lib.kit.root import find_root  # noqa: F401 - also course_lib.cli.find_root for callers


# --------------------------------------------------------------------------------------------
# doctor
# --------------------------------------------------------------------------------------------

def cmd_doctor(args: argparse.Namespace) -> int:
    from course_lib.kit import doctor

    if args.clear_stale_locks:
        for path in doctor.clear_stale_locks():
            print(f"removed stale op build lock {path}")
    if args.measure_peak:
        print("measuring this CPU's matmul peak for MFU (fp32 and bf16, 1 thread up to every core) ...", flush=True)
        doctor.measure_peak()
    report = doctor.gather(load_ops=args.load_ops, root=find_root())
    print(json.dumps(report, indent=2) if args.json else doctor.format_report(report))
    return 1 if report["problems"] else 0


# --------------------------------------------------------------------------------------------
# notebooks
# --------------------------------------------------------------------------------------------

def cmd_notebooks(args: argparse.Namespace) -> int:
    from course_lib.kit import notebooks

    root = find_root()
    try:
        if args.action == "build":
            changed = notebooks.write_all(root)
            for path in changed:
                print(f"wrote {path.relative_to(root)}")
            print(f"{len(changed)} notebook(s) changed")
            stale = [p for p in notebooks.check_all(root) if "outputs are from older code" in p]
            for line in stale:
                print(f"note: {line}")
            return 0
        problems = notebooks.check_all(root)
    except notebooks.NotebookSourceError as exc:
        print(f"course notebooks {args.action}: {exc}", file=sys.stderr)
        return 2
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{len(problems)} stale or missing notebook(s)", file=sys.stderr)
        return 1
    print("all generated notebooks match their sources")
    return 0


# --------------------------------------------------------------------------------------------
# labs run
# --------------------------------------------------------------------------------------------

def _select_labs(root: Path, names: list[str]) -> list[Path]:
    labs = sorted((root / "labs").glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return labs
    chosen = []
    for name in names:
        hits = [p for p in labs if p.stem == name or p.stem.startswith(name)]
        if not hits:
            known = ", ".join(p.stem for p in labs)
            raise SystemExit(f"course labs run: no lab matches {name!r}; labs are: {known}")
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


def cmd_labs_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from course_lib.kit import notebooks
    from course_lib.kit import run_notebooks

    root = find_root()
    if args.in_place and args.smoke:
        raise SystemExit("course labs run: --in-place records full-size outputs; drop --smoke")
    if args.record_time and (args.smoke or args.in_place):
        raise SystemExit("course labs run: --record-time times a full-size run and keeps the committed outputs; "
                         "use it without --smoke and --in-place")
    if args.timeout <= 0:
        raise SystemExit(f"course labs run: --timeout must be > 0 seconds, got {args.timeout}")
    labs = _select_labs(root, args.names)
    out_dir = Path(args.out).resolve()
    results = []
    bar = tqdm(labs, desc="labs", unit="nb", file=sys.stderr)
    for lab in bar:
        bar.set_postfix_str(lab.stem)
        res = run_notebooks.execute(lab, out_dir / lab.name, smoke=args.smoke,
                                    timeout_s=args.timeout, cwd=lab.parent)
        if res.status == "ok" and args.in_place:
            import nbformat

            notebooks.record_execution(nbformat.read(res.output, as_version=4), lab, seconds=res.seconds)
        elif res.status == "ok" and args.record_time:
            try:
                notebooks.record_time(lab, res.seconds)
            except ValueError as exc:  # outputs from older code: the time would describe another notebook
                res = dataclasses.replace(res, status="stale", error=str(exc))
        results.append(res)
    bar.close()
    width = max([len("notebook")] + [len(r.notebook.stem) for r in results])
    print(f"\n{'notebook':<{width}}  {'status':<7} {'seconds':>8}  error")
    for r in results:
        print(f"{r.notebook.stem:<{width}}  {r.status:<7} {r.seconds:>8.1f}  {r.error[:100]}")
    failed = [r for r in results if r.status != "ok"]
    print(f"\n{len(results) - len(failed)}/{len(results)} ok; executed copies in {out_dir}")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="course", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="check the install and what this machine can run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--load-ops", action="store_true",
                   help="also build/load DeepSpeed's CPU ops (about a minute each the first time)")
    p.add_argument("--clear-stale-locks", action="store_true",
                   help="first delete op build locks left by killed builds (no process holds them, "
                        "older than COURSE_OP_LOCK_STALE_S, default 120 s)")
    p.add_argument("--measure-peak", action="store_true",
                   help="first measure this CPU's fp32/bf16 matmul peak and stamp it into the venv, where the "
                        "trainer's MFU reads it (run it on a quiet machine; a few seconds per core count)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("notebooks", help="generate .ipynb files from the .py sources")
    p.add_argument("action", choices=["build", "check"],
                   help="build: write labs/solutions/exercises notebooks; check: fail if stale")
    p.set_defaults(func=cmd_notebooks)

    p = sub.add_parser("labs", help="execute labs headless")
    labs_sub = p.add_subparsers(dest="labs_command", required=True)
    run = labs_sub.add_parser("run", help="execute labs with papermill and print a summary")
    run.add_argument("names", nargs="*", help="lab names or prefixes (default: all), e.g. 00")
    run.add_argument("--smoke", action="store_true", help="tiny sizes (SMOKE=True), as the tests do")
    run.add_argument("--out", default="runs/labs", help="folder for executed copies (default runs/labs)")
    run.add_argument("--timeout", type=float, default=900.0, help="per-cell timeout in seconds")
    run.add_argument("--in-place", action="store_true",
                     help="write the executed (full-size) outputs back into labs/*.ipynb")
    run.add_argument("--record-time", action="store_true",
                     help="only record the full-size wall time (shown by `course doctor`) in labs/*.ipynb; "
                          "the committed outputs stay")
    run.set_defaults(func=cmd_labs_run)

    from course_lib import train as train_mod

    p = sub.add_parser("train", help="train TinyGPT from a TOML config (same as python -m course_lib.train)")
    train_mod.build_parser(p)
    p.set_defaults(func=train_mod.run_cli)

    from course_lib.estimate import cli as estimate_cli  # torch-free, cheap to import

    p = sub.add_parser("estimate", help="memory / FLOPs per rank for a model and a parallel layout")
    estimate_cli.add_arguments(p)
    p.set_defaults(func=estimate_cli.run)

    from course_lib.launchers.cli import add_launch_parser

    add_launch_parser(sub)  # `course launch`: torchrun / deepspeed / accelerate / sbatch scripts

    from course_lib.planner.cli import add_plan_parser

    add_plan_parser(sub)  # `course plan`: layout search, configs, launch scripts, checkpoint plan, budget

    from course_lib.ckpt.cli import add_ckpt_parser

    add_ckpt_parser(sub)  # `course ckpt list/consolidate/export-hf`: checkpoints out of the kit

    from course_lib.data.prepare import add_data_parser

    add_data_parser(sub)  # `course data prepare`: a text file -> a token file for data.task = "tokens"

    from course_lib.grading.cli import add_grading_parsers

    add_grading_parsers(sub)  # `course grade` (instructor) and `course check` (learner)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
