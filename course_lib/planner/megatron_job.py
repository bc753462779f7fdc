"""The plan as Megatron-LM arguments (``megatron_args.txt``) and the one command that runs them.

Megatron-LM **core_v0.14.0** (commit 23e00ed0963c, ``megatron/training/arguments.py``): virtual
stages as ``--num-virtual-stages-per-pipeline-rank`` (the newer flag; the older
``--num-layers-per-virtual-pipeline-stage`` cannot describe uneven splits), uneven first/last
stages as ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``, and any
other split as ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a block, ``L`` the
loss; stages in depth order, stage i on pipeline rank i mod pp, as the planner places them).

What ``validate_args`` and the model need beyond the layout, and so the file carries:

* the environment: with tp or cp > 1 (and no Megatron-FSDP) ``validate_args`` asserts
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (before Blackwell); Megatron-FSDP asserts it is *not* 1. The
  "Use:" line sets it (:func:`megatron_env`);
* Megatron-FSDP (ZeRO-2/3) only saves ``--ckpt-format fsdp_dtensor``;
* the model of ``train.toml``: dropout 0 (Megatron's default is 0.1), the RoPE base
  (``--rotary-base``, default 10,000; Llama 3 uses 500,000), the vocabulary unpadded where tp
  divides it (:func:`vocab_divisor`);
* batch: micro-batch and global batch; Megatron derives accumulation = global / (micro x dp).
* mixture of experts (:func:`megatron_moe_args`): ``--num-experts``, ``--moe-ffn-hidden-size``,
  ``--moe-router-topk``, shared experts, which blocks are dense (``--moe-layer-freq``), the
  ``alltoall`` dispatcher, grouped GEMMs, the router's balancing (an auxiliary loss; DeepSeek-V3's
  sigmoid scores with the loss-free expert bias, a small sequence-wise loss and node-limited
  groups), ``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size``; the model's
  attention as Megatron names it (``--kv-channels``, ``--qk-layernorm``, ``--multi-latent-attention``).
* FP8 (:func:`megatron_fp8_args`): ``--fp8-format hybrid`` (E4M3 forward, E5M2 gradients) and
  ``--fp8-recipe`` (tensorwise, delayed, blockwise, mxfp8; rowwise is torchao's and has no
  Megatron recipe), ``--fp8-param-gather`` for FP8 weights (validate_args: with the distributed
  optimizer or Megatron-FSDP only).
  The distributed optimizer is ZeRO-1, Megatron-FSDP's ``optim_grads[_params]`` ZeRO-2/3;
  recomputation "selective" is the planner's (attention core).
"""
from __future__ import annotations

from course_lib.planner.checkpoint_plan import CheckpointPlan
from course_lib.planner.configs import learning_rate
from course_lib.planner.costs import Candidate
from course_lib.planner.engines import (MEGATRON_VERSION, command_line, stage_blocks, torchrun_head, train_steps,
                                        warmup_steps)
from course_lib.planner.spec import JobSpec

#: What the user provides to the command (shell variables of the "Use:" line).
MEGATRON_INPUTS = {
    "MEGATRON_LM": "a Megatron-LM checkout at core_v0.14.0 (its pretrain_gpt.py), with Transformer Engine",
    "DATA_PREFIX": "the tokenized corpus, as tools/preprocess_data.py writes it (PREFIX_text_document)",
    "TOKENIZER": "a Hugging Face tokenizer folder whose vocabulary is the plan's",
    "CKPT_DIR": "the checkpoint folder (saved to and resumed from)",
}


def uses_megatron_fsdp(c: Candidate) -> bool:
    """Whether the plan runs Megatron-FSDP (ZeRO-2/3) rather than DDP or the distributed optimizer."""
    return c.layout.zero_stage >= 2


def megatron_env(c: Candidate) -> dict[str, str]:
    """The environment ``validate_args`` asserts for the layout (see the module's docstring)."""
    lay = c.layout
    if uses_megatron_fsdp(c):  # FSDP refuses 1; 8 is CUDA's default, so an inherited 1 cannot slip in
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    if lay.tp > 1 or lay.cp > 1:  # TP/CP overlap needs the kernels queued in order on one connection
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def vocab_divisor(spec: JobSpec, c: Candidate) -> int:
    """``--make-vocab-size-divisible-by``: Megatron pads the vocabulary to a multiple of this x tp.
    The largest power of two up to 128 whose multiple the vocabulary already is keeps it exact (the
    plan's and train.toml's); where tp does not divide it, 128 pads it as train.toml does."""
    vocab, tp = spec.shape.vocab_size, c.layout.tp
    if vocab % tp:
        return 128
    d = 128
    while vocab % (d * tp):
        d //= 2
    return d


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
                 f"--data-parallel-sharding-strategy {'optim_grads' if lay.zero_stage == 2 else 'optim_grads_params'}",
                 "--ckpt-format fsdp_dtensor"]  # the only format Megatron-FSDP saves (validate_args)
    if lay.dp * lay.cp > 1:
        args.append("--overlap-grad-reduce")
    if lay.recompute == "selective":
        args.append("--recompute-granularity selective")
    elif lay.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    args += [f"--micro-batch-size {lay.micro_batch}", f"--global-batch-size {spec.global_batch}",
             f"--seq-length {spec.seq}"]
    return args


