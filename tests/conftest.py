"""Fixtures shared by the test modules in tests/ (the root conftest.py sets the environment)."""
import pytest


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread for a whole test module, restored afterwards: the test machines
    have 2 cores shared with other jobs, and more threads than cores only adds waiting. Use it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch  # here, not at the top: torch-free test modules share this conftest

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
