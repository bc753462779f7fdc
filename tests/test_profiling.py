"""The trainer's profiler (course_lib.trainer.profiling): traces and a summary whose numbers agree with
each other and with metrics.jsonl; communication seen on 2 gloo ranks; the step split on a
hand-made trace; config errors naming the key; nothing at all when not asked for."""
import json
from pathlib import Path

import pytest

import rank_fns
from course_lib.trainer import config as train_config
from course_lib.trainer.metrics import read_rows
from course_lib.parallel import run_ranks
from course_lib.trainer.profile_summary import is_comm, step_breakdown
from course_lib.trainer.profiling import load_summary
from course_lib.train import main, train

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"
WINDOW = ["profile.wait=2", "profile.warmup=1", "profile.active=2"]


def cfg(*overrides):
    base = ["train.progress=false", "train.max_steps=7", "schedule.warmup_steps=2", "train.peak_flops=1e11",
            "train.util_sample_s=0", "checkpoint.async_save=false"]
    return train_config.load(TINY, base + list(overrides))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled")
    train(cfg("profile.enabled=true", *WINDOW), out)
    return out


def test_profiled_run_writes_a_loadable_trace_and_tensorboard_files(profiled):
    trace = json.loads((profiled / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= names  # the two active steps (0-based)
    assert list((profiled / "profile" / "tensorboard").glob("rank0.*.pt.trace.json"))
    summary_md = (profiled / "profile" / "summary.md").read_text()
    assert summary_md.startswith("# Profile")
    # the summary points at what opens the trace; TensorBoard as installed shows no profile (README)
    assert "tensorboard --logdir" not in summary_md and "plain `tensorboard` shows no profile" in summary_md


def test_summary_parts_add_up_and_mfu_is_the_metrics_rows(profiled):
    summary = load_summary(profiled)
    rank0 = summary["ranks"][0]
    rows = {r["step"]: r for r in read_rows(profiled / "metrics.jsonl")}
    assert [s["step"] for s in rank0["steps"]] == [4, 5]  # trainer steps count from 1
    for s in rank0["steps"]:
        assert s["compute_s"] + s["comm_s"] + s["idle_s"] == pytest.approx(s["wall_s"], abs=1e-9)
        assert s["compute_s"] > 0 and s["idle_s"] >= 0 and s["comm_total_s"] == 0  # one process: no collective
        assert s["mfu"] == rows[s["step"]]["mfu"]
        # the profiler's step window and the trainer's stopwatch time the same step
        assert s["wall_s"] == pytest.approx(rows[s["step"]]["step_seconds"], rel=0.35, abs=0.02)
    top = rank0["top_ops"]["cpu"]
    assert top and all(op["self_s"] > 0 and op["calls"] >= 1 for op in top)
    assert not any(op["name"].startswith("ProfilerStep") for op in top)
    assert rank0["mean"]["compute_share"] + rank0["mean"]["comm_share"] + rank0["mean"]["idle_share"] == \
        pytest.approx(1.0)


def test_two_gloo_ranks_spend_time_communicating(tmp_path):
    run_ranks(rank_fns.train_rank, 2, cfg("train.strategy='ddp'", "train.micro_batch=8", "profile.enabled=true",
                                          *WINDOW), str(tmp_path))
    summary = load_summary(tmp_path)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for r in summary["ranks"]:
        assert len(r["steps"]) == 2 and (tmp_path / "profile" / f"trace_rank{r['rank']}.json").exists()
        for s in r["steps"]:
            assert s["comm_total_s"] > 0 and s["comm_s"] > 0  # the loss all-reduce blocks the step
            assert s["compute_s"] + s["comm_s"] + s["idle_s"] == pytest.approx(s["wall_s"], abs=1e-9)


def _x(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}


def test_step_split_on_a_hand_made_cpu_trace():
    events = [_x("ProfilerStep#7", 0, 100, "user_annotation"),
              _x("aten::mm", 10, 30),                     # compute 10..40
              _x("aten::add", 20, 10),                    # nested: no extra time
              _x("gloo:all_reduce", 30, 30, "user_annotation", tid=2),  # comm 30..60: 10 hidden, 20 exposed
              _x("c10d::allreduce_", 70, 10),             # a blocking collective on the main thread
              _x("aten::copy_", 72, 2),                   # ...its own copy is communication, not compute
              _x("aten::mm", 90, 30)]                     # runs past the step: clipped to 90..100
    (s,) = step_breakdown({"traceEvents": events})
    assert s["profiler_step"] == 7 and s["timeline"] == "cpu"
    assert s["wall_s"] == pytest.approx(100e-6)
    assert s["compute_s"] == pytest.approx(40e-6)
    assert s["comm_s"] == pytest.approx(30e-6) and s["comm_total_s"] == pytest.approx(40e-6)
    assert s["comm_overlapped_s"] == pytest.approx(10e-6)
    assert s["idle_s"] == pytest.approx(30e-6)


def test_step_split_on_a_gpu_trace_uses_kernels():
    events = [_x("ProfilerStep#0", 0, 100, "user_annotation"),
              _x("aten::mm", 0, 90),  # host-side op: ignored when kernels exist
              _x("sm90_gemm", 10, 40, "kernel", tid=7),
              _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 30, "kernel", tid=8)]
    (s,) = step_breakdown(events)
    assert s["timeline"] == "cuda"
    assert (s["compute_s"], s["comm_s"], s["idle_s"]) == pytest.approx((40e-6, 20e-6, 40e-6))


def test_collective_names():
    assert all(map(is_comm, ["gloo:all_reduce", "c10d::allreduce_", "ncclDevKernel_AllGather_RING_LL",
                             "record_param_comms", "c10d::recv_", "aten::_reduce_scatter_base"]))
    assert not any(map(is_comm, ["aten::mm", "aten::broadcast_tensors", "aten::addmm", "aten::expand"]))


@pytest.mark.parametrize("overrides, words", [
    (["profile.active=0"], ["profile.active", ">= 1"]),
    (["profile.wiat=2"], ["profile.wiat", "did you mean 'wait'"]),
    (["profile.warmup=-1"], ["profile.warmup", ">= 0"]),
    (["profile.enabled=true", "profile.wait=5", "profile.warmup=1", "profile.active=3"],
     ["profile.wait + profile.warmup + profile.active", "train.max_steps (7)"]),
])
def test_bad_profile_keys_name_the_key(overrides, words):
    with pytest.raises(train_config.ConfigError) as err:
        cfg(*overrides)
    for word in words:
        assert word in str(err.value)


def test_cli_profile_flag_with_too_few_steps_writes_nothing(tmp_path, capsys):
    code = main(["--config", str(TINY), "--max-steps", "3", "--set", "schedule.warmup_steps=1",
                 "--out", str(tmp_path / "run"), "--profile", "--no-progress"])
    assert code == 2 and "profile.wait" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_no_profiler_when_not_asked(tmp_path, monkeypatch):
    import torch.profiler

    def refuse(*a, **k):
        raise AssertionError("torch.profiler.profile was created although profiling is off")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    train(cfg(), tmp_path)
    assert not (tmp_path / "profile").exists()
    with pytest.raises(FileNotFoundError, match="--profile"):
        load_summary(tmp_path)
