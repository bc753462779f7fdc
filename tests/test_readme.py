"""The README's and docs/'s commands, as a newcomer runs them.

The README links one page per subject in ``docs/``; every rule below holds for the command blocks
of ``README.md`` and ``docs/*.md`` alike (``DOCS``), and the README's course map is the table
``course_lib.kit.course_map`` builds from ``course doctor``'s records.

* Every ``bash`` block follows the README's one convention: the kit's environment is activated once
  (``source .venv/bin/activate``), then bare ``course`` / ``torchrun`` / ``python``; no
  ``.venv/bin/...`` paths, no ``[optional]`` brackets that a shell would take literally, every
  ``course`` and trainer command line parses, and no two training commands share an ``--out``
  (a run folder belongs to one configuration).
* The blocks marked ``<!-- readme-test: quick -->`` (bash) or ``<!-- readme-test: quick python -->``
  (a ``.py`` file run with ``python``) run as written, in a scratch folder where ``labs/`` is the
  kit's, with the environment activated the way ``source .venv/bin/activate`` does it (this
  interpreter's ``bin`` first on PATH). Mark a block quick only if it takes seconds; blocks marked
  ``<!-- readme-test: slow -->`` (the three training runs: minutes on a busy 2-core machine) run
  the same way under ``-m slow``.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
MARK = re.compile(r"<!-- readme-test: (quick|slow)( python)? -->\s*\n```(\w+)\n(.*?)\n```", re.S)
BLOCK = re.compile(r"```(\w+)\n(.*?)\n```", re.S)


def blocks(lang: str = "bash") -> list[str]:
    return [body for doc in DOCS for kind, body in BLOCK.findall(doc.read_text()) if kind == lang]


def marked_blocks(speed: str) -> list[tuple[str, str, str]]:
    """(file, language, text) of every block marked ``speed`` (quick or slow), README and docs."""
    out = []
    for doc in DOCS:
        for mark, python, lang, body in MARK.findall(doc.read_text()):
            assert (lang == "python") == bool(python), f"{doc.name}: marker and fence disagree: {lang} block {body[:60]!r}"
            if mark == speed:
                out.append((doc.name, lang, body))
    return out


def commands(block: str) -> list[str]:
    """The block's command lines: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_bash_block_follows_the_one_convention():
    from course_lib.cli import build_parser
    from course_lib.train import build_parser as train_parser

    outs: dict[str, str] = {}
    for block in blocks():
        for cmd in commands(block):
            argv = shlex.split(cmd)
            assert ".venv/bin/" not in cmd or cmd == "source .venv/bin/activate", \
                f"{cmd!r}: the README activates .venv once; write the bare command"
            assert not re.search(r"\s\[-", cmd), f"{cmd!r}: [optional] flags are not runnable as written"
            train_args = None
            if argv[0] == "course":
                try:
                    parsed = build_parser().parse_args(argv[1:])
                except SystemExit:
                    pytest.fail(f"{cmd!r}: `course` does not accept this command line")
                if parsed.command == "train":
                    train_args = argv[2:]
            elif argv[0] == "torchrun" and "course_lib.train" in argv:
                train_args = argv[argv.index("course_lib.train") + 1:]
            if train_args is not None:
                try:
                    out = train_parser().parse_args(train_args).out
                except SystemExit:
                    pytest.fail(f"{cmd!r}: the trainer does not accept these arguments")
                assert out not in outs, f"{cmd!r} writes into {out}, as does {outs.get(out)!r}"
                outs[out] = cmd
    assert "source .venv/bin/activate" in [c for b in blocks() for c in commands(b)]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder to run README blocks in: the kit's labs/ (configs), everything written stays here."""
    work = tmp_path_factory.mktemp("readme")
    (work / "labs").symlink_to(ROOT / "labs")
    (work / "docs").symlink_to(ROOT / "docs")  # a text to tokenize (docs/TRAINING.md)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "VIRTUAL_ENV": str(Path(sys.executable).parent.parent), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return work, env


QUICK, SLOW = marked_blocks("quick"), marked_blocks("slow")


def test_blocks_are_marked():
    langs = [lang for _, lang, _ in QUICK]
    assert langs.count("bash") >= 2 and "python" in langs, langs
    # the installed `course` script runs from PATH here (tests/test_doctor.py counts on it)
    assert any(cmd.startswith("course ") for _, lang, body in QUICK if lang == "bash" for cmd in commands(body))
    assert any("course train" in body for _, _, body in SLOW), "the training examples are not marked"
    assert any(doc == "README.md" for doc, _, _ in QUICK), "the README itself runs none of its blocks"


def _ids(marked):
    return [f"{doc}-{lang}-{i}" for i, (doc, lang, _) in enumerate(marked)]


