"""The grader's output folder: grades.csv, feedback per student (Markdown + HTML), class summary."""
from __future__ import annotations

import csv
import html
from collections import Counter
from pathlib import Path

# The status column says the same word in grades.csv and in the feedback (one vocabulary for the
# instructor's spreadsheet and the student's page); the feedback explains each word it uses below
# its table.
STATUS_MEANING = {"passed": "the test cell ran and every check and compared value agreed",
                  "failed": "a check in the test cell failed (or the cell raised an error)",
                  "wrong": "the checks passed in the kernel, but a checked value differs from the reference",
                  "timeout": "the cell ran past the time limit",
                  "crashed": "the kernel died",
                  "not-run": "not run: an earlier cell crashed or timed out"}


def unreadable_line(g) -> str:
    """The console's / summary's sentence for a submission that could not be read ("" if it was)."""
    return f"UNREADABLE: {g.note}; every test scored 0 (see feedback/{g.student}.md)" if g.note else ""


def console_lines(graded: list) -> list[str]:
    """One line per student for the terminal: points, seconds, and why when the file was unreadable."""
    lines = []
    for g in graded:
        line = f"{g.student:<24} {g.points:>4} / {sum(r.test.points for r in g.results)}  ({g.seconds:.1f} s)"
        lines.append(line + (f"  {unreadable_line(g)}" if g.note else ""))
    return lines


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
        head += f"\nUnreadable submission: {g.note}, so every test scored 0. Submit the .ipynb file itself.\n"
    rows = ["| test | points | status | message |", "| --- | --- | --- | --- |"]
    for r in g.results:
        msg = r.message.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {r.test.label} | {r.points} / {r.test.points} | {r.status} | {msg} |")
    used = list(dict.fromkeys(r.status for r in g.results))
    legend = [(word, STATUS_MEANING.get(word, word)) for word in used]
    md = (head + "\n" + "\n".join(rows) + "\n\n"
          + "\n".join(f"- **{word}**: {meaning}" for word, meaning in legend) + "\n")
    cells = "".join(
        f"<tr class='{html.escape(r.status)}'><td>{html.escape(r.test.label)}</td><td>{r.points} / {r.test.points}"
        f"</td><td>{html.escape(r.status)}</td><td>{html.escape(r.message)}</td></tr>"
        for r in g.results)
    legend_html = "".join(f"<li><b>{html.escape(w)}</b>: {html.escape(m)}</li>" for w, m in legend)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(exercise.name)}: "
            f"{html.escape(g.student)}</title><style>td,th{{border:1px solid #ccc;padding:4px}}"
            f".passed{{background:#e6ffe6}}</style></head><body><h1>{html.escape(exercise.name)}: "
            f"{html.escape(g.student)}</h1><p>Score: <b>{g.points} / {exercise.max_points}</b></p>"
            + (f"<p>Unreadable submission: {html.escape(g.note)}, so every test scored 0. Submit the .ipynb "
               "file itself.</p>" if g.note else "")
            + f"<table><tr><th>test</th><th>points</th><th>status</th><th>message</th></tr>{cells}</table>"
            f"<ul>{legend_html}</ul></body></html>\n")
    return md, page


def _write_summary(out: Path, exercise, graded: list) -> list[Path]:
    """summary.md and summary.png: score histogram and the most-failed checks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [g.points for g in graded]
    failed = Counter(r.test.label for g in graded for r in g.results if r.status != "passed")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    # the exercise's name goes in the figure's title: in one axis' title a long name was clipped
    fig.suptitle(exercise.name)
    ax1.hist(scores, bins=range(0, exercise.max_points + 2), edgecolor="black", align="left")
    ax1.set(title=f"scores ({len(graded)} submissions)", xlabel="points", ylabel="students")
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
    unreadable = [g for g in graded if g.note]
    lines = [f"# {exercise.name}: class summary", "",
             f"{len(graded)} submissions, mean {mean:.1f} / {exercise.max_points}, "
             f"full marks: {sum(s == exercise.max_points for s in scores)}", "", "![scores](summary.png)", "",
             *([f"**Unreadable submissions ({len(unreadable)})**, scored 0:", "",
                *[f"- {g.student}: {g.note}" for g in unreadable], ""] if unreadable else []),
             "| student | points | note |", "| --- | --- | --- |",
             *[f"| {g.student} | {g.points} | {'unreadable: ' + g.note if g.note else ''} |" for g in graded], "",
             "## Most-failed tests", "", "| test | failing submissions |", "| --- | --- |",
             *[f"| {label} | {n} |" for label, n in failed.most_common()]]
    return [png, _write(out / "summary.md", "\n".join(lines) + "\n")]
