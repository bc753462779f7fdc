"""course_lib.kit.scratch.fresh: a lab's cell run twice starts its run afresh, and nothing outside
the temporary directory is ever removed."""
import json
import tempfile
from pathlib import Path

import pytest

from course_lib.kit.scratch import fresh


def test_fresh_empties_a_run_folder_or_file_in_the_scratch_directory():
    runs = Path(tempfile.mkdtemp(prefix="labtest-"))
    run = runs / "single"
    (run / "checkpoints" / "step_000000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    out = runs / "model.safetensors"
    out.write_bytes(b"x")
    assert fresh(run) == run.resolve() and not run.exists()
    assert fresh(out) == out.resolve() and not out.exists()
    assert fresh(runs / "never-made") == (runs / "never-made").resolve()  # nothing there: nothing to do
    assert runs.is_dir()  # the lab's own scratch root stays


def test_fresh_refuses_anything_outside_the_temporary_directory(tmp_path):
    keep = Path(__file__).resolve().parent / "conftest.py"
    with pytest.raises(ValueError, match="inside the temporary directory"):
        fresh(keep)
    assert keep.exists()
    with pytest.raises(ValueError, match="inside the temporary directory"):
        fresh(tempfile.gettempdir())


def test_a_fresh_run_into_a_used_lab_folder_trains_again(tmp_path):
    """What a learner's second Run of a training cell does: without fresh() the trainer refuses the
    folder (an earlier run's checkpoints), with it the run starts again and logs the same losses."""
    from course_lib.train import train
    from course_lib.trainer import config as train_config
    from course_lib.trainer.config import ConfigError

    cfg = train_config.load(Path(__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml",
                            ["train.progress=false", "train.max_steps=2", "schedule.warmup_steps=1", "checkpoint.save_every=2",
                             "checkpoint.async_save=false", "train.peak_flops=1e12", "model.n_layers=1"])
    runs = Path(tempfile.mkdtemp(prefix="labtest-"))
    first = (runs / "single" / "metrics.jsonl")
    train(cfg, fresh(runs / "single"))
    losses = [json.loads(line)["loss"] for line in first.read_text().splitlines()]
    with pytest.raises(ConfigError, match="already holds an earlier run's checkpoints"):
        train(cfg, runs / "single")
    train(cfg, fresh(runs / "single"))
    assert [json.loads(line)["loss"] for line in first.read_text().splitlines()] == losses
