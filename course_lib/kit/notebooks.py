"""Build the course's ``.ipynb`` files from jupytext percent scripts, and check they are fresh.

Sources of truth (reviewable in diffs):

* ``labs/NN_topic.py``       -> ``labs/NN_topic.ipynb`` (committed *executed*: outputs kept)
* ``solutions/NN_topic.py``  -> ``solutions/NN_topic.ipynb`` and ``exercises/NN_topic.ipynb``

Exercises are generated from solutions line by line, before conversion, so error messages can
name the source line and every exercise keeps the cells (and cell ids) of its solution:

* ``### BEGIN SOLUTION <hint>`` ... ``### END SOLUTION`` becomes ``raise NotImplementedError(<hint>)``
* ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` is removed (kept for grading)

Cell ids are positional (``cell-000``, ...) so building twice gives identical bytes. The metadata's
``language_info`` is the one the course-kit kernel reports (:func:`language_info`): JupyterLab writes
the kernel's into the notebook when the kernel connects, so a notebook holding anything else shows
as modified (the unsaved-changes dot) right after it is opened. A lab keeps the
outputs of every code cell whose id and source are unchanged; its metadata records the hash of the
code it was executed with, so a lab whose code changed since its last execution is reported stale.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

KERNELSPEC = {"name": "course-kit", "display_name": "Python (course kit)", "language": "python"}


def language_info() -> dict:
    """The ``language_info`` that ipykernel on this Python (the course-kit kernel runs the kit's
    venv Python) sends to JupyterLab, which stores it in the notebook's metadata when the kernel
    connects: a notebook that already holds exactly this opens unmodified. Only ``version`` (the
    Python version, e.g. "3.11.7") depends on the machine; :func:`same_notebook` ignores it."""
    major = sys.version_info[0]
    return {"codemirror_mode": {"name": "ipython", "version": major}, "file_extension": ".py",
            "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
            "pygments_lexer": f"ipython{major}", "version": sys.version.split()[0]}


def same_notebook(text_a: str, text_b: str) -> bool:
    """Whether two notebook files are the same but for ``language_info.version``: notebooks built on
    another Python patch release are not stale (and are not rewritten for it)."""
    if text_a == text_b:
        return True
    try:
        a, b = json.loads(text_a), json.loads(text_b)
        for nb in (a, b):
            nb.get("metadata", {}).get("language_info", {}).pop("version", None)
    except (ValueError, AttributeError):
        return False
    return a == b


SOURCE_DIRS = ("labs", "solutions")
_SOURCE_NAME = re.compile(r"^\d\d_[a-z0-9_]+\.py$")
_MARKER = re.compile(r"^(\s*)### (BEGIN|END) (SOLUTION|HIDDEN TESTS)\b(.*)$")
_CELL_HEADER = re.compile(r"^# %%(\s.*)?$")
HIDDEN_PLACEHOLDER = "# (hidden tests run here when the exercise is graded)"


def _marker_in(line: str):
    """Match a marker in a code line, or in a markdown line (which percent format comments out)."""
    return _MARKER.match(line) or _MARKER.match(re.sub(r"^\s*#\s?", "", line, count=1))


class NotebookSourceError(ValueError):
    """A source script is malformed; the message names the file and line."""


@dataclass(frozen=True)
class BuiltNotebook:
    """One generated notebook: where it goes and its exact bytes."""

    path: Path
    text: str


# --------------------------------------------------------------------------------------------
# markers -> exercise text
# --------------------------------------------------------------------------------------------

def make_exercise_source(text: str, filename: str = "<source>") -> str:
    """Return the exercise version of a solution script (percent format) as text.

    Raises :class:`NotebookSourceError` naming ``filename`` and the 1-based line for: a marker in
    a markdown cell, a BEGIN inside an open block (nested), an END without its BEGIN, an END of the
    other kind, and a block still open at the end of its cell."""
    out: list[str] = []
    open_kind: str | None = None
    open_line = 0
    in_markdown = False
    lines = text.split("\n")

    def close_check(lineno: int) -> None:
        if open_kind:
            raise NotebookSourceError(
                f"{filename}:{open_line}: '### BEGIN {open_kind}' is never closed "
                f"(reached {'the end of its cell' if lineno else 'the end of the file'} at line "
                f"{lineno or len(lines)}); add '### END {open_kind}'")

    for lineno, line in enumerate(lines, start=1):
        header = _CELL_HEADER.match(line)
        if header:
            close_check(lineno)
            spec = header.group(1) or ""
            in_markdown = "[markdown]" in spec or "[md]" in spec
            out.append(line)
            continue
        marker = _marker_in(line) if in_markdown else _MARKER.match(line)
        if marker and in_markdown:
            raise NotebookSourceError(
                f"{filename}:{lineno}: '### {marker.group(2)} {marker.group(3)}' in a markdown "
                "cell; markers belong in code cells")
        if marker:
            indent, edge, kind, rest = marker.groups()
            if edge == "BEGIN":
                if open_kind:
                    raise NotebookSourceError(
                        f"{filename}:{lineno}: '### BEGIN {kind}' inside the '### BEGIN "
                        f"{open_kind}' opened at line {open_line}; blocks cannot nest")
                open_kind, open_line = kind, lineno
                if kind == "SOLUTION":
                    hint = rest.strip().lstrip(":-").strip() or "write your solution here"
                    out.append(f"{indent}# YOUR CODE HERE")
                    out.append(f"{indent}raise NotImplementedError({hint!r})")
                else:
                    out.append(f"{indent}{HIDDEN_PLACEHOLDER}")
            else:
                if open_kind is None:
                    raise NotebookSourceError(
                        f"{filename}:{lineno}: '### END {kind}' without a matching '### BEGIN {kind}'")
                if kind != open_kind:
                    raise NotebookSourceError(
                        f"{filename}:{lineno}: '### END {kind}' closes the '### BEGIN {open_kind}' "
                        f"opened at line {open_line}")
                open_kind = None
            continue
        if open_kind is None:
            out.append(line)
    close_check(0)
    return "\n".join(out)


def find_markers(text: str) -> list[int]:
    """1-based line numbers of every marker line in ``text`` (used to keep labs marker-free)."""
    return [i for i, line in enumerate(text.split("\n"), 1)
            if _marker_in(line)]


# --------------------------------------------------------------------------------------------
# text -> notebook
# --------------------------------------------------------------------------------------------

def code_hash(nb) -> str:
    """sha256 of the notebook's code cells (markdown edits don't make outputs stale)."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode())
            h.update(b"\0")
    return h.hexdigest()


