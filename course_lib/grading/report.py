"""The grader's output folder: grades.csv, feedback per student (Markdown + HTML), class summary."""
from __future__ import annotations

import csv
import html
from collections import Counter
from pathlib import Path

STATUS_WORDS = {"passed": "passed", "failed": "a check failed", "wrong": "a checked value is wrong",
                "timeout": "ran past the time limit", "crashed": "the kernel died",
                "not-run": "not run (an earlier cell crashed or timed out)"}


def write_reports(out: Path, exercise, graded: list) -> list[Path]:
    """Write every report into ``out``; files in ``out`` the grader did not write (``out`` was
    empty when grading began, so a kernel put them there) are removed. Returns the paths written."""
    out = Path(out)
    written = [_write_csv(out / "grades.csv", exercise, graded)]
    (out / "feedback").mkdir(exist_ok=True)
    for g in graded:
        md, page = feedback(exercise, g)
        written.append(_write(out / "feedback" / f"{g.student}.md", md))
        written.append(_write(out / "feedback" / f"{g.student}.html", page))
    written += _write_summary(out, exercise, graded)
    keep = {p.resolve() for p in written}
    for path in sorted(out.rglob("*"), reverse=True):
        if path.is_symlink() or (path.is_file() and path.resolve() not in keep):
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return written


def _write(path: Path, text: str) -> Path:
    if path.is_symlink():
        path.unlink()
    path.write_text(text, encoding="utf-8")
    return path


def _write_csv(path: Path, exercise, graded: list) -> Path:
    if path.is_symlink():
        path.unlink()
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "exercise", "test", "points", "max", "status", "seconds"])
        for g in graded:
            for r in g.results:
                writer.writerow([g.student, exercise.name, r.test.label, r.points, r.test.points, r.status,
                                 f"{r.seconds:.2f}"])
    return path


def feedback(exercise, g) -> tuple[str, str]:
    """(Markdown, HTML) feedback for one student: score, and per test its status and message.
    Messages come from the check that failed; a hidden test's code is never shown."""
    head = f"# {exercise.name}: {g.student}\n\nScore: **{g.points} / {exercise.max_points}**\n"
    if g.note:
        head += f"\nNote: {g.note}.\n"
    rows = ["| test | points | status | message |", "| --- | --- | --- | --- |"]
    for r in g.results:
        msg = r.message.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {r.test.label} | {r.points} / {r.test.points} | {STATUS_WORDS.get(r.status, r.status)} "
                    f"| {msg} |")
    md = head + "\n" + "\n".join(rows) + "\n"
    cells = "".join(
        f"<tr class='{html.escape(r.status)}'><td>{html.escape(r.test.label)}</td><td>{r.points} / {r.test.points}"
        f"</td><td>{html.escape(STATUS_WORDS.get(r.status, r.status))}</td><td>{html.escape(r.message)}</td></tr>"
        for r in g.results)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(exercise.name)}: "
            f"{html.escape(g.student)}</title><style>td,th{{border:1px solid #ccc;padding:4px}}"
            f".passed{{background:#e6ffe6}}</style></head><body><h1>{html.escape(exercise.name)}: "
            f"{html.escape(g.student)}</h1><p>Score: <b>{g.points} / {exercise.max_points}</b></p>"
            + (f"<p>Note: {html.escape(g.note)}.</p>" if g.note else "")
            + f"<table><tr><th>test</th><th>points</th><th>status</th><th>message</th></tr>{cells}</table>"
            "</body></html>\n")
    return md, page


def _write_summary(out: Path, exercise, graded: list) -> list[Path]:
    """summary.md and summary.png: score histogram and the most-failed checks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [g.points for g in graded]
    failed = Counter(r.test.label for g in graded for r in g.results if r.status != "passed")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist(scores, bins=range(0, exercise.max_points + 2), edgecolor="black", align="left")
    ax1.set(title=f"{exercise.name}: scores ({len(graded)} submissions)", xlabel="points", ylabel="students")
    top = failed.most_common(8)
    ax2.barh([label for label, _ in top][::-1] or ["(none)"], [n for _, n in top][::-1] or [0])
    ax2.set(title="most-failed tests", xlabel="submissions failing")
    from matplotlib.ticker import MaxNLocator

    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of students
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    png = out / "summary.png"
    if png.is_symlink():
        png.unlink()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    mean = sum(scores) / len(scores) if scores else 0.0
    lines = [f"# {exercise.name}: class summary", "",
             f"{len(graded)} submissions, mean {mean:.1f} / {exercise.max_points}, "
             f"full marks: {sum(s == exercise.max_points for s in scores)}", "", "![scores](summary.png)", "",
             "| student | points |", "| --- | --- |", *[f"| {g.student} | {g.points} |" for g in graded], "",
             "## Most-failed tests", "", "| test | failing submissions |", "| --- | --- |",
             *[f"| {label} | {n} |" for label, n in failed.most_common()]]
    return [png, _write(out / "summary.md", "\n".join(lines) + "\n")]
