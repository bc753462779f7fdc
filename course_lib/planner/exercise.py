"""Exercise 12 (parallelism selection): judge a learner's layout in words, against the planner.

A layout is a plain dict: ``tp``, ``pp``, ``dp``, ``zero_stage``, ``recompute``, ``micro_batch``,
optionally ``cp`` (default 1) and ``why`` (a one-line justification). :func:`review` says whether it
follows the rules, whether it fits, and how its modelled step time compares with the planner's best;
:func:`check_layout` turns a bad review into a :class:`~course_lib.kit.checks.CheckFailed` that explains
what is wrong ("tp=16 crosses the node boundary ...", "does not fit: 93 GiB > 72 GiB usable; the
optimizer states are 60% of it - try ZeRO-3"). :func:`check_chooser` grades a learner's
``choose_layout(spec)`` on several jobs with the planner's own search switched off.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager

from course_lib.kit.checks import CheckFailed
from course_lib.planner.costs import RECOMPUTE, Candidate, Layout, evaluate
from course_lib.planner.search import why_lost
from course_lib.planner.spec import JobSpec, make_spec

# The module, not the function `course_lib.planner.search` re-exported by the package.
search_module = importlib.import_module("course_lib.planner.search")

GIB = 2**30

#: The three jobs lab 13 plans (make_spec keywords).
SCENARIOS = {
    "7b-one-node": dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T"),
    "70b-8-nodes": dict(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens="2T"),
    "7b-8k-context": dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T", seq=8192),
}

_KEYS = ("tp", "pp", "dp", "zero_stage", "recompute", "micro_batch")


#: Exercise 12's three jobs: cousins of the lab's, not the same ones (the lab prints its answers).
EXERCISE_JOBS = {
    "13b-one-node": dict(model="llama2-13b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T"),
    "70b-16-nodes-h100": dict(model="llama2-70b", gpu="h100", gpus=128, gpus_per_node=8, tokens="2T"),
    "7b-16k-context": dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T", seq=16384),
}


def scenario(name: str) -> JobSpec:
    """The JobSpec of one of SCENARIOS (lab 13) or EXERCISE_JOBS (exercise 12) by name."""
    jobs = {**SCENARIOS, **EXERCISE_JOBS}
    if name not in jobs:
        raise ValueError(f"scenario must be one of {', '.join(jobs)}; got {name!r}")
    return make_spec(**jobs[name])


def problems(spec: JobSpec, choice: dict) -> list[str]:
    """Every rule ``choice`` breaks for ``spec``, one sentence each (empty when it is a legal layout)."""
    if choice is None:
        return [f"no layout yet: write a dict with keys {', '.join(_KEYS)} (optional cp) and why"]
    if not isinstance(choice, dict):
        return [f"a layout is a dict with keys {', '.join(_KEYS)}; got {type(choice).__name__}"]
    missing = [k for k in _KEYS if k not in choice]
    if missing:
        return [f"the layout is missing {', '.join(missing)} (keys: {', '.join(_KEYS)}, optional cp and why)"]
    out = []
    ints = {k: choice[k] for k in ("tp", "pp", "dp", "zero_stage", "micro_batch")} | {"cp": choice.get("cp", 1)}
    for k, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "zero_stage" else 1):
            out.append(f"{k} must be a whole number >= {0 if k == 'zero_stage' else 1}, got {v!r}")
    if out:
        return out
    tp, pp, dp, cp, z, mb = (ints[k] for k in ("tp", "pp", "dp", "cp", "zero_stage", "micro_batch"))
    sh, gpn = spec.shape, spec.gpus_per_node
    if choice["recompute"] not in RECOMPUTE:
        out.append(f"recompute must be one of {', '.join(RECOMPUTE)}; got {choice['recompute']!r}")
    if z > 3:
        out.append(f"zero_stage must be 0, 1, 2 or 3; got {z}")
    if tp * pp * dp * cp != spec.gpus:
        out.append(f"tp x pp x dp x cp = {tp} x {pp} x {dp} x {cp} = {tp * pp * dp * cp}, but the job has "
                   f"{spec.gpus} GPUs: every GPU must hold exactly one rank")
    if tp > gpn:
        out.append(f"tp={tp} crosses the node boundary: tensor parallelism all-reduces activations 4 times per "
                   f"layer per micro-batch, and with {gpn} GPUs per node {tp} ranks put that traffic on the "
                   f"network ({spec.inter_node_bytes_per_s / 1e9:g} GB/s per GPU instead of "
                   f"{spec.intra_node_bytes_per_s / 1e9:g} GB/s NVLink); keep tp <= {gpn}")
    if sh.n_heads % tp or sh.kv_heads % tp or sh.ffn_dim % tp:
        out.append(f"tp={tp} must divide the {sh.n_heads} attention heads, the {sh.kv_heads} KV heads and the "
                   f"MLP width {sh.ffn_dim}: each rank holds whole heads")
    if sh.n_layers % pp:
        out.append(f"pp={pp} must divide the {sh.n_layers} layers (equal stages)")
    if spec.seq % cp:
        out.append(f"cp={cp} must divide the sequence length {spec.seq}")
    if tp <= gpn < tp * cp:
        out.append(f"tp x cp = {tp * cp} > {gpn} GPUs per node: both talk every layer and belong on NVLink")
    if spec.global_batch % (dp * mb):
        out.append(f"the global batch of {spec.global_batch} sequences is not a multiple of dp x micro_batch = "
                   f"{dp} x {mb}: every data-parallel rank must run whole micro-batches")
    if pp > 1 and z > 1:
        out.append(f"pp={pp} with ZeRO-{z}: pipeline engines (Megatron, DeepSpeed) shard only the optimizer "
                   f"state across pipelines (ZeRO-1); use zero_stage 0 or 1 with pp > 1")
    return out


def to_layout(spec: JobSpec, choice: dict) -> Layout:
    """The Layout of a legal ``choice`` (grad_accum = global batch / (dp x micro_batch))."""
    dp, mb = choice["dp"], choice["micro_batch"]
    return Layout(choice["tp"], choice["pp"], dp, choice.get("cp", 1), choice["zero_stage"], choice["recompute"],
                  mb, spec.global_batch // (dp * mb))


def best(spec: JobSpec) -> Candidate:
    """The planner's best candidate for ``spec`` (raises CheckFailed when nothing fits)."""
    plan = search_module.search(spec)
    if plan.best is None:
        raise CheckFailed("nothing fits this job at all; " + "; ".join(plan.advice))
    return plan.best