#: Auxiliary load-balancing loss coefficient written for MoE plans: Megatron's help text
#: recommends 1e-2 as a start (GShard / Switch Transformer's loss); DeepSeek-V3 (arXiv 2412.19437,
#: Sec. 4.2) uses a sequence-wise loss of 1e-4 beside its loss-free expert bias.
AUX_LOSS_COEFF = 1e-2
DEEPSEEK_AUX_LOSS_COEFF = 1e-4
#: FP8 recipes Megatron-LM core_v0.14.0 accepts (arguments.py L1224-1227)
MEGATRON_FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")


def megatron_moe_args(spec: JobSpec, c: Candidate) -> list[str]:
    """The mixture-of-experts flags (see the module's docstring); [] for a dense model."""
    moe, lay = spec.moe, c.layout
    if moe is None:
        return []
    args = [f"--num-experts {moe.n_experts}", f"--moe-ffn-hidden-size {moe.expert_d_ff}",
            f"--moe-router-topk {moe.top_k}", f"--expert-model-parallel-size {lay.ep}",
            f"--expert-tensor-parallel-size {lay.etp}", "--moe-token-dispatcher-type alltoall", "--moe-grouped-gemm"]
    if moe.mtp_layers:  # DeepSeek-V3 trains with its multi-token-prediction module
        args.append(f"--mtp-num-layers {moe.mtp_layers}")
    if moe.n_shared_experts:
        args.append(f"--moe-shared-expert-intermediate-size {moe.n_shared_experts * moe.shared_width}")
    if moe.n_dense_layers:
        args.append(f"--moe-layer-freq ([0]*{moe.n_dense_layers}+[1]*{moe.n_moe_layers})")
    if moe.mla is not None:  # DeepSeek-V3's router: sigmoid scores, loss-free bias, groups = nodes
        args += ["--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-load-balancing-type seq_aux_loss", f"--moe-aux-loss-coeff {DEEPSEEK_AUX_LOSS_COEFF}",
                 "--moe-router-topk-scaling-factor 2.5", "--moe-router-dtype fp32"]
        if spec.moe_node_limit is not None:
            groups = max(1, lay.ep * lay.etp // spec.gpus_per_node)
            if moe.n_experts % groups == 0 and spec.moe_node_limit <= groups:
                args += [f"--moe-router-num-groups {groups}", f"--moe-router-group-topk {spec.moe_node_limit}"]
    else:
        args += ["--moe-router-load-balancing-type aux_loss", f"--moe-aux-loss-coeff {AUX_LOSS_COEFF}"]
    return args


def megatron_fp8_args(spec: JobSpec) -> list[str]:
    """The FP8 flags for an FP8 plan ([] for bf16); ValueError for a recipe Megatron has not."""
    if spec.precision != "fp8":
        return []
    if spec.fp8_recipe not in MEGATRON_FP8_RECIPES:
        raise ValueError(f"fp8_recipe: Megatron-LM {MEGATRON_VERSION} has no {spec.fp8_recipe!r} recipe "
                         f"(it has {', '.join(MEGATRON_FP8_RECIPES)})")
    args = ["--fp8-format hybrid", f"--fp8-recipe {spec.fp8_recipe}"]
    if spec.fp8_param_gather:
        args.append("--fp8-param-gather")
    return args


def megatron_args(spec: JobSpec, c: Candidate, ck: CheckpointPlan | None = None) -> list[str]:
    """Megatron-LM (``pretrain_gpt.py``) arguments for the plan: the layout's flags, the model's
    shape, the optimizer and schedule (one flag with its value per item)."""
    sh, moe = spec.shape, spec.moe
    args = megatron_layout_args(spec, c)
    heads = moe.n_heads if moe else sh.n_heads
    ffn = (moe.d_ff or moe.expert_d_ff) if moe else sh.ffn_dim
    args += [f"--max-position-embeddings {spec.seq}", f"--num-layers {sh.n_layers}", f"--hidden-size {sh.d_model}", f"--ffn-hidden-size {ffn}",
             f"--num-attention-heads {heads}"]
    kv_heads = moe.kv_heads if moe else sh.kv_heads
    if moe is not None and moe.mla is not None:
        m = moe.mla
        args += ["--multi-latent-attention", f"--kv-lora-rank {m.kv_lora_rank}", f"--qk-head-dim {m.qk_nope_head_dim}",
                 f"--qk-pos-emb-head-dim {m.qk_rope_head_dim}", f"--v-head-dim {m.v_head_dim}"]
        if m.q_lora_rank:
            args.append(f"--q-lora-rank {m.q_lora_rank}")
    elif kv_heads != heads:
        args += ["--group-query-attention", f"--num-query-groups {kv_heads}"]
    if moe is not None and moe.mla is None and moe.head_dim is not None and moe.head_dim * heads != moe.d_model:
        args.append(f"--kv-channels {moe.head_dim}")
    if moe is not None and moe.qk_norm:
        args.append("--qk-layernorm")
    args += [f"--vocab-size {sh.vocab_size}", f"--make-vocab-size-divisible-by {vocab_divisor(spec, c)}",
             f"--position-embedding-type {'learned_absolute' if sh.learned_pos_emb else 'rope'}"]
    if not sh.learned_pos_emb:  # Megatron's default base is 10,000: Llama 3's 500,000 must be said
        args.append(f"--rotary-base {int(sh.rope_theta)}")
    args += [f"--normalization {'RMSNorm' if sh.norm == 'rmsnorm' else 'LayerNorm'}",
             # train.toml's dropout is 0 (as in Llama and most pre-training); Megatron's default is 0.1
             "--attention-dropout 0.0", "--hidden-dropout 0.0"]
    if sh.mlp == "swiglu":
        args.append("--swiglu")
    if not sh.bias:
        args.append("--disable-bias-linear")
    if not sh.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if spec.attention == "flash":
        args.append("--attention-backend flash")
    args += megatron_moe_args(spec, c) + megatron_fp8_args(spec)
    lr = learning_rate(spec)
    args += ["--bf16", f"--lr {lr}", f"--min-lr {round(lr / 10, 12)}", "--lr-decay-style cosine",
             f"--lr-warmup-iters {warmup_steps(spec)}", f"--train-iters {train_steps(spec)}", "--weight-decay 0.1",
             "--adam-beta2 0.95", "--clip-grad 1.0"]
    if ck is not None:
        args.append(f"--save-interval {ck.save_every_steps}")
    return args


def megatron_command(spec: JobSpec, c: Candidate, plan_dir: str = ".") -> str:
    """The one command that trains the plan in Megatron-LM, run on every node: the environment
    ``validate_args`` needs, torchrun for the plan's nodes, ``pretrain_gpt.py`` with the file's
    arguments and what the user provides (``MEGATRON_INPUTS``)."""
    return command_line(megatron_env(c), torchrun_head(spec) + ["$MEGATRON_LM/pretrain_gpt.py"],
                        f"$(grep -v '^#' {plan_dir}/megatron_args.txt) --save \"$CKPT_DIR\" --load \"$CKPT_DIR\" "
                        "--data-path \"$DATA_PREFIX\" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer "
                        "--tokenizer-model \"$TOKENIZER\"")


def megatron_args_text(spec: JobSpec, c: Candidate, ck: CheckpointPlan, plan_dir: str = ".") -> str:
    """``megatron_args.txt``: comment lines (the batch arithmetic, the command, what to provide),
    then one flag (with its value) per line."""
    lay = c.layout
    env = megatron_env(c)
    why_env = ("" if not env else
               "# CUDA_DEVICE_MAX_CONNECTIONS=8: Megatron-FSDP refuses 1 (validate_args)." if uses_megatron_fsdp(c) else
               f"# CUDA_DEVICE_MAX_CONNECTIONS=1: validate_args requires it with tp {lay.tp} / cp {lay.cp} (before Blackwell).")
    head = [f"# Megatron-LM {MEGATRON_VERSION} arguments generated by `course plan`: {spec.model_name} on "
            f"{spec.gpus} x {spec.gpu_name}, layout {lay.label()}.",
            f"# dp = {spec.gpus} / (tp {lay.tp} x pp {lay.pp} x cp {lay.cp}) = {lay.dp}; Megatron derives "
            f"{spec.global_batch} / ({lay.micro_batch} x {lay.dp}) = {lay.grad_accum} micro-batches per step.",
            "# Use (on every node" + (", with HEAD_NODE = the first node and JOB_ID = one id for all" if spec.nodes > 1
                                      else "") + "):",
            "#   " + megatron_command(spec, c, plan_dir)]
    head += [why_env] if why_env else []
    head += [f"# {k}: {v}" for k, v in MEGATRON_INPUTS.items()]
    return "\n".join(head + megatron_args(spec, c, ck)) + "\n"
