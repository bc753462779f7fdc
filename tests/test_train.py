"""The trainer: accumulation equals the big batch, determinism, config errors before any file,
resume after SIGKILL, faults caught, DDP equal to one process."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rank_fns
from adam_tolerance import assert_weights_match_after_adam
from host_reads import reads_per_step
from course_lib.trainer import config as train_config
from course_lib.trainer.metrics import read_rows
from course_lib.parallel import run_ranks
from course_lib.train import main, train

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"


def cfg(**sets):
    """tiny-cpu.toml with `section__key=value` overrides and no progress bar."""
    overrides = ["train.progress=false", "train.max_steps=12", "schedule.warmup_steps=3"]
    overrides += [f"{k.replace('__', '.')}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
                  for k, v in sets.items()]
    return train_config.load(TINY, overrides)


def losses(out):
    return [r["loss"] for r in read_rows(Path(out) / "metrics.jsonl")]


def final_weights(out):
    from safetensors.torch import load_file

    newest = sorted((Path(out) / "checkpoints").glob("step_*"))[-1]
    files = list(newest.glob("*.safetensors"))
    assert files, f"no safetensors in {newest}"
    return load_file(str(files[0]))


def test_accumulation_equals_one_big_batch(tmp_path):
    big = train(cfg(train__micro_batch=32, train__grad_accum=1), tmp_path / "big")
    acc = train(cfg(train__micro_batch=8, train__grad_accum=4), tmp_path / "acc")
    assert big.steps == acc.steps == 12
    # the logged loss is the mean over the 4 micro-batches, not the last one
    assert losses(tmp_path / "acc") == pytest.approx(losses(tmp_path / "big"), rel=1e-5)
    wb, wa = final_weights(tmp_path / "big"), final_weights(tmp_path / "acc")
    # Summation order differs (4 partial sums vs one), so gradients differ by rounding (~1e-9);
    # the key biases, whose exact gradient is zero, wander within Adam's bound (adam_tolerance.py).
    assert_weights_match_after_adam(wa, wb, lr=3e-3, steps=12)


def test_same_seed_same_losses_and_another_seed_differs(tmp_path):
    a = losses(train(cfg(), tmp_path / "a").out_dir)
    b = losses(train(cfg(), tmp_path / "b").out_dir)
    c = losses(train(cfg(train__seed=1), tmp_path / "c").out_dir)
    assert a == b
    assert a != c


def test_metrics_rows_have_the_contract_fields_and_loss_falls(tmp_path):
    train(cfg(train__max_steps=60, schedule__warmup_steps=5), tmp_path)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 61))
    for key in ("step", "loss", "lr", "grad_norm", "skipped", "tokens_per_s", "mfu"):
        assert key in rows[0], key
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # the synthetic task is learnable
    assert rows[0]["lr"] < rows[4]["lr"]  # warmup
    assert json.loads((tmp_path / "config.json").read_text())["train"]["max_steps"] == 60


@pytest.fixture(scope="module")
def clean40(tmp_path_factory):
    """An fp32 run of 40 steps, no faults: the reference of the bf16, fault and roll-back tests
    (trained once for all of them)."""
    return train(cfg(train__max_steps=40), tmp_path_factory.mktemp("clean40"))


def test_bf16_autocast_trains_within_a_band_of_fp32(tmp_path, clean40):
    bf16 = train(cfg(train__max_steps=40, train__precision="bf16"), tmp_path / "bf16").final_loss
    assert abs(bf16 - clean40.final_loss) < 0.1, (clean40.final_loss, bf16)


@pytest.mark.parametrize("args, words", [
    (["--set", "train.max_step=5"], "unknown config key train.max_step (did you mean 'max_steps'?)"),
    (["--set", "trian.seed=1"], "unknown config section [trian]"),
    (["--set", "train.micro_batch=2.5"], "train.micro_batch must be int, got float"),
    (["--set", "optim.lr=-1"], "optim.lr must be >= 0.0"),
    (["--set", "train.precision=fp4"], "train.precision must be one of fp32, bf16, fp16, fp8"),
    (["--set", "schedule.warmup_steps=500"], "schedule.warmup_steps (500) must be <= train.max_steps"),
    (["--set", "model.n_heads=5"], "[model]"),
    (["--set", "model.flavour=1"], "unknown model config key"),
    (["--inject-fault", "gradscale@5"], "--inject-fault"),
    (["--max-steps", "0"], "train.max_steps must be >= 1"),
])
def test_bad_config_is_refused_before_any_file(tmp_path, capsys, args, words):
    out = tmp_path / "run"
    assert main(["--config", str(TINY), "--out", str(out), *args]) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_a_file_where_the_run_folder_goes_is_a_config_error(tmp_path, capsys):
    """``--out FILE`` (or a path under a file) was a NotADirectoryError traceback: now exit 2
    naming --out, the file untouched."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for out, words in [(tmp_path / "notes.txt", "is a file, not a folder"),
                       (tmp_path / "notes.txt" / "run", "cannot be made"),
                       (tmp_path / "gone", "a link to nothing")]:
        assert main(["--config", str(TINY), "--out", str(out), "--max-steps", "10"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: --out") and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _cmd(out, *extra):
    return [sys.executable, "-m", "course_lib.train", "--config", str(TINY), "--out", str(out),
            "--no-progress", "--set", "schedule.warmup_steps=3", "--set", "train.metrics_flush_s=0", *extra]


# Slow: three subprocesses. The default suite proves the same on 2 ranks (a random-moment SIGKILL,
# a torn metrics line, bit-exact losses and weights, each step once):
# tests/test_train_recovery.py::test_ddp_killed_at_random_moments_resumes_bit_exact.
@pytest.mark.slow
def test_resume_after_sigkill_is_bit_exact(tmp_path):
    steps = ["--max-steps", "40", "--save-every", "5"]
    clean = subprocess.run(_cmd(tmp_path / "clean", *steps), capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    victim = subprocess.Popen(_cmd(tmp_path / "victim", *steps), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(read_rows(tmp_path / "victim" / "metrics.jsonl")) < 23:
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = len(read_rows(tmp_path / "victim" / "metrics.jsonl"))
    assert 23 <= killed_at < 40, "the run was not killed mid-way"
    with open(tmp_path / "victim" / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 1.')  # a torn line, as a kill mid-write leaves it
    resumed = subprocess.run(_cmd(tmp_path / "victim", *steps, "--resume", "auto"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from step 20" in resumed.stdout or "resumed from step 15" in resumed.stdout, resumed.stdout
    lines = (tmp_path / "victim" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is valid JSON
    assert [r["step"] for r in rows] == list(range(1, 41))  # no gap, no duplicate
    assert [r["loss"] for r in rows] == losses(tmp_path / "clean")  # bit-exact, not approx
    wc, wv = final_weights(tmp_path / "clean"), final_weights(tmp_path / "victim")
    assert all(torch.equal(wc[k], wv[k]) for k in wc)


@pytest.mark.parametrize("fault, field", [
    ("grad_scale@25=10", "spike"),  # after the detector's 16-step warm-up window
    ("nan_loss@25", "nonfinite"),
    ("inf_grad@25", "nonfinite"),
])
def test_injected_faults_are_caught_and_the_run_recovers(tmp_path, fault, field, clean40):
    clean = clean40
    hit = train(cfg(train__max_steps=40), tmp_path / "hit", faults=[fault])
    rows = read_rows(tmp_path / "hit" / "metrics.jsonl")
    bad = rows[25]  # the fault hits the 26th optimizer step (steps count from 0 inside the loop)
    assert bad["skipped"] is True and bad[field] is True, bad
    assert sum(r["skipped"] for r in rows) == 1
    # the step was skipped, so nothing was corrupted: the run ends in the clean run's band
    assert hit.final_loss == pytest.approx(clean.final_loss, abs=0.1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 ranks: a DDP run (micro-batch 8 each, the global batch 16), then the
    single-process strategy started on the same 2 ranks (a refusal: its message per rank)."""
    root = tmp_path_factory.mktemp("two-ranks")
    calls = [(rank_fns.train_rank, (cfg(train__micro_batch=8, train__strategy="ddp"), str(root / "ddp"))),
             (rank_fns.refused, (rank_fns.train_rank, cfg(), str(root / "x")))]
    per_rank = run_ranks(rank_fns.several, 2, calls)
    return root, [r[0] for r in per_rank], [r[1] for r in per_rank]


def test_ddp_on_two_ranks_matches_one_process_with_the_global_batch(tmp_path, two_ranks):
    root, results, _ = two_ranks
    single = train(cfg(train__micro_batch=16), tmp_path / "single")
    assert single.steps == 12
    assert [r["steps"] for r in results] == [12, 12]
    assert results[0]["final_loss"] == results[1]["final_loss"]  # both ranks saw the same mean
    assert losses(root / "ddp") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)


def test_single_strategy_under_several_ranks_is_refused(two_ranks):
    messages = two_ranks[2]
    assert all(m and m.startswith("ConfigError") and "train.strategy = 'ddp'" in m for m in messages), messages


def test_at_most_one_host_read_of_device_values_per_step(tmp_path, monkeypatch):
    """Every way our code reads a tensor's value into Python is counted (tests/host_reads.py); on
    a GPU each is a device sync. Reads made inside torch itself are not counted: AdamW reads its
    step counters with .item(), but those live on the host even when the model is on a GPU."""
    monkeypatch.setattr("course_lib.train._peak_flops", lambda cfg, device: 1e12)

    def run(steps):
        train(cfg(train__max_steps=steps, checkpoint__async_save=False), tmp_path / f"r{steps}")
    per_step = reads_per_step(run, 10)
    assert per_step <= 1, f"{per_step} host reads per optimizer step"


def test_rollback_policy_restores_the_last_checkpoint_and_skips_the_bad_data(tmp_path, clean40):
    clean = clean40
    out = tmp_path / "rb"
    hit = train(cfg(train__max_steps=40, checkpoint__save_every=10, stability__spike_policy="rollback",
                    checkpoint__async_save=False), out, faults=["grad_scale@25=10"])
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["rolled_back_to"]) for e in events] == [("rollback", 20)]
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))  # rows after step 20 were rewritten
    assert hit.steps == 40 and hit.final_loss == pytest.approx(clean.final_loss, abs=0.1)


@pytest.mark.parametrize("path", sorted((ROOT / "labs" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = train_config.load(path)
    assert config["train"]["max_steps"] >= 1
    train_config.build_model_config(config)
