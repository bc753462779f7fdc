"""The chosen layout for the engines people run at scale: a torchtitan job config and Megatron-LM
arguments (``torchtitan.toml`` and ``megatron_args.txt`` in a plan's folder).

Neither engine is installed beside the kit's pinned torch (torchtitan needs a nightly torch and
its own kernels; Megatron-LM needs CUDA and Transformer Engine), so the names here were read from
the engines' own sources, at the versions below, and ``tests/test_planner_engines.py`` holds the
files against those names (the TOML's keys against torchtitan's ``JobConfig`` fields, the
arguments against an argparse parser of Megatron's flags):

* torchtitan **0.2.0** (PyPI wheel; ``torchtitan/config/job_config.py``): the last release whose
  ``ConfigManager`` reads a TOML file (``--job.config_file torchtitan.toml``; 0.3.0 replaced files
  with Python config registries). Sections ``[job] [model] [optimizer] [lr_scheduler] [training]
  [parallelism] [activation_checkpoint] [checkpoint]``.
* Megatron-LM **core_v0.14.0** (commit 23e00ed0963c, ``megatron/training/arguments.py``): virtual
  stages as ``--num-virtual-stages-per-pipeline-rank`` (the newer flag; the older
  ``--num-layers-per-virtual-pipeline-stage`` cannot describe uneven splits), uneven first/last
  stages as ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``, and any
  other split as ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a block, ``L`` the
  loss; stages in depth order, stage i on pipeline rank i mod pp, as the planner places them).

How the plan maps (what each engine can and cannot say):

* batch: Megatron takes micro-batch and global batch, and derives accumulation = global / (micro x
  dp). torchtitan takes ``local_batch_size`` per data-parallel rank and derives accumulation =
  global / (local x dp); with a pipeline its schedule cuts ``local_batch_size`` into micro-batches
  of ``pipeline_parallel_microbatch_size``, so there local = micro-batch x micro-batches per step;
* data parallelism: Megatron's distributed optimizer is ZeRO-1, Megatron-FSDP's
  ``optim_grads[_params]`` ZeRO-2/3. torchtitan shards with FSDP2 (over dp x cp, like the plan) and
  runs DDP only on a 1-D mesh: ZeRO-0 on pure data parallelism is DDP, every other stage is FSDP2,
  ``fsdp_reshard_after_forward = "always"`` for ZeRO-3, ``"never"`` otherwise (weights stay
  gathered from forward to backward: ZeRO-2's memory, at most the plan's);
* pipeline: torchtitan gets the exact blocks of every stage as ``module_fqns_per_model_part``
  (its Llama's module names), never its default split (which moves a block off each end stage);
* recomputation: Megatron's selective is the planner's (attention core); torchtitan's nearest is
  op-level selective checkpointing (``selective_ac_option = "op"``).
"""
from __future__ import annotations

from course_lib.planner.checkpoint_plan import CheckpointPlan
from course_lib.planner.configs import learning_rate
from course_lib.planner.costs import Candidate
from course_lib.planner.spec import JobSpec

TORCHTITAN_VERSION = "0.2.0"
MEGATRON_VERSION = "core_v0.14.0"
MEGATRON_COMMIT = "23e00ed0963c35382dfe8a5a94fb3cda4d21e133"

#: torchtitan 0.2.0's built-in Llama 3 flavors: (layers, d_model, heads, KV heads, MLP width) ->
#: flavor name (the vocabulary comes from the tokenizer).
TORCHTITAN_LLAMA3_FLAVORS = {(32, 4096, 32, 8, 14336): "8B", (80, 8192, 64, 8, 28672): "70B",
                             (126, 16384, 128, 8, 53248): "405B"}


def _steps(spec: JobSpec) -> int:
    return max(1, int(round(spec.tokens / spec.global_batch_tokens)))


