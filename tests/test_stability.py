"""Stabilizer: fault injection, gradient monitor (one sync per step), clipping, spike detection,
the non-finite guard, and the whole loop recovering from planted faults."""
import copy
import json
import math
import random
import statistics
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import tiny_loop
from course_lib.stability import FaultInjector, FaultSpec, parse_fault, parse_faults
from course_lib.stability import SpikeDetector, SpikePolicy, decide
from course_lib.stability import (ClipController, GradientMonitor, NonFiniteError, NonFiniteGuard, RollbackLimitError,
                                  Stabilizer, scaled_lr)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def backward(model, seed=0, stab=None, step=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    if stab is not None:
        loss = stab.on_loss(loss, step)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss, (x, y)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class HostTransfers(TorchFunctionMode):
    """Independent of the stabilizer's own counter: counts every tensor->host conversion."""
    NAMES = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        moves = name == "to" and isinstance(args[0], torch.Tensor) and any(
            str(a) == "cpu" and args[0].device.type != "cpu" for a in args[1:])
        if name in self.NAMES or moves:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------ fault specs

def test_parse_fault_accepts_the_three_kinds():
    assert parse_fault("grad_scale@500=10") == FaultSpec("grad_scale", 500, 10.0)
    assert parse_fault("grad_scale@3") == FaultSpec("grad_scale", 3, 10.0)
    assert parse_fault("nan_loss@7") == FaultSpec("nan_loss", 7, None)
    assert parse_fault("inf_grad@2=blocks.0.weight") == FaultSpec("inf_grad", 2, "blocks.0.weight")
    assert parse_fault("inf_grad@2") == FaultSpec("inf_grad", 2, None)
    assert [str(f) for f in parse_faults("nan_loss@1, grad_scale@2=3")] == ["nan_loss@1", "grad_scale@2=3.0"]


@pytest.mark.parametrize("text, needle", [
    ("boom@3", "kind"), ("grad_scale", "KIND@STEP"), ("grad_scale@x=2", "STEP"),
    ("grad_scale@-1=2", "step"), ("grad_scale@1=abc", "number"), ("grad_scale@1=0", "> 0"),
    ("grad_scale@1=inf", "finite"), ("nan_loss@1=3", "no value"),
])
def test_parse_fault_rejects_bad_specs(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_fault(text)


def test_fault_injector_effects_fire_once():
    model = tiny_model()
    inj = FaultInjector(["grad_scale@1=10", "nan_loss@2", "inf_grad@3=2.weight"])
    backward(model)
    before = [p.grad.clone() for p in model.parameters()]
    inj.on_grads(model, 0)  # nothing due
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    inj.on_grads(model, 1)
    assert all(torch.allclose(a * 10, p.grad) for a, p in zip(before, model.parameters()))
    inj.on_grads(model, 1)  # already fired: a rollback past the step does not meet it again
    assert all(torch.allclose(a * 10, p.grad) for a, p in zip(before, model.parameters()))
    loss, _ = backward(model, stab=inj_wrapper(inj), step=2)
    assert math.isnan(loss.item()) and all(torch.isnan(p.grad).all() for p in model.parameters())
    backward(model)
    inj.on_grads(model, 3)
    grads = dict((n, p.grad) for n, p in model.named_parameters())
    assert torch.isinf(grads["2.weight"]).sum() == 1
    assert all(torch.isfinite(g).all() for n, g in grads.items() if n != "2.weight")
    assert [s for _, s in inj.fired] == ["grad_scale@1=10.0", "nan_loss@2", "inf_grad@3=2.weight"]


def inj_wrapper(inj):
    class W:
        def on_loss(self, loss, step):
            return inj.on_loss(loss, step)
    return W()


def test_fault_injector_validates_parameter_names():
    with pytest.raises(ValueError, match="no trainable parameter named 'nope'"):
        FaultInjector("inf_grad@1=nope").validate(tiny_model())


# ------------------------------------------------------------------ monitor and clipping

def test_monitor_norms_match_torch_with_one_transfer():
    model = tiny_model()
    loss, _ = backward(model)
    mon = GradientMonitor()
    with HostTransfers() as seen:
        stats = mon.measure(model, loss)
    assert seen.calls == ["tolist"] and mon.sync_count == 1
    for name, p in model.named_parameters():
        assert stats.param_norms[name] == pytest.approx(torch.linalg.vector_norm(p.grad).item(), rel=1e-6)
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert stats.total_norm == pytest.approx(total, rel=1e-6)
    assert stats.loss == pytest.approx(loss.item())
    layer0 = math.hypot(stats.param_norms["0.weight"], stats.param_norms["0.bias"])
    assert stats.layer_norms["0"] == pytest.approx(layer0)
    assert stats.finite


def test_monitor_layer_grouping_by_depth():
    mon = GradientMonitor(layer_depth=2)
    assert mon.layer_of("blocks.3.attn.qkv.weight") == "blocks.3"
    assert GradientMonitor().layer_of("blocks.3.attn.qkv.weight") == "blocks.3.attn.qkv"
    with pytest.raises(ValueError, match="layer_depth"):
        GradientMonitor(layer_depth=0)


def test_clip_matches_torch_clip_grad_norm():
    a, b = tiny_model(), tiny_model()
    backward(a)
    backward(b)
    for m in (a, b):
        for p in m.parameters():
            p.grad.mul_(50)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0).item()
    clip = ClipController(max_norm=1.0)
    total = torch.nn.utils.get_total_norm([p.grad for p in a.parameters()]).item()
    clipped, coef = clip.clip_([p.grad for p in a.parameters()], total)
    assert clipped and coef < 1 and total == pytest.approx(ref, rel=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-8)
    assert not clip.clip_([p.grad for p in a.parameters()], 0.5)[0]


def test_clip_rate_window_and_warning():
    clip = ClipController(max_norm=1.0, window=10, warn_rate=0.5)
    g = [torch.ones(3)]
    for _ in range(10):
        clip.clip_(g, 0.5)
    assert clip.clip_rate == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            clip.clip_(g, 2.0)  # 5/10 = 50%: not above the warn rate
    assert clip.clip_rate == 0.5
    with pytest.warns(RuntimeWarning, match="clipping fired on 60%"):
        clip.clip_(g, 2.0)
    assert len(clip.warnings) == 1 and clip.total_clipped == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip.clip_(g, 2.0)  # rate-limited: at most one warning per window


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_norm=0), "max_norm"), (dict(max_norm=float("nan")), "max_norm"),
    (dict(window=0), "window"), (dict(warn_rate=1.5), "warn_rate")])
