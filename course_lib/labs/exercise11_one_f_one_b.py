"""Exercise 11 (1F1B): a deadlock simulator for the learner's action lists, then a run on gloo ranks.

The learner's code is a pure function (the action list of one pipeline stage), so it never needs to
reach a rank: :func:`simulate` runs every stage's list together in plain Python (non-blocking
sends, blocking receives, one FIFO per direction between neighbours, as the real runner) and finds
a deadlock without starting a process. Only lists that pass are executed on gloo ranks, by the
library's runner (:func:`course_lib.parallel.pipeline.schedules.pipeline_step`) fed the learner's
lists, and compared with one process; the launch timeout is only a backstop.

Checks raise :class:`course_lib.kit.checks.CheckFailed` with a sentence that says what was expected,
what came out and the likely bug (``NotImplementedError`` while the learner's code raises it),
and otherwise return table rows for the notebook.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist

from course_lib.kit.checks import CheckFailed
from course_lib.labs.exercise10_tp_linear import _err, _mismatch, _raw  # the same comparisons as exercise 10
from course_lib.labs.exercise_harness import _first_problem, _guard, _launch


# ============================================================= exercise 11: 1F1B, without processes
ACTIONS = ("recv_activation", "forward", "send_activation", "recv_grad", "backward", "send_grad")


def _normalise(actions) -> list:
    return [tuple(a) if isinstance(a, (tuple, list)) else a for a in actions]


def validate_actions(actions, pp: int, m: int, stage: int) -> str | None:
    """None when ``actions`` is a well-formed list for ``stage``; else what is wrong, in words."""
    where = f"stage {stage} of pp={pp}, m={m}"
    if not isinstance(actions, list):
        return f"{where}: expected a list of (action, micro_batch) pairs, got {type(actions).__name__}"
    first, last = stage == 0, stage == pp - 1
    need = {"forward", "backward"} | ({"recv_activation", "send_grad"} if not first else set()) \
        | ({"send_activation", "recv_grad"} if not last else set())
    pos = {}
    for k, a in enumerate(actions):
        if not (isinstance(a, tuple) and len(a) == 2 and a[0] in ACTIONS and isinstance(a[1], int)
                and 0 <= a[1] < m):
            return (f"{where}: item {k} is {a!r}; each item must be a pair (action, micro_batch) with an "
                    f"action from {ACTIONS} and 0 <= micro_batch < {m}")
        if a[0] not in need:
            why = "the first stage reads the tokens itself" if a[0] in ("recv_activation", "send_grad") \
                else "the last stage computes the loss itself"
            return f"{where}: item {k} is {a!r}, but this stage has no {a[0]}: {why}"
        if a in pos:
            return f"{where}: {a!r} appears twice (items {pos[a]} and {k}); each happens once per micro-batch"
        pos[a] = k
    for i in range(m):
        for op in sorted(need):
            if (op, i) not in pos:
                return f"{where}: ({op!r}, {i}) is missing; every micro-batch needs {sorted(need)}"
        for before, after in (("recv_activation", "forward"), ("forward", "send_activation"),
                              ("forward", "backward"), ("recv_grad", "backward"), ("backward", "send_grad")):
            if (before, i) in pos and (after, i) in pos and pos[(before, i)] > pos[(after, i)]:
                return (f"{where}: ({after!r}, {i}) comes before ({before!r}, {i}); "
                        f"{after} needs what {before} provides")
    return None


def simulate(schedule: list[list], forward_time: float = 1.0, backward_time: float = 2.0) -> dict:
    """Run every stage's action list together, in plain Python: sends never block, a receive
    waits for the next message from its neighbour (one FIFO per direction and kind, as gloo
    delivers messages with one tag between two ranks). Forward and backward take the given time
    units, communication none. Returns ``deadlock`` (None or a description of who waits for
    what), ``mixed`` (None or the first receive that would get another micro-batch's message),
    ``makespan``, ``peak_in_flight`` per stage and ``events`` (stage, op, mb, start, end)."""
    pp = len(schedule)
    todo = [deque(_normalise(a)) for a in schedule]
    clock, in_flight, peak = [0.0] * pp, [0] * pp, [0] * pp
    fifo = {}  # (src, dst, kind) -> deque of (micro_batch, time sent)
    events, mixed = [], None
    progress = True
    while progress and mixed is None:
        progress = False
        for s in range(pp):
            while todo[s]:
                op, i = todo[s][0]
                if op.startswith("recv"):
                    kind, src = ("act", s - 1) if op == "recv_activation" else ("grad", s + 1)
                    q = fifo.get((src, s, kind))
                    if not q:
                        break  # blocked: nothing sent yet
                    got, sent_at = q.popleft()
                    if got != i:
                        what = "activation" if kind == "act" else "gradient"
                        mixed = (f"stage {s} posts {(op, i)!r}, but the next {what} stage {src} sent "
                                 f"it is micro-batch {got}'s: between two ranks messages "
                                 f"arrive in the order they were sent, so stage {src}'s sends and stage "
                                 f"{s}'s receives must list micro-batches in the same order")
                        break
                    clock[s] = max(clock[s], sent_at)
                elif op.startswith("send"):
                    kind, dst = ("act", s + 1) if op == "send_activation" else ("grad", s - 1)
                    fifo.setdefault((s, dst, kind), deque()).append((i, clock[s]))
                else:
                    start = clock[s]
                    clock[s] += forward_time if op == "forward" else backward_time
                    in_flight[s] += 1 if op == "forward" else -1
                    peak[s] = max(peak[s], in_flight[s])
                    events.append((s, op, i, start, clock[s]))
                todo[s].popleft()
                progress = True
    deadlock = None
    if mixed is None and any(todo):
        stuck = [f"stage {s} waits at {todo[s][0]!r} for stage "
                 f"{s - 1 if todo[s][0][0] == 'recv_activation' else s + 1}" for s in range(pp) if todo[s]]
        deadlock = "; ".join(stuck) + ": nobody can move (a cycle of waits)"
    return {"deadlock": deadlock, "mixed": mixed, "makespan": max(clock), "peak_in_flight": peak,
            "events": events}


def gpipe_lists(pp: int, micro_batches: int) -> list[list]:
    """GPipe's order for every stage (all forwards, then all backwards), from the library's
    schedules: the baseline exercise 11 draws next to the learner's 1F1B. Only GPipe: the
    notebook imports no schedule that would hand over the 1F1B order it asks for."""
    from course_lib.parallel.pipeline.schedules import stage_actions

    return [stage_actions("gpipe", pp, micro_batches, s) for s in range(pp)]


def check_schedule_fn(fn, pp: int, micro_batches: int) -> dict:
    """The pure checks of exercise 11 for one (pp, m): well-formed lists, no deadlock, no mixed-up
    messages, at most ``min(m, pp - stage)`` micro-batches in flight, and the library's 1F1B order
    (:func:`course_lib.parallel.pipeline.schedules.stage_actions`). Raises CheckFailed (or the
    learner's NotImplementedError), else returns a row with the simulated numbers and ``lists``:
    every stage's list as ``fn`` returned it (``[action, micro_batch]`` pairs), for the grader."""
    from course_lib.parallel.pipeline.schedules import stage_actions

    m = micro_batches
    lists = [_normalise(fn(pp, m, s)) for s in range(pp)]
    for s, actions in enumerate(lists):
        problem = validate_actions(actions, pp, m, s)
        if problem:
            raise CheckFailed(problem)
    sim = simulate(lists)
    if sim["mixed"]:
        raise CheckFailed(f"pp={pp}, m={m}: {sim['mixed']}")
    if sim["deadlock"]:
        raise CheckFailed(
            f"pp={pp}, m={m}: your order deadlocks: {sim['deadlock']}. A stage may only wait for data "
            "whose producer comes earlier in its neighbour's list: count the forwards a stage can run "
            "before the first gradient can reach it, then alternate one forward and one backward.")
    for s in range(pp):
        bound = min(m, pp - s)
        if sim["peak_in_flight"][s] > bound:
            raise CheckFailed(
                f"pp={pp}, m={m}: stage {s} holds the activations of {sim['peak_in_flight'][s]} "
                f"micro-batches at once; 1F1B keeps at most min(m, pp - stage) = {bound}: after its "
                "warm-up a stage runs a backward after each forward, which frees one micro-batch.")
    ref_lists = [stage_actions("1f1b", pp, m, s) for s in range(pp)]
    ideal = simulate(ref_lists)["makespan"]
    for s, (got, want) in enumerate(zip(lists, ref_lists)):
        if got != want:
            k = next(k for k, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
            # What is wrong and how far off, not 1F1B's own list (that is the answer).
            raise CheckFailed(
                f"pp={pp}, m={m}, stage {s}: your order leaves 1F1B's at item {k} "
                f"({got[k] if k < len(got) else 'the end of the list'!r}). It is deadlock-free and within "
                f"memory but takes {sim['makespan']:g} time units (forward 1, backward 2) where 1F1B takes "
                f"{ideal:g} ({sim['makespan'] / ideal - 1:+.0%}): is the warm-up as long as it can be, and "
                "does each forward after it pair with the oldest waiting backward?")
    return {"pp": pp, "micro_batches": m, "makespan": sim["makespan"], "ideal": (m + pp - 1) * 3.0,
            "peak_in_flight": sim["peak_in_flight"], "events": sim["events"],
            "lists": [[list(a) for a in actions] for actions in lists]}


# ============================================================= exercise 11: on gloo ranks
PP_CFG = dict(vocab_size=64, block_size=16, n_layers=4, n_heads=4, d_model=32, bias=False)
PP_SEQ = 16


@contextlib.contextmanager
def _runner_uses(actions: list):
    """The library's runner asks ``schedules.stage_actions`` what to do: answer with ``actions``."""
    from course_lib.parallel.pipeline import schedules

    real = schedules.stage_actions
    schedules.stage_actions = lambda *_args: list(actions)
    try:
        yield
    finally:
        schedules.stage_actions = real


def _pp_scenario(rank: int, world: int, m: int, actions: list) -> dict:
    from course_lib.model import ModelConfig, TinyGPT
    from course_lib.parallel.pipeline import build_stage, pipeline_step

    cfg = ModelConfig(**PP_CFG)
    g = torch.Generator().manual_seed(1234)
    x, y = (torch.randint(0, cfg.vocab_size, (2 * m, PP_SEQ), generator=g) for _ in range(2))
    torch.manual_seed(0)
    ref = TinyGPT(cfg)  # one process on the same micro-batches: the gradients to reproduce
    ref_loss = 0.0
    for xs, ys in zip(x.split(2), y.split(2)):
        _, loss = ref(xs, ys)
        (loss / m).backward()
        ref_loss += loss.item() / m
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    torch.manual_seed(0)
    stage = build_stage(TinyGPT(cfg), rank, world)
    with _runner_uses(actions):
        result = pipeline_step(stage, x, y, schedule="1f1b", micro_batches=m)
    problems, err = [], 0.0
    if stage.is_last and abs(result["loss"] - ref_loss) > 1e-5 * max(1.0, abs(ref_loss)):
        problems.append((1, f"the pipeline's loss is {result['loss']:.6g}, one process gets {ref_loss:.6g}"))
    for n, p in stage.named_parameters():
        if (msg := _mismatch(f"the gradient of {n}", p.grad, want[n], "Every micro-batch needs exactly "
                             "one forward and one backward on every stage.")):
            problems.append((2, msg))
            break
        err = max(err, _err(p.grad, want[n]))
    if result["peak_in_flight"] > min(m, world - rank):
        problems.append((3, f"the runner held {result['peak_in_flight']} micro-batches in flight, "
                            f"1F1B allows min(m, pp - stage) = {min(m, world - rank)}"))
    grads = {n: _raw(p.grad) for n, p in stage.named_parameters()}  # this stage's, for the grader
    return {"problems": problems, "max_err": err, "peak_in_flight": result["peak_in_flight"],
            "loss": result["loss"], "ref_loss": ref_loss, "grads": grads}


def pp_rank(rank: int, world_size: int, scenarios: list) -> dict:
    """Rank function: every scenario ``(name, m, action lists of all stages)``."""
    out = {name: _guard(name, _pp_scenario, rank, world_size, m, lists[rank]) for name, m, lists in scenarios}
    dist.barrier()
    return out


def check_one_f_one_b_on_ranks(fn, pp: int, micro_batch_counts: list, *,
                               timeout: float = 120.0) -> list[dict]:
    """Execute ``fn``'s orders on ``pp`` gloo ranks (one stage each, a 4-block TinyGPT) with the
    library's runner, one scenario per micro-batch count; compare loss and gradients with one
    process. The pure checks run first, so an order that would hang is never started. Each row's
    ``grads`` holds, per rank, its stage's parameter gradients by name (fp32 tensors), and ``lists``
    the action lists the ranks ran, for the grader."""
    scenarios = []
    for m in micro_batch_counts:
        check_schedule_fn(fn, pp, m)
        scenarios.append((f"pp={pp}, m={m}", m, [_normalise(fn(pp, m, s)) for s in range(pp)]))
    per_rank = _launch(pp_rank, pp, "your 1F1B order", timeout, scenarios,
                       deadlock_hint="The simulation found none, so look at what the runner was given.")
    _first_problem(per_rank, pp)
    return [{"pp": pp, "micro_batches": m, "loss": per_rank[-1][name]["loss"],
             "ref_loss": per_rank[-1][name]["ref_loss"],
             "max_err": max(per_rank[r][name]["max_err"] for r in range(pp)),
             "peak_in_flight": [per_rank[r][name]["peak_in_flight"] for r in range(pp)],
             "grads": [per_rank[r][name]["grads"] for r in range(pp)],
             "lists": [[list(a) for a in actions] for actions in lists]}
            for name, m, lists in scenarios]
