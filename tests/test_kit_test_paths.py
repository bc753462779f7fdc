"""``./kit test PATH`` with a path that is not there says so, instead of pytest's bare "no tests ran".

``kit`` runs against a scratch "venv" whose stamp matches, so set-up installs nothing and the
``test`` branch runs as a learner's would.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kit_env(tmp_path_factory):
    venv = tmp_path_factory.mktemp("venv")
    (venv / "bin").mkdir()
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    want = subprocess.run(["bash", "-c", 'cat pyproject.toml kit | sha256sum | cut -d" " -f1'], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    (venv / ".course-kit-installed").write_text(want + "\n")
    return {**os.environ, "COURSE_VENV": str(venv), "COURSE_TEST_WORKERS": "1"}


def kit_test(env, *args):
    return subprocess.run([str(ROOT / "kit"), "test", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path", ["tests/does_not_exist.py", "tests/test_nothing_here.py::test_x", "tests/no_dir/"])
def test_a_missing_test_path_is_named(kit_env, path):
    res = kit_test(kit_env, path)
    assert res.returncode == 4, res.stdout + res.stderr
    assert f"{path.split('::')[0]}: no such test file or folder" in res.stderr
    assert "tests/test_" in res.stderr  # and it names a real one to copy


def test_option_values_and_real_files_pass_through(kit_env):
    """``-k EXPR`` is not a path even when it looks like one; a real file reaches pytest."""
    res = kit_test(kit_env, "--co", "-q", "-k", "nothing_matches.py", "tests/test_kit_test_paths.py")
    assert "no such test file" not in res.stderr, res.stderr
    assert res.returncode == 5, res.stdout + res.stderr  # pytest ran: nothing matched the -k expression
