"""Rank functions for lab 11 (pipeline parallelism and 3D parallelism).

They live here, not in the notebook, because spawned ranks can only run importable code. Each has
the ``fn(rank, world_size, ...)`` signature :func:`course_lib.parallel.run_ranks` calls and returns
plain dicts and lists (tensors only where the lab compares them with one process).

Every pipeline run builds the same TinyGPT (seed 0) on every rank and trains it on the same global
batches of the synthetic Markov task (:func:`global_batches`); :func:`reference_losses` is the one
process they are compared with (it accumulates the same micro-batches: the arithmetic a pipeline
does). Timed steps can add a **simulated compute time** per micro-batch (a sleep after each
forward / backward, ``run_schedule(simulate_s=...)``): the tiny model's own compute takes well
under a millisecond, so without it the timeline would show Python overhead, not a schedule.
The sleeps stand in for the GPU kernels of a bigger model; the schedule, the messages and the
waiting are real.

* :func:`scratch_runs` - our GPipe / 1F1B runner: losses, timelines, micro-batches in flight and
  saved-activation bytes per stage (sections 1, 2, 3 and 5 of the lab).
* :func:`torch_runs` - torch's ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``: losses, a timeline
  recorded by an identity autograd function at each stage's output, live saved bytes (section 4).
* :func:`train_layouts` - the trainer on a tp x pp x dp mesh (section 6).
* :func:`sharded_layouts` - the trainer with a sharded data-parallel dimension under tp / cp (section 7).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from course_lib.data import make_dataset
from course_lib.model import ModelConfig, TinyGPT
from course_lib.parallel.pipeline.live_bytes import LiveSavedBytes

VOCAB = 64  # the Markov task's vocabulary


# ------------------------------------------------------------------------------ model and data
def model_config(**overrides) -> ModelConfig:
    """The lab's GPT-2-style TinyGPT (tied embeddings, no biases: see tests/pp_rank_fns.py for why
    biases make AdamW runs compare badly), resized by ``overrides``."""
    kw = dict(vocab_size=VOCAB, block_size=32, n_layers=8, n_heads=4, d_model=32, bias=False)
    kw.update(overrides)
    return ModelConfig(**kw)


def make_model(cfg: ModelConfig) -> TinyGPT:
    torch.manual_seed(0)  # every rank and the reference build the same weights
    return TinyGPT(cfg)


def global_batches(steps: int, batch: int, seq_len: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches (x, y), int64 [batch, seq_len], the same in every process."""
    task = make_dataset("markov", seq_len=seq_len, seed=seed, vocab_size=VOCAB)
    return [task.get_batch(list(range(s * batch, (s + 1) * batch))) for s in range(steps)]


