"""Words for a plan: the comparison table printed by ``course plan`` and the ``plan.md`` file."""
from __future__ import annotations

import dataclasses

from course_lib.estimate import format_bytes
from course_lib.planner.checkpoint_plan import CheckpointPlan
from course_lib.planner.costs import Candidate, evaluate
from course_lib.planner.engines import MEGATRON_VERSION, TORCHTITAN_VERSION
from course_lib.planner.megatron_job import MEGATRON_INPUTS, megatron_command, megatron_layout_args
from course_lib.planner.search import Plan, why_lost, why_not_fit
from course_lib.planner.spec import JobSpec
from course_lib.planner.stages import compact_counts
from course_lib.planner.torchtitan_job import TORCHTITAN_INPUTS, torchtitan_command, torchtitan_unsupported


def table(plan: Plan, n: int = 6) -> str:
    """Best plan and runners-up: layout, memory/GPU, step split, tokens/s, why each lost."""
    best = plan.best
    shown = plan.runners_up(n)
    # The chosen layout first; the runners-up by the step time printed (the ranking breaks
    # near-ties by simplicity, which would list a 202.8 s row above a 202.4 s one).
    shown = shown[:1] + sorted(shown[1:], key=lambda c: round(c.step_s, 1))
    w = max([40] + [len(c.layout.label()) for c in shown + list(plan.closest_misses)])
    # Units that suit the job: a model of a few KiB on a toy "GPU" steps in milliseconds, and its
    # rows should not all read "0.00 GiB" and "0.0 s".
    sizes = [c.memory_total for c in shown + list(plan.closest_misses)]
    mem_unit = "GiB" if not sizes or max(sizes) >= 2**30 else format_bytes(max(sizes), "auto").split()[-1]
    scale, t_unit = (1e3, "ms") if shown and max(c.step_s for c in shown) < 1 else (1.0, "s")
    head = (f"{'layout':<{w}} {'mem/GPU':>10} {'step ' + t_unit:>8} {'compute':>8} {'comm':>7} {'bubble':>7} "
            f"{'tokens/s':>9}  reason")
    rows = [head, "-" * len(head)]
    for c in shown:
        t = c.time
        rows.append(f"{c.layout.label():<{w}} {format_bytes(c.memory_total, mem_unit):>10} {c.step_s * scale:>8.1f} "
                    f"{t['compute'] * scale:>8.1f} {c.comm_s * scale:>7.2f} {t['bubble'] * scale:>7.2f} "
                    f"{c.tokens_per_s:>9,.0f}  {why_lost(c, best)}")
    for c in plan.closest_misses:
        rows.append(f"{c.layout.label():<{w}} {format_bytes(c.memory_total, mem_unit):>10} {'-':>8} {'':>8} {'':>7} "
                    f"{'':>7} {'':>9}  {why_not_fit(c)}")
    return "\n".join(rows)


def breakdown(spec: JobSpec, c: Candidate) -> list[str]:
    """A candidate's memory per GPU (GiB by component, the busiest pipeline rank) and step time
    (seconds by term), as printed by ``course plan --layout``."""
    m, t, lay = c.memory, c.time, c.layout
    gib = 2**30
    mem = ", ".join(f"{k} {m[k] / gib:.2f}" for k in ("params", "grads", "optimizer", "activations", "transient",
                                                      "accumulated_grads"))
    lines = [f"memory per GPU (GiB): {mem}; peak {m['peak'] / gib:.2f} at {m['peak_at']}"]
    if lay.pp > 1:
        lines.append(f"pipeline: {lay.pp} ranks x {lay.virtual_stages} stage(s) ({lay.schedule}), blocks per stage "
                     f"{compact_counts(c.stage_blocks)}; busiest rank computes {t['stage_imbalance']:.3f}x the mean; "
                     f"bubble {t['bubble_fraction']:.1%} of the ideal step")
    lines.append(f"step {c.step_s:.2f} s = (compute {t['compute']:.2f} [recompute {t['recompute']:.2f}] + tp {t['tp']:.2f} "
                 f"+ cp {t['cp']:.2f} + pp sends {t['pp']:.2f}) x (1 + bubble {t['bubble_fraction']:.3f}) "
                 f"+ exposed dp {t['dp_exposed']:.2f} (of {t['dp_total']:.2f}"
                 + (f" + expert all-to-all {t['ep']:.2f} over {c.links['ep']}" if spec.moe is not None else "")
                 + f"); {c.tokens_per_s:,.0f} tokens/s, modelled MFU {c.mfu(spec):.1%}")
    return lines


