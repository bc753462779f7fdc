"""Root pytest configuration: loaded for every test path, notebooks (nbval) included."""
import os

# Notebook kernels started by nbval inherit this environment. nbval cannot inject parameters, so
# COURSE_SMOKE=1 is how it gets smoke-test sizes (course_lib.smoke reads it); Agg keeps
# matplotlib headless.
os.environ.setdefault("COURSE_SMOKE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


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
