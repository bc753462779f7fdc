"""Test helper: a tiny, fully deterministic training loop wired to the Stabilizer and the
CheckpointManager (a regression toy, not part of the library; the real loop is ``course_lib.train``).

The fault-tolerance tests kill it with SIGKILL, corrupt its checkpoints and delete its disk: a
step takes about a millisecond, so a test can run hundreds of steps and many kills in seconds.
It composes the same pieces the way ``course_lib.train`` does. Run ``python tests/tiny_loop.py --help``.

Determinism: one CPU thread, a data stream driven by its own ``torch.Generator`` (its state is the
data position), dropout driven by the global RNG (restored from the checkpoint). So a run killed
after step k and resumed reproduces the uninterrupted run's losses and weights bit for bit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from course_lib.checkpoint import CheckpointManager
from course_lib.stability import Stabilizer, scaled_lr


class SyntheticRegression:
    """Endless batches of ``y = sin(x @ w)`` (``batch`` x ``dim``); the generator state is the data
    position, so :meth:`state_dict` / :meth:`load_state_dict` make the stream resumable."""

    def __init__(self, dim: int = 16, batch: int = 32, seed: int = 0):
        self.dim, self.batch = dim, batch
        self.w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(1000 + seed)) / math.sqrt(dim)
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)`` batch."""
        x = torch.randn(self.batch, self.dim, generator=self.gen)
        self.position += 1
        return x, torch.sin(3 * x @ self.w)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.position = int(state["position"])


def make_model(dim: int = 16, width: int = 64, depth: int = 2, seed: int = 0) -> nn.Sequential:
    """MLP with dropout (so resume must restore the RNG to be bit-exact)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = dim
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.Tanh(), nn.Dropout(0.1)]
        d = width
    layers.append(nn.Linear(d, 1))
    return nn.Sequential(*layers)


def _read_rows(path: Path, before_step: int) -> list[dict]:
    """Valid JSON rows of an earlier run's metrics file with ``step < before_step`` (a torn or
    garbled line is dropped: the resumed run writes those steps again)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < before_step:
                rows.append(row)
    return rows


def run(out_dir: str | os.PathLike, steps: int = 60, *, save_every: int | None = 10, resume: bool = True,
        faults: list[str] | None = None, mirror: str | None = None, die_at_step: int | None = None,
        async_save: bool = True, keep_last: int = 3, spike_policy: str = "skip", max_grad_norm: float = 1.0,
        width: int = 64, depth: int = 2, lr: float = 3e-3, seed: int = 0,
        storage_options: dict | None = None) -> dict[str, Any]:
    """Train for ``steps`` optimizer steps, checkpointing into ``out_dir/ckpt`` every ``save_every``
    steps and logging to ``out_dir/metrics.jsonl``. ``die_at_step``: SIGKILL itself just before that
    step (a real crash, for tests). Returns a summary dict (final loss, resumed_from, decisions)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(width=width, depth=depth, seed=seed)
    data = SyntheticRegression(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    stab = Stabilizer(max_grad_norm=max_grad_norm, spike_policy=spike_policy, faults=faults,
                      diag_dir=out / "diagnostics", max_consecutive_bad=3)
    stab.faults.validate(model)
    if mirror is not None and storage_options is not None:
        from course_lib.checkpoint.mirror import CheckpointMirror
        mirror = CheckpointMirror(mirror, storage_options=storage_options, backoff_s=0.05)
    mgr = CheckpointManager(out / "ckpt", every_steps=save_every, keep_last=keep_last, async_save=async_save,
                            mirror=mirror)
    state = dict(model=model, optimizer=opt, scheduler=sched, data=data, stateful={"stabilizer": stab})
    start, resumed = 0, None
    if resume:
        res = mgr.load(**state)
        if res is not None:
            start, resumed = res.step, {"step": res.step, "source": res.source, "name": res.path.name}
    metrics_path = out / "metrics.jsonl"
    rows = _read_rows(metrics_path, start)
    tmp = metrics_path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, metrics_path)  # keep the rows before the checkpoint, never a torn line
    log = open(metrics_path, "a")
    step, rollbacks = start, 0
    try:
        while step < steps:
            if die_at_step is not None and step == die_at_step:
                log.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = data.next()
            loss = nn.functional.mse_loss(model(x), y)
            loss = stab.on_loss(loss, step)
            loss.backward()
            d = stab.after_backward(model, loss, step, optimizer=opt, batch=(x, y))
            if d.rollback:
                opt.zero_grad(set_to_none=True)
                mgr.wait(mirror=False)
                res = mgr.load(**state)
                if res is None:
                    raise RuntimeError(f"step {step}: rollback requested but there is no checkpoint")
                rollbacks += 1
                log.write(json.dumps(dict(d.log_row(), rolled_back_to=res.step)) + "\n")
                log.flush()
                step = res.step
                continue
            if not d.skip:
                with scaled_lr(opt, d.lr_factor):
                    opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            log.write(json.dumps(dict(d.log_row(), lr=opt.param_groups[0]["lr"])) + "\n")
            log.flush()
            step += 1
            if mgr.should_save(step):
                mgr.save(step, metrics={"loss": d.loss if d.loss is not None and math.isfinite(d.loss) else 0.0},
                         **state)
    finally:
        log.close()
        mgr.close()
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / ".final.tmp"))
    os.replace(out / ".final.tmp", out / "final.safetensors")
    return {"steps": steps, "resumed_from": resumed, "rollbacks": rollbacks, "cleaned": mgr.cleaned,
            "faults_fired": stab.faults.fired, "syncs": stab.sync_count, "spikes": {
                k: det.spikes for k, det in stab.detectors.items()}, "bad_steps": stab.guard.bad_steps}


def main(argv: list[str] | None = None) -> int:
    """CLI: the flags the trainer of issue 4 has for this (``--save-every``, ``--resume auto``,
    ``--inject-fault KIND@STEP[=VALUE]``) plus test hooks (``--die-at-step``, ``--mirror``)."""
    p = argparse.ArgumentParser(prog="python tests/tiny_loop.py", description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="output directory (checkpoints, metrics.jsonl)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", choices=["auto", "none"], default="auto")
    p.add_argument("--inject-fault", action="append", default=[], metavar="KIND@STEP[=VALUE]")
    p.add_argument("--mirror", default=None, help="fsspec URL of the second checkpoint tier")
    p.add_argument("--storage-options", default=None, help="JSON dict for the mirror's filesystem")
    p.add_argument("--die-at-step", type=int, default=None, help="SIGKILL itself before this step")
    p.add_argument("--sync-save", action="store_true", help="synchronous saves")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--spike-policy", default="skip", choices=["warn", "skip", "lower_lr", "rollback"])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    a = p.parse_args(argv)
    summary = run(a.dir, a.steps, save_every=a.save_every, resume=a.resume == "auto", faults=a.inject_fault,
                  mirror=a.mirror, die_at_step=a.die_at_step, async_save=not a.sync_save, keep_last=a.keep_last,
                  spike_policy=a.spike_policy, width=a.width, depth=a.depth,
                  storage_options=json.loads(a.storage_options) if a.storage_options else None)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
