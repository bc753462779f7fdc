"""MetricsLog: crash safety of the buffered JSONL log, resume truncation, strict JSON, TensorBoard."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from course_lib.trainer import metrics
from course_lib.trainer.metrics import MetricsLog, read_rows

ROOT = Path(__file__).resolve().parent.parent


def _strict_lines(path: Path) -> list[dict]:
    """Every line of the file as strict JSON (NaN/Infinity literals rejected)."""
    def reject(token):
        raise AssertionError(f"non-strict JSON constant {token} in {path}")
    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def _child(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _wait_for_line(proc: subprocess.Popen, want: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == want:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) before {want!r}: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"child never printed {want!r}")


def _row(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "lr": 3e-3, "skipped": False}


# ----------------------------------------------------------------------------- crash safety

def test_flushed_rows_survive_sigkill_unflushed_ones_are_only_lost(tmp_path):
    """The contract the trainer relies on: flush() before a checkpoint save, then a SIGKILL loses
    only rows written after that flush; what is in the file is whole rows, each once."""
    path = tmp_path / "metrics.jsonl"
    proc = _child(f"""
        import sys, time
        from course_lib.trainer.metrics import MetricsLog
        log = MetricsLog({str(path)!r}, flush_every_s=3600, flush_every_rows=10**6)
        for step in range(1, 51):
            log.write({{"step": step, "loss": 1.0 / step, "lr": 3e-3}})
        log.flush()                       # the trainer: just before saving checkpoint 50
        for step in range(51, 71):        # steps after the checkpoint: a resume rewrites them
            log.write({{"step": step, "loss": 1.0 / step, "lr": 3e-3}})
        print("ready", flush=True)
        time.sleep(600)
    """)
    try:
        _wait_for_line(proc, "ready")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    rows = _strict_lines(path)  # every line whole
    assert [r["step"] for r in rows] == list(range(1, 51))
    assert rows == [{"step": s, "loss": 1.0 / s, "lr": 3e-3} for s in range(1, 51)]


def test_sigkill_mid_stream_leaves_whole_unique_rows(tmp_path):
    """Killed at a random moment while flushing every few rows: the file is a gap-free prefix of
    the rows, each once; only the very last line may be torn, and read_rows skips it."""
    path = tmp_path / "metrics.jsonl"
    proc = _child(f"""
        from course_lib.trainer.metrics import MetricsLog
        log = MetricsLog({str(path)!r}, flush_every_s=3600, flush_every_rows=7)
        step = 0
        while True:
            step += 1
            log.write({{"step": step, "loss": 1.0 / step, "pad": "x" * 300}})
            if step == 700:
                print("ready", flush=True)
    """)
    try:
        _wait_for_line(proc, "ready")
        time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = path.read_text().split("\n")
    whole, last = lines[:-1], lines[-1]  # text after the last newline: "" or a torn line
    steps = [json.loads(line)["step"] for line in whole]
    assert len(steps) >= 700 and steps == list(range(1, len(steps) + 1))
    assert [r["step"] for r in read_rows(path)] == steps
    if last:
        with pytest.raises(json.JSONDecodeError):
            json.loads(last)


def test_unclosed_log_is_flushed_at_interpreter_exit(tmp_path):
    """An uncaught exception ends the program normally: the buffered rows still reach the file."""
    path = tmp_path / "metrics.jsonl"
    proc = _child(f"""
        from course_lib.trainer.metrics import MetricsLog
        log = MetricsLog({str(path)!r}, flush_every_s=3600)
        for step in range(1, 6):
            log.write({{"step": step}})
        raise RuntimeError("boom")
    """)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "boom" in err
    assert [r["step"] for r in _strict_lines(path)] == [1, 2, 3, 4, 5]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_does_not_write_the_parents_pending_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, flush_every_s=3600)
    log.write(_row(1))
    pid = os.fork()
    if pid == 0:  # child: flush and close would duplicate row 1 without the at-fork hook
        try:
            log.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    log.write(_row(2))
    log.close()
    assert [r["step"] for r in _strict_lines(path)] == [1, 2]


def test_failed_write_is_resumed_without_duplicates(tmp_path, monkeypatch):
    """A write(2) that stops part-way (disk full) keeps the rest pending; the next flush finishes
    the torn line instead of writing the rows again."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, flush_every_s=3600)
    for step in range(1, 4):
        log.write(_row(step))
    real_write, calls = os.write, []

    def half_then_fail(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", half_then_fail)
    with pytest.raises(OSError):
        log.flush()
    assert len(read_rows(path)) < 3  # a torn line on disk, the rest still owed
    monkeypatch.setattr(metrics.os, "write", real_write)
    log.write(_row(4))
    log.close()
    assert [r["step"] for r in _strict_lines(path)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- flush policy

def test_default_writes_every_row_at_once(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write(_row(1))
    assert log.pending == 0 and [r["step"] for r in read_rows(tmp_path / "m.jsonl")] == [1]
    log.close()


def test_buffered_flushes_by_rows_time_and_on_request(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path, flush_every_s=3600, flush_every_rows=3)
    log.write(_row(1))
    log.write(_row(2))
    assert read_rows(path) == [] and log.pending == 2
    log.write(_row(3))  # the row bound
    assert len(read_rows(path)) == 3 and log.pending == 0
    log.write(_row(4))
    log.flush()  # on request (before a checkpoint save)
    assert len(read_rows(path)) == 4
    log.close()

    timed = MetricsLog(path, resume_step=4, flush_every_s=0.05)
    timed.write(_row(5))  # the first write after construction may already be 0.05 s late
    timed.flush()
    timed.write(_row(6))
    assert timed.pending == 1
    time.sleep(0.06)
    timed.write(_row(7))  # the time bound
    assert timed.pending == 0 and [r["step"] for r in read_rows(path)] == list(range(1, 8))
    timed.close()


def test_close_and_with_block_flush_even_on_exceptions(tmp_path):
    path = tmp_path / "m.jsonl"
    with pytest.raises(KeyError):
        with MetricsLog(path, flush_every_s=3600) as log:
            log.write(_row(1))
            raise KeyError("crash in the loop")
    assert [r["step"] for r in read_rows(path)] == [1]
    log.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        log.write(_row(2))


def test_row_is_copied_at_write_time(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl", flush_every_s=3600)
    row = _row(1)
    log.write(row)
    row["loss"] = -1.0  # the caller reuses its dict
    row["extra"] = 1
    log.close()
    assert read_rows(tmp_path / "m.jsonl") == [_row(1)]


def test_a_value_json_cannot_hold_fails_at_write_not_at_flush(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path, flush_every_s=3600)
    log.write(_row(1))
    with pytest.raises(TypeError):
        log.write({"step": 2, "loss": object()})
    with pytest.raises(TypeError):
        log.write({"step": 2, ("not", "a", "str"): 1.0})
    log.write(_row(2))
    log.close()
    assert [r["step"] for r in _strict_lines(path)] == [1, 2]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(flush_every_s=-1), ValueError, "flush_every_s must be >= 0"),
    (dict(flush_every_s=float("nan")), ValueError, "flush_every_s must be a finite number"),
    (dict(flush_every_s=True), TypeError, "flush_every_s must be a number"),
    (dict(flush_every_rows=0), ValueError, "flush_every_rows must be >= 1"),
    (dict(flush_every_rows=2.5), TypeError, "flush_every_rows must be an int"),
])
def test_bad_flush_settings_are_refused(tmp_path, kwargs, error, words):
    with pytest.raises(error, match=words):
        MetricsLog(tmp_path / "m.jsonl", **kwargs)
    assert not (tmp_path / "m.jsonl").exists()


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "sub" / "m.jsonl", enabled=False, flush_every_s=1.0)
    log.write(_row(1))
    log.flush()
    log.close()
    assert not (tmp_path / "sub").exists()