def experts_section(spec: JobSpec, c: Candidate) -> list[str]:
    """plan.md's "Experts" for a mixture-of-experts plan: the fold of ep x etp onto the ranks, what
    one GPU holds, the all-to-all (``estimate.alltoall_bytes_per_layer``) and its time."""
    from course_lib.estimate import alltoall_bytes_per_layer, expected_tokens_off_rank

    moe, lay, m = spec.moe, c.layout, c.memory
    tokens = spec.seq // lay.cp * lay.micro_batch // (lay.tp if lay.sequence_parallel else 1)
    off = expected_tokens_off_rank(tokens, moe.top_k, lay.ep)
    a = alltoall_bytes_per_layer(tokens_off_rank=off, d_model=moe.d_model, ep=lay.ep, n_experts=moe.n_experts)
    return ["## Experts", "",
            f"- {moe.n_experts} experts per MoE block ({moe.n_moe_layers} of {moe.n_layers} blocks), top-{moe.top_k}"
            + (f", {moe.n_shared_experts} shared" if moe.n_shared_experts else "")
            + f": {moe.num_params() / 1e9:.1f}B parameters, {moe.active_params() / 1e9:.1f}B active per token "
            "(MFU counts the active ones).",
            f"- ep {lay.ep} x etp {lay.etp} folded onto tp {lay.tp} x cp {lay.cp} x dp {lay.dp} = "
            f"{lay.tp * lay.cp * lay.dp} ranks per stage: expert-data-parallel {lay.edp}; each GPU holds "
            f"{moe.n_experts // lay.ep} experts per block, {m['expert_params'] / 1e9:.2f}B expert + "
            f"{m['dense_params'] / 1e9:.2f}B other parameters.",
            f"- all-to-all per MoE block and micro-batch ({tokens:,} tokens, {off:,.0f} copies to other ranks when "
            f"routing is even): dispatch {format_bytes(a.dispatch, 'auto')} + combine {format_bytes(a.combine, 'auto')}"
            f" forward, {format_bytes(a.backward, 'auto')} backward, {a.counts:,.0f} B of counts; "
            f"{c.time['ep']:.2f} s per step over {c.links['ep']}"
            + (f" (node-limited routing: at most {spec.moe_node_limit} nodes per token)" if spec.moe_node_limit else "")
            + ", hidden with the DP traffic behind up to "
            f"{spec.overlap:.0%} of the compute (`--overlap`)."]


def _dimension_reasons(spec: JobSpec, c: Candidate, plan: Plan) -> list[str]:
    lay, t = c.layout, c.time
    others = plan.ranked
    out = []
    alt_tp = [o for o in others if o.layout.tp != lay.tp]
    out.append(f"- **tp = {lay.tp}**: " + (
        f"each layer's matmuls split {lay.tp} ways inside a node, sequence parallelism on; its all-reduces "
        f"cost {t['tp']:.2f} s per step over NVLink and are not overlapped." if lay.tp > 1 else
        "layers are not split: the memory fits without it, and tensor parallelism would add activation "
        "all-reduces on the critical path of every layer.")
        + (f" Best layout with another tp: {alt_tp[0].layout.label()} ({why_lost(alt_tp[0], c)})." if alt_tp else ""))
    out.append(f"- **pp = {lay.pp}**: " + (
        (f"{spec.shape.n_layers // lay.pp} layers per stage, 1F1B" if not lay.split and lay.virtual_stages == 1 else
         f"blocks per stage {compact_counts(c.stage_blocks)}, {lay.schedule}"
         + (f" with {lay.virtual_stages} virtual stages per rank" if lay.virtual_stages > 1 else "")
         + f" (busiest rank {t['stage_imbalance']:.3f}x the mean compute)")
        + f" with {lay.grad_accum} micro-batches: the bubble "
        f"is {t['bubble_fraction']:.1%} of the ideal step ({t['bubble']:.2f} s)." if lay.pp > 1 else
        "no pipeline: no bubble and no stage-to-stage sends."))
    out.append(f"- **cp = {lay.cp}**: " + (
        f"each sequence of {spec.seq} tokens is split {lay.cp} ways (ring attention): activations shrink "
        f"{lay.cp}x for {t['cp']:.2f} s of K/V traffic per step." if lay.cp > 1 else
        "sequences are not split: activations fit without it."))
    out.append(f"- **dp = {lay.dp}, {lay.sharding}**: " + (
        f"{t['dp_total']:.2f} s of {('gradient' if lay.zero_stage < 3 else 'gradient + weight')} traffic per step "
        f"over {c.links['dp'] if lay.dp * lay.cp > 1 else 'no link'}, {t['dp_exposed']:.2f} s of it not hidden "
        f"behind compute (overlap assumption {spec.overlap:.0%} of compute)."))
    if lay.zero_stage > 0:
        lower = evaluate(spec, dataclasses.replace(lay, zero_stage=lay.zero_stage - 1))
        out[-1] += (f" ZeRO-{lay.zero_stage - 1} with the same layout: "
                    + (why_not_fit(lower) if not lower.fits else why_lost(lower, c)) + ".")
    out.append(f"- **recompute = {lay.recompute}**: " + (
        "every activation is kept: memory allows it and recomputation would cost extra forward work."
        if lay.recompute == "none" else
        f"trades {t['recompute']:.2f} s of extra forward work per step for the activation memory it frees."))
    if lay.recompute != "none":
        keep = evaluate(spec, dataclasses.replace(lay, recompute="none"))
        out[-1] += " Without it: " + (why_not_fit(keep) if not keep.fits else why_lost(keep, c)) + "."
    out.append(f"- **micro-batch = {lay.micro_batch} x {lay.grad_accum} accumulation steps** per data-parallel "
               f"rank: {lay.dp} x {lay.micro_batch} x {lay.grad_accum} = {spec.global_batch} sequences "
               f"= {spec.global_batch_tokens:,} tokens per step.")
    return out