def _memory_hint(c: Candidate) -> str:
    m, lay = c.memory, c.layout
    parts = {"parameters": m["params"], "gradients": m["grads"], "optimizer states": m["optimizer"],
             "activations": m["activations"], "output-layer transients": m["transient"]}
    top = max(parts, key=parts.get)
    share = parts[top] / c.memory_total
    if top in ("optimizer states", "gradients", "parameters"):
        fix = (f"try ZeRO-{min(3, lay.zero_stage + 1)} (shards them over the {lay.dp * lay.cp} data-parallel "
               f"ranks)" if lay.zero_stage < 3 and lay.pp == 1 and lay.dp * lay.cp > 1 else
               "split the model further (tp within a node, or pp)")
    elif top == "activations":
        fix = ("recompute (selective drops the attention scores, full keeps only each layer's input), a smaller "
               "micro-batch, tp with sequence parallelism, or cp")
    else:
        fix = "a smaller micro-batch, or tp (it splits the logits over the vocabulary)"
    return f"the {top} are {share:.0%} of it - {fix}"


def _costliest_term(c: Candidate, top: Candidate) -> str:
    """What costs ``c`` most against the best, in terms of ``c``'s own layout only (why_lost's tie
    breaker would compare with the best's micro-batch or ZeRO stage, i.e. name the answer)."""
    text = why_lost(c, top)
    if text.startswith("within 0.5%"):
        return "about as fast as the best; a smaller or simpler layout may still win"
    return "the term that costs it most: " + text.split(": ", 1)[1]