def to_notebook(text: str, filename: str):
    """Convert a percent script to a clean nbformat v4 notebook with positional cell ids.

    The first code cell must be tagged ``parameters`` and set ``SMOKE = False``: papermill injects
    ``SMOKE = True`` after it when the tests run the notebook."""
    import jupytext

    nb = jupytext.reads(text, fmt="py:percent")
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": language_info()}
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    if not code_cells:
        raise NotebookSourceError(f"{filename}: has no code cell")
    first = code_cells[0]
    if "parameters" not in first.metadata.get("tags", []):
        raise NotebookSourceError(
            f"{filename}: the first code cell must be tagged parameters: start it with "
            "'# %% tags=[\"parameters\"]'")
    if not re.search(r"^SMOKE\s*=\s*False\b", first.source, re.M):
        raise NotebookSourceError(f"{filename}: the parameters cell must set 'SMOKE = False'")
    cells = []
    for i, cell in enumerate(nb.cells):
        meta = _kept_metadata(cell.metadata)
        if cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(cell.source, metadata=meta)
        else:
            new = nbformat.v4.new_markdown_cell(cell.source, metadata=meta)
        new.id = f"cell-{i:03d}"
        cells.append(new)
    nb.cells = cells
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


def _keep_outputs(new_nb, old_path: Path) -> None:
    """Carry over outputs of unchanged code cells from the committed lab notebook."""
    if not old_path.exists():
        return
    try:
        old = nbformat.read(old_path, as_version=4)
    except Exception:  # noqa: BLE001 - a broken old file just means no outputs to keep
        return
    old_cells = {c.get("id"): c for c in old.cells if c.cell_type == "code"}
    for cell in new_nb.cells:
        prev = old_cells.get(cell.id)
        if cell.cell_type == "code" and prev is not None and prev.source == cell.source:
            cell.outputs = prev.outputs
            cell.execution_count = prev.execution_count
    recorded = old.metadata.get("course", {})
    if recorded.get("executed_code_sha256"):  # which code made the outputs, and how long it took
        new_nb.metadata["course"] = dict(recorded)


