"""Rank functions for tests/test_train_zero_model_parallel.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def census(rank, world_size, cfg):
    """One optimizer step of the model-parallel strategy built from ``cfg`` (its train.strategy is
    the dp dimension), outside the trainer so the gradients still exist; returns this rank's
    mesh coordinates, measured model-state bytes and the stage's block count."""
    import torch

    from course_lib.trainer import config as train_config
    from course_lib.model import TinyGPT
    from course_lib.parallel.ranks.launch import DistInfo
    from course_lib.parallel.memory_census import model_state_bytes_on_rank
    from course_lib.parallel.registry import make_strategy
    from course_lib.precision import make_policy

    cpu = torch.device("cpu")
    strategy = make_strategy(cfg["train"]["strategy"], DistInfo(rank, world_size, rank, cpu, "gloo"), cpu, cfg)
    mcfg = train_config.build_model_config(cfg)
    torch.manual_seed(0)
    model = TinyGPT(mcfg)
    strategy.setup(model, lambda m: torch.optim.AdamW(m.param_groups(0.1), lr=1e-3))
    g = torch.Generator().manual_seed(1)  # every rank the same tokens (TP peers must agree)
    T = cfg["data"]["seq_len"]
    batches = [(torch.randint(0, mcfg.vocab_size, (2, T), generator=g),
                torch.randint(0, mcfg.vocab_size, (2, T), generator=g)) for _ in range(2)]
    policy = make_policy("fp32", cpu)
    strategy.forward_backward(batches, autocast=policy.autocast, on_loss=lambda x: x, backward=policy.backward)
    strategy.optimizer_step(policy, found_inf=False)
    c = model_state_bytes_on_rank(None, strategy.optimizer, params=strategy.dp.census_params())
    stage = strategy.model
    return {"coords": strategy.mesh.coords, "census": c.to_dict(),
            "local_elements": sum(p.numel() for p in strategy.model.parameters()),
            "blocks": len(getattr(stage, "block_ids", range(mcfg.n_layers)))}


def train_census_faults_resume(rank, world_size, runs, census_cfgs, faulty):
    """One launch (starting 4 ranks and each process's first train() are the slow part): the
    trainer runs ``(cfg, out)`` into ``out/full``, each census, the runs with injected faults
    (``faulty``: model_parallel_rank_fns.train_many's ``(cfg, out, resume, faults)``), then each
    resume of ``out/cut`` (``out/full`` without its newest checkpoint). The fresh runs count the
    host reads per step on the way (model_parallel_rank_fns.train_counting_reads)."""
    import model_parallel_rank_fns as mp

    first, reads = [], []
    for cfg, out in runs:
        result, per_step = mp.train_counting_reads(cfg, out + "/full")
        first.append(mp.weights_entry(rank, result))
        reads.append(per_step)
    census_out = [census(rank, world_size, c) for c in census_cfgs]
    faults_out = mp.train_many(rank, world_size, faulty)
    return {"runs": first, "census": census_out, "faults": faults_out, "second": mp.resume_each(rank, runs),
            "host_reads": reads}
