"""The same pipeline with PyTorch's production API, ``torch.distributed.pipelining``.

The from-scratch runner (:mod:`.schedules`) shows what a schedule *is*; this module hands the
same stages to torch's ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` and gets the same numbers (tests/test_torch_pipelining.py: loss and
every gradient equal our ``pipeline_step`` and one process on the global batch, fp32).

* :func:`build_torch_stages` cuts a ``TinyGPT`` with *our* splitter (:class:`.stages.PipelineStage`,
  dense parameter names, even / balanced / explicit ``balance``) into ``pp * virtual_stages``
  stages and wraps the ones this rank runs in torch ``PipelineStage`` objects. Interleaved
  (Narayanan et al. 2021, "virtual stages"): rank r holds stages r, r + pp, r + 2 pp, ... - the
  looped placement torch's ``ScheduleInterleaved1F1B`` expects (stage i on group rank i % pp).
* :func:`torch_pipeline_step` runs one global batch through the schedule; gradients land in
  ``.grad``; the loss is on the rank that holds the last stage.

Usage, on every rank (``run_ranks`` or torchrun)::

    model = TinyGPT(cfg)                                     # same seed on every rank
    stages = build_torch_stages(model, dist.get_rank(), pp, virtual_stages=2)
    opt = torch.optim.AdamW(named_stage_parameters(stages).values(), lr=1e-3)
    opt.zero_grad()
    out = torch_pipeline_step(stages, idx, targets, schedule="interleaved", micro_batches=4)
    opt.step()                                               # out["loss"] on the last stage's rank

Loss arithmetic (why ``scale_grads=False``): torch's schedules default to ``scale_grads=True``:
the loss function returns each micro-batch's *mean* and the schedule divides every ``.grad`` of
the stage by m once all backwards are done. We instead divide each micro-batch loss by m inside
the loss function and pass ``scale_grads=False`` - exactly what ``pipeline_step`` and plain
gradient accumulation do, so the two runners add the same numbers in the same order (measured:
bit-identical gradients). Torch's way is the same mathematics but also divides whatever was in
``.grad`` *before* the step (accumulating over several steps without zeroing would be scaled
wrongly), and it would divide a parameter shared by two local stages twice (it scales per stage;
read in torch 2.13's ``schedules.py``/``stage.py``).

Tied embeddings (``tie_embeddings=True``, GPT-2 style): the token table on the first stage and
the LM head on the last stage are two copies of one matrix on two ranks; each gets only its part
of the gradient. After the schedule, :func:`torch_pipeline_step` sums the two parts on both
ranks with our :func:`.schedules.sync_tied_grads` (Megatron's "embedding group" idea; torch's
pipelining does not do it for you). With a single pipeline rank both copies are the same
``Parameter`` and autograd already adds the parts, so nothing is sent.

Constraints torch adds (checked here, with the argument named, before any message is sent):
``Schedule1F1B`` needs ``micro_batches >= pp``; ``ScheduleInterleaved1F1B`` does not (m = 1 on 2
ranks is tested), but needs ``micro_batches`` to be a multiple of its number of rounds
``max(1, micro_batches // pp)`` (so any m < 2 pp, or a multiple of pp). Every stage needs at
least one block, so ``pp * virtual_stages <= n_layers``.

Memory (benchmarks/bench_pipeline.py): the activation peaks per rank are our runner's - GPipe
holds all m micro-batches, 1F1B ``min(m, pp - rank)`` - and interleaved holds a little more than
1F1B (more warm-up forwards, each of a smaller stage) for half the bubble. Torch's stages also
keep one receive buffer per micro-batch (activations and gradients) allocated between steps.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from course_lib.model import TinyGPT
from course_lib.parallel.pipeline.schedules import check_batch, sync_tied_grads
from course_lib.parallel.pipeline.stages import PipelineStage, resolve_balance
from course_lib.validate import check_choice, check_int

__all__ = ["TORCH_SCHEDULES", "build_torch_stages", "torch_pipeline_step", "named_stage_parameters",
           "MicroBatchMeanLoss"]

TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved")
_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


# ------------------------------------------------------------------------------ building stages
def _require_group(group) -> tuple[int, int]:
    """(rank in ``group``, size of ``group``); torch's stages need a process group to exist."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch pipelining needs a process group: start ranks with "
                           "course_lib.parallel.run_ranks, or torchrun + init_distributed()")
    return dist.get_rank(group), dist.get_world_size(group)


