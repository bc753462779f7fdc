"""Rank functions for tests/test_train_recompute_tp.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations

import dataclasses

MODES = (("none", None), ("selective", None), ("full", None))


def _measure(cfg, sp: bool, idx, targets) -> int:
    """Bytes autograd saves on this rank over one forward (with the loss) of tp_tinygpt(cfg)."""
    import torch

    from course_lib.measure import saved_activation_bytes
    from course_lib.model import TinyGPT
    from course_lib.parallel.tensor_parallel import tp_tinygpt

    torch.manual_seed(0)
    model = tp_tinygpt(TinyGPT(cfg), sequence_parallel=sp).train()
    model.check_targets = False  # as the trainer: no host read inside the measured forward
    return saved_activation_bytes(model, idx, targets).total_bytes


def saved_bytes_census(rank, world_size, configs, batch, seq_len):
    """For each ``(kind, cfg)`` (a dense ModelConfig, n_layers ignored), SP off and on, and each
    recompute mode: this rank's saved bytes over one forward of the TP model with 1 and 2 blocks
    (their difference is one block, whatever the embedding and the vocab-parallel loss keep), and
    with 3 blocks under checkpoint_every = 2 and without recomputation (blocks 0 and 2 checkpointed
    whole, block 1 not). Same token ids on every rank (TP splits the model, not the batch)."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = {}
    for kind, base in configs:
        idx = torch.randint(0, base.vocab_size, (batch, seq_len), generator=g)
        targets = torch.randint(0, base.vocab_size, (batch, seq_len), generator=g)
        for sp in (False, True):
            for mode, every in MODES:
                totals = [_measure(dataclasses.replace(base, n_layers=n, checkpointing=mode, checkpoint_every=every),
                                   sp, idx, targets) for n in (1, 2)]
                out[(kind, sp, mode)] = {"one_block": totals[1] - totals[0], "total_1": totals[0]}
            every2 = dataclasses.replace(base, n_layers=3, checkpointing="selective", checkpoint_every=2)
            plain = dataclasses.replace(base, n_layers=3, checkpointing="none")
            out[(kind, sp, "every2")] = {"saved": _measure(every2, sp, idx, targets),
                                         "none": _measure(plain, sp, idx, targets)}
    return out
