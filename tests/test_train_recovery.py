"""The trainer under faults: roll-backs that agree across ranks and end, saves after skipped steps,
resumes that refuse instead of silently restarting, per-rank state, device choice, and the
start-up checks. Each test here failed on the trainer before the strategy interface (issue 8)."""
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import rank_fns
from course_lib.trainer import config as train_config
from course_lib.checkpoint import CheckpointLoadError
from course_lib.trainer.metrics import read_rows
from course_lib.parallel import run_ranks
from course_lib.stability import RollbackLimitError
from course_lib.train import choose_device, main, train
from host_reads import reads_per_step

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"


def cfg(*sets, steps=40):
    return train_config.load(TINY, ["train.progress=false", f"train.max_steps={steps}",
                                    "schedule.warmup_steps=3", *sets])


def events(out):
    path = Path(out) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps_of(out):
    return [r["step"] for r in read_rows(Path(out) / "metrics.jsonl")]


# ------------------------------------------------------------------ the 2-rank runs, one launch

HOST_READ_STRATEGIES = ["ddp", "ddp-scratch", "zero2", "fsdp-scratch", "fsdp"]  # zero1 shares zero2's step
SCRATCH_DDP = ("ddp", "ddp-scratch")


HOST_READ_STEPS = 5  # runs of 5 and 10 steps; a log row every 5 (log_every) falls inside the difference
SHARDED_STEPS, SHARDED_EVERY = 4, 2  # a checkpoint and two steps after it: enough for a bit-exact resume


def rollback_cfg():
    # the spike (grad_scale@20, after the detector's 16-step warm-up) lands one step after the
    # step-20 save; two steps after it show the run going on
    return cfg("train.strategy='ddp'", "train.micro_batch=8", "checkpoint.save_every=10",
               "checkpoint.async_save=true", "stability.spike_policy='rollback'", steps=22)