def dumps(nb) -> str:
    """Deterministic JSON for a notebook (sorted keys, one-space indent, final newline)."""
    nbformat.validate(nb)
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


# --------------------------------------------------------------------------------------------
# the project: sources -> files
# --------------------------------------------------------------------------------------------

def find_sources(root: Path) -> list[Path]:
    """Every notebook source (``labs/NN_*.py``, ``solutions/NN_*.py``) under ``root``, sorted."""
    return sorted(p for d in SOURCE_DIRS for p in (root / d).glob("*.py")
                  if _SOURCE_NAME.match(p.name))


def build_one(source: Path, root: Path) -> list[BuiltNotebook]:
    """The notebooks generated from one source, as text (nothing is written)."""
    text = source.read_text()
    rel = str(source.relative_to(root))
    kind = source.parent.name
    if kind == "labs":
        bad = find_markers(text)
        if bad:
            raise NotebookSourceError(
                f"{rel}:{bad[0]}: solution/hidden-test markers belong in solutions/, not in labs")
        nb = to_notebook(text, rel)
        target = source.with_suffix(".ipynb")
        _keep_outputs(nb, target)
        return [BuiltNotebook(target, dumps(nb))]
    exercise_text = make_exercise_source(text, rel)  # validates markers first
    solution = to_notebook(text, rel)
    exercise = to_notebook(exercise_text, rel)
    return [BuiltNotebook(source.with_suffix(".ipynb"), dumps(solution)),
            BuiltNotebook(root / "exercises" / source.with_suffix(".ipynb").name, dumps(exercise))]


def build_all(root: Path) -> list[BuiltNotebook]:
    """Every generated notebook of the project. All sources are validated before anything is
    returned, so a malformed source means nothing is written."""
    built: list[BuiltNotebook] = []
    for source in find_sources(root):
        built.extend(build_one(source, root))
    return built


def write_all(root: Path) -> list[Path]:
    """Build and write every generated notebook; returns the paths whose bytes changed."""
    changed = []
    for item in build_all(root):
        if not item.path.exists() or not same_notebook(item.path.read_text(), item.text):
            item.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = item.path.with_suffix(".ipynb.tmp")
            tmp.write_text(item.text)
            tmp.replace(item.path)
            changed.append(item.path)
    return changed


def check_all(root: Path) -> list[str]:
    """Problems that make the generated notebooks stale, one line each (empty: all fresh)."""
    problems = []
    built = build_all(root)
    expected = {item.path for item in built}
    for item in built:
        rel = item.path.relative_to(root)
        if not item.path.exists():
            problems.append(f"{rel}: missing (run `course notebooks build`)")
        elif not same_notebook(item.path.read_text(), item.text):
            problems.append(f"{rel}: differs from its source (run `course notebooks build`)")
        if item.path.parent.name == "labs":
            problems += [f"{rel}: cell {cell.id} marks itself with a '# NBVAL_...' comment, which the learner "
                         f"reads; put the marker in the cell's tags instead (# %% tags=[\"nbval-check-output\"])"
                         for cell in nbformat.reads(item.text, as_version=4).cells
                         if cell.cell_type == "code" and any(line.strip().startswith("# NBVAL_")
                                                              for line in cell.source.splitlines())]
        if item.path.parent.name == "labs" and item.path.exists():
            nb = nbformat.reads(item.text, as_version=4)
            from course_lib.kit.notebook_paths import machine_paths

            problems += [f"{rel}: cell {cell_id} shows a path of the machine it ran on ({path[:60]}); re-record it "
                         f"with `course labs run {item.path.stem} --in-place` (it writes <repo>/<tmp>/~ instead)"
                         for cell_id, path in machine_paths(nb)]
            executed = nb.metadata.get("course", {}).get("executed_code_sha256")
            if executed != code_hash(nb):
                problems.append(f"{rel}: outputs are from older code or missing "
                                f"(run `course labs run {item.path.stem} --in-place`)")
    for d in ("labs", "solutions", "exercises"):
        for path in sorted((root / d).glob("*.ipynb")):
            if path not in expected:
                problems.append(f"{path.relative_to(root)}: has no source .py (delete it or add one)")
    return problems