def _opt(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def reference_losses(cfg: ModelConfig, steps: int, batch: int, micro_batches: int) -> list[float]:
    """One process, AdamW, each global batch in ``micro_batches`` slices with gradients
    accumulated (each loss / m): the losses every pipeline run must reproduce."""
    model = make_model(cfg)
    opt = _opt(model.parameters())
    out = []
    for x, y in global_batches(steps, batch, cfg.block_size):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            _, loss = model(xs, ys)
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        out.append(total)
        opt.step()
    return out


# ------------------------------------------------------------------------------ our runner
_TIMING_KEYS = ("stage", "pp", "rank", "schedule", "micro_batches", "events", "origin", "peak_in_flight",
                "peak_activation_bytes", "loss")


def _timing(result: dict) -> dict:
    return {k: result[k] for k in _TIMING_KEYS}


def scratch_runs(rank: int, world_size: int, jobs: list[dict], batch: int) -> list[dict]:
    """Each job on our from-scratch runner, stage ``rank`` of ``world_size``. A job is a dict:

    ``schedule`` ("gpipe" | "1f1b"), ``m`` (micro-batches), ``model`` (``model_config`` overrides),
    ``balance`` (None | "balanced" | list), ``train_steps`` (AdamW steps recorded as losses, no
    sleeps), ``timed`` (repeats of one timed step, each after a barrier, no optimizer step),
    ``fwd_s`` (simulated forward seconds of this stage for the **whole global batch**; a
    micro-batch sleeps ``fwd_s / m``, backward twice that) or ``flop_s`` (seconds per forward FLOP:
    the stage sleeps in proportion to its ``stage_costs``, embedding and head included).

    Returns per job: ``losses`` (last stage, else Nones), ``balance``, ``block_ids``, ``memory``
    (the first step's ``peak_in_flight`` and ``peak_activation_bytes``) and ``timed`` (the
    timelines of the timed steps).
    """
    from course_lib.parallel.pipeline import build_stage, pipeline_step, stage_costs

    out = []
    for job in jobs:
        cfg = model_config(**job.get("model", {}))
        stage = build_stage(make_model(cfg), rank, world_size, job.get("balance"))
        m, schedule = job["m"], job["schedule"]
        opt = _opt(stage.parameters())
        losses, memory = [], None
        data = global_batches(max(1, job.get("train_steps", 0)), batch, cfg.block_size)
        for x, y in data[:job.get("train_steps", 0)]:
            opt.zero_grad(set_to_none=True)
            res = pipeline_step(stage, x, y, schedule=schedule, micro_batches=m)
            losses.append(res["loss"])
            if memory is None:
                memory = {"peak_in_flight": res["peak_in_flight"],
                          "peak_activation_bytes": res["peak_activation_bytes"]}
            opt.step()
        if "flop_s" in job:  # forward FLOPs of this stage for the whole batch
            fwd = stage_costs(cfg, world_size, job.get("balance"))[rank] * batch * job["flop_s"]
        else:
            fwd = job.get("fwd_s", 0.0)
        sim = (fwd / m, 2 * fwd / m)
        x, y = data[0]
        timed = []
        if job.get("timed", 0):
            pipeline_step(stage, x, y, schedule=schedule, micro_batches=m)  # warm-up, not timed
        for _ in range(job.get("timed", 0)):
            stage.zero_grad(set_to_none=True)
            dist.barrier()
            res = pipeline_step(stage, x, y, schedule=schedule, micro_batches=m, simulate_s=sim)
            timed.append(_timing(res))
            if memory is None:
                memory = {"peak_in_flight": res["peak_in_flight"],
                          "peak_activation_bytes": res["peak_activation_bytes"]}
        out.append({"losses": losses, "balance": stage.balance, "block_ids": stage.block_ids,
                    "memory": memory, "timed": timed, "simulate_s": sim})
    dist.barrier()
    return out


# ------------------------------------------------------------------------------ torch's schedules
class _Recorder:
    """Timeline and in-flight count of one rank's torch stages (filled while ``active``)."""

    def __init__(self):
        self.active, self.events, self.origin = False, [], 0.0
        self.sim = {}  # stage index -> (forward s, backward s) per micro-batch
        self.blocks = {}  # stage index -> blocks it holds
        self.in_flight = self.peak_in_flight = 0  # in blocks' worth of micro-batches (layer-equivalents)
        self.mb = {}  # stage index -> micro-batches seen in forward / backward this step

    def reset(self):
        self.events, self.origin = [], time.perf_counter()
        self.in_flight = self.peak_in_flight = 0
        self.mb = {s: [0, 0] for s in self.sim}


class _SimulatedCompute(torch.autograd.Function):
    """Identity on a stage's output: the forward sleeps (and stamps the stage's forward from its
    start), the backward sleeps and stamps itself: the timeline of torch's schedule."""

    @staticmethod
    def forward(ctx, x, rec, stage_idx, t_start):
        ctx.rec, ctx.stage_idx = rec, stage_idx
        if rec.active:
            time.sleep(rec.sim[stage_idx][0])
            i = rec.mb[stage_idx][0]
            rec.mb[stage_idx][0] += 1
            rec.events.append({"op": "forward", "stage": stage_idx, "mb": i, "start": t_start - rec.origin,
                               "end": time.perf_counter() - rec.origin})
            rec.in_flight += rec.blocks[stage_idx]
            rec.peak_in_flight = max(rec.peak_in_flight, rec.in_flight)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        rec = ctx.rec
        if rec.active:
            t0 = time.perf_counter()
            time.sleep(rec.sim[ctx.stage_idx][1])
            i = rec.mb[ctx.stage_idx][1]
            rec.mb[ctx.stage_idx][1] += 1
            rec.events.append({"op": "backward", "stage": ctx.stage_idx, "mb": i, "start": t0 - rec.origin,
                               "end": time.perf_counter() - rec.origin})
            rec.in_flight -= rec.blocks[ctx.stage_idx]
        return g, None, None, None


def _instrument(stages, rec: _Recorder, fwd_s: float, m: int, n_stages: int, n_layers: int):
    """Hooks on each local stage: stamp the forward's start, add the simulated compute at its end.
    ``fwd_s`` is a *pipeline rank's* forward time for the whole batch; a stage of ``b`` blocks
    sleeps ``fwd_s * b / (n_layers / pp) / m`` per micro-batch, backward twice that."""
    pp = stages[0].group_size
    for st in stages:
        idx, blocks = st.stage_index, len(st.submod.block_ids)
        per_mb = fwd_s * blocks / (n_layers / pp) / m
        rec.sim[idx], rec.blocks[idx] = (per_mb, 2 * per_mb), blocks
        starts = []
        st.submod.register_forward_pre_hook(lambda mod, args, starts=starts: starts.append(time.perf_counter()))
        st.submod.register_forward_hook(
            lambda mod, args, out, idx=idx, starts=starts: _SimulatedCompute.apply(out, rec, idx, starts.pop()))


def torch_runs(rank: int, world_size: int, jobs: list[dict], batch: int) -> list[dict]:
    """Each job through torch's schedules (``build_torch_stages`` / ``torch_pipeline_step``). A job:
    ``schedule`` ("gpipe" | "1f1b" | "interleaved"), ``v`` (virtual stages), ``m``, ``model``
    overrides, ``train_steps``, ``timed`` (repeats), ``fwd_s`` (simulated forward seconds per
    pipeline rank for the whole batch, split over its stages by blocks and over micro-batches).

    Returns per job: ``losses`` (rank with the last stage), ``stages`` (indices on this rank),
    ``timed`` (per repeat: ``events`` with ``stage``, ``origin``, ``step_s``), ``peak_saved_bytes``
    (live saved bytes at the peak of one untimed step), ``peak_in_flight_layers`` (the most
    blocks' worth of micro-batch activations held at once, counted by the recorder).
    """
    from course_lib.parallel.pipeline.torch_pipelining import (build_torch_stages, named_stage_parameters,
                                                               torch_pipeline_step)

    out = []
    for job in jobs:
        cfg = model_config(**job.get("model", {}))
        v, m, schedule = job.get("v", 1), job["m"], job["schedule"]
        stages = build_torch_stages(make_model(cfg), rank, world_size, v)
        rec = _Recorder()
        _instrument(stages, rec, job.get("fwd_s", 0.0), m, world_size * v, cfg.n_layers)
        params = named_stage_parameters(stages)
        opt = _opt(params.values())
        data = global_batches(max(1, job.get("train_steps", 0)), batch, cfg.block_size)
        losses = []
        for x, y in data[:job.get("train_steps", 0)]:  # the first also runs torch's shape inference
            opt.zero_grad(set_to_none=True)
            losses.append(torch_pipeline_step(stages, x, y, schedule=schedule, micro_batches=m)["loss"])
            opt.step()
        x, y = data[0]
        opt.zero_grad(set_to_none=True)
        counter = LiveSavedBytes([s.submod for s in stages])
        rec.reset()
        sim, rec.sim = rec.sim, {s: (0.0, 0.0) for s in rec.sim}  # memory step: no sleeps
        rec.active = True
        with counter:
            torch_pipeline_step(stages, x, y, schedule=schedule, micro_batches=m)
        rec.active, rec.sim = False, sim
        peak_layers = rec.peak_in_flight
        timed = []
        for _ in range(job.get("timed", 0)):
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            rec.reset()
            rec.active = True
            res = torch_pipeline_step(stages, x, y, schedule=schedule, micro_batches=m)
            rec.active = False
            timed.append({"events": list(rec.events), "origin": rec.origin, "step_s": res["step_s"]})
        out.append({"losses": losses, "stages": [s.stage_index for s in stages], "timed": timed,
                    "peak_saved_bytes": counter.peak, "peak_in_flight_layers": peak_layers,
                    "blocks": {s.stage_index: len(s.submod.block_ids) for s in stages}})
    dist.barrier()
    return out


def torch_bubble(per_rank_timed: list[dict], pp: int) -> dict:
    """Measured bubble of one torch step from every rank's recorded timeline (same definition as
    :func:`course_lib.parallel.pipeline.measure_bubble`, ``relative_to="ideal"``): busy = the
    stamped forward / backward intervals, idle = span - busy per rank, bubble = sum idle / sum busy."""
    begin = min(r["origin"] + e["start"] for r in per_rank_timed for e in r["events"])
    end = max(r["origin"] + e["end"] for r in per_rank_timed for e in r["events"])
    span = end - begin
    busy = [sum(e["end"] - e["start"] for e in r["events"]) for r in per_rank_timed]
    return {"measured": (pp * span - sum(busy)) / sum(busy), "span_s": span, "busy_s": busy}


# ------------------------------------------------------------------------------ the trainer (3D)
def train_layouts(rank: int, world_size: int, runs: list[tuple]) -> list[dict]:
    """Trainer runs ``(cfg, out_dir)`` in one launch. Per run: this rank's mesh coordinates and the
    ranks of its groups along each dimension (from the strategy's mesh), and the steps run."""
    from course_lib.train import train

    out = []
    for cfg, out_dir in runs:
        result = train(cfg, out_dir)
        mesh = getattr(result.strategy, "mesh", None)
        out.append({"steps": result.steps, "coords": None if mesh is None else dict(mesh.coords),
                    "groups": None if mesh is None else {d: list(r) for d, r in mesh.ranks.items()}})
    return out


# ------------------------------------------------------------------------------ sharding under model parallelism
def sharded_layouts(rank: int, world_size: int, runs: list[tuple]) -> list[dict]:
    """Lab 11 section 7: trainer runs ``(cfg, out_dir)`` whose data-parallel dimension is sharded
    (fsdp, zero1/zero2) under tp / cp. Per run: this rank's (pp, dp, cp, tp) coordinates, its
    strategy's class, and its model-state bytes measured mid-step - after one more forward and
    backward on a fixed batch, so the gradients exist as they do before an optimizer step
    (:func:`~course_lib.parallel.memory_census.model_state_bytes_on_rank`: storages, each once)."""
    from course_lib.parallel.memory_census import model_state_bytes_on_rank
    from course_lib.precision import make_policy
    from course_lib.train import train

    out = []
    for cfg, out_dir in runs:
        result = train(cfg, out_dir)
        strategy = result.strategy
        g = torch.Generator().manual_seed(1)  # the same tokens on every rank (TP and cp peers agree)
        vocab, T, mb = cfg["data"]["vocab_size"], cfg["data"]["seq_len"], cfg["train"]["micro_batch"]
        batch = (torch.randint(0, vocab, (mb, T), generator=g), torch.randint(0, vocab, (mb, T), generator=g))
        policy = make_policy("fp32", torch.device("cpu"))
        strategy.forward_backward([batch], autocast=policy.autocast, on_loss=lambda x: x, backward=policy.backward)
        params = strategy.dp.census_params() if hasattr(strategy, "dp") else list(strategy.model.parameters())
        census = model_state_bytes_on_rank(None, strategy.optimizer, params=params).to_dict()
        strategy.zero_grad()
        mesh = getattr(strategy, "mesh", None)
        coords = dict(mesh.coords) if mesh is not None else dict(strategy.coords)
        out.append({"steps": result.steps, "coords": coords, "strategy": type(strategy).__name__,
                    "census": census})
    dist.barrier()
    return out


# ------------------------------------------------------------------------------ pictures
# what each mesh dimension carries, in the words the lab uses (colour, label)
FLOWS = {"tp": ("tab:red", "tp: all-reduce of activations, 2 per layer (fwd) + 2 (bwd)"),
         "pp": ("tab:blue", "pp: send activation / receive gradient, 1 each per micro-batch"),
         "dp": ("tab:green", "dp: all-reduce of gradients, once per step"),
         "cp": ("tab:purple", "cp: K/V blocks around the ring, every attention layer"),
         "dp_cp": ("tab:olive", "ZeRO over dp x cp: reduce-scatter gradients, all-gather weights, per step")}


def draw_data_flow(ax, layout, labels: dict[int, str], dims: tuple[str, ...], title: str) -> None:
    """Draw the ranks of ``layout`` (a :class:`course_lib.parallel.mesh.MeshLayout`) as boxes: one
    column per pipeline stage and cp chunk, TP shards stacked inside each dp replica, and one
    coloured link per pair of neighbours in each group of every dimension in ``dims`` (see
    :data:`FLOWS`). ``labels[rank]``: a short text inside the box (what the rank holds)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch

    pos = {}
    for r in range(layout.world_size):
        c = layout.coords_of(r)
        pos[r] = (c["pp"] * (layout.cp + 0.9) * 1.6 + c["cp"] * 1.6, -(c["dp"] * (layout.tp + 0.5) + c["tp"]) * 1.2)
    for r, (x, y) in pos.items():
        ax.add_patch(FancyBboxPatch(
            (x - 0.6, y - 0.4), 1.2, 0.8, boxstyle="round,pad=0.02", fc="0.93", ec="0.3"))
        ax.text(x, y + 0.2, f"rank {r}", ha="center", va="center", fontsize=8, weight="bold")
        ax.text(x, y - 0.12, labels.get(r, ""), ha="center", va="center", fontsize=6.5)
    handles = []
    for k, dim in enumerate(dims):
        color, label = FLOWS[dim]
        for group in layout.group_ranks(dim):
            for a, b in zip(group, group[1:]):
                (xa, ya), (xb, yb) = pos[a], pos[b]
                between = [p for q, p in pos.items() if q not in (a, b) and  # a box in the way: go around it
                           ((p[0] == xa == xb and min(ya, yb) < p[1] < max(ya, yb)) or
                            (p[1] == ya == yb and min(xa, xb) < p[0] < max(xa, xb)))]
                far = bool(between)
                ax.annotate("", (xb, yb), (xa, ya), arrowprops=dict(
                    arrowstyle="<->", color=color, lw=2, shrinkA=18, shrinkB=18,
                    connectionstyle=f"arc3,rad={(0.45 if far else 0.0) + 0.12 * k * (not far)}"))
        handles.append(Line2D([], [], color=color, lw=2, label=label))
    xs, ys = [p[0] for p in pos.values()], [p[1] for p in pos.values()]
    ax.set(xlim=(min(xs) - 1.2, max(xs) + 1.2), ylim=(min(ys) - 0.7, max(ys) + 0.7), title=title)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=7, frameon=False)