def test_clip_controller_validates(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ClipController(**kwargs)


# ------------------------------------------------------------------ spike detector

def noisy_decreasing(n, seed):
    rng = random.Random(seed)
    return [2.0 * math.exp(-i / 300) + 0.3 + rng.gauss(0, 0.03) for i in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_no_false_alarms_on_clean_noisy_curve(seed):
    det = SpikeDetector(name="loss", min_ratio=1.05)
    flags = [det.update(v).is_spike for v in noisy_decreasing(1000, seed)]
    assert sum(flags) == 0


def test_planted_spikes_found():
    values = noisy_decreasing(600, 11)
    planted = {100: 3.0, 250: 1.6, 251: 1.6, 400: 2.0, 550: 5.0}
    for i, factor in planted.items():
        values[i] *= factor
    det = SpikeDetector(name="loss", min_ratio=1.05)
    found = [i for i, v in enumerate(values) if det.update(v).is_spike]
    assert found == sorted(planted)
    assert det.spikes == len(planted)


def test_window_statistics_after_a_spike():
    det = SpikeDetector(window=8, min_samples=8, threshold=5.0, min_ratio=0.0, patience=3)
    base = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.2, 0.8]
    for v in base:
        assert not det.update(v).is_spike
    med = statistics.median(base)
    mad = statistics.median(abs(v - med) for v in base)
    check = det.update(50.0)
    assert check.is_spike
    assert check.median == pytest.approx(med) and check.scale == pytest.approx(1.4826 * mad)
    expected = base[1:] + [check.bound]  # the window advanced; the spike entered winsorized
    assert list(det.window) == pytest.approx(expected)
    med2, scale2 = det.stats()
    assert med2 == pytest.approx(float(np.median(expected)))
    assert scale2 == pytest.approx(1.4826 * float(np.median(np.abs(np.array(expected) - np.median(expected)))))
    nxt = det.update(1.02)  # normal values keep flowing in after a spike
    assert not nxt.is_spike and list(det.window) == pytest.approx(expected[1:] + [1.02])
    assert det.update(60.0).is_spike  # the next spike is not masked by the first


def test_level_shift_is_accepted_after_patience():
    det = SpikeDetector(window=16, min_samples=8, patience=4, min_ratio=0.0)
    for v in noisy_decreasing(16, 3):
        det.update(v)
    checks = [det.update(10.0 + 0.01 * i) for i in range(4)]
    assert [c.is_spike for c in checks[:3]] == [True, True, True]
    assert checks[3].level_shift and not checks[3].is_spike
    assert list(det.window) == pytest.approx([10.0, 10.01, 10.02, 10.03])  # re-based on the raw values
    later = [det.update(10.0 + 0.01 * i) for i in range(4, 30)]
    assert not any(c.is_spike for c in later)  # the new level is normal, training is not frozen
    assert det.update(30.0).is_spike  # and detection works again at the new level


def test_detector_state_roundtrip_gives_same_decisions():
    values = noisy_decreasing(200, 5)
    values[120] *= 3
    a = SpikeDetector()
    for v in values[:100]:
        a.update(v)
    b = SpikeDetector()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.update(v) for v in values[100:]] == [b.update(v) for v in values[100:]]