def record_execution(executed_nb, target: Path, *, seconds: float | None = None) -> None:
    """Write an executed lab back into ``labs/`` with clean metadata, the code hash it ran and,
    when given, its full-size wall time in ``seconds`` with the machine it was measured on (what
    ``course doctor`` lists)."""
    from course_lib.kit.notebook_paths import scrub_paths

    clean = to_notebook_like(executed_nb)
    scrub_paths(clean, Path(target).resolve().parent.parent)  # no path of this machine is committed
    clean.metadata["course"] = {"executed_code_sha256": code_hash(clean)}
    if seconds is not None:
        clean.metadata["course"]["full_size_seconds"] = round(float(seconds), 1)
        clean.metadata["course"]["measured_on"] = _machine_line()
    tmp = target.with_suffix(".ipynb.tmp")
    tmp.write_text(dumps(clean))
    tmp.replace(target)


def record_time(lab: Path, seconds: float) -> None:
    """Store a full-size run's wall ``seconds`` (and the machine) in a committed lab's metadata,
    leaving its outputs alone. Refused when the lab's outputs came from other code than the run's
    (the time would then describe a different notebook)."""
    nb = nbformat.read(lab, as_version=4)
    meta = nb.metadata.get("course", {})
    if meta.get("executed_code_sha256") != code_hash(nb):
        raise ValueError(f"{lab.name}: its committed outputs are from older code; record it with --in-place")
    nb.metadata["course"] = {**meta, "full_size_seconds": round(float(seconds), 1), "measured_on": _machine_line()}
    tmp = lab.with_suffix(".ipynb.tmp")
    tmp.write_text(dumps(nb))
    tmp.replace(lab)


def _machine_line() -> str:
    """'N CPU cores, load L, GPU or none, torch X, date': enough to read a recorded lab time in context
    (L: the 1-minute load average when the run ended; above the core count, the lab shared the CPU)."""
    import datetime
    import os

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""  # busy machine = slower lab
    return f"{cores} CPU cores{load}, {gpu}, torch {torch.__version__}, {datetime.date.today().isoformat()}"


def recorded_run(path: Path) -> dict:
    """What an in-place run recorded in a committed lab: ``full_size_seconds`` (wall seconds of
    the whole notebook at full size) and ``measured_on``; empty when it was never timed."""
    try:
        meta = json.loads(Path(path).read_text()).get("metadata", {}).get("course", {})
    except (OSError, ValueError):
        return {}
    return {k: meta[k] for k in ("full_size_seconds", "measured_on") if k in meta}


def _kept_metadata(metadata) -> dict:
    """The cell metadata a built or executed notebook keeps: non-empty tags, and JupyterLab's
    ``jupyter.source_hidden`` (a worked answer shown collapsed until the learner opens it, written
    ``# %% jupyter={"source_hidden": true}`` in the source). Everything else (papermill's run
    metadata, execution times) is dropped so the committed file stays diffable."""
    meta = {}
    if metadata.get("tags"):
        meta["tags"] = list(metadata["tags"])
    if metadata.get("jupyter", {}).get("source_hidden"):
        meta["jupyter"] = {"source_hidden": True}
    return meta


def to_notebook_like(executed_nb):
    """Strip papermill's injected cell and run metadata so the committed file stays diffable."""
    nb = nbformat.from_dict(json.loads(json.dumps(executed_nb)))
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    for cell in nb.cells:
        # to_notebook writes only non-empty tags; papermill adds run metadata and empty tags
        tags = [t for t in cell.metadata.get("tags", []) if t != "injected-parameters"]
        cell.metadata = _kept_metadata({**cell.metadata, "tags": tags})
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": language_info()}
    return nb