# ----------------------------------------------------------------------------- resume, JSON

@pytest.mark.parametrize("flush_every_s", [0.0, 3600.0])
def test_resume_keeps_rows_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path, flush_every_s):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, flush_every_s=flush_every_s)
    for step in range(1, 11):
        log.write(_row(step))
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 11, "loss": 0.')  # torn, as a kill mid-write leaves it
    assert [r["step"] for r in read_rows(path)] == list(range(1, 11))
    log = MetricsLog(path, resume_step=6, flush_every_s=flush_every_s)
    assert [r["step"] for r in _strict_lines(path)] == list(range(1, 7))  # rewritten, torn line gone
    for step in range(7, 9):
        log.write(_row(step))
    log.close()
    assert [r["step"] for r in _strict_lines(path)] == list(range(1, 9))
    assert not path.with_suffix(".jsonl.tmp").exists()
    MetricsLog(path, resume_step=0).close()  # 0/None: a fresh run
    assert path.read_text() == ""


@pytest.mark.parametrize("flush_every_s", [0.0, 3600.0])
def test_non_finite_values_become_null(tmp_path, flush_every_s):
    path = tmp_path / "m.jsonl"
    np = pytest.importorskip("numpy")
    log = MetricsLog(path, flush_every_s=flush_every_s)
    # plain scalars only (encoded at flush time), then a list and a numpy float (encoded at once)
    log.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "mfu": float("-inf"),
               "ok": 2.5, "flag": True, "note": None})
    log.write({"step": 2, "norms": [1.0, float("nan")], "loss": np.float64("nan"), "layer": {"a": np.inf}})
    log.write({"step": 3, "loss": 0.5})
    log.close()
    assert _strict_lines(path) == [
        {"step": 1, "loss": None, "grad_norm": None, "mfu": None, "ok": 2.5, "flag": True, "note": None},
        {"step": 2, "norms": [1.0, None], "loss": None, "layer": {"a": None}},
        {"step": 3, "loss": 0.5}]


