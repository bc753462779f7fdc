"""The chosen layout as configuration: the kit's trainer TOML, a DeepSpeed JSON, FSDP settings.

* :func:`trainer_toml` - a ``[train]/[parallel]/[model]/[checkpoint]`` TOML that
  ``course_lib.trainer.config.load`` accepts. The kit's trainer trains TinyGPT: it is a *teaching*
  trainer, so where it cannot express the plan (context parallelism, recomputation together with
  tp, ZeRO inside a tensor-/pipeline-parallel run) the TOML says so in a comment and keeps the
  closest setting it supports; the production setting is in plan.md.
* :func:`deepspeed_json` - built by the kit's own ``build_ds_config`` from that TOML's settings and
  checked by DeepSpeed's parser (``validate_ds_config``) when ``validate=True``.
* :func:`fsdp_settings` - the FSDP2 ``fully_shard`` arguments (when the plan is FSDP-shaped).
"""
from __future__ import annotations

import contextlib
import logging

from course_lib.planner.checkpoint_plan import CheckpointPlan
from course_lib.planner.costs import Candidate
from course_lib.planner.spec import JobSpec


def _strategy(c: Candidate) -> tuple[str, str]:
    """The trainer's ``train.strategy`` for the plan's sharding, and a note when the kit runs a
    nearer layout than the plan's (empty otherwise). Under tp/pp/cp the strategy names the
    data-parallel dimension: ddp (ZeRO-0), the kit's ZeRO-1/2 over dp x cp, or FSDP2 (ZeRO-3) on the
    DTensor-TP model, which runs with pp = 1 and without recomputation."""
    lay = c.layout
    if lay.tp * lay.pp * lay.cp == 1:
        return {0: "ddp", 1: "deepspeed", 2: "deepspeed", 3: "fsdp"}[lay.zero_stage], ""
    if lay.zero_stage < 3:
        return ("ddp", "zero1", "zero2")[lay.zero_stage], ""
    if lay.pp == 1 and lay.recompute == "none" and not (lay.cp > 1 and lay.sequence_parallel):
        return "fsdp", ""
    why = "pp > 1" if lay.pp > 1 else ("recomputation" if lay.recompute != "none" else "cp with sequence parallelism")
    return "zero2", (f"plan: ZeRO-3; the kit's fsdp does not compose with {why}, so it runs ZeRO-2 (weights "
                     f"whole per tp/pp shard: more memory than planned); ZeRO-3 here needs Megatron-LM or torchtitan")


def runs_context_parallel(c: Candidate) -> bool:
    """Whether the kit's trainer runs the plan's cp as context parallelism (pp = 1); with pp > 1
    the cp ranks run as more data-parallel replicas (same world size and global batch)."""
    return c.layout.cp > 1 and c.layout.pp == 1


def learning_rate(spec: JobSpec) -> float:
    """Peak learning rate: 3e-4 below 20B parameters, 1.5e-4 above (Llama 2 paper, Table 1)."""
    return 3e-4 if spec.shape.num_params() < 20e9 else 1.5e-4


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float):
        return repr(v)
    return str(v)