@pytest.mark.parametrize("doc,lang,body", QUICK, ids=_ids(QUICK))
def test_quick_block_runs_as_written(scratch, doc, lang, body):
    run_block(scratch, lang, body)


@pytest.mark.slow
@pytest.mark.parametrize("doc,lang,body", SLOW, ids=_ids(SLOW))
def test_slow_block_runs_as_written(scratch, doc, lang, body):
    run_block(scratch, lang, body)


def test_the_readme_starts_with_the_learner():
    """Lab 00's Run All within the first screen; the map is the one course doctor's records give;
    each audience's material is one link away and every link resolves."""
    from course_lib.kit.course_map import markdown_table

    text = README.read_text()
    head = "\n".join(text.splitlines()[:30])
    assert "./kit lab" in head and "labs/00_orientation.ipynb" in head and "Run All" in head, head
    assert "course check 00" in head
    assert markdown_table(ROOT) in text, (
        "the README's course map is not what `course doctor` records (a lab was re-timed, renamed or "
        "given an exercise?); paste the output of `python -m course_lib.kit.course_map`:\n" + markdown_table(ROOT))
    for heading in ("## Quick start", "## Course map", "## Instructors", "## Engineers on GPU nodes", "## Contributors"):
        assert heading in text, heading
    assert len(text.split()) < 1500, "the README is a front door; reference material goes to docs/"
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+?)\)", doc.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"
    linked = set(re.findall(r"\]\(docs/([^)]+)\)", text))
    assert {p.name for p in DOCS[1:]} - linked <= {"published-runs.md"}, "a docs/ page the README does not link"


def test_the_course_map_names_every_exercise_once():
    from course_lib.kit.course_map import EXERCISES, format_duration

    stems = sorted(stem for stem, _ in EXERCISES.values())
    assert stems == sorted(p.stem for p in (ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
    assert all((ROOT / "labs" / f"{lab}.py").is_file() for lab in EXERCISES)
    assert (format_duration(12.3), format_duration(705.5), format_duration(None)) == ("12 s", "11.8 min", "not timed")
    with pytest.raises(ValueError, match="seconds"):
        format_duration(-1)


@pytest.mark.parametrize("path", ["runs/x", "data/corpus.bin", "submissions/ann/05.ipynb", "grades/grades.csv"])
def test_what_the_commands_create_is_ignored_by_git(path):
    res = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert res.returncode == 0, f"{path}: a README/docs command creates it, and git would offer to commit it"


def run_block(scratch, lang: str, body: str) -> None:
    """Run one README block as written; check what the text around it promises."""
    work, env = scratch
    if lang == "python":
        (work / "snippet.py").write_text(body + "\n")
        argv = ["python", "snippet.py"]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", body]
    t0 = time.monotonic()
    res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert res.returncode == 0, (f"README block exited {res.returncode} after {took:.0f} s:\n{body}\n"
                                 f"--- output ---\n{(res.stdout + res.stderr)[-3000:]}")
    text = res.stdout + res.stderr
    assert "[WARNING]" not in res.stdout, f"a library's log line in the report:\n{res.stdout[-2000:]}"
    assert "MFU would be" not in text, f"an MFU warning in an example's output:\n{text[-2000:]}"
    if "runs/tiny-bf16" in body:  # what the text around it promises
        for run in ("tiny", "tiny-bf16", "ddp"):
            rows = [json.loads(x) for x in (work / "runs" / run / "metrics.jsonl").read_text().splitlines()]
            assert rows[-1]["step"] == 100, run
            assert all(r["mfu"] is None or r["mfu"] <= 1.0 for r in rows if "mfu" in r), run
            assert all(r.get("mfu") is not None for r in rows), f"{run}: MFU missing from a row"
            assert (work / "runs" / run / "mfu_peak.json").is_file(), run
        assert sorted(p.name for p in (work / "runs" / "tiny-bf16" / "checkpoints").iterdir())
    if "data/architecture" in body:
        assert (work / "runs" / "architecture" / "metrics.jsonl").is_file()
    if "course plan" in body and "plan-7b" in body:
        # the 7B plan is data-parallel: its ds_config.json went through DeepSpeed's parser, whose
        # import once logged an accelerator warning into the report (checked above)
        assert (work / "runs" / "plan-7b" / "ds_config.json").is_file(), sorted((work / "runs").iterdir())
    if "--units GB --json" in body:
        est = json.loads(res.stdout[res.stdout.index("\n{") + 1:])
        assert est["per_rank_GB"]["total"] == round(est["per_rank_bytes"]["total"] / 1e9, 3)
    if "run_ranks" in body:
        assert "[1.0, 2.0]" in text and "[12.0, 14.0]" in text, text[-2000:]
