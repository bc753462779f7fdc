"""The ``course grade`` and ``course check`` subcommands (thin shells over the library)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_grading_parsers(sub) -> None:
    """Register ``grade`` (instructor) and ``check`` (learner) on the ``course`` sub-parsers."""
    p = sub.add_parser("grade", help="grade a folder of submitted notebooks for one exercise")
    p.add_argument("submissions", help="folder of <student>/NN_topic.ipynb or <student>_NN_topic.ipynb")
    p.add_argument("--exercise", required=True, help="two digits, e.g. 01")
    p.add_argument("--out", required=True, help="report folder (must be absent or empty)")
    p.add_argument("--timeout", type=float, default=120.0, help="wall-time limit per cell, seconds (default 120)")
    p.add_argument("--notebook-timeout", type=float, default=600.0,
                   help="wall-time limit per submission, seconds (default 600)")
    p.add_argument("--memory-gb", type=float, default=6.0,
                   help="address-space limit of each kernel, GiB (default 6; torch reserves ~2 GiB virtual)")
    p.add_argument("--jobs", type=int, default=2, help="submissions graded at once (default 2)")
    p.add_argument("--cache", default=None, help="folder for cached reference runs (default $XDG_CACHE_HOME/course-kit/grading, "
                        "i.e. ~/.cache/course-kit/grading)")
    p.add_argument("--no-sandbox", action="store_true",
                   help="do not use namespaces even where available (trusted submissions only)")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("check", help="run your exercise notebook's visible checks and show a score per test")
    p.add_argument("exercise", help="two digits, e.g. 01")
    p.add_argument("--notebook", default=None, help="the notebook to check (default exercises/NN_*.ipynb)")
    p.add_argument("--timeout", type=float, default=300.0, help="wall-time limit per cell, seconds")
    p.set_defaults(func=cmd_check)


def cmd_grade(args: argparse.Namespace) -> int:
    from course_lib.kit.root import find_root
    from course_lib.grading import assemble, grade, reference, report, sandbox

    try:
        graded = grade.grade(Path(args.submissions), args.exercise, Path(args.out), root=find_root(),
                             cell_timeout=args.timeout, notebook_timeout=args.notebook_timeout,
                             memory_gb=args.memory_gb, jobs=args.jobs,
                             cache_dir=Path(args.cache) if args.cache else None,
                             sandbox_on=False if args.no_sandbox else None)
    except (ValueError, assemble.GradingSourceError, reference.ReferenceError) as exc:
        print(f"course grade: {exc}", file=sys.stderr)
        return 2
    if not sandbox.sandbox_available() or args.no_sandbox:
        print("note: kernels ran WITHOUT namespaces (no network/process/file isolation); see docs/GRADING.md, "
              "Isolation", file=sys.stderr)
    for line in report.console_lines(graded):
        print(line)
    print(f"reports in {args.out}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from course_lib.kit.root import find_root
    from course_lib.grading import learner

    try:
        path = Path(args.notebook) if args.notebook else learner.find_exercise_notebook(find_root(), args.exercise)
        lines = learner.check_notebook(path, cell_timeout=args.timeout)
    except ValueError as exc:
        print(f"course check: {exc}", file=sys.stderr)
        return 2
    print(learner.format_lines(path.stem, lines))
    return 0 if all(ln.status in ("passed", "hidden") for ln in lines) else 1
