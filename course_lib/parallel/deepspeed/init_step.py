"""Undo the optimizer step DeepSpeed takes while it builds the engine (ZeRO-0 with bf16/fp16).

Without ZeRO, a bf16 or fp16 run wraps the torch optimizer in DeepSpeed's ``FP16_UnfusedOptimizer``
(``FP16_Optimizer`` with its own FusedAdam). Their constructors set every fp32 master gradient
to zeros and call ``optimizer.step()`` once, to make the optimizer create its state. For AdamW
that step is not a no-op: the decoupled weight decay shrinks every decayed master weight by
``lr * weight_decay``, and Adam's step counter starts at 1, so the bias corrections of every later
step are those of the next step. Measured on the tiny model, 2 ranks vs one process, both bf16:
losses 1.3e-2 apart after 12 steps, where ZeRO 1-3 stay within 7e-4 (they do not step at build).

The constructor leaves the bf16/fp16 model weights alone (it copies masters back only in a real
step), so the masters as they were built are those weights, widened to fp32 - exactly what the
constructor cloned. Undoing the step: masters <- model weights, optimizer state emptied (torch's
AdamW and DeepSpeed's FusedAdam create it again at the first real step, as for a fresh optimizer).
"""
from __future__ import annotations

from typing import Any

import torch


def _master_pairs(wrapper: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(fp32 master, bf16/fp16 model tensor)`` pairs of a DeepSpeed fp16-style wrapper, or None
    for any other optimizer (ZeRO partitions, BF16_Optimizer: no step at build)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if isinstance(wrapper, FP16_UnfusedOptimizer):  # one master tensor per parameter
        return [(hp, lp) for hps, lps in zip(wrapper.fp32_groups, wrapper.fp16_groups) for hp, lp in zip(hps, lps)]
    if isinstance(wrapper, FP16_Optimizer):  # one flat master per group; the model views the flat bit16 buffer
        return list(zip(wrapper.fp32_groups_flat, wrapper.fp16_groups_flat))
    return None


@torch.no_grad()
def undo_build_step(engine: Any) -> bool:
    """Reset the fp32 masters and the optimizer state of ``engine`` (a ``deepspeed.initialize``
    result) to what they were before the wrapper's constructor stepped. Call right after building
    the engine, before any training step. Returns True when there was such a step to undo."""
    wrapper = engine.optimizer
    pairs = _master_pairs(wrapper)
    if pairs is None:
        return False
    undecayed = {id(t) for g in wrapper.optimizer.param_groups if not g.get("weight_decay") for t in g["params"]}
    for master, weight in pairs:
        # Zero gradients move a master only through weight decay: an undecayed one still equals
        # its weight, unless this DeepSpeed builds the masters some other way than assumed here.
        if id(master) in undecayed and not torch.equal(master, weight.float()):
            raise RuntimeError(f"{type(wrapper).__name__}: an fp32 master differs from its model weight right "
                               f"after the engine was built; cannot undo the build-time optimizer step")
        master.copy_(weight.float())
    wrapper.optimizer.state.clear()  # no moments, no step count: the next step is step 1
    return True
