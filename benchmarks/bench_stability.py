"""Cost of the gradient monitor + Stabilizer per training step, against a bare step.

    python benchmarks/bench_stability.py [--layers 4] [--d-model 256] [--steps 30] [--repeats 5]

Three variants of the same step (forward, backward, AdamW step, zero_grad) on a small causal
transformer, interleaved step by step so machine noise hits them alike; the median step time of
each is reported:

* bare: nothing else;
* torch clip: ``torch.nn.utils.clip_grad_norm_`` (the usual minimum, for reference);
* stabilizer: ``Stabilizer.on_loss`` + ``after_backward`` (per-parameter and per-layer norms, NaN
  guard, two spike detectors, clipping, one host transfer).

The target of the course (issue 5) is stabilizer overhead <= 3% of a bare step on CPU. Ratios are
printed, never asserted: timings belong to the machine they were taken on.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from course_lib.stability import Stabilizer, scaled_lr


class TinyLM(nn.Module):
    """Embedding, ``layers`` pre-norm transformer blocks, tied output head."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.blocks(self.emb(idx), mask=mask, is_causal=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadiest timings)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message="gradient clipping fired")  # expected: random targets
    vocab = 512
    model = TinyLM(vocab, a.d_model, a.layers, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stab = Stabilizer(max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (a.batch, a.seq + 1), generator=gen) for _ in range(8)]
    step_no = [0]
    own: list[float] = []  # seconds inside Stabilizer.after_backward (monitor, guard, detectors, clip)

    def step(variant: str) -> None:
        b = batches[step_no[0] % len(batches)]
        logits = model(b[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())
        if variant == "stabilizer":
            loss = stab.on_loss(loss, step_no[0])
        loss.backward()
        if variant == "torch clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        elif variant == "stabilizer":
            t0 = time.perf_counter()
            d = stab.after_backward(model, loss, step_no[0], optimizer=opt)
            own.append(time.perf_counter() - t0)
            if not d.skip:
                with scaled_lr(opt, d.lr_factor):
                    opt.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        step_no[0] += 1

    variants = ["bare", "torch clip", "stabilizer"]
    for v in variants:  # warm-up: allocator, optimizer state, detector windows
        for _ in range(5):
            step(v)
    # Interleave single steps in a rotating order and keep per-step times: a load spike from another
    # process then hits every variant alike instead of one whole block.
    times: dict[str, list[float]] = {v: [] for v in variants}
    syncs0, stab_steps = stab.sync_count, 0
    for i in range(a.steps * a.repeats):
        order = variants[i % 3:] + variants[:i % 3]
        for v in order:
            t0 = time.perf_counter()
            step(v)
            times[v].append(time.perf_counter() - t0)
            stab_steps += v == "stabilizer"
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = sum(1 for p in model.parameters())
    bare = statistics.median(times["bare"])
    print(f"model: {n_params / 1e6:.2f} M parameters in {n_tensors} tensors, batch {a.batch}x{a.seq}, "
          f"{torch.get_num_threads()} threads")
    for v in variants:
        med = statistics.median(times[v])
        print(f"{v:>11}: {med * 1e3:8.2f} ms/step  ratio to bare {med / bare:6.3f}  "
              f"(overhead {100 * (med / bare - 1):+5.1f}%)")
    inside = statistics.median(own)
    print(f"inside Stabilizer.after_backward: {inside * 1e3:.3f} ms/step = {100 * inside / bare:.2f}% of a bare step "
          f"(the precise figure; whole-step ratios carry the machine's noise)")
    print(f"device syncs per stabilizer step: {(stab.sync_count - syncs0) / stab_steps:.2f}")
    print("target (issue 5): stabilizer overhead <= 3% of a bare step")


if __name__ == "__main__":
    main()
