"""Heartbeats, the watchdog and the stall fault (course_lib.watch).

Unit tests drive the bookkeeping and the watchdog thread in-process through an in-memory store;
one real job (torchrun, 2 CPU ranks, rank 1 stalled for 10 minutes) must be ended by the watchdog
within its timeout plus a few seconds, naming rank 1 and dumping both ranks' stacks."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from course_lib import train as train_mod
from course_lib.trainer.config import ConfigError
from course_lib.watch import HANG_EXIT_CODE, Heartbeat, StaleTracker, Watchdog, parse_stall, read_beats, split_stalls
from course_lib.watch.control import trainer_faults
from course_lib.watch.demo import run_stall_demo

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- bookkeeping
def test_stale_tracker_waits_for_the_timeout_then_blames_the_rank_that_is_behind():
    tr = StaleTracker(3, timeout_s=2.0, started=0.0)
    assert tr.update({0: "0:1", 1: "0:1", 2: "0:1"}, 0.5) == []
    assert tr.update({0: "1:5", 1: "1:5", 2: "1:2"}, 1.5) == []    # rank 2 entered step 1, no collective yet
    assert tr.update({0: "1:5", 1: "1:5", 2: "1:2"}, 3.4) == []    # silent 1.9 s: not yet
    # everyone is silent now; ranks 0 and 1 wait inside collective 5, which rank 2 never issued
    assert tr.update({0: "1:5", 1: "1:5", 2: "1:2"}, 3.6) == [{"rank": 2, "step": 1, "seq": 2, "silent_s": 2.1}]


def test_stale_tracker_names_every_silent_rank_when_none_is_behind():
    tr = StaleTracker(2, timeout_s=1.0, started=0.0)
    tr.update({0: "3:9", 1: "3:9"}, 0.5)
    assert [s["rank"] for s in tr.update({0: "3:9", 1: "3:9"}, 1.6)] == [0, 1]


def test_stale_tracker_ignores_finished_ranks_and_counts_never_seen_ones_from_the_start():
    tr = StaleTracker(2, timeout_s=1.0, started=10.0)
    tr.update({0: "done"}, 10.1)
    assert tr.update({0: "done"}, 20.0) == [{"rank": 1, "step": None, "seq": None, "silent_s": 10.0}]


def test_heartbeat_publishes_only_changes():
    store = dist.HashStore()
    hb = Heartbeat(1, progress=lambda: 7)
    assert not hb.publish(store)              # no step yet: nothing to say
    hb.beat(4)
    assert hb.publish(store) and not hb.publish(store)
    assert read_beats(store, 2) == {1: "4:7"}  # rank 0 never beat: absent, no blocking get


@pytest.mark.parametrize("text, msg", [("stall@3", "stall@STEP=SECONDS"), ("stall@x=5", "integers"),
                                       ("stall@3=0", "SECONDS finite and > 0"), ("stall@3=5:-1", ">= 0")])
def test_stall_syntax_errors_say_what_is_wrong(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_stall(text)


def test_stalls_are_split_from_the_stabilizer_faults_and_checked_against_the_job():
    others, stalls = split_stalls(["nan_loss@3", "stall@2=1.5:1"])
    assert others == ["nan_loss@3"] and str(stalls[0]) == "stall@2=1.5:1"
    with pytest.raises(ConfigError, match="rank 2 does not exist"):
        trainer_faults(["stall@2=5:2"], world_size=2, max_steps=10)
    with pytest.raises(ConfigError, match="max_steps"):
        trainer_faults(["stall@10=5"], world_size=1, max_steps=10)


def test_bad_stall_on_the_command_line_is_a_config_error_before_any_file(tmp_path, capsys):
    out = tmp_path / "run"
    code = train_mod.main(["--config", str(ROOT / "labs/configs/tiny-cpu.toml"), "--out", str(out),
                           "--no-progress", "--inject-fault", "stall@3=abc"])
    assert code == 2 and "--inject-fault" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------- the thread
def _watch(store, rank, tmp_path, exits, timeout_s=0.6):
    return Watchdog(store, rank, 2, tmp_path, timeout_s, poll_s=0.05, grace_s=0.5, exit_fn=exits.append)


def test_watchdog_stays_quiet_while_every_rank_beats(tmp_path):
    store, exits = dist.HashStore(), []
    dogs = [_watch(store, r, tmp_path, exits).start() for r in range(2)]
    for step in range(30):                      # 1.5 s of steps: 2.5 timeouts
        for d in dogs:
            d.heartbeat.beat(step)
        time.sleep(0.05)
    for d in dogs:
        d.stop()
    assert exits == [] and not (tmp_path / "hang").exists()


def test_watchdog_dumps_every_rank_and_names_the_stalled_one(tmp_path):
    store, exits = dist.HashStore(), []
    dogs = [_watch(store, r, tmp_path, exits).start() for r in range(2)]
    t0 = time.monotonic()
    for step in range(60):
        dogs[0].heartbeat.beat(step)            # rank 1 beats once, then falls silent
        dogs[1].heartbeat.beat(min(step, 2))
        if len(exits) == 2:
            break
        time.sleep(0.05)
    took = time.monotonic() - t0
    for d in dogs:
        d.stop()
    assert exits == [HANG_EXIT_CODE, HANG_EXIT_CODE], exits
    assert took < 0.6 + 0.1 + 0.5 + 1.0         # timeout + polls + grace, with slack for a loaded CPU
    summary = json.loads((tmp_path / "hang" / "summary.json").read_text())
    assert [s["rank"] for s in summary["stalled"]] == [1] and summary["stalled"][0]["step"] == 2
    assert summary["ranks_dumped"] == 2
    for r in range(2):
        text = (tmp_path / "hang" / f"rank{r}.txt").read_text()
        assert "stalled: rank 1 (last heartbeat: step 2" in text
        assert "test_watchdog_dumps_every_rank_and_names_the_stalled_one" in text  # the main thread's stack


# ------------------------------------------------------------------------------- a real job
def test_a_stalled_rank_of_a_torchrun_job_is_named_dumped_and_aborted(tmp_path):
    report = run_stall_demo(world_size=2, stall_rank=1, timeout_s=3.0, out_dir=tmp_path / "job", time_limit_s=60)
    assert report.stalled_rank == 1 and report.last_step == 2, report.log[-3000:]
    assert report.exit_code != 0 and f"exitcode  : {HANG_EXIT_CODE}" in report.log
    assert sorted(report.stacks) == [0, 1]
    assert "in stall_if_due" in report.stacks[1]     # the stalled rank stopped in the injected sleep
    assert "in backward" in report.stacks[0]         # its peer waits in the gradient all-reduce
    assert 3.0 <= report.seconds_to_abort < 3.0 + 5.0, report
