# %% [markdown]
# # Exercise 12 — Parallelism selection
#
# You are the engineer who has to say what to run. For three jobs you choose a layout: tensor
# parallel size `tp`, pipeline stages `pp`, data-parallel replicas `dp`, optionally context
# parallelism `cp`, a ZeRO stage, activation recomputation and a micro-batch size, with a one-line
# reason. Then you write `choose_layout(spec)`, which does the same for any model and cluster.
#
# Nothing runs on GPUs here: every layout is judged by the same closed-form model the planner
# (`course plan`) uses. Memory per GPU comes from `course_lib.estimate` (ZeRO paper bytes,
# Korthikanti et al. activations); the step time is compute at 50% of peak plus the
# communication that is not hidden, plus the pipeline bubble. The checks tell you, in words,
# whether your layout breaks a rule, whether it fits, and how much slower it is than the
# planner's best.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook (it is fast at any size)

# %%
import course_lib
from course_lib.kit.checks import check
from course_lib.grading import record
from course_lib.estimate import format_bytes
from course_lib.planner import evaluate
from course_lib.planner.exercise import check_chooser, check_layout, problems, review, scenario, to_layout

SMOKE = course_lib.smoke(SMOKE)
JOBS = {name: scenario(name) for name in ("13b-one-node", "70b-16-nodes-h100", "7b-16k-context")}
for name, spec in JOBS.items():
    print(f"{name:14} {spec.model_name} ({spec.shape.num_params() / 1e9:.1f}B): {spec.gpus} x {spec.gpu_name} in "
          f"{spec.nodes} node(s), seq {spec.seq}, global batch {spec.global_batch} sequences, "
          f"usable {format_bytes(spec.usable_bytes)} per GPU")

# %% [markdown]
# ## The rules and the tools
#
# A layout is a dict. The rules every framework enforces:
#
# * `tp * pp * dp * cp` equals the number of GPUs;
# * `tp` divides the attention heads and KV heads and stays **inside a node** (`tp <= 8` here):
#   tensor parallelism all-reduces activations four times per layer per micro-batch;
# * `pp` divides the layers; `cp` divides the sequence; `tp * cp` fits in a node;
# * the global batch is a multiple of `dp * micro_batch` (accumulation makes up the rest);
# * with `pp > 1` only ZeRO-0 or ZeRO-1.
#
# `review(spec, layout)` explains a layout. Here is a first guess for the 13B job, plain data
# parallelism with nothing sharded:

# %%
first_guess = dict(tp=1, pp=1, dp=8, zero_stage=0, recompute="none", micro_batch=1)
print(review(JOBS["13b-one-node"], first_guess)["verdict"])
print(review(JOBS["13b-one-node"], dict(first_guess, tp=16, dp=1))["verdict"])

# %% [markdown]
# What you should see: the first guess does not fit, mostly because of optimizer states; the
# second breaks two rules. `evaluate(spec, to_layout(spec, layout))` gives the numbers behind a
# review: `.memory` (bytes per GPU by component), `.time` (seconds per step by term), `.fits`,
# `.step_s`.

# %%
c = evaluate(JOBS["13b-one-node"], to_layout(JOBS["13b-one-node"], first_guess))
print({k: format_bytes(v) for k, v in c.memory.items() if k != "peak_at"})
print({k: round(v, 2) for k, v in c.time.items()})

# %% [markdown]
# ## Part 1: three jobs, three layouts
#
# Fill in a layout for each job, with `why`: one line saying what limits the job and how your
# layout answers it. A layout passes when it follows the rules, fits, and its modelled step is
# within 10% of the planner's best.
#
# 1. **13B on one node of 8 A100-80GB**, sequence 4096: what fills the memory first?
# 2. **70B on 128 H100s in 16 nodes**: 1.1 TB of model state; where may which traffic go?
# 3. **7B with a 16K context** on one node: the attention scores grow with the square of the
#    sequence.
#
# (Lab 13 planned three cousins of these jobs; the reasoning carries over, the answers do not.)

# %%
LAYOUT_13B = LAYOUT_70B = LAYOUT_16K = None  # your three layouts replace these
### BEGIN SOLUTION three dicts with tp, pp, dp, (cp,) zero_stage, recompute, micro_batch and why
LAYOUT_13B = dict(tp=2, pp=1, dp=4, zero_stage=3, recompute="none", micro_batch=1,
                  why="208 GB of model state (16 B/param) cannot be replicated: shard it with ZeRO-3 over dp, and "
                      "tp=2 on NVLink halves each GPU's activations so no recomputation is needed")
LAYOUT_70B = dict(tp=4, pp=2, dp=16, zero_stage=1, recompute="selective", micro_batch=1,
                  why="1.1 TB of state needs model splitting: tp=4 on NVLink inside a node, pp=2 across nodes "
                      "(one activation per micro-batch), ZeRO-1 over dp, selective recompute for the scores")
LAYOUT_16K = dict(tp=1, pp=1, dp=2, cp=4, zero_stage=3, recompute="none", micro_batch=1,
                  why="the s x s attention scores dominate at 16K: cp=4 splits each sequence over four GPUs, "
                      "ZeRO-3 shards the states")
### END SOLUTION