def test_detector_rejects_nonfinite_and_bad_config():
    with pytest.raises(ValueError, match="NonFiniteGuard"):
        SpikeDetector().update(float("nan"))
    with pytest.raises(ValueError, match="min_samples"):
        SpikeDetector(window=8, min_samples=9)
    with pytest.raises(ValueError, match="threshold"):
        SpikeDetector(threshold=0)


def test_policy_actions():
    det = SpikeDetector(window=8, min_samples=4, min_ratio=0.0)
    for v in [1.0, 1.1, 0.9, 1.0]:
        det.update(v)
    checks = {"loss": det.update(9.0)}
    assert decide("skip", checks).skip and not decide("skip", checks).rollback
    low = decide(SpikePolicy.LOWER_LR, checks, lr_factor=0.25, lr_steps=7)
    assert not low.skip and low.lr_factor == 0.25 and low.lr_steps == 7
    back = decide("rollback", checks)
    assert back.skip and back.rollback
    assert not decide("warn", checks).skip
    assert decide("skip", {"loss": det.update(1.0)}) is None
    with pytest.raises(ValueError):
        decide("explode", checks)
    with pytest.raises(ValueError, match="lr_factor"):
        decide("lower_lr", checks, lr_factor=0)


# ------------------------------------------------------------------ the facade

def warm(stab, model, steps=20):
    """Feed clean steps so the detectors have statistics (no optimizer: same grads each time)."""
    for s in range(steps):
        loss, _ = backward(model, seed=s % 7)
        d = stab.after_backward(model, loss, s)
        assert not d.skip, d.reason
    return steps


def test_one_sync_per_step_asserted_twice():
    model = tiny_model()
    stab = Stabilizer(max_grad_norm=0.05)  # clips every step: clipping must not add a sync
    for s in range(25):
        loss, _ = backward(model, seed=s)
        with HostTransfers() as seen:
            d = stab.after_backward(model, loss, s)
        assert seen.calls == ["tolist"], seen.calls
        assert d.clipped
    assert stab.sync_count == 25


@pytest.mark.parametrize("fault", ["grad_scale@20=10", "nan_loss@20", "inf_grad@20=2.weight", "inf_grad@20"])
def test_each_fault_is_caught_and_parameters_untouched(fault, tmp_path):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stab = Stabilizer(faults=[fault], diag_dir=tmp_path)
    warm(stab, model)
    before = snapshot(model)
    loss, batch = backward(model, seed=3, stab=stab, step=20)
    d = stab.after_backward(model, loss, 20, optimizer=opt, batch=batch)
    assert d.skip, "a faulty step must not reach the optimizer"
    if not d.skip:
        opt.step()
    assert same(before, snapshot(model))
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    if fault.startswith("grad_scale"):
        assert d.spike and not d.nonfinite and d.grad_norm > 5
        assert list(tmp_path.iterdir()) == []
    else:
        assert d.nonfinite and d.diagnostic is not None
        bundle = json.loads(open(d.diagnostic).read())
        assert bundle["step"] == 20 and bundle["lr"] == [0.1]
        assert bundle["batch"]["batch.0"]["shape"] == [4, 8]
        bad = [n for n, g in bundle["grads"].items() if g["nan"] or g["inf"]]
        assert bad and (fault != "inf_grad@20=2.weight" or bad == ["2.weight"])
        assert (tmp_path / "nonfinite_step000000020_rank0.batch.safetensors").exists()
    loss, _ = backward(model, seed=4)
    assert not stab.after_backward(model, loss, 21).skip  # the next clean step goes through


