"""BucketedDDP's opt-in timeline (``record_timeline=True``): off by default, and when on, one
ready/launch/complete triple per bucket per sync, in a consistent order, on every rank; the
gradients are the same as without it. Rank functions: course_lib.labs.lab08_data_parallel
(the ones lab 08 draws its timeline from) and the ones below (spawned ranks import this module)."""

import pytest
import torch

from course_lib.parallel import BucketedDDP, run_ranks
from course_lib.labs import lab08_data_parallel as lab_runs

pytestmark = pytest.mark.usefixtures("one_thread")


def grads_with_and_without_timeline(rank, world_size):
    """Same model, same data, recording off and on: the mean gradients and what was recorded."""
    out = {}
    for record in (False, True):
        torch.manual_seed(0)
        model = lab_runs.TinyGPT(lab_runs.model_config(d_model=32, n_layers=2))
        ddp = BucketedDDP(model, bucket_mb=0.01, record_timeline=record)
        x, y = lab_runs.global_batches(1, 4)[0]
        for _ in range(2):  # twice: the second sync must record a fresh set of events
            model.zero_grad(set_to_none=True)
            ddp(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])[1].backward()
            ddp.finish_gradient_synchronization()
        out[record] = {"grads": [p.grad.clone() for p in model.parameters()],
                       "timeline": ddp.timeline, "buckets": ddp.bucket_count,
                       "launched": ddp.launched_in_backward}
    return out


@pytest.fixture(scope="module")
def recorded():
    return run_ranks(grads_with_and_without_timeline, 2, timeout=180, show_output=False)


def test_timeline_is_off_by_default_and_changes_no_gradient(recorded):
    for rank in recorded:
        assert rank[False]["timeline"] is None
        for a, b in zip(rank[False]["grads"], rank[True]["grads"]):
            assert torch.equal(a, b)


def test_each_sync_records_ready_launch_complete_per_bucket_in_order(recorded):
    for rank in recorded:
        on = rank[True]
        events, n = on["timeline"], on["buckets"]
        assert n > 2
        syncs = [i for i, e in enumerate(events) if e["event"] == "finish_end"]
        assert len(syncs) == 2  # two syncs, each closed by finish_end
        first = events[:syncs[0] + 1]
        assert [e["t"] for e in events] == sorted(e["t"] for e in events)  # perf_counter stamps
        for b in range(n):
            mine = {e["event"]: e for e in first if e["bucket"] == b}
            assert set(mine) == {"ready", "launch", "complete"}, (b, mine)
            assert mine["ready"]["t"] <= mine["launch"]["t"] <= mine["complete"]["t"]
            assert mine["launch"]["bytes"] == mine["complete"]["bytes"] > 0
            assert mine["complete"]["how"] in ("poll", "wait")
        launches = [e for e in first if e["event"] == "launch"]
        assert [e["bucket"] for e in launches] == list(range(n))  # strictly in bucket order
        # every bucket filled inside backward was launched from a hook, overlapping it
        assert sum(e["in_backward"] for e in launches) == on["launched"] == n
        assert first[-1]["event"] == "finish_end"
        assert [e["event"] for e in first].count("finish_start") == 1


def test_lab_timeline_run_stamps_compute_and_every_bucket():
    naive, bucketed = run_ranks(lab_runs.timeline_runs, 2,
                                [{"kind": "naive"}, {"kind": "bucketed", "bucket_mb": 0.01}],
                                2, 4, d_model=32, n_layers=2, timeout=180,
                                show_output=False)[0]
    for run in (naive, bucketed):
        for step in run["steps"]:
            assert 0 < step["forward_end"] < step["backward_end"] <= step["sync_end"]
    step = bucketed["steps"][-1]
    completes = [e for e in step["events"] if e["event"] == "complete"]
    assert len(completes) == bucketed["buckets"] > 2
    assert sum(e["bytes"] for e in completes) >= bucketed["grad_bytes"]  # gradients plus flags
    assert max(e["t"] for e in completes) <= step["sync_end"]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_record_timeline_must_be_a_bool(bad):
    # checked before the process group, so no ranks are needed to see the refusal
    with pytest.raises(TypeError, match="record_timeline"):
        BucketedDDP(torch.nn.Linear(2, 2), record_timeline=bad)


def test_bucket_size_prediction_matches_the_buckets_built():
    sizes = run_ranks(lab_runs.sync_cost, 1, [None, 0.01], 1, d_model=32, n_layers=2,
                      timeout=120, show_output=False)[0]
    numels = [p.numel() for p in lab_runs.TinyGPT(lab_runs.model_config(d_model=32, n_layers=2)).parameters()]
    for row in sizes:
        assert row["bucket_bytes"] == lab_runs.bucket_sizes_bytes(numels, row["config"])
