"""Root pytest configuration: loaded for every test path, notebooks (nbval) included."""
import os

import pytest

# Notebook kernels started by nbval inherit this environment. nbval cannot inject parameters, so
# COURSE_SMOKE=1 is how it gets smoke-test sizes (course_lib.smoke reads it); Agg keeps
# matplotlib headless.
os.environ.setdefault("COURSE_SMOKE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

# `COURSE_TEST_WORKERS=2 ./kit test` runs two pytest workers (pytest-xdist) on 2 cores. torch's default of
# one OpenMP thread per core, in each worker, its notebook kernels and its subprocesses, puts more
# threads than cores to work, and spinning OpenMP threads then wait for each other: a lab cell
# that takes 6 s alone took 95 s next to a 4-rank job. One thread each (inherited by kernels and
# subprocesses; set before anything imports torch) keeps two workers at two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

_XDIST_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in the workers of an xdist run


def _longest_files_first(items) -> None:
    """Two workers take whole files in collection order, so a long file collected last leaves
    one worker idle at the end. Order the files longest first (tests/file_seconds.json, measured
    in one process; unknown files last), each file's items in their own order."""
    import json
    from pathlib import Path

    table = Path(__file__).with_name("tests") / "file_seconds.json"
    seconds = json.loads(table.read_text()) if table.exists() else {}
    root = Path(__file__).parent

    def weight(item) -> float:
        try:
            return seconds.get(Path(str(item.fspath)).relative_to(root).as_posix(), 0.0)
        except ValueError:  # a path outside the kit
            return 0.0

    items.sort(key=lambda item: -weight(item))  # stable: a file's items keep their order


def pytest_collection_modifyitems(config, items):
    if _XDIST_RUN:
        _longest_files_first(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under two workers, a check that compares measured times (a pipeline bubble, an overlap, a
# bandwidth fit) would measure the other worker too. Such tests carry the marker `exclusive`, and
# such notebook cells the tag `timing`; each of them runs alone: it takes a file lock exclusively,
# every other test takes it shared. A turnstile lock, held by a waiting exclusive test, stops new
# shared tests from slipping in ahead of it, so it waits for at most the one test already running.
def _runs_alone(item) -> bool:
    if item.get_closest_marker("exclusive") is not None:
        return True
    cell = getattr(item, "cell", None)  # an nbval notebook cell
    return cell is not None and "timing" in cell.get("metadata", {}).get("tags", [])


def _lock_files():
    import tempfile
    from pathlib import Path

    base = Path(tempfile.gettempdir()) / f"course-pytest-{_XDIST_RUN}"
    return base.with_suffix(".turnstile"), base.with_suffix(".lock")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _XDIST_RUN:
        return (yield)
    import fcntl
    import time

    turnstile_path, lock_path = _lock_files()
    with open(turnstile_path, "a") as turnstile, open(lock_path, "a") as lock:
        asked = time.monotonic()
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if _runs_alone(item):
            fcntl.flock(lock, fcntl.LOCK_EX)  # waits for the test running on the other worker
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_SH)
        waited = time.monotonic() - asked
        if waited >= 0.5:  # in the JUnit report (--junitxml): what running alone costs
            item.user_properties.append(("lock_wait_s", round(waited, 1)))
        return (yield)  # set-up, call and tear-down all run under the lock
