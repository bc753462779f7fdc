"""``course grade``: grade a folder of submissions for one exercise, several in parallel."""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from course_lib.grading import assemble, probes, reference, report, sandbox

STUDENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class Submission:
    """One student's notebook for the exercise."""

    student: str
    path: Path


@dataclass
class Graded:
    """One graded submission: per-test results, total seconds, problems reading it."""

    student: str
    results: list
    seconds: float
    note: str = ""

    @property
    def points(self) -> int:
        return sum(r.points for r in self.results)


def find_exercise_source(root: Path, number: str) -> Path:
    """``solutions/NN_*.py`` for ``number`` (two digits); a clear error listing the ones there."""
    if not re.fullmatch(r"\d\d", str(number)):
        raise ValueError(f"--exercise must be two digits like 01, got {number!r}")
    if not Path(root, "solutions").is_dir():
        raise ValueError(f"{root} has no solutions/ folder: course grade needs the instructor's checkout of the "
                         "kit (with solutions/); run it inside that checkout, or from anywhere with the kit "
                         "installed from it")
    found = sorted(Path(root, "solutions").glob(f"{number}_*.py"))
    if len(found) != 1:
        have = ", ".join(p.stem[:2] for p in sorted(Path(root, "solutions").glob("[0-9][0-9]_*.py")))
        raise ValueError(f"--exercise {number}: no solutions/{number}_*.py (exercises: {have})")
    return found[0]


def find_submissions(folder: Path, name: str) -> list[Submission]:
    """``<student>/<name>.ipynb`` and ``<student>_<name>.ipynb`` in ``folder`` (``name`` is NN_topic).
    Student names must match ``[A-Za-z0-9][A-Za-z0-9._-]*`` (they name feedback files)."""
    found: dict[str, Path] = {}
    candidates = [(p.parent.name, p) for p in folder.glob(f"*/{name}.ipynb")]
    candidates += [(p.name[: -len(f"_{name}.ipynb")], p) for p in folder.glob(f"*_{name}.ipynb")]
    for student, path in sorted(candidates):
        if not STUDENT_NAME.match(student):
            raise ValueError(f"submission {path}: student name {student!r} must match [A-Za-z0-9._-] "
                             "(it names the feedback file); rename it")
        if student in found:
            raise ValueError(f"student {student!r} has two submissions: {found[student]} and {path}")
        found[student] = path
    return [Submission(s, p) for s, p in sorted(found.items())]


def default_cache_dir() -> Path:
    """Where reference runs are cached: ``$XDG_CACHE_HOME/course-kit/grading`` (or ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "course-kit" / "grading"


def grade(submissions: Path, number: str, out: Path, *, root: Path, cell_timeout: float = 120.0,
          notebook_timeout: float = 600.0, memory_gb: float = 6.0, jobs: int = 2,
          cache_dir: Path | None = None, sandbox_on: bool | None = None, progress: bool = True) -> list[Graded]:
    """Grade every submission of exercise ``number`` in ``submissions`` and write the reports to
    ``out`` (which must be absent or empty). ``cell_timeout``/``notebook_timeout`` in seconds,
    ``memory_gb`` the kernel's address-space limit in GiB (2**30 bytes), ``jobs`` kernels at once.
    All arguments are checked before any kernel starts or any file is written."""
    submissions, out, root = Path(submissions).resolve(), Path(out).resolve(), Path(root).resolve()
    source = find_exercise_source(root, number)
    if not submissions.is_dir():
        raise ValueError(f"SUBMISSIONS {submissions} is not a folder")
    if not 0 < cell_timeout <= 86400 or not 0 < notebook_timeout <= 86400:
        raise ValueError(f"--timeout and --notebook-timeout must be in (0, 86400] seconds, got "
                         f"{cell_timeout} and {notebook_timeout}")
    if not 0.5 <= memory_gb <= 1024:
        raise ValueError(f"--memory-gb must be in [0.5, 1024] GiB, got {memory_gb}")
    if not 1 <= jobs <= 64:
        raise ValueError(f"--jobs must be in [1, 64], got {jobs}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} must be absent or an empty folder")
    if out == submissions or submissions in out.parents:
        raise ValueError(f"--out {out} must not be inside SUBMISSIONS")
    cache_dir = Path(cache_dir or default_cache_dir()).resolve()
    needed = [Path(assemble.__file__).resolve().parents[2], Path(sys.prefix).resolve()]
    for flag, folder in (("SUBMISSIONS", submissions), ("--out", out), ("--cache", cache_dir)):
        if any(folder == n or folder in n.parents for n in needed):
            raise ValueError(f"{flag} {folder} contains the kit or its Python environment, which every kernel "
                             "needs; the grader hides that folder from kernels, so pick another one")
    exercise = assemble.load_exercise(source)
    subs = find_submissions(submissions, exercise.name)
    if not subs:
        raise ValueError(f"no submission of {exercise.name} in {submissions} (expected "
                         f"<student>/{exercise.name}.ipynb or <student>_{exercise.name}.ipynb)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    memory_bytes = int(memory_gb * 2**30)
    scratch = Path(tempfile.mkdtemp(prefix="course-grade-"))
    # what no kernel may read: the instructor's code, the cache of references, the grader's output,
    # the other submissions, and the other kernels' folders
    hide = [root / "solutions", root / "tests", root / ".git", cache_dir, out, submissions, scratch]
    limits = dict(cell_timeout=cell_timeout, notebook_timeout=notebook_timeout, memory_bytes=memory_bytes,
                  hide=hide, sandbox=sandbox_on)
    try:
        ref = reference.build_reference(exercise, source, cache_dir, cell_timeout=cell_timeout,
                                        notebook_timeout=notebook_timeout, memory_bytes=memory_bytes,
                                        hide=hide, sandbox_on=sandbox_on)
        graded = _grade_all(exercise, ref, subs, scratch, limits, jobs, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report.write_reports(out, exercise, graded)
    return graded


def _grade_all(exercise, ref, subs, scratch, limits, jobs, progress) -> list[Graded]:
    def one(k_sub):
        k, sub = k_sub
        cells, note = assemble.read_submission(sub.path)
        job = scratch / f"job-{k:04d}"
        run = sandbox.run_cells(assemble.grading_cells(exercise, cells), job / "work", **limits)
        # the kernel is gone: the grader now runs its own tests on the module(s) the run wrote
        verdicts = probes.run_probes(exercise.probes, job / "work", job / "probes", probes.ProbeLimits(
            limits["memory_bytes"], tuple(limits["hide"]), limits["sandbox"]))
        results = reference.score(exercise, ref, run, verdicts)
        shutil.rmtree(job, ignore_errors=True)
        return Graded(sub.student, results, run.seconds, note)

    from tqdm.auto import tqdm

    graded = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, item) for item in enumerate(subs)]
        for future in tqdm(as_completed(futures), total=len(futures), desc=f"grading {exercise.name}",
                           unit="submission", disable=not progress):
            graded.append(future.result())
    return sorted(graded, key=lambda g: g.student)