def trainer_sections(spec: JobSpec, c: Candidate, ck: CheckpointPlan, mirror: str = "") -> dict:
    """The trainer config as {section: {key: (value, comment)}} (the TOML's content, testable)."""
    sh, lay = spec.shape, c.layout
    strategy, strategy_note = _strategy(c)
    steps = max(1, int(round(spec.tokens / spec.global_batch_tokens)))
    cp_here = runs_context_parallel(c)
    mp = lay.tp * lay.pp * (lay.cp if cp_here else 1) > 1
    vocab = sh.vocab_size
    if vocab % lay.tp:  # Megatron pads the vocabulary to a multiple of 128 x tp
        vocab = -(-vocab // (128 * lay.tp)) * 128 * lay.tp
    # cp with pp does not compose in the kit's trainer: the cp ranks then run as more data-parallel
    # replicas (same world size, same global batch: fewer accumulation steps each).
    dp, accum = lay.dp, lay.grad_accum
    if lay.cp > 1 and not cp_here and lay.grad_accum % lay.cp == 0:
        dp, accum = lay.dp * lay.cp, lay.grad_accum // lay.cp
    sections = {
        "train": {
            "max_steps": (steps, f"{spec.tokens:.3g} tokens / {spec.global_batch_tokens:,} tokens per step"),
            "micro_batch": (lay.micro_batch, "sequences per rank per micro-batch"),
            "grad_accum": (accum, f"micro-batches per step: {dp} dp x {lay.micro_batch} x "
                                  f"{accum} = {spec.global_batch} sequences"),
            "precision": ("bf16", "bf16 autocast, fp32 master weights (recipe mixed-adam)"),
            "strategy": (strategy, strategy_note or ("data-parallel dimension under tp/pp/cp: " + lay.sharding if mp
                                                     else f"data-parallel engine: {lay.sharding}")),
            "peak_flops": (float(spec.gpu_peak_flops), f"{spec.gpu_name} dense bf16, for MFU"),
            "progress": (False, "batch job: log lines, no progress bar"),
        },
        "data": {
            "task": ("text", "bytes of the bundled notes; your corpus: task = \"tokens\", path = \"OUT.bin\" "
                             "(course data prepare), dtype, vocab_size"),
            "seq_len": (spec.seq, "tokens per sequence"),
        },
        "model": {
            "preset": ("tiny", "base preset; every field below overrides it"),
            "vocab_size": (vocab, "padded to a multiple of 128 x tp" if vocab != sh.vocab_size else ""),
            "block_size": (spec.seq, ""), "n_layers": (sh.n_layers, ""), "d_model": (sh.d_model, ""),
            "n_heads": (sh.n_heads, ""), "n_kv_heads": (sh.kv_heads, ""), "d_ff": (sh.ffn_dim, ""),
            "norm": (sh.norm, ""), "mlp": (sh.mlp, ""),
            "position": ("learned" if sh.learned_pos_emb else "rope", ""),
            **({} if sh.learned_pos_emb else {"rope_theta": (float(sh.rope_theta), "RoPE base (Megatron --rotary-base, "
                                                                                    "torchtitan rope_theta)")}),
            "bias": (sh.bias, ""), "tie_embeddings": (sh.tied_embeddings, ""), "dropout": (0.0, ""),
            "checkpointing": (lay.recompute, "activation recomputation (under tp/pp too)"),
        },
        "optim": {"lr": (learning_rate(spec), "Llama 2 Table 1"), "min_lr": (round(learning_rate(spec) / 10, 12), ""),
                  "weight_decay": (0.1, ""), "beta2": (0.95, "")},
        "schedule": {"kind": ("cosine", ""), "warmup_steps": (min(2000, max(1, steps // 100)), "")},
        "checkpoint": {
            "save_every": (ck.save_every_steps, f"Young/Daly: sqrt(2 x {ck.save_cost_s:.0f} s x "
                                                f"{ck.mtbf_job_h:.0f} h) = {ck.interval_s / 3600:.2f} h"),
            "keep_last": (ck.keep_last, "the newest may be cut off by a failure: keep older ones"),
            "async_save": (True, "training continues while the files are written"),
            "format": ("sharded" if strategy == "fsdp" else "auto",
                       "DCP shards, one per rank" if strategy == "fsdp" else
                       "what the strategy needs (the kit saves tp/pp runs dense)"),
        },
        "parallel": {
            "tp": (lay.tp, "tensor parallel inside a node" + (", with sequence parallelism" if lay.tp > 1 else "")),
            "pp": (lay.pp, "pipeline stages"),
            "dp": (dp if mp else 0, ("data-parallel replicas" + (f" (the plan's dp {lay.dp} x cp {lay.cp}: cp does not "
                                                               f"compose with pp here)" if dp != lay.dp else ""))
                   if mp else "0 = all ranks"),
            "pp_schedule": (lay.schedule, "micro-batches per step = train.grad_accum"),
            "sequence_parallel": (lay.sequence_parallel, ""),
            "cp": (lay.cp if cp_here else 1,
                   "context parallel: ring attention over zig-zag sequence chunks" if cp_here else
                   (f"plan: cp = {lay.cp}; with pp > 1 the kit runs these ranks as data parallel (Megatron-LM "
                    f"--context-parallel-size runs both)" if lay.cp > 1 else "")),
            "zero_stage": (lay.zero_stage, "read by train.strategy = 'deepspeed'"
                           + ("; under tp/pp/cp train.strategy above runs this ZeRO stage" if mp and lay.zero_stage else "")),
            "reshard_after_forward": (lay.zero_stage == 3, "fsdp: true = full shard (ZeRO-3)"),
        },
    }
    if lay.virtual_stages > 1 or lay.split:  # only where the plan needs them: other plans' files stay as they were
        extra = {"virtual_stages": (lay.virtual_stages, "stages per pipeline rank (interleaved 1F1B)")}
        if lay.split:
            extra["pp_split"] = (list(lay.split), "blocks per stage: the end stages also hold the embedding / the head")
        keys = list(sections["parallel"].items())
        at = [k for k, _ in keys].index("pp_schedule") + 1
        sections["parallel"] = dict(keys[:at] + list(extra.items()) + keys[at:])
    if mirror and strategy == "deepspeed":  # the mirror copies full and sharded (DCP) checkpoints, not DeepSpeed's
        sections["checkpoint"]["format"] = (sections["checkpoint"]["format"][0],
                                            f"{sections['checkpoint']['format'][1] or 'DeepSpeed shards'}; the kit "
                                            f"does not mirror these: copy OUT/checkpoints to {mirror} with your "
                                            f"storage tools (trainer.config refuses checkpoint.mirror here)")
    elif mirror:
        sections["checkpoint"]["mirror"] = (mirror, "second tier: copies of finished checkpoints")
    return sections


def trainer_toml(spec: JobSpec, c: Candidate, ck: CheckpointPlan, mirror: str = "") -> str:
    """The TOML text (loads with ``course_lib.trainer.config.load``)."""
    lay = c.layout
    lines = [f"# Generated by `course plan`: {spec.model_name} on {spec.gpus} x {spec.gpu_name} "
             f"({spec.nodes} node(s)), layout {lay.label()}.",
             "# It loads in this kit's trainer (python -m course_lib.train), which trains TinyGPT: a teaching",
             "# trainer that runs every idea on CPU and GPU but is not tuned for production at this size.",
             "# For a real run, carry the same layout into Megatron-LM (megatron_args.txt), torchtitan (torchtitan.toml)",
             "# or DeepSpeed (see plan.md).",
             "# Keys marked 'plan:' are what the plan wants where the kit's trainer cannot express it."]
    for section, keys in trainer_sections(spec, c, ck, mirror).items():
        lines.append(f"\n[{section}]")
        for key, (value, comment) in keys.items():
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {comment}" if comment else ""))
    return "\n".join(lines) + "\n"


def deepspeed_supports(c: Candidate) -> bool:
    """Whether the kit's DeepSpeed strategy runs the plan's layout: data parallelism only (tp = pp =
    cp = 1; ZeRO 0-3). For other layouts the plan writes no DeepSpeed config or launch script -
    the trainer would refuse them - and plan.md says why."""
    lay = c.layout
    return lay.tp * lay.pp * lay.cp == 1


def deepspeed_json(spec: JobSpec, c: Candidate, *, validate: bool = True) -> dict:
    """DeepSpeed's config for the plan: ZeRO stage, batch sizes over the dp ranks, bf16, clipping,
    activation checkpointing. Built by ``build_ds_config``; ``validate`` runs DeepSpeed's parser."""
    from course_lib.trainer import config as train_config
    from course_lib.parallel.deepspeed.config import build_ds_config, validate_ds_config

    lay = c.layout
    cfg = train_config.validate({
        "train": {"strategy": "deepspeed", "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
                  "precision": "bf16", "max_steps": 10},
        "optim": {"lr": learning_rate(spec), "min_lr": round(learning_rate(spec) / 10, 12), "beta2": 0.95},
        "parallel": {"zero_stage": lay.zero_stage}, "schedule": {"warmup_steps": 1}})
    ds = build_ds_config(cfg, world_size=lay.dp, device="cuda")
    if lay.zero_stage >= 1:
        # Overlap the reduce-scatter with backward: the overlap the step-time model assumes.
        ds["zero_optimization"].update({"overlap_comm": True, "contiguous_gradients": True})
    if lay.recompute != "none":
        ds["activation_checkpointing"] = {"partition_activations": lay.tp > 1,
                                          "contiguous_memory_optimization": False, "cpu_checkpointing": False}
    if validate:
        with _deepspeed_quiet():
            validate_ds_config(ds, world_size=lay.dp)
    return ds


@contextlib.contextmanager
def _deepspeed_quiet():
    """DeepSpeed's logger below ERROR off while its parser runs: importing it on a machine without
    a GPU logs "Setting accelerator to CPU" to stdout, in the middle of ``course plan``'s report."""
    ds_logger = logging.getLogger("DeepSpeed")  # the logger deepspeed.utils.logging creates

    def drop(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    ds_logger.addFilter(drop)
    try:
        yield
    finally:
        ds_logger.removeFilter(drop)


def fsdp_settings(spec: JobSpec, c: Candidate) -> dict:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) arguments for the plan, with whether they apply."""
    lay = c.layout
    applies = lay.pp == 1 and lay.zero_stage >= 2
    return {
        "applies": applies,
        "why": ("the plan shards weights/gradients over data-parallel ranks: FSDP2 does that" if applies else
                "the plan keeps weights replicated across data-parallel ranks (ZeRO-0/1) or uses pipeline "
                "stages: use DDP / DeepSpeed (ds_config.json) or Megatron-LM instead"),
        "device_mesh": {"dp_shard": lay.dp * lay.cp, "tp": lay.tp},
        "fully_shard": {"reshard_after_forward": lay.zero_stage == 3,
                        "unit": "one call per transformer block, then the root model"},
        "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
        "activation_checkpointing": lay.recompute,
        "tensor_parallel": ("DTensor parallelize_module with ColwiseParallel/RowwiseParallel and "
                            "SequenceParallel on the tp mesh dimension" if lay.tp > 1 else "none"),
        "context_parallel": lay.cp,
    }
