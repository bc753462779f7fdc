"""Schedules: golden values, monotonicity, continuity at phase boundaries, errors, resume."""

import io
import math

import pytest
import torch

from course_lib.schedules import DECAY_SHAPES, KINDS, WARMUP_CONVENTIONS, Schedule, lr_at, make_scheduler


def sched(**kw):
    base = dict(max_lr=1e-3, total_steps=110, warmup_steps=10, min_lr=1e-4)
    return Schedule(**{**base, **kw})


# ----------------------------------------------------------------------------- golden values
def test_golden_values_cosine_and_linear():
    cos = sched(kind="cosine")
    assert cos(0) == pytest.approx(1e-4)  # (it+1)/W: 1/10 of max at step 0
    assert cos(4) == pytest.approx(5e-4)
    assert cos(9) == pytest.approx(1e-3) and cos(10) == pytest.approx(1e-3)
    assert cos(60) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way: cos(pi/2) = 0
    assert cos(35) == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert cos(110) == pytest.approx(1e-4) and cos(10_000) == pytest.approx(1e-4)
    lin = sched(kind="linear")
    assert lin(60) == pytest.approx(5.5e-4) and lin(85) == pytest.approx(1e-4 + 9e-4 * 0.25)
    const = sched(kind="constant")
    assert const(10) == const(109) == const(500) == pytest.approx(1e-3)


def test_golden_values_warmup_conventions():
    it_w, it1_w, it1_w1 = (sched(warmup_convention=c) for c in ("it/W", "(it+1)/W", "(it+1)/(W+1)"))
    assert it_w(0) == 0.0 and it_w(5) == pytest.approx(5e-4) and it_w(9) == pytest.approx(9e-4)
    assert it1_w(0) == pytest.approx(1e-4) and it1_w(9) == pytest.approx(1e-3)
    assert it1_w1(0) == pytest.approx(1e-3 / 11) and it1_w1(9) == pytest.approx(1e-3 * 10 / 11)
    assert max(it1_w1(s) for s in range(10)) < 1e-3  # nanoGPT's form never reaches the peak in warmup
    assert it_w(10) == it1_w(10) == it1_w1(10) == pytest.approx(1e-3)  # all agree after warmup


def test_golden_values_wsd():
    w = Schedule(max_lr=1.0, total_steps=100, warmup_steps=10, kind="wsd")  # default decay: 20 steps
    assert w.decay_steps == 20 and w.decay_shape == "linear"
    assert w(10) == w(79) == w(80) == 1.0
    assert w(90) == pytest.approx(0.5) and w(95) == pytest.approx(0.25) and w(100) == 0.0
    sq = Schedule(max_lr=1.0, total_steps=100, kind="wsd", decay_steps=40, decay_shape="sqrt", min_lr=0.1)
    assert sq(70) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.25)))
    cs = Schedule(max_lr=1.0, total_steps=100, kind="wsd", decay_steps=40, decay_shape="cosine")
    assert cs(80) == pytest.approx(0.5)


def test_lr_at_is_the_same_function():
    s = Schedule(max_lr=2.0, total_steps=50, warmup_steps=5, kind="wsd", decay_steps=10, decay_shape="cosine")
    for step in (0, 4, 5, 39, 40, 45, 49, 50, 80):
        assert lr_at(step, max_lr=2.0, total_steps=50, warmup_steps=5, schedule="wsd", decay_steps=10,
                     decay_shape="cosine") == s(step)


# ----------------------------------------------------------------------------- shape properties
ALL = [dict(kind=k, warmup_convention=c) for k in KINDS for c in WARMUP_CONVENTIONS] + \
      [dict(kind="wsd", decay_shape=d, decay_steps=30) for d in DECAY_SHAPES]