def test_consecutive_nonfinite_steps_abort_with_a_clear_message(tmp_path):
    model = tiny_model()
    stab = Stabilizer(faults=["nan_loss@0", "nan_loss@1", "nan_loss@2"], diag_dir=tmp_path, max_consecutive_bad=3)
    for s in range(2):
        loss, _ = backward(model, stab=stab, step=s)
        assert stab.after_backward(model, loss, s).nonfinite
    loss, _ = backward(model, stab=stab, step=2)
    with pytest.raises(NonFiniteError, match=r"3 consecutive non-finite steps \(0\.\.2\).*nonfinite_step000000002_rank0"):
        stab.after_backward(model, loss, 2)


def test_a_good_step_resets_the_consecutive_count():
    model = tiny_model()
    stab = Stabilizer(faults=["nan_loss@0", "nan_loss@1", "nan_loss@3", "nan_loss@4"], max_consecutive_bad=3)
    for s in range(6):
        loss, _ = backward(model, stab=stab, step=s)
        stab.after_backward(model, loss, s)
    assert stab.guard.bad_steps == [0, 1, 3, 4] and stab.guard.consecutive == 0


def test_fp16_overflow_is_the_scalers_business(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A real overflow: the scaled gradients (about 1e6 * 2**125) exceed the fp32 range.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 125)
    stab = Stabilizer(diag_dir=tmp_path, max_consecutive_bad=2)
    before = snapshot(model)
    for s in range(5):  # five overflows in a row: more than max_consecutive_bad, and no abort
        loss = model(torch.full((4, 8), 1e3)).pow(2).mean()
        model.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        d = stab.after_backward(model, loss, s, optimizer=opt, scaler=scaler)
        assert d.skip and d.overflow and not d.nonfinite
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 120 and list(tmp_path.iterdir()) == []
    assert same(before, snapshot(model))
    guard = NonFiniteGuard(max_consecutive_overflow=3)
    for s in range(2):
        guard.record_bad(s, loss=1.0, param_norms={}, model=model, scaler=scaler)
    with pytest.raises(NonFiniteError, match="3 consecutive fp16 overflows"):
        guard.record_bad(2, loss=1.0, param_norms={}, model=model, scaler=scaler)


def test_lower_lr_policy_and_scaled_lr():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stab = Stabilizer(spike_policy="lower_lr", lr_factor=0.5, lr_steps=3, faults=["grad_scale@20=10"])
    warm(stab, model)
    factors = []
    for s in range(20, 25):
        loss, _ = backward(model, seed=3)  # a batch whose x10 gradient is far outside the window
        d = stab.after_backward(model, loss, s)
        factors.append(d.lr_factor)
        with scaled_lr(opt, d.lr_factor):
            assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * d.lr_factor)
        assert opt.param_groups[0]["lr"] == 0.1
    assert factors == [0.5, 0.5, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="factor"):
        with scaled_lr(opt, 2.0):
            pass


def test_rollback_policy_requests_a_rollback():
    model = tiny_model()
    stab = Stabilizer(spike_policy="rollback", faults=["grad_scale@20=10"])
    warm(stab, model)
    loss, _ = backward(model, seed=3)
    d = stab.after_backward(model, loss, 20)
    assert d.rollback and d.skip and "rolling back" in d.reason


def test_stabilizer_validates_arguments():
    with pytest.raises(ValueError):
        Stabilizer(spike_policy="sometimes")
    with pytest.raises(ValueError, match="lr_factor"):
        Stabilizer(lr_factor=1.5)
    with pytest.raises(TypeError, match="detect_loss_spikes"):
        Stabilizer(detect_loss_spikes="yes")
    with pytest.raises(ValueError, match="step"):
        model = tiny_model()
        Stabilizer().after_backward(model, backward(model)[0], -1)
    with pytest.raises(ValueError, match="max_consecutive"):
        NonFiniteGuard(max_consecutive=0)


# ------------------------------------------------------------------ the loop, end to end

