"""Rank functions for tests/test_accumulation_memory.py: the model-state census at the moment the
second micro-batch starts its backward, under the trainer's own strategies."""
from __future__ import annotations

import contextlib

import torch

from course_lib.trainer import config as train_config
from course_lib.model import TinyGPT
from course_lib.parallel.ranks.launch import DistInfo
from course_lib.parallel.memory_census import model_state_bytes_on_rank
from course_lib.parallel.registry import make_strategy
from course_lib.precision import make_policy


def census_at_second_micro_batch(rank: int, world_size: int, strategies: list[str]) -> dict:
    """For each strategy: two optimizer steps of 2 micro-batches on TinyGPT (tiny preset, 2 blocks);
    in the second step (AdamW's moments exist), the census of parameters, gradients and moments
    taken when micro-batch 2's loss is handed to backward - the gradients of micro-batch 1 are
    then the live sum. Also the census after the step. Bytes on this rank."""
    out = {}
    for name in strategies:
        cfg = train_config.load(None, [f"train.strategy='{name}'", "model.n_layers=2", "data.seq_len=16",
                                       "data.vocab_size=64"])
        torch.manual_seed(0)
        model = TinyGPT(train_config.build_model_config(cfg))
        info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo" if world_size > 1 else None)
        strategy = make_strategy(name, info, torch.device("cpu"), cfg)
        strategy.setup(model, lambda m: torch.optim.AdamW(m.param_groups(0.1), lr=1e-3))
        policy = make_policy("fp32", "cpu")
        gen = torch.Generator().manual_seed(rank)
        batches = [(x, x) for x in (torch.randint(0, 64, (2, 16), generator=gen) for _ in range(2))]
        seen = {}

        def on_loss(loss, _seen=seen, _s=strategy):
            _seen["n"] = _seen.get("n", 0) + 1
            if _seen["n"] == 4:  # step 2, micro-batch 2: micro-batch 1's gradients are live
                _seen["census"] = model_state_bytes_on_rank(_s.model, _s.optimizer).to_dict()
            return loss

        for _ in range(2):
            strategy.forward_backward(batches, autocast=contextlib.nullcontext, on_loss=on_loss,
                                      backward=lambda loss: loss.backward())
            strategy.optimizer_step(policy)
            after = model_state_bytes_on_rank(strategy.model, strategy.optimizer).to_dict()
            strategy.zero_grad()
        out[name] = {"during": seen["census"], "after_step": after, "num_params": model.num_params()}
    return out
