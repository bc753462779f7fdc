"""Fake nodes for tests that run launch scripts here (tests/test_launchers.py, tests/test_plan_scripts.py).

``tests/fake_cluster_tools/`` holds the stand-ins: ``srun`` (one task per node of the step, all on
this machine), ``scontrol`` (host names; requeue logged), and ``torchrun`` / ``deepspeed`` /
``accelerate`` (fake_launchers.py: parse the command line as the real tool, then run the trainer's
``--check-config`` for the world size it would start). A test that trains for real points the
scripts' ``COURSE_SRUN`` / ``COURSE_SCONTROL`` at the first two and keeps the venv's real torchrun;
a test that only checks puts the whole folder first on PATH.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)
FAKE_TOOLS = Path(__file__).resolve().parent / "fake_cluster_tools"


def run_env() -> dict:
    """This environment with the venv's tools (the real torchrun) first and one thread per rank."""
    env = dict(os.environ)
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")  # torchrun of this venv
    env["OMP_NUM_THREADS"] = "1"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def fake_slurm_env(tmp_path: Path, nodes: int = 2) -> dict:
    """:func:`run_env` inside a fake allocation of ``nodes`` nodes, all this machine (127.0.0.1):
    the SLURM_* variables a batch step sees on its first node, the fake srun and scontrol through
    the scripts' COURSE_SRUN / COURSE_SCONTROL, a free rendezvous port (COURSE_RDZV_PORT), and
    ``scontrol requeue`` logged to ``tmp_path/scontrol.log``."""
    env = run_env()
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"fake[0-{nodes - 1}]", SLURM_NNODES=str(nodes),
               SLURM_NODEID="0", COURSE_SRUN=str(FAKE_TOOLS / "srun"), COURSE_SCONTROL=str(FAKE_TOOLS / "scontrol"),
               COURSE_RDZV_PORT=str(free_port()), FAKE_LOG=str(tmp_path / "scontrol.log"))
    return env