def megatron_flags(spec: JobSpec, c: Candidate) -> str:
    """The layout as Megatron-LM command-line flags (one code line in Markdown): degrees, virtual
    stages and uneven splits, sharding, recomputation, batch (``engines.megatron_layout_args``)."""
    experts = ([f"--expert-model-parallel-size {c.layout.ep}", f"--expert-tensor-parallel-size {c.layout.etp}"]
               if spec.moe is not None else [])
    return (f"Megatron-LM ({MEGATRON_VERSION}): `{' '.join(megatron_layout_args(spec, c) + experts)} --bf16` "
            "(every argument, with the model's shape and the schedule: `megatron_args.txt`)")


def start_commands(spec: JobSpec, c: Candidate, files: list[str], plan_dir: str, train_out: str) -> list[str]:
    """plan.md's "How to start it": per engine, the one command and what the user provides."""
    d = plan_dir
    every = " on every node" if spec.nodes > 1 else ""
    rdzv = "RDZV_HOST=<first node> " if spec.nodes > 1 else ""
    out = ["## How to start it", "", "From the kit's root (the scripts name the plan's files by this path); what you "
           "provide follows each command.", ""]
    if spec.moe is None:
        out += [f"- **this kit's trainer, torchrun**{every}: `{rdzv}bash {d}/launch_torchrun.sh`. Provide: the data "
           "(`[data]` in train.toml: the bundled text, or your corpus with `course data prepare`); checkpoints go to "
           f"`{train_out}`.",
           f"- **the same under SLURM**: `mkdir -p {train_out} && sbatch {d}/job.sbatch` (SLURM opens the job's log "
           f"in `{train_out}` before the script runs, so the folder must exist first); it requeues itself at the "
           "time limit."]
    if spec.moe is not None:
        pass  # the kit's trainer, DeepSpeed and accelerate files are not written for MoE plans
    elif "launch_deepspeed.sh" in files:
        out.append(f"- **DeepSpeed**: `bash {d}/launch_deepspeed.sh`"
                   + (f" on the first host of `{d}/hostfile` (the others reached over ssh/pdsh; the variables the "
                      f"ranks need travel in `{d}/.deepspeed_env`, which the script writes)" if spec.nodes > 1 else "")
                   + ". Provide: the data, as for torchrun.")
    else:
        out.append("- **DeepSpeed**: no script: the kit's DeepSpeed strategy runs data parallelism only (see above).")
    if spec.moe is None:
        out.append(f"- **accelerate**{every}: `bash {d}/launch_accelerate.sh`"
                   + (" (under SLURM, or with MASTER_ADDR and NODE_RANK set)" if spec.nodes > 1 else "")
                   + ". Provide: `pip install accelerate`, and the data as for torchrun.")
    out.append(f"- **Megatron-LM {MEGATRON_VERSION}**{every}"
               + (" (HEAD_NODE = the first node, JOB_ID = one id for all nodes)" if spec.nodes > 1 else "")
               + f": `{megatron_command(spec, c, d)}`. Provide: "
               + "; ".join(f"`{k}`: {v}" for k, v in MEGATRON_INPUTS.items()) + ".")
    why = torchtitan_unsupported(spec, c)
    if why:
        out.append(f"- **torchtitan {TORCHTITAN_VERSION}**: no file: {why}.")
    else:
        out.append(f"- **torchtitan {TORCHTITAN_VERSION}**{every}: `{torchtitan_command(spec, d)}` "
                   f"(`{d}/torchtitan_model.py` registers the plan's exact model). Provide: "
                   + "; ".join(f"{k}: {v}" for k, v in TORCHTITAN_INPUTS.items()) + ".")
    return out