def build_torch_stages(model: TinyGPT, rank: int, pp: int, virtual_stages: int = 1, balance=None,
                       group=None, device=None) -> list[TorchStage]:
    """The torch ``PipelineStage`` objects that pipeline rank ``rank`` of ``pp`` runs.

    ``model`` is the whole dense ``TinyGPT``, built with the same seed on every rank; it is cut
    into ``pp * virtual_stages`` stages with our splitter (``balance``: None, "balanced" or a
    list of ``pp * virtual_stages`` block counts, see :func:`.stages.resolve_balance`), and this
    rank keeps stages ``rank, rank + pp, ...`` (``virtual_stages`` of them, in that order). Each
    torch stage's ``submod`` is our :class:`.stages.PipelineStage`, sharing the dense model's
    modules under the dense parameter names. ``group``: the pipeline's process group (None: the
    default group, whose size must then be ``pp``); ``rank`` is the rank *in that group*.
    ``device``: where the stage computes (default: the device of the model's parameters).

    Torch infers the shapes of the messages from the first micro-batch of the first step (a
    forward and an input-gradient pass, parameters' ``.grad`` untouched, RNG state restored), so
    no example inputs are needed here. Raises ValueError (naming the argument) for a rank or pp
    that does not match the group and for more stages than blocks; nothing is sent.
    """
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a course_lib.model.TinyGPT, got {type(model).__name__}")
    check_int("pp", pp, 1)
    check_int("virtual_stages", virtual_stages, 1)
    check_int("rank", rank, 0, pp - 1, "pp - 1")
    n_layers, n_stages = model.cfg.n_layers, pp * virtual_stages
    if n_stages > n_layers:
        raise ValueError(f"pp * virtual_stages = {pp} * {virtual_stages} = {n_stages} stages, but the model "
                         f"has n_layers={n_layers} blocks and every stage needs at least one: virtual_stages "
                         f"must be in [1, {max(1, n_layers // pp)}] for pp={pp}")
    if isinstance(balance, (list, tuple)) and len(balance) != n_stages:
        raise ValueError(f"balance must have one entry per stage, pp * virtual_stages = {n_stages}, "
                         f"got {len(balance)}: {list(balance)}")
    counts = resolve_balance(model.cfg, n_stages, balance)
    group_rank, group_size = _require_group(group)
    if group_size != pp:
        raise ValueError(f"pp ({pp}) must equal the size of the pipeline group ({group_size}): torch places "
                         f"stage i on group rank i % group size")
    if group_rank != rank:
        raise ValueError(f"rank ({rank}) must be this process's rank in the pipeline group ({group_rank})")
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    return [TorchStage(PipelineStage(model, s, n_stages, counts), s, n_stages, device, group=group)
            for s in range(rank, n_stages, pp)]


def named_stage_parameters(stages) -> dict[str, torch.nn.Parameter]:
    """{dense name: parameter} over this rank's stages, each parameter once (hand ``.values()``
    to the optimizer). A tied table held by two local stages (one pipeline rank) appears once."""
    out, seen = {}, set()
    for st in _as_stage_list(stages):
        for name, p in st.submod.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
    return out


# ------------------------------------------------------------------------------ the step
class MicroBatchMeanLoss:
    """The loss torch's schedule calls on the last stage per micro-batch: mean cross-entropy per
    scored token of that micro-batch (fp32, ``ignore_index=-100``, the same call as
    :class:`.stages.PipelineStage` makes) divided by the number of micro-batches ``m`` - so the
    m losses add up to the global-batch mean and the gradients need no rescaling afterwards."""

    def __init__(self, micro_batches: int):
        self.micro_batches = check_int("micro_batches", micro_batches, 1)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)
        return loss / self.micro_batches


def _as_stage_list(stages) -> list[TorchStage]:
    if isinstance(stages, TorchStage):
        stages = [stages]
    elif isinstance(stages, tuple):
        stages = list(stages)
    if not isinstance(stages, list) or not stages or not all(isinstance(s, TorchStage) for s in stages):
        raise TypeError("stages must be a torch.distributed.pipelining.PipelineStage or a non-empty list of "
                        "them (from build_torch_stages)")
    for s in stages:
        if not isinstance(s.submod, PipelineStage):
            raise TypeError(f"stage {s.stage_index} must wrap a course_lib PipelineStage (build_torch_stages), "
                            f"got {type(s.submod).__name__}")
    return stages


