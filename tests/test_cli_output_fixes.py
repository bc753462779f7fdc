"""What `course plan`, `course estimate` and `course launch`'s scripts print, as the README promises.

* `course plan`: the best layout first, then the runners-up in the order of the step time printed
  (that its report holds no DeepSpeed log line is checked by tests/test_readme.py, which runs the
  README's plan commands).
* `course estimate --units GB --json`: bytes stay bytes, ``per_rank_GB`` carries the GB.
* `launch_accelerate.sh` without accelerate installed: exit 127 with what to install.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

from course_lib.estimate.cli import main as estimate_main
from course_lib.planner import plan
from course_lib.planner.report import table

ROOT = Path(__file__).resolve().parents[1]


def _step_column(text: str) -> list[float]:
    """The `step s` column of the rows that fit (misses print '-')."""
    out = []
    for line in text.splitlines()[2:]:
        m = re.search(r"GiB\s+(\d+\.\d)\s", line)
        if m:
            out.append(float(m.group(1)))
    return out


def test_plan_table_lists_runners_up_by_the_step_time_printed():
    # The 70B job of the README: a near-tie rule once put a 202.8 s row above a 202.4 s one.
    p = plan(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
    text = table(p, 6)
    steps = _step_column(text)
    assert len(steps) == 6, text
    assert steps[1:] == sorted(steps[1:]), text
    assert text.splitlines()[2].startswith(p.best.layout.label()), "the chosen layout must stay first"
    widths = {line.index(" GiB") for line in text.splitlines()[2:] if " GiB" in line}
    assert len(widths) == 1, f"columns out of line:\n{text}"


def test_estimate_json_carries_the_asked_units(capsys):
    assert estimate_main(["--model", "gpt2-small", "--micro-batch", "8", "--seq", "1024", "--units", "GB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["per_rank_GB"]["total"] == round(r["per_rank_bytes"]["total"] / 1e9, 3)
    assert isinstance(r["per_rank_bytes"]["total"], (int, float)) and r["per_rank_bytes"]["total"] > 1e9
    assert estimate_main(["--model", "gpt2-small", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["per_rank_GiB"]["total"] == round(r["per_rank_bytes"]["total"] / 2**30, 3)


def test_launch_accelerate_says_what_to_install(tmp_path):
    from course_lib.cli import build_parser
    from course_lib.launchers.cli import build_files

    args = build_parser().parse_args(["launch", "--config", str(ROOT / "labs" / "configs" / "tiny-cpu.toml"),
                                      "--nproc-per-node", "2", "--out", str(tmp_path), "--dry-run"])
    assert isinstance(args, argparse.Namespace)
    files = build_files(args)
    for name, program in (("launch_accelerate.sh", "accelerate"), ("launch_torchrun.sh", "torchrun"),
                          ("launch_deepspeed.sh", "deepspeed")):
        script = tmp_path / name
        script.write_text(files[name])
        empty = tmp_path / "empty-bin"
        empty.mkdir(exist_ok=True)
        # PATH without the program: bash from its absolute path, nothing else to find
        res = subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True, timeout=60,
                             env={"PATH": str(empty)}, cwd=ROOT)
        assert res.returncode == 127, (name, res.stdout, res.stderr)
        assert f"'{program}' not found" in res.stderr, (name, res.stderr)
    assert "pip install accelerate" in files["launch_accelerate.sh"]
