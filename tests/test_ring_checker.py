"""Exercise 00's checker: a ring that calls a collective is refused (also one bound at import),
and the rows carry every rank's result for the grader."""
import importlib
import sys

import pytest
import torch

from course_lib.kit.checks import CheckFailed
from course_lib.labs import lab00_orientation as collectives

SHORTCUTS = {
    "by_attribute": "import torch.distributed as dist\ndef ring_all_reduce(t):\n    dist.all_reduce(t)\n    return t\n",
    "bound_at_import": "from torch.distributed import all_reduce\ndef ring_all_reduce(t):\n    all_reduce(t)\n    return t\n",
}


@pytest.mark.parametrize("name", sorted(SHORTCUTS))
def test_a_ring_that_calls_a_collective_is_refused(tmp_path, monkeypatch, name):
    (tmp_path / f"shortcut_{name}.py").write_text(SHORTCUTS[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    impl = importlib.import_module(f"shortcut_{name}").ring_all_reduce
    with pytest.raises(CheckFailed, match="called dist.all_reduce while it ran"):
        collectives.check_all_reduce(impl, [2], [(10, "float32", 1)])
    sys.modules.pop(f"shortcut_{name}", None)


PAIR_SUM = """import torch, torch.distributed as dist
def ring_all_reduce(t):
    other = torch.empty_like(t)
    req = dist.isend(t.clone(), 1 - dist.get_rank())
    dist.recv(other, 1 - dist.get_rank())
    req.wait()
    return t.add_(other)
"""


def test_point_to_point_passes_and_rows_carry_every_ranks_result(tmp_path, monkeypatch):
    (tmp_path / "pair_sum.py").write_text(PAIR_SUM)  # a two-rank "ring": swap and add
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = collectives.check_all_reduce(importlib.import_module("pair_sum").ring_all_reduce, [2],
                                        [(10, "float32", 1)])
    want = collectives.case_data(0, 10, "float32", 1) + collectives.case_data(1, 10, "float32", 1)
    assert len(rows[0]["outputs"]) == 2
    for got in rows[0]["outputs"]:
        torch.testing.assert_close(got, want)
    sys.modules.pop("pair_sum", None)