def _warmup(spec: JobSpec) -> int:
    return min(2000, max(1, _steps(spec) // 100))  # as the trainer TOML


def stage_blocks(spec: JobSpec, c: Candidate) -> tuple:
    """Blocks on each of the pp x v stages, in depth order (stage i on pipeline rank i mod pp)."""
    return tuple(c.layout.blocks_per_stage(spec.shape.n_layers))


# --------------------------------------------------------------------------------------------
# torchtitan
# --------------------------------------------------------------------------------------------

def torchtitan_fqns_per_stage(spec: JobSpec, c: Candidate) -> list[list[str]]:
    """Module names of each pipeline stage for torchtitan's Llama (tok_embeddings, layers.i, norm,
    output): the planner's blocks per stage, the embedding on the first, norm and head on the last."""
    out, first = [], 0
    counts = stage_blocks(spec, c)
    for i, n in enumerate(counts):
        names = [f"layers.{j}" for j in range(first, first + n)]
        first += n
        if i == 0:
            names = ["tok_embeddings"] + names
        if i == len(counts) - 1:
            names += ["norm", "output"]
        out.append(names)
    return out


def torchtitan_batches(c: Candidate) -> dict:
    """``local_batch_size`` (sequences per data-parallel rank per forward call), ``global_batch_size``
    and ``pipeline_parallel_microbatch_size`` for torchtitan, and the accumulation it will derive."""
    lay = c.layout
    local = lay.micro_batch * lay.grad_accum if lay.pp > 1 else lay.micro_batch
    glob = lay.dp * lay.micro_batch * lay.grad_accum
    return {"local_batch_size": local, "global_batch_size": glob, "pipeline_parallel_microbatch_size": lay.micro_batch,
            "accumulation": glob // (local * lay.dp)}


def torchtitan_sections(spec: JobSpec, c: Candidate, ck: CheckpointPlan) -> dict:
    """torchtitan's job config as {section: {key: (value, comment)}} (see module for the mapping)."""
    sh, lay = spec.shape, c.layout
    flavor = TORCHTITAN_LLAMA3_FLAVORS.get((sh.n_layers, sh.d_model, sh.n_heads, sh.kv_heads, sh.ffn_dim))
    llama = sh.mlp == "swiglu" and sh.norm == "rmsnorm" and not sh.learned_pos_emb
    batches = torchtitan_batches(c)
    ddp = lay.zero_stage == 0 and lay.tp * lay.pp * lay.cp == 1
    reshard = "always" if lay.zero_stage == 3 else "never"
    parallelism = {
        "data_parallel_replicate_degree": (lay.dp if ddp else 1, "DDP (ZeRO-0 on pure data parallelism)" if ddp else ""),
        "data_parallel_shard_degree": (1 if ddp else lay.dp,
                                       "" if ddp else f"FSDP2 over dp x cp = {lay.dp * lay.cp} ranks (plan: {lay.sharding})"),
        "fsdp_reshard_after_forward": (reshard, "ZeRO-3" if reshard == "always" else
                                       "weights stay gathered until backward: ZeRO-2's memory, at most the plan's"),
        "tensor_parallel_degree": (lay.tp, "with sequence parallelism and loss parallelism" if lay.tp > 1 else ""),
        "context_parallel_degree": (lay.cp, ""),
        "pipeline_parallel_degree": (lay.pp, "pipeline ranks"),
        "pipeline_parallel_schedule": ("Interleaved1F1B" if lay.virtual_stages > 1 else "1F1B",
                                       f"{lay.virtual_stages} stages per rank" if lay.virtual_stages > 1 else ""),
        "pipeline_parallel_microbatch_size": (batches["pipeline_parallel_microbatch_size"],
                                              f"local_batch_size / this = {lay.grad_accum} micro-batches per step"
                                              if lay.pp > 1 else ""),
    }
    if lay.pp > 1:
        parallelism["module_fqns_per_model_part"] = (
            torchtitan_fqns_per_stage(spec, c), f"blocks per stage {list(stage_blocks(spec, c))} (the plan's split)")
    return {
        "job": {"dump_folder": (f"./outputs/{spec.model_name}-{spec.gpus}gpu", ""),
                "description": (f"course plan: {spec.model_name} on {spec.gpus} x {spec.gpu_name}, {lay.label()}", "")},
        "model": {"name": ("llama3", "" if llama else "torchtitan's Llama (RMSNorm, SwiGLU, RoPE): this model "
                           f"({sh.norm}, {sh.mlp}) needs a model of its own"),
                  "flavor": (flavor or spec.model_name,
                             "built-in flavor of this shape (the vocabulary comes from the tokenizer)" if flavor else
                             f"not built in: register TransformerModelArgs(dim={sh.d_model}, n_layers={sh.n_layers}, "
                             f"n_heads={sh.n_heads}, n_kv_heads={sh.kv_heads}, vocab_size={sh.vocab_size}) under this name"),
                  "hf_assets_path": ("./assets/hf/tokenizer", "the tokenizer's files")},
        "optimizer": {"name": ("AdamW", ""), "lr": (learning_rate(spec), ""), "beta2": (0.95, ""),
                      "weight_decay": (0.1, "")},
        "lr_scheduler": {"warmup_steps": (_warmup(spec), ""), "decay_type": ("cosine", ""),
                         "min_lr_factor": (0.1, "")},
        "training": {"local_batch_size": (batches["local_batch_size"], "sequences per data-parallel rank per step"
                                          + (" (all the pipeline's micro-batches)" if lay.pp > 1 else "")),
                     "global_batch_size": (batches["global_batch_size"],
                                           f"{lay.dp} dp x {batches['local_batch_size']} x "
                                           f"{batches['accumulation']} accumulation"),
                     "seq_len": (spec.seq, ""), "steps": (_steps(spec), ""), "max_norm": (1.0, ""),
                     "mixed_precision_param": ("bfloat16", ""), "mixed_precision_reduce": ("float32", "")},
        "parallelism": parallelism,
        "activation_checkpoint": dict(
            [("mode", (lay.recompute, "plan: " + lay.recompute))]
            + ([("selective_ac_option", ("op", "op-level selective checkpointing: the nearest to recomputing "
                                              "the attention core"))] if lay.recompute == "selective" else [])),
        "checkpoint": {"enable": (True, ""), "folder": ("checkpoint", ""),
                       "interval": (ck.save_every_steps, "Young/Daly (plan.md)"),
                       "keep_latest_k": (ck.keep_last, ""), "async_mode": ("async", "")},
    }


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v) if isinstance(v, float) else str(v)


def torchtitan_toml(spec: JobSpec, c: Candidate, ck: CheckpointPlan) -> str:
    """The torchtitan job config text (``torchrun ... -m torchtitan.train --job.config_file FILE``)."""
    lines = [f"# torchtitan {TORCHTITAN_VERSION} job config generated by `course plan`: {spec.model_name} on "
             f"{spec.gpus} x {spec.gpu_name}, layout {c.layout.label()}.",
             f"# Run on every node: torchrun --nnodes {spec.nodes} --nproc_per_node {spec.gpus_per_node} ... "
             "-m torchtitan.train --job.config_file torchtitan.toml"]
    for section, keys in torchtitan_sections(spec, c, ck).items():
        lines.append(f"\n[{section}]")
        for key, (value, comment) in keys.items():
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {comment}" if comment else ""))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Megatron-LM
# --------------------------------------------------------------------------------------------

def megatron_layout(counts) -> str:
    """``--pipeline-model-parallel-layout`` text for blocks per stage: ``E`` the embedding, ``t``
    a block, ``L`` the loss, stages in depth order joined by ``|``."""
    stages = [("E" if i == 0 else "") + (f"t*{n}" if n else "") + ("L" if i == len(counts) - 1 else "")
              for i, n in enumerate(counts)]
    return "|".join(stages)


def megatron_pipeline_args(spec: JobSpec, c: Candidate) -> list[str]:
    """The pipeline flags: size, virtual stages, and the split (first/last stage sizes when only
    the end stages differ and there are no virtual stages, else the explicit layout)."""
    lay = c.layout
    out = [f"--pipeline-model-parallel-size {lay.pp}"]
    if lay.pp == 1:
        return out
    counts = stage_blocks(spec, c)
    middle = counts[1:-1]
    if len(set(counts)) == 1:
        if lay.virtual_stages > 1:
            out.append(f"--num-virtual-stages-per-pipeline-rank {lay.virtual_stages}")
    elif lay.virtual_stages == 1 and len(set(middle)) <= 1:
        inner = middle[0] if middle else None
        if inner is None or counts[0] != inner:
            out.append(f"--decoder-first-pipeline-num-layers {counts[0]}")
        if inner is not None and counts[-1] != inner:  # pp = 2: the last stage takes the rest
            out.append(f"--decoder-last-pipeline-num-layers {counts[-1]}")
    else:  # the layout sets the virtual stages too (Megatron refuses both)
        out.append(f"--pipeline-model-parallel-layout {megatron_layout(counts)}")
    return out


def megatron_layout_args(spec: JobSpec, c: Candidate) -> list[str]:
    """The layout's Megatron-LM flags: parallel degrees, pipeline split, optimizer sharding,
    recomputation, batch and sequence (one flag with its value per item)."""
    lay = c.layout
    args = [f"--tensor-model-parallel-size {lay.tp}"] + megatron_pipeline_args(spec, c)
    args.append(f"--context-parallel-size {lay.cp}")
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    if lay.zero_stage == 1:
        args.append("--use-distributed-optimizer")
    elif lay.zero_stage >= 2:
        args += ["--use-megatron-fsdp",
                 f"--data-parallel-sharding-strategy {'optim_grads' if lay.zero_stage == 2 else 'optim_grads_params'}"]
    if lay.dp * lay.cp > 1:
        args.append("--overlap-grad-reduce")
    if lay.recompute == "selective":
        args.append("--recompute-granularity selective")
    elif lay.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    args += [f"--micro-batch-size {lay.micro_batch}", f"--global-batch-size {spec.global_batch}",
             f"--seq-length {spec.seq}"]
    return args


def megatron_args(spec: JobSpec, c: Candidate, ck: CheckpointPlan | None = None) -> list[str]:
    """Megatron-LM (``pretrain_gpt.py``) arguments for the plan: the layout's flags, the model's
    shape, the optimizer and schedule (one flag with its value per item)."""
    sh = spec.shape
    args = megatron_layout_args(spec, c)
    args += [f"--max-position-embeddings {spec.seq}", f"--num-layers {sh.n_layers}", f"--hidden-size {sh.d_model}", f"--ffn-hidden-size {sh.ffn_dim}",
             f"--num-attention-heads {sh.n_heads}"]
    if sh.kv_heads != sh.n_heads:
        args += ["--group-query-attention", f"--num-query-groups {sh.kv_heads}"]
    args += [f"--vocab-size {sh.vocab_size}", "--make-vocab-size-divisible-by 128",
             f"--position-embedding-type {'learned_absolute' if sh.learned_pos_emb else 'rope'}",
             f"--normalization {'RMSNorm' if sh.norm == 'rmsnorm' else 'LayerNorm'}"]
    if sh.mlp == "swiglu":
        args.append("--swiglu")
    if not sh.bias:
        args.append("--disable-bias-linear")
    if not sh.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if spec.attention == "flash":
        args.append("--attention-backend flash")
    lr = learning_rate(spec)
    args += ["--bf16", f"--lr {lr}", f"--min-lr {round(lr / 10, 12)}", "--lr-decay-style cosine",
             f"--lr-warmup-iters {_warmup(spec)}", f"--train-iters {_steps(spec)}", "--weight-decay 0.1",
             "--adam-beta2 0.95", "--clip-grad 1.0"]
    if ck is not None:
        args.append(f"--save-interval {ck.save_every_steps}")
    return args


def megatron_args_text(spec: JobSpec, c: Candidate, ck: CheckpointPlan) -> str:
    """``megatron_args.txt``: comment lines, then one flag (with its value) per line."""
    lay = c.layout
    head = [f"# Megatron-LM {MEGATRON_VERSION} arguments generated by `course plan`: {spec.model_name} on "
            f"{spec.gpus} x {spec.gpu_name}, layout {lay.label()}.",
            f"# dp = {spec.gpus} / (tp {lay.tp} x pp {lay.pp} x cp {lay.cp}) = {lay.dp}; Megatron derives "
            f"{spec.global_batch} / ({lay.micro_batch} x {lay.dp}) = {lay.grad_accum} micro-batches per step.",
            "# Use: torchrun ... pretrain_gpt.py $(grep -v '^#' megatron_args.txt) --save DIR --load DIR "
            "--data-path ... --tokenizer-type ..."]
    return "\n".join(head + megatron_args(spec, c, ck)) + "\n"
