"""Rank functions for tests/test_train_expert_parallel.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def state_numel(optimizer) -> dict | None:
    """Under zero1/zero2 with ep (ExpertShardedOptimizer): this rank's optimizer-state elements
    (tensors, not step counters) of the dense part and of the expert part, and the elements of the
    dense weights and of the expert slices it holds. None for the other strategies."""
    from course_lib.parallel.expert_parallel.zero_in_trainer import ExpertShardedOptimizer

    if not isinstance(optimizer, ExpertShardedOptimizer):
        return None
    held = lambda part: sum(v.numel() for st in part.state.values() for v in st.values()  # noqa: E731
                            if hasattr(v, "dim") and v.dim() > 0)
    params = lambda part: sum(p.numel() for g in part.param_groups for p in g["params"])  # noqa: E731
    return {"dense": held(optimizer.dense), "expert": held(optimizer.experts), "all": held(optimizer),
            "dense_params": params(optimizer.dense), "expert_params": params(optimizer.experts)}


_NORMS: list[dict] = []  # per-tensor gradient norms of each step since the last entry()


def record_grad_norms() -> None:
    """From now on in this process, keep the per-tensor gradient norms the trainer's stabilizer
    measures each step (GradientMonitor.measure's ``param_norms``: whole tensors, e.g. an expert
    stack's over every expert) for the MoE layers' tensors (names with ``mlp.``); entry() hands them
    over. The losses and the total norm barely see a wrong expert gradient (AdamW is nearly
    scale-free and the experts are a small share of the norm); these norms see it directly."""
    from course_lib.stability.grad_monitor import GradientMonitor

    if getattr(GradientMonitor.measure, "records", False):
        return
    measure = GradientMonitor.measure

    def recording(self, *args, **kwargs):
        stats = measure(self, *args, **kwargs)
        _NORMS.append({k: v for k, v in stats.param_norms.items() if ".mlp." in k and "[" not in k})
        return stats

    recording.records = True
    GradientMonitor.measure = recording


def take_grad_norms() -> list[dict]:
    """The per-step norms recorded since the last call (see :func:`record_grad_norms`)."""
    out = list(_NORMS)
    _NORMS.clear()
    return out


def entry(rank, result) -> dict:
    """model_parallel_rank_fns.weights_entry (the gathered one-process weights on rank 0) plus every
    rank's expert biases (the bias update must leave them equal everywhere) and its optimizer-state
    counts (:func:`state_numel`)."""
    from course_lib.model.moe import moe_layers
    from model_parallel_rank_fns import weights_entry

    return {**weights_entry(rank, result),
            "bias": [m.router.expert_bias.detach().clone() for m in moe_layers(result.model)],
            # the rank's last micro-batch, per MoE layer: pairs dropped over capacity, tokens per expert
            "dropped": [int(m.last_dropped) for m in moe_layers(result.model)],
            "load": [m.last_load.tolist() for m in moe_layers(result.model)],
            "state_numel": state_numel(result.strategy.optimizer), "grad_norms": take_grad_norms(),
            # per MoE layer (none at ep 1): local experts that received no rows, summed over the forwards
            "idle": [d.idle_experts for d in getattr(result.strategy, "dispatchers", [])],
            # the trainer's dispatchers record no exchanges (a record each would grow for the whole run)
            "logs": [d.log for d in getattr(result.strategy, "dispatchers", [])]}


def train_and_cross_resume(rank, world_size, runs, crosses, resume=True):
    """Every fresh run of ``runs`` (each ``(cfg, out_dir)``, trained into ``out_dir/full``) and, with
    ``resume`` (True: every run; or the out_dirs to resume), its resume in the same layout (model_parallel_rank_fns.train_then_resume), then each
    ``(cfg, src, dst)`` of ``crosses``: the run folder ``src`` copied to ``dst`` without its newest
    checkpoint and resumed there under ``cfg`` (another EP size), in one launch."""
    import model_parallel_rank_fns as fns
    from course_lib.train import train

    record_grad_norms()
    again = [o for _, o in runs] if resume is True else list(resume or ())  # the out_dirs resumed
    resumed = fns.train_then_resume(rank, world_size, [r for r in runs if r[1] in again], entry=entry)
    first, second = iter(resumed["first"]), iter(resumed["second"])
    out = {"first": [], "second": []}
    for cfg, o in runs:  # in the order of runs; second: None for a run not resumed
        if o in again:
            out["first"].append(next(first))
            out["second"].append(next(second))
        else:
            out["first"].append(entry(rank, train(cfg, o + "/full")))
            out["second"].append(None)
    out["cross"] = []
    for cfg, src, dst in crosses:
        fns.copy_without_newest(src, dst)
        out["cross"].append(entry(rank, train(cfg, dst, resume=True)))
    return out