def test_clean_run_has_no_false_alarms_and_faulted_run_recovers(tmp_path):
    clean = tiny_loop.run(tmp_path / "clean", 200, save_every=None)
    assert clean["spikes"] == {"loss": 0, "grad_norm": 0} and clean["bad_steps"] == []
    assert clean["syncs"] == 200  # one device sync per step, over a whole run
    faulty = tiny_loop.run(tmp_path / "faulty", 200, save_every=None,
                            faults=["grad_scale@120=10", "nan_loss@130", "inf_grad@140=3.weight"])
    assert [s for s, _ in faulty["faults_fired"]] == [120, 130, 140]
    rows_c = [json.loads(line) for line in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    rows_f = [json.loads(line) for line in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_f] == list(range(200))
    assert [r["step"] for r in rows_f if r["skipped"]] == [120, 130, 140]
    assert rows_f[:120] == rows_c[:120]  # identical until the first fault
    tail_c = [r["loss"] for r in rows_c[-40:]]
    tail_f = [r["loss"] for r in rows_f[-40:]]
    # back in the clean run's loss band after the faults (3 skipped updates out of 200)
    assert abs(statistics.mean(tail_f) - statistics.mean(tail_c)) < 0.1 * statistics.mean(tail_c)
    assert min(tail_c) * 0.8 < statistics.median(tail_f) < max(tail_c) * 1.2


# ------------------------------------------------------------------ bounded roll-backs

def _level_shift_run(limit, max_rollbacks=3):
    """A stabilizer that keeps rolling back to a 'checkpoint' taken after warm-up while every loss
    after the checkpoint sits at 3x the old level (a data switch, not a spike)."""
    model = tiny_model()
    stab = Stabilizer(spike_policy="rollback", detect_grad_spikes=False, max_rollbacks=max_rollbacks,
                      rollback_limit=limit, faults=["loss_shift@30=3"])
    warm(stab, model, steps=30)
    saved = copy.deepcopy(stab.state_dict())  # what the checkpoint at step 30 holds
    rollbacks, step, decisions = 0, 30, []
    while step < 40 and rollbacks < 50:
        loss, _ = backward(model, seed=step, stab=stab, step=step)
        d = stab.after_backward(model, loss, step)
        decisions.append(d)
        if d.rollback:
            stab.load_state_dict(copy.deepcopy(saved))  # the roll-back restores the old window...
            stab.note_rollback(step)
            rollbacks, step = rollbacks + 1, 30
            continue
        step += 1
    return rollbacks, decisions


def test_rollback_loop_on_a_level_shift_is_bounded_and_accepted():
    with pytest.warns(RuntimeWarning, match="accepted as the new level"):
        rollbacks, decisions = _level_shift_run("accept")
    assert rollbacks == 3, "three consecutive roll-backs, then the new level is accepted"
    accepted = [d for d in decisions if d.rollbacks_accepted]
    assert len(accepted) == 1 and accepted[0].level_shift and not accepted[0].skip
    assert decisions[-1].step == 39 and not decisions[-1].rollback  # the run went on to the end


def test_rollback_limit_error_stops_with_a_clear_message():
    with pytest.raises(RollbackLimitError, match=r"survived 2 consecutive roll-backs.*rollback_limit = 'accept'"):
        _level_shift_run("error", max_rollbacks=2)


def test_a_transient_spike_after_recovery_starts_a_new_streak():
    model = tiny_model()
    stab = Stabilizer(spike_policy="rollback", max_rollbacks=1, faults=["grad_scale@20=10", "grad_scale@24=10"])
    warm(stab, model)
    loss, _ = backward(model, seed=3)
    assert stab.after_backward(model, loss, 20).rollback
    stab.note_rollback(20)
    for s in range(21, 24):  # the run gets past step 20: the streak is over
        loss, _ = backward(model, seed=s)
        assert not stab.after_backward(model, loss, s).skip
    loss, _ = backward(model, seed=3)
    assert stab.after_backward(model, loss, 24).rollback, "a new spike is rolled back again, not accepted"


def test_loss_shift_fault_is_persistent():
    inj = FaultInjector(["loss_shift@5=2"])
    one = torch.tensor(1.0)
    assert [float(inj.on_loss(one, s)) for s in (4, 5, 6, 50)] == [1.0, 2.0, 2.0, 2.0]
    assert inj.fired == [(5, "loss_shift@5=2.0")]
    assert parse_fault("loss_shift@3").value == 3.0
    with pytest.raises(ValueError, match="loss_shift value must be a finite float > 0"):
        parse_fault("loss_shift@3=-1")


def test_diagnostic_bundles_are_named_by_rank(tmp_path):
    model = tiny_model()
    for rank in (0, 1):
        stab = Stabilizer(faults=["nan_loss@4"], diag_dir=tmp_path, rank=rank)
        loss, batch = backward(model, stab=stab, step=4)
        stab.after_backward(model, loss, 4, batch=batch)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "nonfinite_step000000004_rank0.json", "nonfinite_step000000004_rank1.json"]