def review(spec: JobSpec, choice: dict) -> dict:
    """Everything a learner should know about ``choice``: rules broken, memory, step time vs best."""
    rules = problems(spec, choice)
    row = {"layout": choice if isinstance(choice, dict) else None, "problems": rules, "fits": False,
           "memory_gib": None, "usable_gib": spec.usable_bytes / GIB, "step_s": None, "best_step_s": None,
           "vs_best": None, "verdict": ""}
    if rules:
        row["verdict"] = "; ".join(rules)
        return row
    c = evaluate(spec, to_layout(spec, choice))
    top = best(spec)
    # The best layout's label stays out of the row and the verdict: the exercise asks the learner
    # to find it, so the judge says what is wrong and how far off, never what the answer is.
    row.update(fits=c.fits, memory_gib=c.memory_total / GIB, step_s=c.step_s, best_step_s=top.step_s,
               vs_best=c.step_s / top.step_s - 1, label=c.layout.label())
    if not c.fits:
        row["verdict"] = (f"does not fit: {c.memory_total / GIB:.1f} GiB > {spec.usable_bytes / GIB:.1f} GiB usable; "
                          + _memory_hint(c))
    elif c.step_s > top.step_s * 1.005:
        row["verdict"] = (f"fits ({c.memory_total / GIB:.1f} GiB), modelled step {c.step_s:.1f} s vs the best "
                          f"layout's {top.step_s:.1f} s ({row['vs_best']:+.1%}): {_costliest_term(c, top)}")
    else:
        row["verdict"] = f"fits ({c.memory_total / GIB:.1f} GiB) and is as fast as the planner's best"
    return row


def check_layout(spec: JobSpec, choice: dict, *, tolerance: float = 0.10, name: str = "",
                 require_why: bool = True) -> dict:
    """CheckFailed, in words, unless ``choice`` is legal, fits, is justified (``require_why``), and is
    within ``tolerance`` (a fraction) of the planner's best modelled step time. Returns the review."""
    where = f"{name}: " if name else ""
    row = review(spec, choice)
    if row["problems"]:
        raise CheckFailed(where + row["verdict"])
    if not row["fits"]:
        raise CheckFailed(where + row["verdict"])
    if row["vs_best"] > tolerance:
        raise CheckFailed(f"{where}{row['verdict']} - more than {tolerance:.0%} slower than the best")
    why = choice.get("why", "")
    if require_why and (not isinstance(why, str) or len(why.split()) < 4):
        raise CheckFailed(f"{where}write a one-line justification in 'why' (a sentence of a few words: "
                          f"what limits this job and how the layout answers it)")
    return row


@contextmanager
def planner_switched_off():
    """Inside: the planner's search raises, so a chooser must do its own work."""
    original = search_module.search

    def refuse(*_a, **_k):
        raise CheckFailed("choose_layout must search by itself: the planner's search() is switched off "
                          "during this check (evaluate() and the helpers in course_lib.planner.exercise are allowed)")

    package = importlib.import_module("course_lib.planner")  # `plan()` there calls its own `search` name
    package_search = package.search
    search_module.search = package.search = refuse
    try:
        yield
    finally:
        search_module.search, package.search = original, package_search


def check_chooser(choose_layout, specs: dict, *, tolerance: float = 0.15) -> list[dict]:
    """Run ``choose_layout(spec) -> dict`` on each named spec (planner switched off), then check
    each result with :func:`check_layout` (``why`` not required). Returns one review per spec."""
    rows = []
    for name, spec in specs.items():
        with planner_switched_off():
            choice = choose_layout(spec)
        if choice is None:
            raise CheckFailed(f"{name}: choose_layout returned None - no layout it tried fits (did it try "
                              f"every ZeRO stage, recompute mode and model-parallel size?)")
        rows.append({"job": name, **check_layout(spec, choice, tolerance=tolerance, name=name, require_why=False)})
    return rows
