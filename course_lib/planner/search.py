"""Search tp x pp x dp x cp, ZeRO stage, recomputation and micro-batch; keep what fits; rank.

Rules a layout must follow (each one a reason real frameworks refuse the alternative):

* tp divides the attention heads, the KV heads and the MLP width, and stays inside a node
  (tp <= gpus per node): TP talks four times per layer per micro-batch, NVLink-only traffic;
* tp x cp <= gpus per node (context parallelism's ring also stays on NVLink);
* pp divides gpus / (tp cp) and is at most the layers; stages are equal where pp divides the
  layers, otherwise (and also when it is faster) balanced: the end stages hold fewer blocks for the
  embedding and the head (``stages.balanced_counts``). cp divides the sequence;
* interleaved 1F1B: v in 2..8 virtual stages per rank when pp x v <= layers and the
  micro-batches per step are a multiple of pp (Megatron-LM's condition);
* dp = gpus / (tp pp cp), and the global batch (sequences) is a multiple of dp x micro_batch;
* pipeline parallelism composes with ZeRO-0/1 only (Megatron's distributed optimizer and
  DeepSpeed's pipeline engine shard optimizer state, not gradients or weights, across pipelines).
* mixture-of-experts models add expert parallelism: ep divides the experts, etp is tp or 1
  (what Megatron-Core and torchtitan 0.2.0 build), and ep x etp divides tp x cp x dp - the expert
  layers fold onto the same ranks (Parallel Folding; Megatron's validate_args); the rest of those
  ranks are expert-data-parallel. torchtitan also asks ep to be a multiple of cp (etp = tp) or of
  tp x cp (etp = 1), which the search requires too, so one plan suits both engines.

Ranking: modelled step time (see costs.py); ties (within 0.5%) go to the simpler layout (fewer
model-parallel ranks), then the larger micro-batch (bigger matmuls, fewer launches), then the lower
ZeRO stage (less traffic to go wrong), then less memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.estimate import format_bytes, format_seconds
from course_lib.planner.costs import RECOMPUTE, Candidate, Layout, job_cache, cached, evaluate, layout_memory
from course_lib.estimate.stage_split import even_blocks
from course_lib.planner.spec import CONTEXT_PARALLEL, JobSpec
from course_lib.planner.stages import balanced_counts, compact_counts

MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (1, 2, 3, 4, 5, 6, 7, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_sizes(spec: JobSpec) -> list[int]:
    """tp values allowed: divisors of the GPUs per node that divide heads, KV heads and MLP width."""
    sh = spec.shape
    return [t for t in _divisors(spec.gpus_per_node)
            if sh.n_heads % t == 0 and sh.kv_heads % t == 0 and sh.ffn_dim % t == 0]


def stage_splits(spec: JobSpec, pp: int, v: int) -> list[tuple]:
    """Splits searched for pp ranks x v virtual stages: as even as possible (``()``; equal when
    the stages divide the layers) and the balanced split of ``stage_split`` when it differs (the
    end stages carry the embedding and the head)."""
    return list(cached(job_cache(spec), ("splits", pp, v), lambda: _stage_splits(spec, pp, v)))


def _stage_splits(spec: JobSpec, pp: int, v: int) -> tuple:
    sh = spec.shape
    stages = pp * v
    if stages == 1:
        return ((),)
    balanced = balanced_counts(sh, stages, spec.seq)
    even = tuple(even_blocks(sh.n_layers, stages))
    if sh.n_layers % stages:
        return (balanced,)  # no equal split: the balanced one (the even one overloads a stage)
    return ((),) if balanced == even else ((), balanced)


def pipeline_sizes(spec: JobSpec, tp: int, cp: int) -> list[int]:
    """pp values: every divisor of gpus / (tp cp) up to the number of layers (stages need not be
    equal: a pp that does not divide the layers gets the balanced split)."""
    if spec.gpus % (tp * cp):
        return []
    return [p for p in _divisors(spec.gpus // (tp * cp)) if p <= spec.shape.n_layers]


def layouts(spec: JobSpec, *, recomputes=RECOMPUTE, micro_batches=MICRO_BATCHES,
            context_parallel=CONTEXT_PARALLEL, virtual_stages=VIRTUAL_STAGES) -> list[Layout]:
    """Every layout the rules above allow for ``spec`` (before any memory check)."""
    sh, gpn, out = spec.shape, spec.gpus_per_node, []
    for tp in tensor_parallel_sizes(spec):
        for cp in context_parallel:
            if tp * cp > gpn or spec.seq % cp:
                continue
            for pp in pipeline_sizes(spec, tp, cp):
                dp = spec.gpus // (tp * cp * pp)
                for mb in micro_batches:
                    if spec.global_batch % (dp * mb):
                        continue
                    m = spec.global_batch // (dp * mb)
                    for v in virtual_stages:
                        # interleaving needs a pipeline, a block per stage, and (Megatron) m a multiple of pp
                        if v > 1 and (pp == 1 or pp * v > sh.n_layers or m % pp):
                            continue
                        for split in stage_splits(spec, pp, v):
                            for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                                if dp * cp == 1 and zero > 0:
                                    continue  # nothing to shard over
                                for rc in recomputes:
                                    for ep, etp in expert_parallel_sizes(spec, tp, cp, dp):
                                        out.append(Layout(tp, pp, dp, cp, zero, rc, mb, m, v, split, ep, etp))
    return out


def expert_parallel_sizes(spec: JobSpec, tp: int, cp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs for a MoE job on a tp x cp x dp replica (see the module's rules); [(1, 1)]
    for a dense model."""
    moe = spec.moe
    if moe is None:
        return [(1, 1)]
    out = []
    for etp in sorted({1, tp}):
        if etp > 1 and moe.expert_d_ff % etp:
            continue
        for ep in _divisors(moe.n_experts):
            if (tp * cp * dp) % (ep * etp):
                continue
            if ep % (cp if etp == tp else tp * cp):  # torchtitan's ParallelDims
                continue
            out.append((ep, etp))
    return out