@pytest.mark.parametrize("kw", ALL, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_monotone_phases_and_continuity(kw):
    s = sched(**kw)
    lrs = [s(t) for t in range(0, 200)]  # past total_steps too: the lr must hold, not climb back
    W, T = s.warmup_steps, s.total_steps
    warm, decay = lrs[:W], lrs[W:]
    assert all(b > a for a, b in zip(warm, warm[1:]))  # warmup strictly increasing
    assert all(b <= a + 1e-15 for a, b in zip(decay, decay[1:]))  # never increases afterwards
    assert all(0 <= v <= s.max_lr + 1e-15 for v in lrs)
    assert all(v >= s.min_lr - 1e-15 for v in decay)  # warmup starts near 0, below the floor
    # continuity: no jump at a phase boundary larger than the largest step inside the phases
    steps = [abs(b - a) for a, b in zip(lrs, lrs[1:])]
    largest_inside = max(steps[: W - 1] + steps[W:T])
    assert abs(lrs[W] - lrs[W - 1]) <= largest_inside + 1e-15
    if s.kind == "wsd":
        start = T - s.decay_steps
        assert abs(lrs[start] - lrs[start - 1]) <= largest_inside + 1e-15
    if s.kind != "constant":
        assert lrs[T] == pytest.approx(s.min_lr) and lrs[T - 1] > s.min_lr


def test_no_warmup_and_warmup_equal_to_total():
    s = Schedule(max_lr=1.0, total_steps=10, warmup_steps=0, kind="linear")
    assert s(0) == 1.0 and s(5) == pytest.approx(0.5)
    full = Schedule(max_lr=1.0, total_steps=10, warmup_steps=10, kind="cosine")
    # no decay phase inside the run (steps 0..9); the floor still sits at step total_steps
    assert full.values() == pytest.approx([(t + 1) / 10 for t in range(10)]) and full(10) == full(50) == 0.0
    assert Schedule(max_lr=1.0, total_steps=1).values() == [1.0]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw, exc, word", [
    (dict(warmup_steps=200), ValueError, "warmup_steps"),
    (dict(warmup_steps=-1), ValueError, "warmup_steps"),
    (dict(min_lr=2e-3), ValueError, "min_lr"),
    (dict(min_lr=-1e-5), ValueError, "min_lr"),
    (dict(max_lr=0.0), ValueError, "max_lr"),
    (dict(max_lr=float("nan")), ValueError, "max_lr"),
    (dict(total_steps=0), ValueError, "total_steps"),
    (dict(total_steps=100.0), TypeError, "total_steps"),
    (dict(max_lr="1e-3"), TypeError, "max_lr"),
    (dict(kind="exponential"), ValueError, "kind"),
    (dict(warmup_convention="it/(W-1)"), ValueError, "warmup_convention"),
    (dict(decay_steps=10), ValueError, "decay_steps"),  # cosine has no separate decay length
    (dict(kind="wsd", decay_steps=101), ValueError, "decay_steps"),
    (dict(kind="wsd", decay_shape="step"), ValueError, "decay_shape"),
])
def test_bad_arguments_name_the_argument_and_range(kw, exc, word):
    with pytest.raises(exc, match=word):
        sched(**kw)


def test_total_steps_is_required_and_step_is_checked():
    with pytest.raises(TypeError, match="total_steps"):
        Schedule(max_lr=1e-3)  # the flawed schedule read an undefined global; ours must be passed
    with pytest.raises(ValueError, match="step"):
        sched()(-1)
    with pytest.raises(TypeError, match="step"):
        sched()(1.5)
    assert sched()(torch.tensor(5)) == sched()(5)  # integer scalars are fine


# ----------------------------------------------------------------------------- LambdaLR
def run(optimizer, scheduler, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def fresh(schedule, lr=None):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=schedule.max_lr if lr is None else lr)
    return opt


def test_scheduler_follows_the_pure_function_step_for_step():
    s = sched(kind="wsd", decay_steps=30)
    opt = fresh(s)
    lrs = run(opt, make_scheduler(opt, s), 130)
    assert lrs == pytest.approx([s(t) for t in range(130)], rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_scheduler_state_round_trip_gives_identical_values(kind):
    s = sched(kind=kind)
    opt = fresh(s)
    sch = make_scheduler(opt, s)
    run(opt, sch, 37)
    buf = io.BytesIO()
    torch.save(sch.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    expected = run(opt, sch, 40)

    opt2 = fresh(s)  # note: the optimizer state is NOT restored; the scheduler alone must set the lr
    sch2 = make_scheduler(opt2, s)
    sch2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(s(37))
    assert run(opt2, sch2, 40) == expected


def test_plain_lambda_lr_resume_pitfall_is_what_we_fix():
    """Plain LambdaLR: after load_state_dict the optimizer keeps its old lr until the next step()."""
    s = sched()
    for build in (lambda o: torch.optim.lr_scheduler.LambdaLR(o, s.factor), lambda o: make_scheduler(o, s)):
        opt = fresh(s)
        sch = build(opt)
        run(opt, sch, 37)
        opt2 = fresh(s)
        sch2 = build(opt2)
        sch2.load_state_dict(sch.state_dict())
        restored = opt2.param_groups[0]["lr"] == pytest.approx(s(37))
        assert restored == (type(sch2) is not torch.optim.lr_scheduler.LambdaLR)


def test_scheduler_checks_the_optimizer_lr_and_warns_on_a_changed_schedule():
    s = sched()
    with pytest.raises(ValueError, match="max_lr"):
        make_scheduler(fresh(s, lr=1.0), s)
    opt = fresh(s, lr=5e-4)
    rel = make_scheduler(opt, s, relative=True)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4 * s.factor(0))
    with pytest.warns(UserWarning, match="total_steps"):
        make_scheduler(fresh(s), sched(total_steps=220)).load_state_dict(rel.state_dict())
    with pytest.raises(TypeError, match="schedule"):
        make_scheduler(fresh(s), {"max_lr": 1e-3})
