"""The rank launcher: results in order, fast and legible failures, nothing left behind."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import rank_fns
from course_lib.parallel.ranks import launch
from course_lib.parallel.ranks.launch import RankFailedError, run_ranks

TESTS = Path(__file__).parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _pids(folder: Path, n: int, wait_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        files = sorted(folder.glob("pid*"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError(f"ranks did not start within {wait_s} s")


def test_results_come_back_in_rank_order():
    results = run_ranks(rank_and_sum := rank_fns.rank_and_sum, 3, offset=5)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 3.0 and r["offset"] == 5 for r in results)
    assert rank_and_sum is rank_fns.rank_and_sum


def test_exception_on_rank_1_surfaces_with_its_traceback_quickly():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(rank_fns.fail_on_rank_1, 2)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "rank 1 failed: ValueError: planted failure on rank 1" in str(err)
    assert "in fail_on_rank_1" in err.remote_traceback  # the rank's own traceback, not ours
    assert elapsed < 10, f"failure took {elapsed:.1f} s to surface"


def test_the_cause_is_reported_over_a_peer_that_only_lost_its_connection():
    """A rank's "connection closed by peer" is a consequence: the launcher waits briefly for the
    rank that caused it (the race test_exception_on_rank_1... once lost under load)."""
    with pytest.raises(RankFailedError) as info:
        run_ranks(rank_fns.peer_loss_first_then_the_cause, 2)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError", str(info.value)


def test_timeout_kills_every_child(tmp_path):
    with pytest.raises(TimeoutError, match="did not finish within"):
        run_ranks(rank_fns.write_pid_then_sleep, 2, str(tmp_path), timeout=8)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid*"))]
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


def test_rank_that_dies_without_result_is_reported():
    with pytest.raises(RankFailedError, match=r"rank 1 failed: process died without a result \(exit code 3\)"):
        run_ranks(rank_fns.die_on_rank_1, 2)


def test_result_survives_a_crash_at_exit():
    # Both ranks abort() during teardown, after handing back their results.
    assert run_ranks(rank_fns.crash_after_returning, 2) == [0, 7]


def test_back_to_back_calls_get_fresh_ports():
    for _ in range(3):
        assert [r["sum"] for r in run_ranks(rank_fns.rank_and_sum, 2)] == [1.0, 1.0]


def test_rank_output_is_relayed_with_a_prefix(capsys):
    run_ranks(rank_fns.say_hello, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out


def test_unpicklable_result_is_a_clear_error():
    with pytest.raises(RankFailedError, match="rank 0 failed: TypeError"):
        run_ranks(rank_fns.unpicklable_result, 1)


def test_functions_that_cannot_be_imported_are_refused_before_starting(monkeypatch):
    with pytest.raises(TypeError, match="lambdas"):
        run_ranks(lambda r, w: r, 2)

    def local(rank, world_size):
        return rank
    with pytest.raises(TypeError, match="inside other functions"):
        run_ranks(local, 2)

    # A function defined in a notebook cell lives in a __main__ that has no file.
    import types
    fake_main = types.ModuleType("__main__")
    exec("def cell_fn(rank, world_size):\n    return rank", fake_main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    with pytest.raises(TypeError, match="notebook"):
        run_ranks(fake_main.cell_fn, 2)


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, r"world_size must be in \[1, 64\]"),
    ({"world_size": 2, "timeout": 0}, "timeout must be > 0"),
    ({"world_size": 2, "threads_per_rank": 0}, "threads_per_rank must be >= 1"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        run_ranks(rank_fns.rank_and_sum, world_size, **kwargs)
    with pytest.raises(TypeError, match="world_size must be an int"):
        run_ranks(rank_fns.rank_and_sum, 2.0)


def test_ctrl_c_in_the_caller_leaves_no_rank_behind(tmp_path):
    script = tmp_path / "interrupt_me.py"
    script.write_text(textwrap.dedent(f"""
        import signal
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import rank_fns
        from course_lib.parallel import run_ranks
        if __name__ == "__main__":
            # A job started in the background (`cmd &`, as CI runners often do) inherits SIGINT
            # *ignored*, and Python then installs no KeyboardInterrupt handler: restore Ctrl-C.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                run_ranks(rank_fns.write_pid_then_sleep, 2, {str(tmp_path)!r}, timeout=120)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(42)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = _pids(tmp_path, 2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 42 and "interrupted" in out
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids)


def test_ranks_die_with_their_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import rank_fns
        from course_lib.parallel import run_ranks
        if __name__ == "__main__":
            run_ranks(rank_fns.write_pid_then_sleep, 2, {str(tmp_path)!r}, timeout=120)
    """))
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        pids = _pids(tmp_path, 2)
        proc.kill()  # a kernel killed hard gets no chance to clean up
        proc.wait(timeout=10)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def test_init_distributed_single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = launch.init_distributed()
    assert (info.rank, info.world_size, info.backend, info.is_main) == (0, 1, None, True)
    # what a script prints about it says what that means, not "backend None"
    assert info.describe().startswith("one process, no process group (not started by torchrun)")
    assert "None" not in info.describe()
    assert launch.DistInfo(1, 2, 1, "cpu", "gloo").describe() == "rank 1 of 2 on gloo (cpu)"
    with pytest.raises(ValueError, match="backend must be"):
        launch.init_distributed(backend="carrier-pigeon")


def test_init_distributed_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from course_lib.parallel import init_distributed, print0, barrier, teardown, is_main
        info = init_distributed()
        t = torch.tensor([info.rank + 1.0])
        dist.all_reduce(t)
        print(f"rank={info.rank} world={info.world_size} backend={info.backend} "
              f"device={info.device} sum={t.item()} main={is_main()}", flush=True)
        barrier()
        print0("only rank 0 says this")
        teardown(0)
    """))
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank=0 world=2 backend=gloo device=cpu sum=3.0 main=True" in out.stdout
    assert "rank=1 world=2 backend=gloo device=cpu sum=3.0 main=False" in out.stdout
    assert out.stdout.count("only rank 0 says this") == 1


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~2.5 s a launch on an idle 2-core machine, far more when it is busy
def test_one_hundred_back_to_back_runs_all_pass():
    """The reliability promise: naive gloo runs die at teardown about 1 in 8 here."""
    for i in range(100):
        results = run_ranks(rank_fns.rank_and_sum, 2, i, show_output=False)
        assert [r["offset"] for r in results] == [i, i] and results[0]["sum"] == 1.0, i


def test_tensors_come_back_from_the_ranks():
    """Results travel as plain pickle bytes: multiprocessing's own pickler would send tensors as
    shared-memory handles, which die with the rank (it leaves with os._exit right after)."""
    out = run_ranks(rank_fns.tensors_back, 2)
    assert [r["rank"].tolist() for r in out] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert torch.equal(out[1]["big"], torch.arange(100_000, dtype=torch.float32))