def _rank_key(c: Candidate):
    lay = c.layout
    return (round(c.step_s, 6), lay.tp * lay.pp * lay.cp, lay.virtual_stages, -lay.micro_batch, lay.zero_stage,
            lay.ep, c.memory_total)


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Sort fitting candidates: fastest first, near-ties (0.5%) broken by simplicity (see module)."""
    if not cands:
        return []
    ordered = sorted(cands, key=lambda c: c.step_s)
    # Bucket step times so that layouts within 0.5% of each other compare by the tie-breakers.
    best = ordered[0].step_s
    return sorted(cands, key=lambda c: (int((c.step_s / best - 1) / 0.005),) + _rank_key(c)[1:])


def distinct(cands: list[Candidate], n: int) -> list[Candidate]:
    """The first ``n`` candidates with different (tp, pp, cp, ZeRO, recompute, virtual stages,
    split): one row per idea."""
    seen, out = set(), []
    for c in cands:
        key = _idea(c.layout)
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == n:
            break
    return out


def _idea(lay: Layout) -> tuple:
    """What makes two layouts different ideas (the table's rows): all but micro-batch and dp."""
    return (lay.tp, lay.pp, lay.cp, lay.zero_stage, lay.recompute, lay.virtual_stages, lay.split, lay.ep, lay.etp)


_TERMS = {"compute": "compute", "recompute": "recomputation", "tp": "TP traffic", "cp": "CP ring traffic",
          "ep": "expert all-to-all",
          "pp": "pipeline sends", "bubble": "pipeline bubble", "dp_exposed": "exposed DP/ZeRO traffic"}


def why_lost(c: Candidate, best: Candidate) -> str:
    """One line: the step-time term that costs ``c`` most against ``best``, with its numbers."""
    if c is best:
        return "best: fastest modelled step that fits"
    deltas = {k: c.time[k] - best.time[k] for k in ("recompute", "tp", "cp", "pp", "bubble", "dp_exposed")}
    # compute beyond recomputation differs only by the busiest pipeline stage's extra load
    deltas["stages"] = (c.time["compute"] - c.time["recompute"]) - (best.time["compute"] - best.time["recompute"])
    term = max(deltas, key=deltas.get)
    lay, slower = c.layout, c.step_s / best.step_s - 1
    if abs(slower) < 0.005 or deltas[term] <= 0.001 * best.step_s:
        return f"within 0.5% of the best ({slower:+.1%}): a tie, lost on {_tie_breaker(c, best)}"
    detail = {
        "recompute": f"{lay.recompute} recomputation adds {format_seconds(c.time['recompute'])} of forward work",
        "tp": f"tp={lay.tp}: {format_seconds(c.time['tp'])} of activation all-reduces per step",
        "cp": f"cp={lay.cp}: {format_seconds(c.time['cp'])} of K/V ring traffic per step",
        "pp": f"pp={lay.pp}: {format_seconds(c.time['pp'])} of stage-to-stage sends ({c.links['pp']})",
        "bubble": (f"pp={lay.pp}" + (f" x {lay.virtual_stages} virtual stages" if lay.virtual_stages > 1 else "")
                   + f" with {lay.grad_accum} micro-batches idles {c.time['bubble_fraction']:.1%}"),
        "stages": (f"pp={lay.pp} blocks {compact_counts(c.stage_blocks)}: the busiest stage "
                   f"computes {c.time['stage_imbalance'] - 1:.1%} more than the mean, the others wait for it"),
        "dp_exposed": (f"{lay.sharding} over {lay.dp * lay.cp} ranks ({c.links['dp']}): "
                       f"{format_seconds(c.time['dp_total'], 1)} of traffic, "
                       f"{format_seconds(c.time['dp_exposed'], 1)} not hidden"),
    }[term]
    return f"{slower:+.1%} slower: {detail}"


def _tie_breaker(c: Candidate, best: Candidate) -> str:
    a, b = c.layout, best.layout
    if a.tp * a.pp * a.cp != b.tp * b.pp * b.cp:
        return f"simplicity ({a.tp * a.pp * a.cp} vs {b.tp * b.pp * b.cp} model-parallel ranks per replica)"
    if a.virtual_stages != b.virtual_stages:
        return f"simplicity ({a.virtual_stages} vs {b.virtual_stages} virtual stages per pipeline rank)"
    if a.micro_batch != b.micro_batch:
        return f"micro-batch size ({a.micro_batch} vs {b.micro_batch}: bigger matmuls run closer to peak)"
    if a.zero_stage != b.zero_stage:
        return f"ZeRO stage ({a.zero_stage} vs {b.zero_stage}: less traffic, fewer moving parts)"
    return f"memory ({format_bytes(c.memory_total, 'auto')} vs {format_bytes(best.memory_total, 'auto')} per GPU)"


def why_not_fit(c: Candidate) -> str:
    """One line: how far over the usable memory ``c`` is and which component dominates."""
    m = c.memory
    parts = {k: m[k] for k in ("params", "grads", "optimizer", "activations", "transient")}
    top = max(parts, key=parts.get)
    return (f"does not fit: {format_bytes(c.memory_total, 'auto')} > {format_bytes(c.usable_bytes, 'auto')} usable; "
            f"{top} {parts[top] / c.memory_total:.0%} of it")


@dataclass
class Plan:
    """The search's result: ranked fitting candidates (best first), and what was refused."""

    spec: JobSpec
    ranked: list = field(default_factory=list)        # fitting candidates, best first
    n_layouts: int = 0
    closest_misses: list = field(default_factory=list)  # smallest-memory layouts that do not fit
    advice: list = field(default_factory=list)          # when nothing fits: what would

    @property
    def best(self) -> Candidate | None:
        """The winning candidate, or None when nothing fits."""
        return self.ranked[0] if self.ranked else None

    def runners_up(self, n: int = 5) -> list[Candidate]:
        """The best and up to n-1 runners-up with different layouts."""
        return distinct(self.ranked, n)


# Context parallelism is a long-context tool. Its costs beyond the K/V ring (attention cut into
# per-rank chunks with a causal load imbalance, smaller kernels) are not in the step-time model,
# so below this length it would win on paper only; it is used there only when nothing else fits.
CP_MIN_SEQ = 8192


def search(spec: JobSpec) -> Plan:
    """Evaluate every allowed layout, keep those that fit, rank them (see module docstring).
    Context parallelism is searched from ``CP_MIN_SEQ`` tokens, or when no layout without it fits.

    A layout whose memory (``layout_memory``, cheap: its pieces are shared between layouts) is
    over the usable bytes cannot fit, so its step time is modelled only if it becomes one of the
    closest misses the plan shows; the others get the full ``evaluate``. The answer is the one
    evaluating every layout gives."""
    fitting, misses = [], []  # misses: (peak bytes, layout, Candidate or None), in search order

    def scan(lays):
        for lay in lays:
            peak = layout_memory(spec, lay)["peak"]
            if peak > spec.usable_bytes:
                misses.append((peak, lay, None))
                continue
            c = evaluate(spec, lay)
            if c.fits:
                fitting.append(c)
            else:
                misses.append((c.memory_total, lay, c))

    lays = layouts(spec, context_parallel=(1,))
    scan(lays)
    n = len(lays)
    if spec.seq >= CP_MIN_SEQ or not fitting:
        lays = layouts(spec, context_parallel=CONTEXT_PARALLEL[1:])
        scan(lays)
        n += len(lays)
    misses.sort(key=lambda x: x[0])  # stable: ties keep the search order
    closest, seen = [], set()
    for _, lay, c in misses:
        if _idea(lay) not in seen:
            seen.add(_idea(lay))
            closest.append(c if c is not None else evaluate(spec, lay))
            if len(closest) == 3:
                break
    plan = Plan(spec, rank(fitting), n, closest)
    if not fitting:
        plan.advice = what_would_fit(spec)
    return plan


def _min_memory(spec: JobSpec) -> Candidate | None:
    """The leanest layout (full recomputation, micro-batch 1, no interleaving), evaluated."""
    lays = layouts(spec, recomputes=("full",), micro_batches=(1,), virtual_stages=(1,))
    if not lays:
        return None
    return evaluate(spec, min(lays, key=lambda lay: layout_memory(spec, lay)["peak"]))


def what_would_fit(spec: JobSpec) -> list[str]:
    """Plain-language options when no layout fits: more GPUs (how many), offload, shorter sequences."""
    import dataclasses

    advice = []
    # Every node count up to 64 more, then doubling (a first answer for huge jobs), to 4096 nodes.
    counts = list(range(spec.nodes + 1, spec.nodes + 65))
    while counts[-1] * 2 <= 4096:
        counts.append(counts[-1] * 2)
    for nodes in counts:
        bigger = dataclasses.replace(spec, gpus=nodes * spec.gpus_per_node)
        c = _min_memory(bigger)
        if c is not None and c.fits:
            advice.append(f"more GPUs: {bigger.gpus} ({nodes} nodes of {spec.gpus_per_node}) fit with "
                          f"{c.layout.label()} at {format_bytes(c.memory_total)} per GPU")
            break
    else:
        advice.append(f"more GPUs: nothing up to {counts[-1]} nodes fits this batch and sequence")
    c = _min_memory(spec)
    if c is not None:
        freed = c.memory["optimizer"]  # ZeRO-Offload: fp32 master weights and Adam moments live on the CPU
        left = c.memory_total - freed
        verdict = "would fit" if left <= spec.usable_bytes else "still would not fit"
        advice.append(f"offload: the leanest layout ({c.layout.label()}) needs {format_bytes(c.memory_total)}; "
                      f"moving its optimizer state to CPU (ZeRO-Offload, parallel.offload_optimizer = 'cpu') "
                      f"leaves {format_bytes(left)}: {verdict} (and the step then waits on PCIe and CPU Adam)")
    seq = spec.seq // 2
    while seq >= 128:
        shorter = dataclasses.replace(spec, seq=seq, global_batch=max(1, spec.global_batch_tokens // seq))
        c = _min_memory(shorter)
        if c is not None and c.fits:
            advice.append(f"shorter sequences: --seq {seq} fits ({c.layout.label()}, "
                          f"{format_bytes(c.memory_total)} per GPU)")
            break
        seq //= 2
    return advice
