"""The trusted side: run the instructor's solution once per exercise, keep its records as the
references, and score a student's run against them in the grader's own process."""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import course_lib
from course_lib.grading import assemble, probes, sandbox, values

MESSAGE_LIMIT = 300  # characters of a check's message shown in feedback


class ReferenceError(RuntimeError):
    """The instructor's solution does not pass its own tests, or a test cell records nothing."""


@dataclass
class Reference:
    """Reference values by name, and the names each test cell must record (by cell id)."""

    records: dict[str, values.Record]
    names: dict[str, list[str]]
    seconds: float
    probes: dict[str, list[str]]  # the solution's verdicts from the grader-side probes (all "ok")


@dataclass
class TestResult:
    """One test cell of one submission: points earned, status, message for feedback, seconds."""

    test: assemble.TestCell
    points: int
    status: str  # passed, failed, wrong, timeout, crashed, not-run
    message: str
    seconds: float


def fingerprint(exercise_source: Path) -> str:
    """sha256 (16 hex digits) of the solution source and every course_lib module: references
    computed with other code are recomputed."""
    h = hashlib.sha256(Path(exercise_source).read_bytes())
    package = Path(course_lib.__file__).parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    h.update(json.dumps(sandbox.KERNEL_ENV, sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_reference(exercise: assemble.Exercise, source: Path, cache_dir: Path, *, cell_timeout: float,
                    notebook_timeout: float, memory_bytes: int, hide: list[Path],
                    sandbox_on: bool | None = None) -> Reference:
    """Run the solution in a fresh kernel, then the exercise's probes on what it wrote (or reuse
    the cached run with the same fingerprint)."""
    folder = Path(cache_dir) / f"{exercise.name}-{fingerprint(source)}"
    index = folder / "reference.json"
    if index.is_file():
        data = json.loads(index.read_text())
        return Reference(values.load_records(folder / "work" / "records"), data["names"], data["seconds"],
                         data.get("probes", {}))
    tmp = Path(cache_dir) / f".{folder.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    run = sandbox.run_cells(assemble.grading_cells(exercise, None), tmp / "work", cell_timeout=cell_timeout,
                            notebook_timeout=notebook_timeout, memory_bytes=memory_bytes, hide=hide,
                            sandbox=sandbox_on)
    bad = [f"{cid}: {o.status} {o.error_name}: {o.error[:300]}" for cid, o in run.cells.items() if o.status != "ok"]
    if bad:
        raise ReferenceError(f"{exercise.name}: the solution fails its own run (log {run.log}): " + "; ".join(bad))
    names = {t.id: run.cells[t.id].record_names for t in exercise.tests}
    empty = [t.id for t in exercise.tests if not names[t.id]]
    if empty:
        raise ReferenceError(f"{exercise.name}: test cell(s) {', '.join(empty)} carry points but record nothing; "
                             "call course_lib.grading.record(name, value) on the values they check")
    all_names = [n for cell_names in names.values() for n in cell_names]
    if len(all_names) != len(set(all_names)):
        raise ReferenceError(f"{exercise.name}: a record name is used twice; names must be unique")
    records = values.load_records(tmp / "work" / "records")
    unjudged = [n for n, r in records.items() if r.judge and isinstance(values.judged(r.judge, r.value), values.Malformed)]
    if unjudged:
        raise ReferenceError(f"{exercise.name}: the solution's own value(s) {', '.join(unjudged)} fail their judge")
    verdicts = probes.run_probes(exercise.probes, tmp / "work", tmp / "probes",
                                 probes.ProbeLimits(memory_bytes, tuple(hide), sandbox_on))
    failing = {n: v for n, v in verdicts.items() if any(x != "ok" for x in v)}
    if failing:
        raise ReferenceError(f"{exercise.name}: the solution fails the grader's probe(s): {failing}")
    shutil.rmtree(tmp / "probes", ignore_errors=True)
    (tmp / "reference.json").write_text(json.dumps({"names": names, "seconds": run.seconds, "probes": verdicts}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return Reference(values.load_records(folder / "work" / "records"), names, run.seconds, verdicts)


def score(exercise: assemble.Exercise, ref: Reference, run: sandbox.RunOutcome,
          verdicts: dict[str, list[str]] | None = None) -> list[TestResult]:
    """Points per test cell: the cell finished, every value it records equals the reference
    (compared here, outside the student's kernel, with the reference run's tolerances), and every
    probe it names gave the reference's verdicts (``verdicts``: :func:`probes.run_probes`)."""
    verdicts = verdicts or {}
    got = values.load_records(run.records_dir)
    sources = {c.id: c.source for c in exercise.cells}
    stop = next((f"the run stopped at {cid}: {o.error}" for cid, o in run.cells.items()
                 if o.status in ("timeout", "crashed")), "")
    results = []
    for test in exercise.tests:
        outcome = run.cells.get(test.id, sandbox.CellOutcome("not-run"))
        if outcome.status != "ok":
            status = {"error": "failed"}.get(outcome.status, outcome.status)
            message = stop if outcome.status == "not-run" else _message(outcome, sources[test.id] if test.hidden else "")
            results.append(TestResult(test, 0, status, message, outcome.seconds))
            continue
        problem = ""
        for name in ref.names[test.id]:
            want = ref.records[name]
            if name not in got:
                problem = f"the value checked as '{name}' was never recorded"
                break
            mine, theirs = got[name].value, want.value
            if want.judge:  # several answers are right: compare the judge's verdicts
                mine, theirs = values.judged(want.judge, mine), values.judged(want.judge, theirs)
            reason = values.mismatch(mine, theirs, want.rtol, want.atol)
            if reason:
                shown = "" if test.hidden else (f" (got {values.describe(mine)}, expected "
                                                f"{values.describe(theirs)})")
                problem = f"'{name}': {reason}{shown}"
                break
        for name in test.probes if not problem else ():
            mine = verdicts.get(name)
            if mine != ref.probes.get(name):
                bad = next((v for v in mine or [] if v != "ok"), "the probe did not run")
                problem = f"the grader's own test '{name}': {bad}"[:MESSAGE_LIMIT]
                break
        status = "wrong" if problem else "passed"
        results.append(TestResult(test, 0 if problem else test.points, status, problem, outcome.seconds))
    return results


def _message(outcome: sandbox.CellOutcome, hidden_source: str) -> str:
    """The failing check's message, short; for a hidden cell never a line of its code."""
    text = f"{outcome.error_name}: {outcome.error}".strip(": ")
    if hidden_source:
        lines = {ln.strip() for ln in hidden_source.split("\n") if len(ln.strip()) >= 12}
        if any(ln in text for ln in lines):
            text = f"{outcome.error_name}: (message withheld: it quotes the hidden test's code)"
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."
