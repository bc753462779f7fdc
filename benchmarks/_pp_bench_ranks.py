"""Rank functions for benchmarks/bench_pipeline.py (spawned ranks import them from here, not the
script's ``__main__``).

Every variant (runner x schedule x micro-batch count) is built in the same processes on its own
copy of one TinyGPT (same seed), warmed up, measured for activation memory in one untimed step,
then timed **interleaved**: round after round each variant runs one step, order rotated, so load
from other processes hits every variant alike. A step is the pipeline's forward + backward over
the global batch + the tied-gradient sum (no optimizer: it is the same for every variant); a
barrier before every step (not timed) lines the ranks up, and each rank returns its seconds so
the caller can take the slower rank per step.

Activation memory, two ways (bytes, fp32, parameters and buffers excluded):

* torch's schedules: :class:`LiveSavedBytes`, a ``saved_tensors_hooks`` pack hook that counts each
  storage autograd saves once, while it is alive (the packed holder's ``__del__`` gives the
  bytes back when autograd frees the graph); its peak over the step is the activation peak.
* our from-scratch runner installs its own pack hook per micro-batch (and the innermost hook is
  the only one that runs), so its own ``peak_activation_bytes`` is used: bytes saved per
  micro-batch, summed over the micro-batches in flight at the peak. The two methods give the
  same bytes on GPipe (measured, every rank). Under 1F1B torch's count is higher by at most the
  batch's token ids / targets (8 bytes per token): torch's input splitting hands out views of the
  whole batch (its storage counted whole), our runner per-micro-batch copies.
"""
from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from course_lib.parallel.pipeline.live_bytes import LiveSavedBytes


def _recv_buffer_bytes(stages) -> int:
    """Bytes of the receive buffers torch's stages allocate up front: one activation buffer and
    one gradient buffer per micro-batch, kept between steps."""
    seen, total = set(), 0
    for st in stages:
        for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
            for info in infos:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor) and buf.untyped_storage().data_ptr() not in seen:
                    seen.add(buf.untyped_storage().data_ptr())
                    total += buf.untyped_storage().nbytes()
    return total


class Variant:
    def __init__(self, name, runner, schedule, m, v, cfg, rank, world, x, y):
        from course_lib.model import ModelConfig, TinyGPT
        from course_lib.parallel.pipeline import build_stage
        from course_lib.parallel.pipeline.torch_pipelining import build_torch_stages, named_stage_parameters

        self.name, self.runner, self.schedule, self.m, self.v = name, runner, schedule, m, v
        self.x, self.y = x, y
        torch.manual_seed(0)
        model = TinyGPT(ModelConfig(**cfg))
        if runner == "torch":
            self.stages = build_torch_stages(model, rank, world, v)
            self.params = list(named_stage_parameters(self.stages).values())
            self.modules = [s.submod for s in self.stages]
        else:
            self.stage = build_stage(model, rank, world)
            self.params = list(self.stage.parameters())
            self.modules = [self.stage]
        self.times: list[float] = []
        self.error: str | None = None
        self.memory: dict = {}

    def step(self) -> dict:
        from course_lib.parallel.pipeline import pipeline_step
        from course_lib.parallel.pipeline.torch_pipelining import torch_pipeline_step

        if self.runner == "torch":
            return torch_pipeline_step(self.stages, self.x, self.y, schedule=self.schedule, micro_batches=self.m)
        return pipeline_step(self.stage, self.x, self.y, schedule=self.schedule, micro_batches=self.m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def measure_memory(self):
        if self.runner == "torch":
            counter = LiveSavedBytes(self.modules)
            with counter:
                out = self.step()
            self.memory = {"peak_saved_bytes": counter.peak, "left_after_step": counter.live,
                           "recv_buffer_bytes": _recv_buffer_bytes(self.stages), "peak_in_flight": None}
        else:
            out = self.step()
            self.memory = {"peak_saved_bytes": out["peak_activation_bytes"], "left_after_step": 0,
                           "recv_buffer_bytes": 0, "peak_in_flight": out["peak_in_flight"]}
        self.zero_grad()
        return out


def run(rank, world_size, cfg, batch, seq, specs, warmup, rounds):
    """specs: [(name, runner, schedule, m, v)]. Returns per variant its times (s), memory (bytes)."""
    g = torch.Generator().manual_seed(1234)  # every rank the same global batch
    tok = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g)
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    variants, t_setup = [], time.perf_counter()
    for spec in specs:
        try:
            v = Variant(*spec, cfg, rank, world_size, x, y)
            for _ in range(warmup):
                v.step()
                v.zero_grad()
            v.measure_memory()
        except Exception:  # noqa: BLE001 - reported per variant; ranks fail alike (same code)
            v = Variant.__new__(Variant)
            v.name, v.times, v.memory = spec[0], [], {}
            v.error = traceback.format_exc(limit=2).strip().splitlines()[-1]
        variants.append(v)
        dist.barrier()
    setup_s = time.perf_counter() - t_setup
    live = [v for v in variants if v.error is None]
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        if r % 2:
            order = order[::-1]
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            v.step()
            v.times.append(time.perf_counter() - t0)
            v.zero_grad()
    dist.barrier()
    return {"setup_s": setup_s,
            "variants": [{"name": v.name, "times": v.times, "memory": v.memory, "error": v.error}
                         for v in variants]}