def test_tensorboard_gets_the_cleaned_numbers(tmp_path, monkeypatch):
    """Behaviour of the optional TensorBoard path: numeric, non-bool, finite fields except step,
    under train/<key>, at global step row['step']; closed with the log."""
    calls = []

    class FakeWriter:
        def __init__(self, logdir):
            calls.append(("init", Path(logdir)))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            calls.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    log = MetricsLog(tmp_path / "m.jsonl", tensorboard=True, flush_every_s=3600)
    log.write({"step": 3, "loss": 2.0, "lr": float("nan"), "skipped": False, "tokens_per_s": 10})
    log.close()
    assert calls == [("init", tmp_path / "tensorboard"), ("train/loss", 2.0, 3),
                     ("train/tokens_per_s", 10, 3), ("close",)]
    assert read_rows(tmp_path / "m.jsonl")[0]["lr"] is None


def test_trainer_event_files_read_back_with_tensorboards_own_reader(tmp_path):
    """A real run with train.tensorboard = true: TensorBoard's event reader finds train/loss at
    every step, equal to metrics.jsonl's (the files a learner opens with
    `tensorboard --logdir RUN/tensorboard`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from course_lib.trainer import config as train_config
    from course_lib.train import train

    tiny = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
    cfg = train_config.load(tiny, ["train.max_steps=6", "schedule.warmup_steps=2", "train.progress=false",
                                   "train.tensorboard=true", "train.metrics_flush_s=0"])
    train(cfg, tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"] and "train/lr" in events.Tags()["scalars"]
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    rows = {r["step"]: r["loss"] for r in read_rows(tmp_path / "metrics.jsonl")}
    assert sorted(logged) == sorted(rows) == list(range(1, 7))
    assert all(abs(logged[s] - rows[s]) <= 1e-6 * abs(rows[s]) for s in rows), (logged, rows)