def _check_step(stages: list[TorchStage], idx, targets, schedule: str, m: int, group) -> tuple[int, int]:
    """Every check torch_pipeline_step makes, before any communication; returns (pp, virtual_stages)."""
    check_choice("schedule", schedule, TORCH_SCHEDULES)
    check_batch(idx, targets, m)
    if group is not None and any(s.group is not group for s in stages):
        raise ValueError("group must be the process group the stages were built with (or None)")
    pp, n_stages = stages[0].group_size, stages[0].num_stages
    rank = stages[0].group_rank
    want = list(range(rank, n_stages, pp))
    if n_stages % pp or [s.stage_index for s in stages] != want or any(s.num_stages != n_stages for s in stages):
        raise ValueError(f"stages must be this rank's stages {want} of {n_stages} in order (build_torch_stages), "
                         f"got {[s.stage_index for s in stages]}")
    v = n_stages // pp
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"virtual_stages must be 1 for schedule {schedule!r} (one stage per rank), got "
                         f"{v} stages per rank; build with virtual_stages=1 or use schedule='interleaved'")
    if schedule == "1f1b" and m < pp:
        raise ValueError(f"micro_batches must be >= pp={pp} for schedule '1f1b' (torch's Schedule1F1B "
                         f"needs a micro-batch per stage in flight), got {m}")
    if schedule == "interleaved":
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(f"micro_batches ({m}) must be a multiple of its number of rounds max(1, "
                             f"micro_batches // pp) = {rounds} for schedule 'interleaved' (torch's "
                             f"ScheduleInterleaved1F1B); e.g. any m <= {2 * pp - 1} or a multiple of pp={pp}")
    return pp, v


def _schedule_for(stages: list[TorchStage], schedule: str, m: int):
    """The torch schedule object, kept on the first stage and reused while (schedule, m) stays
    the same: a fresh schedule object re-runs torch's set-up (a neighbour handshake and the
    shape inference forward) on its first step."""
    key = (schedule, m, tuple(id(s) for s in stages))
    cached = getattr(stages[0], "_course_schedule", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    loss_fn = MicroBatchMeanLoss(m)
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = _CLASSES[schedule](stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    stages[0]._course_schedule = (key, sched)
    return sched


def torch_pipeline_step(stages, idx: torch.Tensor, targets: torch.Tensor, *, schedule: str = "1f1b",
                        micro_batches: int = 1, group=None, sync_tied: bool = True) -> dict:
    """Forward and backward of one global batch with torch's schedule; gradients land in ``.grad``.

    ``stages``: this rank's torch stage(s) from :func:`build_torch_stages` (a list, or one stage).
    Every rank passes the same ``idx`` and ``targets`` (int64 [B, T]); the rank with the first
    stage feeds the tokens, the one with the last stage the targets. ``schedule``: "gpipe",
    "1f1b" or "interleaved" (needs the stages built with ``virtual_stages`` >= 1; the others
    need ``virtual_stages == 1``). ``micro_batches`` (m) must divide B. ``group``: None or the
    group the stages were built with. ``sync_tied``: sum the tied embedding / LM head gradient
    parts across the first and last stage's ranks afterwards (leave True unless you do it
    yourself).

    The loss is the mean over the global batch (each micro-batch's mean loss / m, gradients
    accumulated over micro-batches): with equal micro-batches the gradients equal one process on
    the whole batch. Zero the gradients before a step. Every check runs before any message.

    Returns a plain dict: ``loss`` (float, the global-batch mean; on the rank holding the last
    stage, else None), ``micro_batch_losses`` (floats, each micro-batch's own mean, same rank),
    ``step_s`` (seconds in the torch schedule's ``step``), ``tied_sync_s`` (seconds summing the
    tied gradient), ``schedule``, ``micro_batches``, ``pp``, ``virtual_stages``, ``stages``
    (the stage indices this rank ran), ``rank`` (in the pipeline group).
    """
    stages = _as_stage_list(stages)
    pp, v = _check_step(stages, idx, targets, schedule, micro_batches, group)
    sched = _schedule_for(stages, schedule, micro_batches)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    args = (idx,) if has_first else ()
    losses: list[torch.Tensor] = []
    t0 = time.perf_counter()
    # return_outputs=False: the last stage would otherwise keep every micro-batch's logits to
    # merge them into a [B, T, vocab] output we do not use.
    sched.step(*args, target=targets if has_last else None, losses=losses if has_last else None,
               return_outputs=False)
    step_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    if sync_tied:
        grp = stages[0].group
        # global rank of every stage (sync_tied_grads sends on the default group)
        ranks = [dist.get_global_rank(grp, s % pp) if grp is not None else s % pp for s in range(pp * v)]
        if ranks[0] != ranks[-1]:  # on one rank both copies are one Parameter: nothing to add
            for st in stages:
                sync_tied_grads(st.submod, ranks)
    tied_s = time.perf_counter() - t0
    loss = float(torch.stack([x.detach() for x in losses]).sum()) if has_last else None
    mb_losses = [float(x.detach()) * micro_batches for x in losses] if has_last else None
    return {"loss": loss, "micro_batch_losses": mb_losses,
            "step_s": step_s, "tied_sync_s": tied_s, "schedule": schedule, "micro_batches": micro_batches,
            "pp": pp, "virtual_stages": v, "stages": [s.stage_index for s in stages],
            "rank": stages[0].group_rank}