# %% tags=["points:3"]
rows = []
for name, var, layout in (("13b-one-node", "LAYOUT_13B", LAYOUT_13B), ("70b-16-nodes-h100", "LAYOUT_70B", LAYOUT_70B),
                          ("7b-16k-context", "LAYOUT_16K", LAYOUT_16K)):
    row = check_layout(JOBS[name], layout, name=f"{var} ({name})")
    rows.append(row)
    print(f"{name:14} {row['label']:42} {row['memory_gib']:6.1f} GiB  {row['step_s']:6.1f} s  "
          f"({row['vs_best']:+.1%} vs best)  - {layout['why']}")
check(len(rows) == 3, "all three jobs should have a layout")
# for the grader: each job's layout passed check_layout (legal, fits, within 10%, justified)
record("part1.accepted", [bool(r["fits"] and r["vs_best"] <= 0.10) for r in rows])

# %% [markdown]
# What you should see: three rows, each within 10% of the planner's best. If a check failed, its
# message names the rule, or the component that fills the memory and what shrinks it.
#
# ## Part 2: `choose_layout(spec)` for any job
#
# Write a function that picks a layout for any `JobSpec` (fields: `spec.gpus`,
# `spec.gpus_per_node`, `spec.seq`, `spec.global_batch`, and `spec.shape` with `n_layers`,
# `n_heads`, `kv_heads`, `ffn_dim`). The cost model is given: `evaluate(spec, to_layout(spec,
# layout))` returns `.fits` and `.step_s`. The planner's own search is switched off while
# your function runs, so the rules are yours to write:
#
# 1. enumerate the layouts the rules allow (try micro-batches 1, 2 and 4);
# 2. keep those that fit;
# 3. return the fastest (a dict like the ones above).
#
# It is graded on the three jobs here and on other models and clusters.

# %%
def choose_layout(spec):
    """A legal layout dict for `spec` that fits and has the shortest modelled step."""
    ### BEGIN SOLUTION which (tp, cp, pp, dp) combinations do the rules above allow for this spec, and which ZeRO stages go with each? Ask evaluate() about every one; when two are within a rounding of each other, which would you rather run?
    sh, gpn = spec.shape, spec.gpus_per_node
    best_key, best_layout = None, None
    tps = [t for t in range(1, gpn + 1)
           if gpn % t == 0 and sh.n_heads % t == 0 and sh.kv_heads % t == 0 and sh.ffn_dim % t == 0]
    for tp in tps:
        for cp in (1, 2, 4):
            if tp * cp > gpn or spec.seq % cp:
                continue
            for pp in [p for p in range(1, sh.n_layers + 1) if sh.n_layers % p == 0]:
                if spec.gpus % (tp * cp * pp):
                    continue
                dp = spec.gpus // (tp * cp * pp)
                for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                    for recompute in ("none", "selective", "full"):
                        for mb in (1, 2, 4):
                            if spec.global_batch % (dp * mb):
                                continue
                            layout = dict(tp=tp, pp=pp, dp=dp, cp=cp, zero_stage=zero, recompute=recompute,
                                          micro_batch=mb)
                            c = evaluate(spec, to_layout(spec, layout))
                            # fastest first; near ties go to fewer model-parallel ranks
                            key = (round(c.step_s, 1), tp * pp * cp)
                            if c.fits and (best_key is None or key < best_key):
                                best_key, best_layout = key, layout
    return best_layout
    ### END SOLUTION


# %% tags=["points:3"]
chosen = check_chooser(choose_layout, JOBS)
for row in chosen:
    print(f"{row['job']:14} {row['label']:42} {row['memory_gib']:6.1f} GiB  ({row['vs_best']:+.1%} vs best)")
check(all(not problems(JOBS[r['job']], r["layout"]) for r in chosen), "every chosen layout follows the rules")
record("part2.accepted", [r["job"] for r in chosen if r["fits"] and r["vs_best"] <= 0.15])

# %% [markdown]
# What you should see: for each job a legal layout that fits, within 15% of the planner's best.
# Compare them with yours from Part 1: where they differ, the modelled time says by how much.

# %% tags=["points:4"]
### BEGIN HIDDEN TESTS
from course_lib.planner import make_spec

OTHER_JOBS = {
    "13b-2-nodes-h100": make_spec(model="llama2-13b", gpu="h100", gpus=16, gpus_per_node=8, tokens="1T"),
    "8b-8k-h100": make_spec(model="llama3-8b", gpu="h100", gpus=8, gpus_per_node=8, tokens="1T", seq=8192,
                            attention="flash"),
    "13b-a100-40gb-4-per-node": make_spec(model="llama2-13b", gpu="a100-40gb", gpus=16, gpus_per_node=4,
                                          tokens="300B", seq=2048, global_batch_tokens="2Mi"),
    "gpt2-xl-v100": make_spec(model="gpt2-xl", gpu="v100", gpus=8, gpus_per_node=8, tokens="100B", seq=1024,
                              global_batch_tokens="512Ki"),
}
hidden = check_chooser(choose_layout, OTHER_JOBS)
check(len(hidden) == len(OTHER_JOBS), "hidden: a layout for every other job")
record("hidden.accepted", [r["job"] for r in hidden if r["fits"] and r["vs_best"] <= 0.15])
### END HIDDEN TESTS
