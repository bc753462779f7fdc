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


def _stage_census(strategy, cfg) -> dict:
    """This rank's saved bytes over one forward of the part the trainer runs here (the TP model,
    or its TP pipeline stage), one micro-batch, with the run's recomputation and without it."""
    import torch

    from course_lib.measure import saved_activation_bytes

    model = strategy.model
    tp_model = getattr(model, "_tp", model)
    m, mb, T = cfg["model"], cfg["train"]["micro_batch"], cfg["data"]["seq_len"]
    g = torch.Generator().manual_seed(2)  # the same tensors on every rank of a tp group
    idx = torch.randint(0, cfg["data"]["vocab_size"], (mb, T), generator=g)
    targets = torch.randint(0, cfg["data"]["vocab_size"], (mb, T), generator=g)
    split = tp_model.tp if tp_model.sequence_parallel else 1
    hidden = torch.randn(mb, T // split, tp_model.cfg.d_model, generator=g)
    staged = hasattr(model, "block_ids")

    def once() -> int:
        if not staged:
            return saved_activation_bytes(model, idx, targets).total_bytes
        x = idx if model.is_first else hidden.clone().requires_grad_()
        return saved_activation_bytes(model, x, targets if model.is_last else None).total_bytes

    # Offloading is off for the census: save_on_cpu's own hooks would hide the tensors from it.
    tp_model.set_memory_strategy(m.get("checkpointing", "none"), m.get("checkpoint_every"), False)
    with_recompute = once()
    tp_model.set_memory_strategy("none", None, False)
    without = once()
    tp_model.set_memory_strategy(m.get("checkpointing", "none"), m.get("checkpoint_every"),
                                 m.get("offload_activations", False))
    blocks = model.block_ids if staged else list(range(len(tp_model.blocks)))
    return {"with": with_recompute, "without": without, "blocks": blocks}


def train_measure_resume(rank, world_size, runs):
    """Every fresh run ``(cfg, out)`` into ``out/full`` with, after it, the census of
    :func:`_stage_census` on the trained model (is recomputation really on where it should be);
    then every resume of ``out/cut`` (``out/full`` without its newest checkpoint), in one launch
    (model_parallel_rank_fns; starting 4 ranks and each process's first train() are the slow part).
    Returns ``{"first": [...], "second": [...]}``, model_parallel_rank_fns.weights_entry's reports,
    the first with ``"census"`` and ``"reads"`` (the fresh run's host reads per step,
    model_parallel_rank_fns.train_counting_reads)."""
    import model_parallel_rank_fns as fns

    first = []
    for cfg, out in runs:
        result, reads = fns.train_counting_reads(cfg, out + "/full")
        first.append({**fns.weights_entry(rank, result), "census": _stage_census(result.strategy, cfg),
                      "reads": reads})
    return {"first": first, "second": fns.resume_each(rank, runs)}