def plan_markdown(plan: Plan, ck: CheckpointPlan | None, budget: dict | None, files: list[str],
                  plan_dir: str = ".", train_out: str = "runs/plan") -> str:
    """The whole plan in words: choice, why, runners-up, how to start it, checkpoints, budget,
    assumptions. ``plan_dir`` and ``train_out`` are the folders the commands name."""
    spec, best = plan.spec, plan.best
    sh = spec.shape
    n_params = spec.moe.num_params() if spec.moe is not None else sh.num_params()
    lines = [f"# Plan: {spec.model_name} ({n_params / 1e9:.2f}B parameters) on {spec.gpus} x {spec.gpu_name}",
             "", f"{spec.nodes} node(s) x {spec.gpus_per_node} GPUs, {spec.tokens:.3g} tokens, sequence {spec.seq}, "
             f"global batch {spec.global_batch} sequences ({spec.global_batch_tokens:,} tokens). "
             f"Searched {plan.n_layouts} layouts, {len(plan.ranked)} fit in "
             f"{format_bytes(spec.usable_bytes)} per GPU ({spec.headroom:.0%} headroom)."]
    if spec.batch_note:
        lines += ["", f"Note: {spec.batch_note}."]
    if best is None:
        lines += ["", "## Nothing fits", "", "No layout fits in the usable memory. Closest:"]
        lines += [f"- {c.layout.label()}: {why_not_fit(c)}" for c in plan.closest_misses]
        lines += ["", "What would fit:"] + [f"- {a}" for a in plan.advice]
        return "\n".join(lines) + "\n"
    lines += ["", "## Choice", "", f"**{best.layout.label()}** - {format_bytes(best.memory_total)} per GPU, "
              f"{best.step_s:.1f} s per step, {best.tokens_per_s:,.0f} tokens/s, modelled MFU {best.mfu(spec):.1%}, "
              f"{budget['days']:.1f} days, {budget['gpu_hours']:,.0f} GPU-hours.", "", "Why:", ""]
    lines += _dimension_reasons(spec, best, plan)
    lines += ["", "## Runners-up (one row per distinct layout)", "", "```", table(plan), "```"]
    if spec.moe is not None:
        lines += [""] + experts_section(spec, best)
    if spec.precision == "fp8":
        lines += ["", "## FP8", "", f"FP8 linears, recipe {spec.fp8_recipe} (Megatron `--fp8-format hybrid "
                  f"--fp8-recipe {spec.fp8_recipe}`; torchtitan `model.converters = [\"float8\"]`)"
                  + ("; weights kept and all-gathered in FP8: recipe fp8-params-adam (15 B per parameter) and 1-byte "
                     "all-gathers" if spec.fp8_param_gather else "; weights in bf16, all-gathers in bf16")
                  + ". The step time is modelled at the bf16 rate (FP8's speed-up is measured, not assumed)."]
    lay = best.layout
    if lay.tp * lay.pp * lay.cp == 1:
        deepspeed = ("DeepSpeed's JSON (`ds_config.json`) carries the ZeRO stage, batch sizes, precision and "
                     "clipping, checked by DeepSpeed's parser for the ranks it will start; `launch_deepspeed.sh` "
                     "starts it.")
    else:
        deepspeed = ("No DeepSpeed config or launch script: the kit's DeepSpeed strategy runs data parallelism only "
                     f"(tp = pp = cp = 1), and this layout has tp {lay.tp} x pp {lay.pp} x cp {lay.cp}. The kit runs "
                     "it with `launch_torchrun.sh` / `job.sbatch`; DeepSpeed users carry the layout to "
                     "Megatron-DeepSpeed with the flags above.")
    titan = torchtitan_unsupported(spec, best)
    lines += ["", "## The same layout in production frameworks", "", megatron_flags(spec, best), "",
              f"torchtitan ({TORCHTITAN_VERSION}): " + (f"no `torchtitan.toml`: {titan}." if titan else
              "`torchtitan.toml` (`--job.config_file`) carries the same degrees, pipeline schedule and blocks per "
              "stage, recomputation, batch and checkpoint interval; `torchtitan_model.py` registers the plan's model "
              "(shape, vocabulary, RoPE) with torchtitan's Llama code."), "",
              deepspeed + " `fsdp_settings.json` says whether FSDP2 fits the plan."]
    if spec.moe is not None:
        lines[-1] = ("The kit's own trainer, DeepSpeed and accelerate files are not written for a mixture-of-experts "
                     "plan: this plan is for the engines above.")
    lines += [""] + start_commands(spec, best, files, plan_dir, train_out)
    lines += ["", "## Checkpoints", "",
              f"- format: {ck.format_reason}.",
              f"- size: {format_bytes(ck.checkpoint_bytes, 'GB')} (weights + fp32 master + optimizer moments); "
              f"one save takes {ck.save_cost_s:.0f} s at {spec.storage_bytes_per_s / 1e9:g} GB/s.",
              f"- interval (Young/Daly): job MTBF = {spec.mtbf_hours:g} h per node / {spec.nodes} nodes = "
              f"{ck.mtbf_job_h:.0f} h; sqrt(2 x {ck.save_cost_s:.0f} s x {ck.mtbf_job_h:.0f} h) = "
              f"{ck.interval_s / 3600:.2f} h = every {ck.save_every_steps} steps; saving costs "
              f"{ck.overhead:.2%} of the time, a failure loses {ck.expected_loss_h:.2f} h on average.",
              f"- retention: keep the last {ck.keep_last} ({format_bytes(ck.checkpoint_bytes * ck.keep_last, 'GB')} "
              "on the fast tier); the newest may be incomplete when a node dies mid-save.",
              "- second tier: set `checkpoint.mirror` to an object store (e.g. `s3://bucket/run`, any fsspec URL): "
              "finished checkpoints are copied there so a lost file system does not lose the run "
              "(the kit mirrors full-format checkpoints).",
              "- resume: every launch script passes `--resume auto`; a restarted or requeued job continues "
              "from the newest valid checkpoint, e.g. `bash launch_torchrun.sh` again, or SLURM's requeue."
              if spec.moe is None else
              "- resume: Megatron-LM loads the newest checkpoint under `--load`, torchtitan the newest in its "
              "checkpoint folder; run the same command again."]
    mem = budget["memory_gib_per_gpu"]
    lines += ["", "## Resource budget", "",
              "| per GPU | GiB |", "| --- | ---: |"]
    lines += [f"| {k} | {mem[k]:.2f} |" for k in ("params", "grads", "optimizer", "activations", "transient",
                                                   "accumulated_grads", "peak", "headroom_reserved", "device")]
    sl = budget["slurm"]
    lines += ["", f"- {budget['tokens_per_s']:,.0f} tokens/s, {budget['steps']:,} steps, {budget['days']:.1f} days, "
              f"{budget['gpu_hours']:,.0f} GPU-hours.",
              f"- SLURM: `--nodes={sl['nodes']} --gpus-per-node={sl['gpus_per_node']} --time={sl['time_per_allocation']}`"
              f", about {sl['allocations']} allocation(s) (the script requeues itself at the limit).",
              f"- to finish in 30 days at the same tokens/s per GPU: about {budget['gpus_for_30_days']:,} GPUs "
              "(linear scaling, an optimistic first answer: plan again with that --gpus)."]
    lines += ["", "## Assumptions (change them with flags)", "",
              f"- compute: FLOPs (Narayanan et al., recomputation included) / ({spec.gpus} x "
              f"{spec.gpu_peak_flops / 1e12:g} TFLOP/s x mfu {spec.mfu:g}); `--mfu` is the matmul efficiency.",
              f"- links: {spec.intra_node_bytes_per_s / 1e9:g} GB/s per GPU inside a node, "
              f"{spec.inter_node_bytes_per_s / 1e9:g} GB/s per GPU between nodes (`--interconnect {spec.interconnect}`; "
              "datasheet numbers, override with `--intra-node-gbps`/`--inter-node-gbps`).",
              f"- overlap: DP/ZeRO traffic hides behind {spec.overlap:.0%} of the compute time (`--overlap`); "
              "TP, CP and pipeline sends are on the critical path.",
              f"- memory: recipe {spec.recipe}, bf16 activations, attention '{spec.attention}' (`--attention`), "
              "Korthikanti et al. 2022 activations, ZeRO sharding over dp x cp.",
              "", "## Files", ""] + [f"- `{f}`" for f in files]
    return "\n".join(lines) + "\n"
