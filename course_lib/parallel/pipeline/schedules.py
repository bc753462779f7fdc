"""GPipe and 1F1B pipeline schedules, run with point-to-point sends between neighbouring stages.

A step splits the global batch into ``m`` micro-batches. Stage s runs on rank ``ranks[s]``; the
forward of micro-batch i on stage s needs stage s-1's output for i (an *activation*, received
from the previous rank), its backward needs the gradient of its output (an *activation
gradient*, received from the next rank). The two schedules differ only in the order each stage
runs its 2m compute ops (:func:`compute_order`):

* ``gpipe`` (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds the
  activations of all m micro-batches at its peak.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): ``pp - stage - 1`` warm-up forwards, then
  alternate one forward and one backward, then the remaining backwards (cool-down). A backward
  frees its micro-batch's activations, so stage s holds at most ``min(m, pp - s)``.

Both have the same bubble, (pp - 1) idle forward+backward slots per stage
(``course_lib.estimate.pipeline.bubble_fraction``); 1F1B's gain is memory.

The loss is the mean over micro-batches: each micro-batch's loss is divided by m before its
backward, and gradients accumulate in ``.grad`` over the micro-batches, so with equal micro-batch
sizes (and no ignored targets) the gradients equal one process on the whole global batch -
gradient-accumulation arithmetic. Zero the gradients before a step, as usual.

Communication, and why it cannot deadlock: sends are ``dist.isend`` (gloo moves the bytes on its
own thread) and are waited for at the end of the step; receives are blocking ``dist.recv``. A
blocking *send* would deadlock 1F1B: in steady state stage s sends an activation forward while
stage s+1 sends a gradient back, and each would wait for the other to post its receive. With
non-blocking sends a stage only ever waits for data whose producing op comes earlier in the
schedule, and both schedules are orderings of one acyclic dependency graph, so every wait ends.
Activations and gradients travel with different tags, so messages between the same pair of ranks
cannot be confused.

:func:`run_schedule` returns a plain dict per rank: the loss (last stage), the ops it ran, a
timeline of ``time.perf_counter()`` stamps and the peak number of micro-batches in flight;
:mod:`.timeline` turns the per-rank dicts into a measured bubble.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from course_lib.parallel.pipeline.stages import PipelineStage
from course_lib.validate import check_choice, check_int, check_number

__all__ = ["SCHEDULES", "compute_order", "stage_actions", "run_schedule", "sync_tied_grads",
           "pipeline_step"]

SCHEDULES = ("gpipe", "1f1b")
TAG_ACTIVATION, TAG_GRAD, TAG_TIED = 1, 2, 3  # separate message streams between two ranks


# ---------------------------------------------------------------- what each stage does, in order
def compute_order(schedule: str, pp: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """The compute ops of ``stage``, in order: ``("forward", i)`` and ``("backward", i)``.

    Pure and deterministic (no timing, no ranks): this *is* the schedule.
    """
    check_choice("schedule", schedule, SCHEDULES)
    check_int("pp", pp, 1)
    check_int("micro_batches", micro_batches, 1)
    check_int("stage", stage, 0, pp - 1, "pp - 1")
    m = micro_batches
    if schedule == "gpipe":
        return [("forward", i) for i in range(m)] + [("backward", i) for i in range(m)]
    # 1F1B: stage s must have pp - s - 1 micro-batches under way before the first gradient can
    # come back from the last stage; with fewer micro-batches than that, all of them.
    warmup = min(pp - stage - 1, m)
    ops = [("forward", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        ops += [("forward", warmup + i), ("backward", i)]
    ops += [("backward", i) for i in range(m - warmup, m)]  # cool-down
    return ops


def stage_actions(schedule: str, pp: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """:func:`compute_order` with the communication around each op, as :func:`run_schedule` runs it:
    ``recv_activation`` before a forward (not on the first stage), ``send_activation`` after it
    (not on the last), ``recv_grad`` before a backward (not on the last), ``send_grad`` after it
    (not on the first)."""
    first, last = stage == 0, stage == pp - 1
    actions = []
    for op, i in compute_order(schedule, pp, micro_batches, stage):
        if op == "forward":
            actions += ([] if first else [("recv_activation", i)]) + [(op, i)] \
                + ([] if last else [("send_activation", i)])
        else:
            actions += ([] if last else [("recv_grad", i)]) + [(op, i)] \
                + ([] if first else [("send_grad", i)])
    return actions


# ---------------------------------------------------------------- running it
def check_batch(idx, targets, micro_batches: int) -> None:
    """ValueError naming the argument unless ``idx`` and ``targets`` are int token tensors [batch,
    seq] of one shape and ``micro_batches`` (>= 1) divides the batch: every pipeline runner's
    input check, made before any communication."""
    check_int("micro_batches", micro_batches, 1)
    for name, t in (("idx", idx), ("targets", targets)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be an int64 tensor [batch, seq], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if targets.shape != idx.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
    if idx.shape[0] % micro_batches:
        raise ValueError(f"micro_batches ({micro_batches}) must divide the batch size ({idx.shape[0]}); "
                         f"accepted values are the divisors of {idx.shape[0]}")


def _check_ranks(stage: PipelineStage, ranks) -> list[int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pipeline schedules need a process group: start ranks with "
                           "course_lib.parallel.run_ranks, or torchrun + init_distributed()")
    world = dist.get_world_size()
    ranks = list(range(stage.pp)) if ranks is None else list(ranks)
    if len(ranks) != stage.pp:
        raise ValueError(f"ranks must list one rank per stage (pp={stage.pp}), got {ranks}")
    for s, r in enumerate(ranks):
        check_int(f"ranks[{s}]", r, 0, world - 1, "world_size - 1")
    if ranks[stage.stage] != dist.get_rank():
        raise ValueError(f"stage {stage.stage} must run on rank ranks[{stage.stage}]={ranks[stage.stage]}, "
                         f"but this is rank {dist.get_rank()}")
    return ranks


def run_schedule(stage: PipelineStage, idx: torch.Tensor, targets: torch.Tensor, *,
                 schedule: str = "1f1b", micro_batches: int = 1, ranks=None,
                 simulate_s: tuple[float, float] | None = None) -> dict:
    """Forward and backward of one global batch through the pipeline; gradients land in ``.grad``.

    Every rank passes the same ``idx`` and ``targets`` (int64 [B, T]); the first stage reads the
    tokens, the last the targets, the others only the shape. ``micro_batches`` (m) must divide B.
    ``ranks[s]`` is the rank running stage s (default: rank s). ``simulate_s`` = (forward seconds,
    backward seconds) sleeps after each forward / backward: a stand-in for a bigger model, so a
    lab's timeline is dominated by "compute" and not by Python overhead.

    Does not sync tied embeddings (see :func:`pipeline_step`). Returns a plain dict:
    ``loss`` (float, the global-batch mean; last stage only, else None), ``ops`` (the actions run,
    = :func:`stage_actions`), ``events`` (one dict per action: ``op``, ``mb``, ``start``, ``end``
    in seconds since ``origin``, a ``time.perf_counter()`` value - one clock for every process on a
    machine), ``peak_in_flight`` (most micro-batches whose forward ran and backward not yet),
    ``peak_activation_bytes`` (bytes autograd saved for those, parameters excluded, at that peak),
    and ``stage``, ``pp``, ``rank``, ``schedule``, ``micro_batches``.
    """
    if not isinstance(stage, PipelineStage):
        raise TypeError(f"stage must be a PipelineStage, got {type(stage).__name__}")
    check_choice("schedule", schedule, SCHEDULES)
    check_batch(idx, targets, micro_batches)
    B, T = idx.shape
    if simulate_s is not None and not (isinstance(simulate_s, (tuple, list)) and len(simulate_s) == 2):
        raise TypeError(f"simulate_s must be None or (forward seconds, backward seconds), got {simulate_s!r}")
    fwd_s, bwd_s = (0.0, 0.0) if simulate_s is None else simulate_s
    check_number("simulate_s[0]", fwd_s, 0.0)
    check_number("simulate_s[1]", bwd_s, 0.0)
    ranks = _check_ranks(stage, ranks)
    s, m = stage.stage, micro_batches
    prev = ranks[s - 1] if not stage.is_first else None
    nxt = ranks[s + 1] if not stage.is_last else None
    # Clones, not views: a view would keep the whole batch's storage alive (and counted) per micro-batch.
    x_mb = [t.clone() for t in idx.split(B // m)]
    y_mb = [t.clone() for t in targets.split(B // m)]
    act_shape = (B // m, T, stage.cfg.d_model)
    act_dtype = next(stage.parameters()).dtype

    # Activation bytes, measured: a pack hook notes each storage autograd saves (once, skipping
    # parameters and buffers such as the RoPE tables) while micro-batch i runs its forward.
    param_ptrs = {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]}
    mb_bytes: dict[int, int] = {}

    def counting_hook(i: int):
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in param_ptrs and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                mb_bytes[i] = mb_bytes.get(i, 0) + st.nbytes()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    inputs, outputs, grads = {}, {}, {}  # by micro-batch; outputs = what is "in flight"
    pending, events, ops, losses = [], [], [], []
    peak = peak_bytes = held_bytes = 0
    origin = time.perf_counter()
    for op, i in stage_actions(schedule, stage.pp, m, s):
        t0 = time.perf_counter()
        if op == "recv_activation":
            buf = torch.empty(act_shape, dtype=act_dtype)
            dist.recv(buf, src=prev, tag=TAG_ACTIVATION)
            inputs[i] = buf.requires_grad_()  # its .grad is what we send back later
        elif op == "forward":
            with counting_hook(i):
                if stage.is_last:
                    out = stage(x_mb[i] if stage.is_first else inputs[i], y_mb[i]) / m
                    losses.append(out.detach())
                else:
                    out = stage(x_mb[i] if stage.is_first else inputs[i])
            outputs[i] = out
            held_bytes += mb_bytes.get(i, 0)
            peak, peak_bytes = max(peak, len(outputs)), max(peak_bytes, held_bytes)
            if fwd_s:
                time.sleep(fwd_s)
        elif op == "send_activation":
            pending.append(dist.isend(outputs[i].detach().contiguous(), dst=nxt, tag=TAG_ACTIVATION))
        elif op == "recv_grad":
            grads[i] = torch.empty(act_shape, dtype=act_dtype)
            dist.recv(grads[i], src=nxt, tag=TAG_GRAD)
        elif op == "backward":
            out = outputs.pop(i)  # dropping it frees the micro-batch's activations
            if stage.is_last:
                out.backward()
            else:
                torch.autograd.backward(out, grad_tensors=grads.pop(i))
            held_bytes -= mb_bytes.get(i, 0)
            if bwd_s:
                time.sleep(bwd_s)
        elif op == "send_grad":
            pending.append(dist.isend(inputs.pop(i).grad.contiguous(), dst=prev, tag=TAG_GRAD))
        ops.append((op, i))
        events.append({"op": op, "mb": i, "start": t0 - origin, "end": time.perf_counter() - origin})
    t0 = time.perf_counter()
    for work in pending:  # the send buffers must stay alive until gloo has shipped them
        work.wait()
    events.append({"op": "wait_sends", "mb": None, "start": t0 - origin, "end": time.perf_counter() - origin})
    loss = float(torch.stack(losses).sum()) if stage.is_last else None
    return {"stage": s, "pp": stage.pp, "rank": dist.get_rank(), "schedule": schedule,
            "micro_batches": m, "loss": loss, "ops": ops, "events": events, "origin": origin,
            "peak_in_flight": peak, "peak_activation_bytes": peak_bytes}


@torch.no_grad()
def sync_tied_grads(stage: PipelineStage, ranks=None) -> bool:
    """Sum the two partial gradients of a tied token table / LM head (pp > 1) on both holders.

    The first stage's copy got only the embedding part, the last stage's only the head part; one
    process would hold their sum. The first rank sends, then receives; the last receives, then
    sends (blocking, so that order is what keeps it deadlock-free). Both then add in the same
    order (embedding part + head part), so the two copies get bit-identical gradients and stay
    equal after the optimizer step. Every other stage returns at once. True if it synced.
    """
    if not isinstance(stage, PipelineStage):
        raise TypeError(f"stage must be a PipelineStage, got {type(stage).__name__}")
    if not stage.tied:
        return False
    ranks = _check_ranks(stage, ranks)
    p = stage.tied_param
    mine = p.grad if p.grad is not None else torch.zeros_like(p)
    theirs = torch.empty_like(mine)
    if stage.is_first:
        dist.send(mine.contiguous(), dst=ranks[-1], tag=TAG_TIED)
        dist.recv(theirs, src=ranks[-1], tag=TAG_TIED)
        p.grad = mine + theirs
    else:
        dist.recv(theirs, src=ranks[0], tag=TAG_TIED)
        dist.send(mine.contiguous(), dst=ranks[0], tag=TAG_TIED)
        p.grad = theirs + mine
    return True


def pipeline_step(stage: PipelineStage, idx: torch.Tensor, targets: torch.Tensor, **kwargs) -> dict:
    """:func:`run_schedule`, then :func:`sync_tied_grads`: after it every rank's ``.grad`` is what
    one process would have for its parameters; call the optimizer next. Adds ``tied_sync_s``
    (seconds) to the result. Keyword arguments are :func:`run_schedule`'s."""
    result = run_schedule(stage, idx, targets, **kwargs)
    t0 = time.perf_counter()
    sync_tied_grads(stage, kwargs.get("ranks"))
    result["tied_sync_s"] = time.perf_counter() - t0
    return result
