"""What the trainer (course_lib.train) reports: after each optimizer step the metrics row, the
progress bar and rare events; at the end, the command line's summary. Host values only: nothing
here reads a tensor, only numbers the step already brought to the host (the stabilizer's
decision, timings, the learning rate), so the step keeps its one device-to-host read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from course_lib.trainer.mfu import MfuGuard


class Throughput:
    """Tokens/s and MFU of a span of optimizer steps: ``tokens_per_step`` (all data-parallel ranks
    together), ``flops_per_token`` (training FLOPs) and the ``guard`` that turns FLOP/s into MFU."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, guard: MfuGuard):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.guard = guard

    def rates(self, steps: int, seconds: float) -> tuple[float, float | None]:
        """``(tokens/s, MFU)`` of ``steps`` steps that took ``seconds`` seconds (MFU a fraction,
        None when the peak is unknown or proved unreliable)."""
        tokens_per_s = self.tokens_per_step * steps / seconds
        return tokens_per_s, self.guard.mfu(tokens_per_s * self.flops_per_token)


def step_row(decision, step: int, lr: float, seconds: float, throughput: Throughput, *, scaled: bool,
             strategy, max_grad_norm: float, sampler) -> dict[str, Any]:
    """One metrics.jsonl row for optimizer step ``step`` (1-based: steps done): the stabilizer's
    ``decision`` columns, the applied ``lr``, tokens/s and MFU over this step's ``seconds``, the
    fp16 loss scale its backward used (``scaled``), the engine's gradient norm where the engine
    kept the gradients, and ``sampler``'s utilization columns."""
    tokens_per_s, mfu = throughput.rates(1, seconds)
    row = {**decision.log_row(), "step": step, "lr": lr, "tokens_per_s": tokens_per_s, "mfu": mfu,
           "step_seconds": seconds}
    if scaled:
        row["loss_scale"] = decision.extra[0]  # the scale this step's backward used
    if not strategy.grads_visible:  # the engine measured (and clipped) inside its step
        row["grad_norm"] = norm = strategy.grad_norm_after_step()
        row["clipped"] = bool(norm is not None and max_grad_norm > 0 and norm > max_grad_norm
                              and not decision.skip)
    row.update(sampler.columns())
    return row


class StepBar:
    """The tqdm bar of optimizer steps on the writer rank (``enabled``: train.progress there),
    redrawn every ``log_every`` steps and at the last one with the last finite loss, the lr and
    tokens/s and MFU over the steps since the last redraw (saves and slow steps included, not one
    step's rate). Disabled, every call does nothing."""

    def __init__(self, *, enabled: bool, start: int, max_steps: int, log_every: int, throughput: Throughput):
        self.max_steps, self.log_every, self.throughput = max_steps, log_every, throughput
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=max_steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
        self.window_step, self.window_time = start, 0.0

    def restart(self, step: int, now: float) -> None:
        """Start the rate window at ``step``, at ``now`` (time.perf_counter seconds): at start-up
        and after a roll-back."""
        self.window_step, self.window_time = step, now

    def update(self, step: int, now: float, last_loss: float | None, lr: float) -> None:
        """After optimizer step ``step`` ended at ``now`` (perf_counter seconds): redraw when due."""
        if self.bar is None or not (step % self.log_every == 0 or step == self.max_steps):
            return
        window_tok_s, window_mfu = self.throughput.rates(step - self.window_step,
                                                         max(now - self.window_time, 1e-9))
        self.bar.set_postfix(loss=f"{last_loss:.3f}" if last_loss is not None else "n/a",
                             lr=f"{lr:.2e}", tok_s=f"{window_tok_s:,.0f}",
                             mfu="n/a" if window_mfu is None else f"{window_mfu:.1%}",
                             refresh=False)
        self.bar.update(step - self.bar.n)
        self.restart(step, now)

    def close(self) -> None:
        """Close the bar (the last redraw stays on screen)."""
        if self.bar is not None:
            self.bar.close()


def append_event(out_dir: Path, row: dict, *, enabled: bool) -> None:
    """Append one rare event (a roll-back, an accepted level) to ``out_dir/events.jsonl`` on the
    writer rank (``enabled``): metrics.jsonl is rewound by a roll-back, this file never is."""
    if enabled:
        with open(out_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def run_summary(result, stop_exit_code: int) -> list[str]:
    """The command line's closing lines for a finished ``TrainResult``: what was trained and where
    (from scratch, from ``model.init_from``'s weights, or resumed from a step),
    the final loss (nats/token), skipped and rolled-back steps, the metrics file, the validation
    loss if any, and, for a run a signal stopped, how to continue (``stop_exit_code``)."""
    loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
    done = result.steps - result.resumed_from
    source = getattr(result, "init_from", None)  # model.init_from: the weights the run began from
    if result.resumed_from:
        origin = f"resumed from step {result.resumed_from}" + (f"; the run began from {source}" if source else "")
    else:
        origin = f"from the weights of {source}" if source else "from scratch"
    what = (f"nothing to do: already at step {result.steps}" if done == 0 and result.resumed_from
            else f"trained {done} steps ({origin})")
    where = f"on {result.device}" + (f" ({result.backend})" if result.backend else "")
    lines = [f"{what} {where}, final loss {loss} nats/token, {result.skipped_steps} skipped, "
             f"{result.rollbacks} rolled back; metrics in {result.out_dir / 'metrics.jsonl'}"
             + (f"; validation loss {result.val_loss:.4f} nats/token" if result.val_loss is not None else "")]
    if getattr(result, "peak", None) is not None:
        lines.append(result.peak.describe())
    if result.stopped_by:
        lines.append(f"stopped by {result.stopped_by} after step {result.steps}, checkpoint saved: continue with "
                     f"--resume auto (exit {stop_exit_code})")
    return lines