def sharded_cfg():
    return cfg("train.strategy='ddp'", "train.micro_batch=8", f"checkpoint.save_every={SHARDED_EVERY}",
               "checkpoint.format='sharded'", "model.dropout=0.1", steps=SHARDED_STEPS)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank run of this module that needs no earlier launch, in one launch (a rank's first
    train() pays seconds of imports): the sharded-checkpoint run, torch DDP and the from-scratch
    DDP, the host-read counts of every data-parallel strategy, and last the roll-back on slow
    storage (its slow save patches the checkpoint manager for the rest of the process). The
    sharded-checkpoint run is resumed in the same launch, its newest checkpoint set aside first.
    ``{name: [rank 0's result, rank 1's]}`` and the root folder."""
    root = tmp_path_factory.mktemp("two-ranks")
    host_cfgs = {s: cfg(f"train.strategy='{s}'", "train.micro_batch=8", "checkpoint.async_save=false",
                        f"train.log_every={HOST_READ_STEPS}", steps=HOST_READ_STEPS)
                 for s in HOST_READ_STRATEGIES}
    calls = {"sharded": (rank_fns.train_rank_digest, (sharded_cfg(), str(root / "sharded"))),
             "sharded-resumed": (rank_fns.set_aside_then_resume, (sharded_cfg(), str(root / "sharded"),
                                                                  f"step_{SHARDED_STEPS:09d}")),
             **{s: (rank_fns.train_rank_digest, (cfg(f"train.strategy='{s}'", "train.micro_batch=8",
                                                     "train.grad_accum=2", steps=12), str(root / s)))
                for s in SCRATCH_DDP},
             # the uninterrupted reference of the torchrun kill test: its command line, in this launch
             "clean": (rank_fns.cli_rank, (_trainer_args(root / "clean"),)),
             "host_reads": (rank_fns.host_reads_on_rank_many, (host_cfgs, str(root / "host-reads"),
                                                               HOST_READ_STEPS)),
             "rollback": (rank_fns.train_rank_digest,
                          (rollback_cfg(), str(root / "rollback"), ["grad_scale@20=10"], 1.0))}
    # one thread per rank, as torchrun gives each worker: the "clean" run must match torchrun's bit for bit
    per_rank = run_ranks(rank_fns.several, 2, list(calls.values()), timeout=600, threads_per_rank=1)
    return root, {name: [r[i] for r in per_rank] for i, name in enumerate(calls)}


# ------------------------------------------------------------------ roll-back across ranks

def test_ddp_rollback_with_async_saves_agrees_and_keeps_replicas_identical(two_ranks):
    """The spike lands one step after a save on slow storage: rank 0's async write is still running
    when the ranks roll back. Rank 0 must finish it, pick, and tell rank 1 (before: rank 1 listed
    the folder on its own, rolled back to step 10 while rank 0 went to 20, and the ranks hung).
    (rollback_cfg, 1 s of slow storage, in the two_ranks launch.)"""
    root, runs = two_ranks
    results, tmp_path = runs["rollback"], root / "rollback"
    assert [r["steps"] for r in results] == [22, 22]
    assert [r["rollbacks"] for r in results] == [1, 1]
    assert results[0]["digest"] == results[1]["digest"], "the replicas drifted apart"
    assert [(e["event"], e["rolled_back_to"]) for e in events(tmp_path)] == [("rollback", 20)]
    assert steps_of(tmp_path) == list(range(1, 23))


def test_rollback_before_any_checkpoint_skips_the_step(tmp_path):
    out = tmp_path / "rb"
    with pytest.warns(RuntimeWarning, match="no checkpoint exists yet; the step is skipped instead"):
        result = train(cfg("checkpoint.save_every=30", "stability.spike_policy='rollback'"), out,
                       faults=["grad_scale@20=10"])
    assert result.steps == 40 and result.rollbacks == 0 and result.skipped_steps == 1
    assert events(out) == []
    assert read_rows(out / "metrics.jsonl")[20]["skipped"] is True


# ------------------------------------------------------------------ bounded roll-backs

def test_a_level_shift_under_rollback_ends_at_the_new_level(tmp_path):
    out = tmp_path / "shift"
    with pytest.warns(RuntimeWarning, match="accepted as the new level"):
        result = train(cfg("checkpoint.save_every=10", "stability.spike_policy='rollback'",
                           "stability.max_rollbacks=2", "checkpoint.async_save=false", steps=28), out,
                       faults=["loss_shift@25=3"])  # after the detector's warm-up; 3 steps past the shift
    assert result.steps == 28 and result.rollbacks == 2
    assert [e["event"] for e in events(out)] == ["rollback", "rollback", "level_accepted"]
    assert steps_of(out) == list(range(1, 29))


def test_a_level_shift_with_rollback_limit_error_stops_clearly(tmp_path):
    with pytest.raises(RollbackLimitError, match="survived 2 consecutive roll-backs"):
        train(cfg("checkpoint.save_every=10", "stability.spike_policy='rollback'",
                  "stability.max_rollbacks=2", "stability.rollback_limit='error'", steps=28), tmp_path,
              faults=["loss_shift@25=3"])


# ------------------------------------------------------------------ saving after skipped steps

def test_a_nonfinite_step_on_a_save_step_is_saved_with_the_last_finite_loss(tmp_path):
    result = train(cfg("checkpoint.save_every=20", steps=22), tmp_path, faults=["nan_loss@19"])
    assert result.steps == 22 and result.skipped_steps == 1
    manifest = json.loads((tmp_path / "checkpoints" / "step_000000020" / "manifest.json").read_text())
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert rows[19]["loss"] is None and rows[19]["nonfinite"] is True
    assert manifest["metrics"]["loss"] == rows[18]["loss"]  # the last finite one


def test_resuming_a_finished_run_does_nothing_and_says_so(tmp_path, capsys):
    args = ["--config", str(TINY), "--out", str(tmp_path), "--no-progress", "--max-steps", "6",
            "--save-every", "3", "--set", "schedule.warmup_steps=3"]
    assert main(args) == 0
    assert "from scratch" in capsys.readouterr().out  # not "resumed from 0"
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert main(args + ["--resume", "auto"]) == 0
    assert "nothing to do: already at step 6" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert steps_of(tmp_path) == list(range(1, 7))


# ------------------------------------------------------------------ resume: refuse, never restart

def _flip_a_byte(ckpt_dir):
    weights = ckpt_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def test_a_corrupt_newest_checkpoint_falls_back_and_all_corrupt_refuses(tmp_path, capsys):
    args = ["--config", str(TINY), "--out", str(tmp_path), "--no-progress", "--max-steps", "12",
            "--save-every", "4", "--set", "checkpoint.async_save=false"]
    assert main(args) == 0
    ckpts = tmp_path / "checkpoints"
    _flip_a_byte(ckpts / "step_000000012")
    with pytest.warns(RuntimeWarning, match="step_000000012"):
        assert main(args + ["--resume", "auto"]) == 0
    assert "resumed from step 8" in capsys.readouterr().out
    for d in ckpts.glob("step_*"):
        _flip_a_byte(d)
    rows_before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.warns(RuntimeWarning):
        assert main(args + ["--resume", "auto"]) == 3
    err = capsys.readouterr().err
    assert "cannot resume" in err and "step_000000008" in err and "step_000000012" in err
    assert (tmp_path / "metrics.jsonl").read_text() == rows_before, "metrics were rewritten"
    with pytest.warns(RuntimeWarning):  # the quarantined ones still stop the next attempt
        assert main(args + ["--resume", "auto"]) == 3


def test_a_checkpoint_of_another_model_shape_is_refused_by_name(tmp_path):
    train(cfg("checkpoint.save_every=3", steps=3), tmp_path)
    with pytest.raises(CheckpointLoadError, match=r"step_000000003.*shape"):
        train(cfg("checkpoint.save_every=3", "model.d_model=96", steps=6), tmp_path, resume=True)
    assert (tmp_path / "checkpoints" / "step_000000003").is_dir(), "a valid checkpoint was quarantined"


# ------------------------------------------------------------------ SIGKILL on 2 ranks

STEPS = 12  # saves at 4 and 8: room for the slow variant's second kill


def _torchrun(out, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "course_lib.train", *_trainer_args(out, *extra)]


def _trainer_args(out, *extra):
    return ["--config", str(TINY), "--out", str(out), "--no-progress",
            "--max-steps", str(STEPS), "--save-every", "4", "--set", "train.strategy='ddp'",
            "--set", "train.micro_batch=8", "--set", "model.dropout=0.1",
            "--set", "schedule.warmup_steps=3", *extra]


def _kill_tree(proc):
    """SIGKILL torchrun and every process under it at once (its workers run in sessions of their
    own, so killing the agent's process group would leave them training as orphans)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
    proc.wait()


def _committed(out):
    """Newest committed checkpoint step under out/checkpoints (0: none yet)."""
    steps = [int(p.name[5:14]) for p in (Path(out) / "checkpoints").glob("step_*")]
    return max(steps, default=0)


def _final_weights(out):
    from safetensors.torch import load_file

    newest = max((Path(out) / "checkpoints").glob("step_*"),
                 key=lambda p: json.loads((p / "manifest.json").read_text())["seq"])
    return load_file(str(newest / "model.safetensors"))


@pytest.mark.parametrize("cycles", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ddp_killed_at_random_moments_resumes_bit_exact(tmp_path, cycles, two_ranks):
    """Two ranks with dropout (each rank its own random stream), killed with SIGKILL at a random
    moment after each run's first checkpoint (once by default; twice, the resumed run killed
    again, in the slow variant), resumed each time: the losses and weights equal an uninterrupted
    run bit for bit. Before, every rank restored rank 0's RNG, so rank 1's dropout masks changed
    after a resume. The final resume also finds a torn last line in metrics.jsonl, as a kill in
    the middle of a row's write leaves it: the rows come out whole, each step once (this was
    tests/test_train.py's one-process SIGKILL test, now slow there). The uninterrupted run is the
    same command line run in the two_ranks launch (one thread per rank, as here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root, runs = two_ranks
    assert runs["clean"] == [0, 0]
    clean_dir = root / "clean"
    victim, rng, kills = tmp_path / "victim", random.Random(), 0
    for _ in range(cycles):
        before = _committed(victim)
        proc = subprocess.Popen(_torchrun(victim, "--resume", "auto"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + 240  # wait for this run's first committed checkpoint...
        while time.monotonic() < deadline and _committed(victim) <= before and proc.poll() is None:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.02))  # ...then anywhere (a step is a few ms): mid-step, mid-save, mid-flush
        kills += proc.poll() is None
        _kill_tree(proc)  # the whole node at once: agent and both workers

    assert kills == cycles, "a run ended before its kill: the test proved less than it says"
    with open(victim / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 1.')  # a torn line, as a kill mid-write leaves it
    resumed = subprocess.run(_torchrun(victim, "--resume", "auto"), capture_output=True, text=True,
                             timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout, resumed.stdout  # not a fresh start
    clean_rows = read_rows(clean_dir / "metrics.jsonl")
    victim_rows = [json.loads(line) for line in (victim / "metrics.jsonl").read_text().splitlines()]  # all valid JSON
    assert [r["step"] for r in victim_rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in victim_rows] == [r["loss"] for r in clean_rows]
    wc, wv = _final_weights(clean_dir), _final_weights(victim)
    assert all(torch.equal(wc[k], wv[k]) for k in wc)


# ------------------------------------------------------------------ sharded checkpoints in the trainer

def test_ddp_with_sharded_checkpoints_resumes_exactly(two_ranks):
    """checkpoint.format = 'sharded': every rank writes its shards through DCP; a resume from the
    step-2 checkpoint reproduces the uninterrupted run's steps 3-4 (both runs in the two_ranks
    launch: rank_fns.set_aside_then_resume)."""
    root, runs = two_ranks
    tmp_path, first, again = root / "sharded", runs["sharded"], runs["sharded-resumed"]
    rows = read_rows(tmp_path / "set-aside" / "metrics.jsonl")  # as the first run left them
    assert [r["step"] for r in rows] == list(range(1, SHARDED_STEPS + 1))
    newest = tmp_path / "set-aside" / f"step_{SHARDED_STEPS:09d}"  # moved there before the resume
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["format"].endswith("dcp/1") and manifest["world_size"] == 2
    assert {"rank0.pt", "rank1.pt"} <= {p.name for p in newest.iterdir()}
    assert [r["resumed_from"] for r in again] == [SHARDED_STEPS - SHARDED_EVERY] * 2
    assert [r["loss"] for r in read_rows(tmp_path / "metrics.jsonl")] == [r["loss"] for r in rows]
    assert again[0]["digest"] == again[1]["digest"] == first[0]["digest"]


# ------------------------------------------------------------------ one host read per step

# zero1 shares zero2's step (only the norm hook differs, and it makes no host read).
def test_data_parallel_makes_one_host_read_per_step_on_every_rank(two_ranks):
    """Every strategy in HOST_READ_STRATEGIES, HOST_READ_STEPS and twice that each, in the two_ranks launch."""
    per_rank = two_ranks[1]["host_reads"]
    per_step = {s: [r[s] for r in per_rank] for s in HOST_READ_STRATEGIES}
    assert all(v == [1.0, 1.0] for v in per_step.values()), per_step


def test_from_scratch_ddp_in_the_trainer_gives_torch_ddps_numbers(two_ranks):
    """The learner's BucketedDDP behind the strategy interface: on 2 ranks the sums of two numbers
    do not depend on the order, so the curves and the weights are identical to torch DDP's (both
    runs in the two_ranks launch, 12 steps with grad_accum 2)."""
    root, runs = two_ranks
    assert [r["digest"] for r in runs["ddp-scratch"]] == [r["digest"] for r in runs["ddp"]]
    assert [r["loss"] for r in read_rows(root / "ddp-scratch" / "metrics.jsonl")] == \
        [r["loss"] for r in read_rows(root / "ddp" / "metrics.jsonl")]


def test_a_parallel_strategy_without_a_process_group_is_a_config_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--config", str(TINY), "--out", str(out), "--set", "train.strategy='ddp-scratch'"]) == 2
    assert "needs a process group: start with torchrun" in capsys.readouterr().err
    assert not out.exists()


def test_fp16_makes_one_host_read_per_step_including_the_scaler(tmp_path, monkeypatch):
    """Counts reads made by our code and by torch's GradScaler (its own inf check and get_scale)."""
    monkeypatch.setattr("course_lib.train._peak_flops", lambda cfg, device: 1e12)

    def run(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # on a CPU fp16 warns that it is slow
            train(cfg("train.precision='fp16'", "checkpoint.async_save=false", steps=steps),
                  tmp_path / f"r{steps}")
    assert reads_per_step(run, 5, where=("course_lib", "grad_scaler.py")) <= 1


# ------------------------------------------------------------------ start-up checks and device

@pytest.mark.parametrize("args, words", [
    (["--inject-fault", "inf_grad@5=blocks.9.nope"], "no trainable parameter named 'blocks.9.nope'"),
    (["--inject-fault", "nan_loss@500"], "would never fire"),
    (["--set", "data.task='text'", "--set", "data.path='/no/such/file.txt'"], "data.path: no such file"),
])
def test_start_up_errors_name_the_flag_before_any_file(tmp_path, capsys, args, words):
    out = tmp_path / "run"
    assert main(["--config", str(TINY), "--out", str(out), "--max-steps", "20", *args]) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_a_value_error_that_mentions_a_default_is_not_called_a_fault_flag(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise ValueError("bad default for something")
    monkeypatch.setattr("course_lib.train.train", boom)
    with pytest.raises(ValueError, match="bad default"):
        main(["--config", str(TINY), "--out", str(tmp_path / "x")])


def test_device_follows_the_config_and_the_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert choose_device("cpu", 3, 4) == torch.device("cpu")
    assert choose_device("auto", 3, 4) == torch.device("cuda", 3)  # not every rank on cuda:0
    assert choose_device("cuda", 1, 4) == torch.device("cuda", 1)
    assert choose_device("auto", 0, 8) == torch.device("cpu")  # 8 ranks, 4 GPUs: all on CPU, no mix
    with pytest.raises(Exception, match="8 ranks on this node, 4 GPUs visible"):
        choose_device("cuda", 0, 8)


def test_cpu_device_asks_the_launcher_for_gloo(monkeypatch, tmp_path):
    seen = {}

    def fake_init(backend=None, **k):
        seen["backend"] = backend
        raise RuntimeError("stop here")
    monkeypatch.setattr("course_lib.parallel.ranks.launch.init_distributed", fake_init)
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    with pytest.raises(RuntimeError, match="stop here"):
        train(cfg("train.device='cpu'"), tmp_path)
    assert seen["backend"] == "gloo"
