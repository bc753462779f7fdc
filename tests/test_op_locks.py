"""A DeepSpeed op build killed half-way leaves ``TORCH_EXTENSIONS_DIR/<op>/lock``; torch's loader
then waits on it forever. course_lib/parallel/deepspeed/op_locks.py tells a stale lock (no process here holds
it, old enough) from a live build's, ``course doctor`` names it and clears it on request, and the
kit's op loads give up with a message naming it. Every lock here is planted in a fake
``TORCH_EXTENSIONS_DIR`` (tmp_path); the venv's real extensions are never touched.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from torch.utils.file_baton import FileBaton

from course_lib import cli
from course_lib.kit import doctor
from course_lib.parallel.deepspeed.op_locks import OpLockError, find_locks, guard

HOUR = 3600.0


def plant(root, op="deepspeed_shm_comm", age_s=HOUR):
    """A lock as a killed build leaves it: the file, created ``age_s`` seconds ago, nobody holding it."""
    path = root / op / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    root = tmp_path / "torch_extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.delenv("COURSE_OP_LOCK_STALE_S", raising=False)
    monkeypatch.delenv("COURSE_OP_LOCK_TIMEOUT_S", raising=False)
    return root


@pytest.fixture
def holder(ext_dir):
    """A live 'build': another process that created the lock the way torch's FileBaton does and
    keeps it open; the lock is then back-dated an hour (age alone must not make it stale)."""
    path = ext_dir / "cpu_adam" / "lock"
    path.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-c",
                             "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
                             "print('held', flush=True); time.sleep(120)", str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        then = time.time() - HOUR
        os.utime(path, (then, then))
        yield path, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_builds_lock_is_stale_and_a_load_gives_up_naming_it(ext_dir):
    path = plant(ext_dir)
    [lock] = find_locks()
    assert (lock.path, lock.op, lock.holders, lock.stale) == (path, "deepspeed_shm_comm", [], True)
    t0 = time.monotonic()
    with guard(), pytest.raises(OpLockError) as err:
        FileBaton(str(path)).wait()  # what torch's JIT loader does when another build holds the lock
    assert time.monotonic() - t0 < 5, "a stale lock must fail the load at once"
    assert str(path) in str(err.value) and f"rm {path}" in str(err.value) and "stale" in str(err.value)
    assert FileBaton.wait is not None and not getattr(FileBaton.wait, "_course_guard", False), "guard not undone"


def test_a_lock_held_by_a_live_build_is_not_stale_and_the_wait_is_bounded(holder):
    path, proc = holder
    [lock] = find_locks()
    assert lock.holders == [proc.pid] and not lock.stale, "an hour-old lock a live build holds is not stale"
    t0 = time.monotonic()
    with guard(timeout_s=1.0), pytest.raises(OpLockError, match="held by pid") as err:
        FileBaton(str(path)).wait()
    assert 1.0 <= time.monotonic() - t0 < 10
    assert str(path) in str(err.value) and str(proc.pid) in str(err.value)
    assert doctor.clear_stale_locks() == [] and path.exists(), "a held lock was removed"
    proc.kill()
    proc.wait()  # the build dies without releasing: its lock is now stale
    assert [(lk.path, lk.stale) for lk in find_locks()] == [(path, True)]


def test_a_young_lock_without_holder_turns_stale_with_age(ext_dir, monkeypatch):
    """No holder here, but young: a build on another machine sharing the folder may own it. It
    becomes stale at COURSE_OP_LOCK_STALE_S; a waiting load gives up then."""
    path = plant(ext_dir, age_s=0.0)
    assert [lk.stale for lk in find_locks()] == [False]
    assert "stale at 120 s" in find_locks()[0].describe()
    monkeypatch.setenv("COURSE_OP_LOCK_STALE_S", "1.5")
    t0 = time.monotonic()
    with guard(), pytest.raises(OpLockError, match="stale"):
        FileBaton(str(path)).wait()
    assert 1.0 <= time.monotonic() - t0 < 10


def test_a_released_lock_ends_the_wait_normally(ext_dir):
    path = plant(ext_dir, age_s=0.0)
    baton = FileBaton(str(path), wait_seconds=0.01)
    with guard():
        import threading

        threading.Timer(0.3, path.unlink).start()  # the build finishes and releases the baton
        baton.wait()
    assert not path.exists()


def test_doctor_names_a_stale_lock_with_the_fix_and_clears_it(ext_dir, holder, monkeypatch, capsys):
    stale = plant(ext_dir, op="fused_adam")
    held, _ = holder
    report = {"versions": {}, "kernel": {"registered": True, "python_exists": True},
              "op_locks": doctor._op_locks()}
    [problem] = doctor.problems(report)
    assert str(stale) in problem["problem"] and "'fused_adam'" in problem["problem"]
    assert problem["fix"].startswith(f"rm {stale}") and "course doctor --clear-stale-locks" in problem["fix"]
    lines = {lk["path"]: lk["line"] for lk in report["op_locks"]}
    assert "STALE" in lines[str(stale)] and "build of op 'cpu_adam' is running" in lines[str(held)]

    def gather(**_):  # the rest of the report is test_doctor.py's business
        return {"python": "3", "executable": sys.executable, "versions": {}, "op_locks": doctor._op_locks(),
                "kernel": {"registered": True, "python": sys.executable, "python_exists": True}, "problems": []}

    monkeypatch.setattr(doctor, "gather", gather)
    assert cli.main(["doctor", "--clear-stale-locks"]) == 0
    out = capsys.readouterr().out
    assert f"removed stale op build lock {stale}" in out and not stale.exists()
    assert held.exists() and f"op lock     {held}" in out



def test_the_trainers_deepspeed_start_fails_on_a_stale_lock_with_its_path(ext_dir, tmp_path):
    """The hang of the issue: a stale lock in deepspeed_shm_comm/ (loaded by every CPU
    ``deepspeed.init_distributed``). One rank, the tiny config: the start ends with the lock's
    path and the fix, writes nothing, and the rank finishes well inside the launch's limit."""
    pytest.importorskip("deepspeed")
    import deepspeed_rank_fns as ds_fns
    from course_lib.trainer import config as train_config
    from course_lib.parallel import run_ranks
    from layout_checks import TINY

    path = plant(ext_dir)
    cfg = train_config.load(TINY, ["train.strategy=\"deepspeed\"", "train.progress=false", "train.max_steps=2", "schedule.warmup_steps=1",
                                   "train.micro_batch=8", "train.peak_flops=1e12"])
    [got] = run_ranks(ds_fns.start_with_op_folder, 1, str(ext_dir), cfg, str(tmp_path / "run"), timeout=120)
    assert got["message"] is not None, "the DeepSpeed start went through a stale lock?"
    assert str(path) in got["message"] and f"rm {path}" in got["message"], got["message"]
    assert not (tmp_path / "run").exists() and path.exists()
    print(f"DeepSpeed start gave up after {got['seconds']:.1f} s")
