"""CheckpointManager: full resume state, atomicity under SIGKILL, corruption fallback, retention,
async saves. The loop under test is tests/tiny_loop.py (the full trainer composes the same parts)."""
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import tiny_loop
from course_lib.checkpoint import io as cio
from course_lib.checkpoint import CheckpointError, CheckpointManager


class Position:
    """A data position with a state_dict, like a resumable sampler."""

    def __init__(self, index=0):
        self.index = index

    def state_dict(self):
        return {"index": self.index, "order": torch.arange(5) * self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


class TiedLM(nn.Module):
    """Embedding and output head share one weight, as GPT-2 does (safetensors refuses shared
    tensors unless the manager stores them once)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))

    def forward(self, idx):
        return self.head(self.mid(self.emb(idx)))


def make_state(train_steps=2):
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    data = Position()
    for _ in range(train_steps):
        train_step(model, opt, sched, data)
    return dict(model=model, optimizer=opt, scheduler=sched, scaler=scaler, data=data)


def train_step(model, opt, sched, data):
    idx = torch.randint(0, 11, (4, 6))
    loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    model.steps_seen += 1
    data.index += 1


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def equal_states(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------ state and format

def test_roundtrip_restores_every_part_of_the_state(tmp_path):
    s = make_state()
    mgr = CheckpointManager(tmp_path, async_save=False)
    path = mgr.save(7, metrics={"loss": 1.25, "note": "x"}, **s)
    saved_lr = s["scheduler"].get_last_lr()
    saved = params(s["model"])
    saved_opt = copy.deepcopy(s["optimizer"].state_dict())
    draws = (random.random(), float(np.random.rand()), torch.rand(3))  # right after the save
    for _ in range(3):
        train_step(s["model"], s["optimizer"], s["scheduler"], s["data"])
    fresh = make_state(train_steps=0)
    res = CheckpointManager(tmp_path).load(**fresh)
    assert (res.step, res.path, res.source, res.metrics) == (7, path, "local", {"loss": 1.25, "note": "x"})
    assert equal_states(saved, params(fresh["model"]))
    assert fresh["model"].head.weight is fresh["model"].emb.weight  # still tied
    got_opt = fresh["optimizer"].state_dict()
    assert got_opt["param_groups"] == saved_opt["param_groups"]
    for k, st in saved_opt["state"].items():
        assert all(torch.equal(st[n], got_opt["state"][k][n]) for n in st)
    assert fresh["scheduler"].last_epoch == 2 and fresh["scheduler"].get_last_lr() == saved_lr
    assert fresh["scaler"].get_scale() == 1024.0 and fresh["data"].index == 2
    assert (random.random(), float(np.random.rand())) == draws[:2] and torch.equal(torch.rand(3), draws[2])


def test_layout_is_safetensors_plus_manifest(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    path = mgr.save(3, model=TiedLM())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000003"]
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors", "train_state.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == cio.FORMAT and manifest["step"] == 3
    assert manifest["aliases"] == {"head.weight": "emb.weight"}
    for name, meta in manifest["files"].items():
        assert cio.sha256_hex((path / name).read_bytes()) == meta["sha256"]
    assert "head.weight" not in load_file(path / "model.safetensors")  # stored once


def test_temp_dirs_are_never_checkpoints_and_are_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    good = mgr.save(5, model=TiedLM())
    shutil.copytree(good, tmp_path / ".tmp-step_000000009-123-abcd")  # complete-looking, never committed
    (tmp_path / "step_000000008").mkdir()  # a stray directory without a manifest
    (tmp_path / ".trash-step_000000001-ff").mkdir()
    fresh = CheckpointManager(tmp_path)
    assert sorted(fresh.cleaned) == [".tmp-step_000000009-123-abcd", ".trash-step_000000001-ff"]
    with pytest.warns(RuntimeWarning, match="step_000000008.*no readable manifest"):
        assert fresh.load(TiedLM()).step == 5
    assert [n for n, _ in fresh.checkpoints()] == ["step_000000005"]


def test_loading_never_unpickles_code(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, model=TiedLM())
    evil = mgr.save(2, model=TiedLM())
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"rng": Payload()}, evil / "train_state.pt")
    manifest = json.loads((evil / "manifest.json").read_text())  # forge matching checksums
    blob = (evil / "train_state.pt").read_bytes()
    manifest["files"]["train_state.pt"] = {"sha256": cio.sha256_hex(blob), "bytes": len(blob)}
    (evil / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match="step_000000002.*unusable"):
        res = CheckpointManager(tmp_path).load(TiedLM())
    assert res.step == 1 and not marker.exists()


@pytest.mark.parametrize("victim", ["model.safetensors", "train_state.pt", "manifest.json"])
def test_flipped_byte_falls_back_to_previous(tmp_path, victim):
    s = make_state()
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(2, **s)
    older = params(s["model"])
    train_step(s["model"], s["optimizer"], s["scheduler"], s["data"])
    newest = mgr.save(3, **s)
    flip_byte(newest / victim, offset=1 if victim == "manifest.json" else None)
    fresh = make_state(train_steps=0)
    with pytest.warns(RuntimeWarning, match="step_000000003.*(falling back|no readable manifest)"):
        res = CheckpointManager(tmp_path).load(**fresh)
    assert res.step == 2 and equal_states(older, params(fresh["model"]))
    assert not newest.exists() and any(p.name.startswith(".corrupt-step_000000003") for p in tmp_path.iterdir())


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert CheckpointManager(tmp_path / "new").load(TiedLM()) is None


# ------------------------------------------------------------------ retention and policies

def test_retention_keeps_last_k_and_best(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_best=1, best_metric="loss", async_save=False)
    model = TiedLM()
    for step, loss in zip(range(1, 7), [5.0, 1.0, 4.0, 3.0, 6.0, 7.0]):
        mgr.save(step, model=model, metrics={"loss": loss})
        names = sorted(p.name for p in tmp_path.iterdir())
        assert len(names) <= 3 and names[-1] == cio.checkpoint_name(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000002", "step_000000005", "step_000000006"]
    assert mgr.removed == ["step_000000001", "step_000000003", "step_000000004"]
    best_max = CheckpointManager(tmp_path / "max", keep_last=1, keep_best=1, best_metric="acc",
                                 best_mode="max", async_save=False)
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.7)]:
        best_max.save(step, model=model, metrics={"acc": acc})
    assert sorted(p.name for p in (tmp_path / "max").iterdir()) == ["step_000000002", "step_000000003"]


def test_pruning_waits_for_verification(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    model = TiedLM()
    mgr.save(1, model=model)
    mgr.save(2, model=model)
    mgr.wait()
    real_write = cio.write_durable

    def bad_disk(path, data):  # the disk stores different bytes than it was given
        if Path(path).name == "model.safetensors":
            data = data[:-1] + bytes([data[-1] ^ 1])
        real_write(path, data)

    monkeypatch.setattr(cio, "write_durable", bad_disk)
    mgr.save(3, model=model)
    with pytest.raises(CheckpointError, match="step_000000003.*checksum"):
        mgr.wait()
    monkeypatch.undo()
    assert [n for n, _ in CheckpointManager(tmp_path).checkpoints()] == ["step_000000002"]
    assert CheckpointManager(tmp_path).load(TiedLM()).step == 2


def test_never_fewer_than_one_valid_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, async_save=True)
    s = make_state()
    mgr.save(0, **s)
    mgr.wait()
    stop, empty_seen, polls = threading.Event(), [], [0]

    def valid_now():
        for p in cio.list_checkpoint_dirs(tmp_path):
            try:
                cio.read_verified(p)
                return True
            except cio.CheckpointError:
                continue  # pruned between listing and reading: look again
        return False

    def watch():
        while not stop.is_set():
            polls[0] += 1
            # a listing can race with rename+prune; count an empty instant only if it persists
            if not any(valid_now() for _ in range(3)):
                empty_seen.append(sorted(os.listdir(tmp_path)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    for step in range(1, 16):
        train_step(s["model"], s["optimizer"], s["scheduler"], s["data"])
        mgr.save(step, **s)
    mgr.close()
    stop.set()
    watcher.join()
    assert empty_seen == [] and polls[0] > 15
    assert [n for n, _ in mgr.checkpoints()] == ["step_000000015"]


def test_save_policies(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("course_lib.checkpoint.manager.time.monotonic", lambda: clock[0])
    mgr = CheckpointManager(tmp_path, every_steps=5, every_seconds=60)
    assert [s for s in range(12) if mgr.should_save(s)] == [5, 10]
    clock[0] += 61
    assert mgr.should_save(3)
    assert mgr.maybe_save(3, model=TiedLM())
    assert not mgr.should_save(4)  # the clock restarts at each save
    mgr.close()
    assert [n for n, _ in mgr.checkpoints()] == ["step_000000003"]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(keep_last=0), "keep_last"), (dict(every_steps=0), "every_steps"),
    (dict(every_seconds=-1), "every_seconds"), (dict(keep_best=1), "best_metric"),
    (dict(best_mode="avg"), "best_mode")])
def test_manager_validates_arguments(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CheckpointManager(tmp_path, **kwargs)


def test_save_validates_arguments(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step"):
        mgr.save(-1, model=TiedLM())
    with pytest.raises(TypeError, match="model"):
        mgr.save(1, model={"w": torch.ones(1)})
    with pytest.raises(ValueError, match="metrics"):
        mgr.save(1, model=TiedLM(), metrics={"loss": float("nan")})
    with pytest.raises(TypeError, match="state_dict"):
        mgr.save(1, model=TiedLM(), data=[1, 2])
    assert list(tmp_path.iterdir()) == []  # nothing written by a rejected call


# ------------------------------------------------------------------ async

def test_async_save_is_a_snapshot(tmp_path):
    s = make_state()
    before = params(s["model"])
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(2, **s)
    with torch.no_grad():  # training goes on while the background thread writes
        for p in s["model"].parameters():
            p.zero_()
        for st in s["optimizer"].state.values():
            st["exp_avg"].fill_(7.0)
    mgr.wait()
    fresh = make_state(train_steps=0)
    CheckpointManager(tmp_path).load(**fresh)
    assert equal_states(before, params(fresh["model"]))
    assert all((st["exp_avg"] != 7.0).all() for st in fresh["optimizer"].state.values())


def test_background_failure_surfaces_and_leaves_no_checkpoint(tmp_path):
    class NumpyState:  # numpy arrays cannot pass torch.load(weights_only=True)
        def state_dict(self):
            return {"perm": np.arange(4)}

    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, model=TiedLM(), data=NumpyState())
    with pytest.raises(CheckpointError, match="does not load"):
        mgr.wait()
    assert cio.list_checkpoint_dirs(tmp_path) == []
    mgr.save(2, model=TiedLM())  # the manager is usable after a failure
    mgr.close()
    assert [n for n, _ in mgr.checkpoints()] == ["step_000000002"]


def test_interpreter_exit_does_not_lose_the_last_async_save(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from course_lib.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r}, async_save=True)
        model = torch.nn.Linear(512, 512)
        mgr.save(1, model=model, optimizer=torch.optim.Adam(model.parameters()))
        print("returned", flush=True)
        # no close(), no wait(): the interpreter exits while the write is in flight
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and "returned" in out.stdout, out.stderr
    assert [n for n, _ in CheckpointManager(tmp_path).checkpoints()] == ["step_000000001"]


# ------------------------------------------------------------------ crash and resume

def rows(path):
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines]  # raises on a torn line


def child(args, **kw):
    return subprocess.Popen([sys.executable, str(Path(__file__).parent / "tiny_loop.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    tiny_loop.run(out, 80, save_every=None)
    return rows(out / "metrics.jsonl"), load_file(out / "final.safetensors")


def test_resume_is_bit_exact_after_sigkill(tmp_path, reference):
    ref_rows, ref_weights = reference
    proc = child(["--dir", tmp_path, "--steps", 80, "--save-every", 10, "--die-at-step", 57])
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    killed_rows = rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in killed_rows] == list(range(57))
    summary = tiny_loop.run(tmp_path, 80, save_every=10)
    assert summary["resumed_from"]["step"] in (40, 50)  # 50 unless its async write was still in flight
    got = rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(80))  # rows 50..56 written again, once
    assert [r["loss"] for r in got] == [r["loss"] for r in ref_rows]
    weights = load_file(tmp_path / "final.safetensors")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_rollback_policy_restores_the_last_checkpoint(tmp_path, reference):
    ref_rows, _ = reference
    summary = tiny_loop.run(tmp_path, 80, save_every=10, spike_policy="rollback", faults=["grad_scale@45=10"])
    assert summary["rollbacks"] == 1
    got = rows(tmp_path / "metrics.jsonl")
    back = [r for r in got if r.get("rolled_back_to") is not None]
    assert len(back) == 1 and back[0]["step"] == 45 and back[0]["rolled_back_to"] == 40
    # steps 40..44 were replayed from the checkpoint: same batches, same RNG, same losses
    assert [r["loss"] for r in got[46:51]] == [r["loss"] for r in ref_rows[40:45]]


# The default case is one deterministic kill: the moment a save's temporary directory shows up
# (certainly mid-write). The soak (slow) alternates random moments with such targeted kills.
@pytest.mark.parametrize("cycles", [1, pytest.param(12, marks=pytest.mark.slow)])
def test_sigkill_at_random_moments_during_saves(tmp_path, cycles):
    ref = tmp_path / "ref"
    steps = 10 * max(cycles, 2)  # room after the first commit for the kill to land mid-save
    cfg = ["--steps", steps, "--save-every", 1, "--width", 384, "--depth", 3]
    tiny_loop.run(ref, steps, save_every=None, width=384, depth=3)
    run = tmp_path / "run"
    rng = random.Random(1234 + cycles)
    last_step, hit_mid_save = -1, 0
    for cycle in range(cycles):
        targeted = cycle % 2 == 1 or cycles == 1  # the single default cycle is a targeted one
        proc = child(["--dir", run, *cfg] + (["--sync-save"] if targeted else []))
        deadline = time.monotonic() + 60
        start_count = len(rows(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0
        while time.monotonic() < deadline and proc.poll() is None:  # wait for training to be under way
            going = (run / "metrics.jsonl").exists() and \
                len((run / "metrics.jsonl").read_text().splitlines()) > start_count
            # ...and, the first time, for one committed checkpoint: a kill before any exists leaves
            # nothing to resume from, which proves nothing about saves (and the check below needs one).
            saved = cycle > 0 or ((run / "ckpt").is_dir() and any(cio.NAME_RE.match(n) for n in os.listdir(run / "ckpt")))
            if going and saved:
                break
            time.sleep(0.01)
        if not targeted:
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment (mostly inside saves: they dominate a step)
        else:  # the moment a save's temporary directory shows up: certainly mid-write
            while time.monotonic() < deadline and proc.poll() is None and not any(
                    n.startswith(".tmp-") for n in os.listdir(run / "ckpt")):
                time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
        leftovers = [p.name for p in (run / "ckpt").iterdir() if p.name.startswith(".tmp-")]
        hit_mid_save += bool(leftovers)
        mgr = CheckpointManager(run / "ckpt")  # "restart": cleans up, then finds a valid checkpoint
        assert set(leftovers) <= set(mgr.cleaned)
        res = mgr.load(tiny_loop.make_model(width=384, depth=3))
        assert res is not None and res.step >= last_step
        assert not any(p.name.startswith(".tmp-") for p in (run / "ckpt").iterdir())
        last_step = res.step
    assert hit_mid_save >= 1, "no kill landed inside a save; the test did not test anything"
    summary = tiny_loop.run(run, steps, save_every=1, width=384, depth=3)  # the resume, in this process
    assert summary["resumed_from"]["step"] >= last_step
    got, want = rows(run / "metrics.jsonl"), rows(ref / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(steps)) and [r["loss"] for r in got] == [r["loss"] for r in want]
    a, b = load_file(run / "final.safetensors"), load_file(ref / "final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


# ------------------------------------------------------------------ load errors are not corruption

def two_checkpoints(tmp_path):
    """Checkpoints at steps 2 and 3 of make_state(); returns (state, newest path, weights at 3)."""
    s = make_state()
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(2, **s)
    train_step(s["model"], s["optimizer"], s["scheduler"], s["data"])
    newest = mgr.save(3, **s)
    return s, newest, params(s["model"])


def quarantined(root):
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".corrupt-"))


def test_read_error_is_not_corruption_and_never_falls_back(tmp_path, monkeypatch):
    from course_lib.checkpoint import CheckpointLoadError
    import errno
    _, newest, _ = two_checkpoints(tmp_path)
    real_read = Path.read_bytes

    def flaky(self):  # the disk fails a read: the checkpoint itself is fine
        if self == newest / "model.safetensors":
            raise OSError(errno.EIO, "Input/output error")
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", flaky)
    fresh = make_state(train_steps=0)
    before = params(fresh["model"])
    with pytest.raises(CheckpointLoadError, match="step_000000003.*Input/output error") as info:
        CheckpointManager(tmp_path).load(**fresh)
    assert [n for n, _ in info.value.failures] == ["step_000000003"]
    assert newest.is_dir() and quarantined(tmp_path) == []  # not moved aside
    assert equal_states(before, params(fresh["model"]))  # not silently replaced by step 2
    monkeypatch.undo()
    assert CheckpointManager(tmp_path).load(**make_state(train_steps=0)).step == 3  # storage back: resumes


def test_a_bug_while_loading_is_not_corruption(tmp_path):
    from course_lib.checkpoint import CheckpointLoadError
    _, newest, _ = two_checkpoints(tmp_path)

    class Broken(Position):
        def load_state_dict(self, state):
            raise KeyError("cursor")  # a bug in the caller's object, not in the checkpoint

    fresh = make_state(train_steps=0)
    fresh["data"] = Broken()
    with pytest.raises(CheckpointLoadError, match="step_000000003.*cursor"):
        CheckpointManager(tmp_path).load(**fresh)
    assert newest.is_dir() and quarantined(tmp_path) == []


class TwoLayers(nn.Module):
    def __init__(self, out=4, extra=False):
        super().__init__()
        torch.manual_seed(out)
        self.first = nn.Linear(8, 8)
        self.last = nn.Linear(8, out)
        if extra:
            self.more = nn.Linear(out, 2)


def test_other_model_shape_is_refused_by_name_and_nothing_is_half_loaded(tmp_path):
    from course_lib.checkpoint import CheckpointLoadError
    src = TwoLayers(out=4)
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(5, model=src, optimizer=torch.optim.AdamW(src.parameters()))
    model = TwoLayers(out=5, extra=True)  # "first" matches and would be copied by load_state_dict
    opt = torch.optim.AdamW(model.parameters())
    before = params(model)
    with pytest.raises(CheckpointLoadError) as info:
        CheckpointManager(tmp_path).load(model, opt)
    msg = str(info.value)
    assert "step_000000005" in msg and "last.weight" in msg and "(4, 8)" in msg and "(5, 8)" in msg
    assert "more.weight" in msg  # missing from the checkpoint
    assert equal_states(before, params(model)) and opt.state_dict()["state"] == {}
    assert (tmp_path / "step_000000005").is_dir() and quarantined(tmp_path) == []
    # an optimizer whose parameter groups do not fit is refused before the model is touched
    same = TwoLayers(out=4)
    before = params(same)
    bad_opt = torch.optim.AdamW([{"params": [same.first.weight]}, {"params": [same.last.weight]}])
    with pytest.raises(CheckpointLoadError, match="step_000000005.*optimizer"):
        CheckpointManager(tmp_path).load(same, bad_opt)
    assert equal_states(before, params(same))


def test_every_checkpoint_corrupt_is_a_loud_refusal_not_a_fresh_start(tmp_path):
    from course_lib.checkpoint import CheckpointLoadError
    s, newest, _ = two_checkpoints(tmp_path)
    flip_byte(newest / "model.safetensors")
    flip_byte(tmp_path / "step_000000002" / "train_state.pt")
    with pytest.warns(RuntimeWarning, match="unusable"):
        with pytest.raises(CheckpointLoadError) as info:
            CheckpointManager(tmp_path).load(**make_state(train_steps=0))
    assert sorted(n for n, _ in info.value.failures) == ["step_000000002", "step_000000003"]
    msg = str(info.value)
    assert "step_000000002" in msg and "step_000000003" in msg and "checksum" in msg
    assert len(quarantined(tmp_path)) == 2
    # the next attempt must not start from step 0 because the corrupt ones are out of the way
    with pytest.warns(RuntimeWarning, match="quarantined"):
        with pytest.raises(CheckpointLoadError, match=r"\.corrupt-.*fresh output folder"):
            CheckpointManager(tmp_path).load(**make_state(train_steps=0))
    for name in quarantined(tmp_path):
        shutil.rmtree(tmp_path / name)
    assert CheckpointManager(tmp_path).load(**make_state(train_steps=0)) is None  # truly nothing


# ------------------------------------------------------------------ per-rank state

def test_each_rank_gets_its_own_rng_and_data_position(tmp_path):
    from course_lib.checkpoint.state import capture_rank_state
    s = make_state()
    rank_states, after = [], []
    for rank in range(2):  # what the trainer gathers to rank 0: each rank's RNG and data position
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        rank_states.append(capture_rank_state(Position(10 + rank)))
        after.append((random.random(), float(np.random.rand()), torch.rand(3)))
    rank_states = copy.deepcopy(rank_states)
    CheckpointManager(tmp_path, async_save=False).save(4, rank_states=rank_states, **s)
    for rank in (1, 0):
        fresh = make_state(train_steps=0)
        res = CheckpointManager(tmp_path, writer=rank == 0).load(**fresh, rank=rank)
        assert res.step == 4 and fresh["data"].index == 10 + rank
        draws = (random.random(), float(np.random.rand()), torch.rand(3))
        assert draws[:2] == after[rank][:2] and torch.equal(draws[2], after[rank][2])
    # data=None keeps today's meaning: the data position is not touched (rollback)
    fresh = make_state(train_steps=0)
    CheckpointManager(tmp_path).load(**{**fresh, "data": None}, rank=1)
    assert fresh["data"].index == 0
    # the world grew: rank 2 saved nothing; data from rank 0, RNG left alone, with a warning
    fresh = make_state(train_steps=0)
    torch.manual_seed(7)
    expect = torch.rand(3)
    torch.manual_seed(7)
    with pytest.warns(RuntimeWarning, match="rank 2"):
        CheckpointManager(tmp_path, writer=False).load(**fresh, rank=2)
    assert fresh["data"].index == 10 and torch.equal(torch.rand(3), expect)


def test_only_loads_exactly_the_named_checkpoint_and_never_falls_back(tmp_path):
    from course_lib.checkpoint import CheckpointLoadError
    s, newest, _ = two_checkpoints(tmp_path)
    reader = CheckpointManager(tmp_path, writer=False)
    res = reader.load(**make_state(train_steps=0), only="step_000000002")
    assert res.step == 2 and res.path.name == "step_000000002"
    flip_byte(newest / "model.safetensors")
    with pytest.warns(RuntimeWarning, match="step_000000003"):
        with pytest.raises(CheckpointLoadError, match="step_000000003.*checksum"):
            reader.load(**make_state(train_steps=0), only="step_000000003")
    assert newest.is_dir() and quarantined(tmp_path) == []  # a reader never moves anything
    with pytest.raises(CheckpointLoadError, match="step_000000009.*not found"):
        reader.load(**make_state(train_steps=0), only="step_000000009")
