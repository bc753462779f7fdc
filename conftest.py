"""Root pytest configuration: loaded for every test path, notebooks (nbval) included."""
import os

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


def pytest_collection_modifyitems(config, items):
    import pytest

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
