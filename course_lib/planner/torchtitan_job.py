"""The plan for torchtitan 0.2.0: ``torchtitan.toml`` (its job config) and ``torchtitan_model.py``,
the module that registers the plan's exact model with torchtitan.

torchtitan **0.2.0** (PyPI wheel; ``torchtitan/config/job_config.py``) is the last release whose
``ConfigManager`` reads a TOML file (``--job.config_file``; 0.3.0 replaced files with Python config
registries). It ships one dense model, Llama 3, in three flavors whose vocabulary (128,256), RoPE
base (500,000) and Llama 3.1 RoPE scaling are fixed in the flavor (``update_from_config`` sets only
``max_seq_len``). A Llama 2 plan run under flavor "70B" would train another, larger model. So the
plan never names a built-in flavor: ``torchtitan_model.py`` builds torchtitan's own Llama train
spec with ``model_args`` = exactly the plan's shape, vocabulary and RoPE, and registers it with
``register_train_spec``, as torchtitan's docs/extension.md describes; ``[experimental]
custom_import`` makes ``torchtitan.train`` import it before it looks the model up (the plan's
folder must be on ``PYTHONPATH``: the command in plan.md sets it).

Models torchtitan's Llama cannot be (GPT-2: learned positions, LayerNorm, GELU, biases, tied
embeddings) get no torchtitan files; :func:`torchtitan_unsupported` says why, and plan.md repeats it.

How the plan maps:

* batch: torchtitan takes ``local_batch_size`` per data-parallel rank and derives accumulation =
  global / (local x dp); with a pipeline its schedule cuts ``local_batch_size`` into micro-batches
  of ``pipeline_parallel_microbatch_size``, so there local = micro-batch x micro-batches per step;
* data parallelism: FSDP2 (over dp x cp, like the plan), DDP only on a 1-D mesh: ZeRO-0 on pure
  data parallelism is DDP, every other stage FSDP2, ``fsdp_reshard_after_forward = "always"`` for
  ZeRO-3, ``"never"`` otherwise (weights stay gathered from forward to backward: ZeRO-2's memory);
* pipeline: the exact blocks of every stage as ``module_fqns_per_model_part`` (its Llama's module
  names), never its default split (which moves a block off each end stage);
* recomputation: torchtitan's nearest to the planner's selective is op-level selective
  checkpointing (``selective_ac_option = "op"``).
* mixture of experts: torchtitan 0.2.0's MoE models are DeepSeek-V3 (MLA, dense blocks first,
  shared experts, sigmoid router with node-limited groups) and Qwen3 (GQA with QK-norm, softmax
  router, no pipelining function); the model module registers the matching train spec with the
  plan's shape, and ``expert_parallel_degree`` / ``expert_tensor_parallel_degree`` carry ep and etp
  (FSDP2 over dp, never DDP: torchtitan's experts borrow their ranks from ``dp_shard``). A Mixtral
  plan gets no torchtitan file (no such model there).
* FP8: ``[model] converters = ["float8"]`` and ``[quantize.linear.float8]`` with the recipe
  (tensorwise or rowwise; torchao's), FP8 all-gather for FSDP with tensorwise weights kept in FP8,
  the output head (and a MoE router) left in bf16 through ``filter_fqns``.
"""
from __future__ import annotations

from course_lib.planner.checkpoint_plan import CheckpointPlan
from course_lib.planner.configs import learning_rate
from course_lib.planner.costs import Candidate
from course_lib.planner.engines import (TORCHTITAN_VERSION, command_line, stage_blocks, torchrun_head, train_steps,
                                        warmup_steps)
from course_lib.planner.spec import JobSpec

MODEL_MODULE = "torchtitan_model"   # torchtitan_model.py in the plan's folder
TRAIN_SPEC_NAME = "course_llama"     # torchtitan's Llama code under the plan's model args
NORM_EPS = 1e-5                      # Llama 2 and 3 (HF config.json rms_norm_eps); torchtitan's default too
#: What the user provides to the torchtitan command.
TORCHTITAN_INPUTS = {
    "tokenizer": "the Hugging Face tokenizer files in ./assets/hf/tokenizer ([model] hf_assets_path), with the "
                 "plan's vocabulary",
    "data": "[training] dataset (default c4, streamed from the Hugging Face hub) or dataset_path to a local copy",
    "checkpoint folder": "written under [job] dump_folder / [checkpoint] folder and resumed from there",
}


#: torchtitan 0.2.0's Float8Linear recipes (config/job_config.py, Float8Linear.recipe_name)
TORCHTITAN_FP8_RECIPES = ("tensorwise", "rowwise")


def moe_family(spec: JobSpec) -> str:
    """Which torchtitan MoE model the plan's experts are: "deepseek_v3", "qwen3", or "" (none)."""
    moe = spec.moe
    if moe is None:
        return ""
    if moe.mla is not None:
        return "deepseek_v3"
    if moe.qk_norm and moe.head_dim is not None and not moe.n_shared_experts and not moe.n_dense_layers:
        return "qwen3"
    return ""


def torchtitan_unsupported(spec: JobSpec, c: Candidate | None = None) -> str:
    """Why torchtitan 0.2.0 cannot train the plan ("" when it can): a model it has no code for, a
    layout its model cannot take (Qwen3 has no pipelining function), an FP8 recipe it has not."""
    if spec.precision == "fp8" and spec.fp8_recipe not in TORCHTITAN_FP8_RECIPES:
        return (f"torchtitan {TORCHTITAN_VERSION}'s float8 linears take the {' or '.join(TORCHTITAN_FP8_RECIPES)} "
                f"recipe, not {spec.fp8_recipe!r}")
    if spec.moe is not None:
        family = moe_family(spec)
        if not family:
            return (f"{spec.model_name} is a mixture-of-experts model torchtitan {TORCHTITAN_VERSION} has no code for "
                    "(its MoE models are DeepSeek-V3 and Qwen3)")
        if family == "qwen3" and c is not None and c.layout.pp > 1:
            return (f"torchtitan {TORCHTITAN_VERSION}'s Qwen3 has no pipelining function, and this layout has "
                    f"pp {c.layout.pp}")
        return ""
    sh = spec.shape
    differs = [what for what, bad in (
        ("learned position embeddings", sh.learned_pos_emb), (f"{sh.norm} (not RMSNorm)", sh.norm != "rmsnorm"),
        (f"a {sh.mlp} MLP (not SwiGLU)", sh.mlp != "swiglu"), ("biases", sh.bias),
        ("tied input and output embeddings", sh.tied_embeddings)) if bad]
    if not differs and ffn_args(sh.d_model, sh.ffn_dim) is None:
        differs.append(f"an MLP width ({sh.ffn_dim}) its FeedForward cannot produce")
    if not differs:
        return ""
    return (f"{spec.model_name} has {', '.join(differs)}; torchtitan {TORCHTITAN_VERSION}'s only dense model is Llama "
            "(RoPE, RMSNorm, SwiGLU, no biases, untied embeddings), so the plan writes no torchtitan files")


def feed_forward_width(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """The hidden width torchtitan 0.2.0's Llama ``FeedForward`` builds for ``4 * dim``
    (torchtitan/models/llama3/model/model.py: 2/3 of it, times the multiplier, rounded up)."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ffn_args(dim: int, width: int) -> tuple[int, float | None] | None:
    """``(multiple_of, ffn_dim_multiplier)`` that make torchtitan's FeedForward exactly ``width``
    wide: rounding alone where it reaches it (the largest multiple, as Meta's configs), else a
    multiplier aimed half a unit above ``width`` (``int()`` truncates) with no rounding; or None."""
    for multiple_of in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        if width % multiple_of == 0 and feed_forward_width(dim, multiple_of, None) == width:
            return multiple_of, None
    multiplier = (width + 0.5) / int(2 * (4 * dim) / 3)
    return (1, multiplier) if feed_forward_width(dim, 1, multiplier) == width else None


def model_args(spec: JobSpec) -> dict:
    """``TransformerModelArgs`` keywords for the plan's model (RoPE scaling factor 1: torchtitan
    0.2.0 always applies Llama 3.1's scaling, and a factor of 1 leaves the frequencies unscaled)."""
    sh = spec.shape
    multiple_of, multiplier = ffn_args(sh.d_model, sh.ffn_dim)
    return {"dim": sh.d_model, "n_layers": sh.n_layers, "n_heads": sh.n_heads, "n_kv_heads": sh.kv_heads,
            "vocab_size": sh.vocab_size, "multiple_of": multiple_of, "ffn_dim_multiplier": multiplier,
            "norm_eps": NORM_EPS, "rope_theta": float(sh.rope_theta)}


def flavor(spec: JobSpec) -> str:
    """The flavor name the module registers: the preset's name, or "plan" for a changed shape."""
    from course_lib.estimate import MOE_PRESETS, PRESETS

    if spec.moe is not None:
        return spec.model_name if MOE_PRESETS.get(spec.model_name) == spec.moe else "plan"
    return spec.model_name if PRESETS.get(spec.model_name) == spec.shape else "plan"


def train_spec_name(spec: JobSpec) -> str:
    """The name the model module registers: "course_llama", or "course_deepseek_v3" / "course_qwen3"."""
    return f"course_{moe_family(spec)}" if spec.moe is not None else TRAIN_SPEC_NAME


def moe_model_args(spec: JobSpec, c: Candidate | None = None) -> tuple[str, str, dict, dict]:
    """(torchtitan model package, args class, model-args keywords, MoEArgs keywords) for a MoE plan.
    Node-limited routing (DeepSeek-V3) becomes ``n_expert_groups`` = the nodes of the EP group and
    ``n_limited_groups`` = the limit, as in torchtitan's own 671B flavor (8 and 4)."""
    moe = spec.moe
    family = moe_family(spec)
    if family == "deepseek_v3":
        m = moe.mla
        groups = limited = 1
        if spec.moe_node_limit is not None and c is not None:
            nodes = max(1, c.layout.ep * c.layout.etp // spec.gpus_per_node)
            if moe.n_experts % nodes == 0 and spec.moe_node_limit <= nodes:
                groups, limited = nodes, spec.moe_node_limit
        kw = {"vocab_size": moe.vocab_size, "dim": moe.d_model, "inter_dim": moe.d_ff, "moe_inter_dim": moe.expert_d_ff,
              "n_layers": moe.n_layers, "n_dense_layers": moe.n_dense_layers, "n_heads": moe.n_heads,
              "n_expert_groups": groups, "n_limited_groups": limited, "q_lora_rank": m.q_lora_rank,
              "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
              "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "rope_theta": float(moe.rope_theta)}
        router = {"num_experts": moe.n_experts, "num_shared_experts": moe.n_shared_experts, "top_k": moe.top_k,
                  "score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "score_before_experts": False}
        return "deepseek_v3", "DeepSeekV3ModelArgs", kw, router
    kw = {"vocab_size": moe.vocab_size, "dim": moe.d_model, "n_layers": moe.n_layers, "n_heads": moe.n_heads,
          "n_kv_heads": moe.kv_heads, "head_dim": moe.head_dim, "qk_norm": True, "rope_theta": float(moe.rope_theta),
          "moe_enabled": True, "moe_inter_dim": moe.expert_d_ff}
    router = {"num_experts": moe.n_experts, "num_shared_experts": 0, "top_k": moe.top_k, "score_func": "softmax",
              "route_norm": True, "route_scale": 1.0, "score_before_experts": False}
    return "qwen3", "Qwen3ModelArgs", kw, router


def _moe_model_py(spec: JobSpec, c: Candidate | None) -> str:
    package, cls, kw, router = moe_model_args(spec, c)
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    moe_args = ", ".join(f"{k}={v!r}" for k, v in router.items())
    return f'''"""torchtitan {TORCHTITAN_VERSION} model generated by `course plan`: {spec.model_name}, exactly as planned.

torchtitan.train imports this module first ([experimental] custom_import in torchtitan.toml; this
folder must be on PYTHONPATH), then builds train_spec.model_args["{flavor(spec)}"] of "{train_spec_name(spec)}":
torchtitan's own {package} code with the plan's shape, experts and router.
"""
import dataclasses

from torchtitan.models.{package} import get_train_spec
from torchtitan.models.{package}.model.args import {cls}
from torchtitan.models.moe import MoEArgs
from torchtitan.protocols.train_spec import register_train_spec

MODEL_ARGS = {cls}({args}, moe_args=MoEArgs({moe_args}))

register_train_spec("{train_spec_name(spec)}", dataclasses.replace(get_train_spec(), model_args={{"{flavor(spec)}": MODEL_ARGS}}))
'''


def torchtitan_model_py(spec: JobSpec, c: Candidate | None = None) -> str:
    """``torchtitan_model.py``: registers torchtitan's Llama train spec (a MoE plan: its DeepSeek-V3
    or Qwen3 train spec) with the plan's model args."""
    if spec.moe is not None:
        return _moe_model_py(spec, c)
    kw = ", ".join(f"{k}={v!r}" for k, v in model_args(spec).items())
    return f'''"""torchtitan {TORCHTITAN_VERSION} model generated by `course plan`: {spec.model_name}, exactly as planned.

torchtitan.train imports this module first ([experimental] custom_import in torchtitan.toml; this
folder must be on PYTHONPATH), then builds train_spec.model_args["{flavor(spec)}"] of "{TRAIN_SPEC_NAME}":
torchtitan's own Llama code with the plan's shape, vocabulary and RoPE base. No built-in flavor
is used: each fixes Llama 3's vocabulary, RoPE base and RoPE scaling.
"""
import dataclasses

from torchtitan.models.llama3 import get_train_spec
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.protocols.train_spec import register_train_spec

# scaling_factor=1.0: torchtitan always applies Llama 3.1's RoPE scaling; a factor of 1 leaves the
# frequencies as theta**(-2i/d), the plan's unscaled RoPE.
MODEL_ARGS = TransformerModelArgs({kw}, rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0))

register_train_spec("{TRAIN_SPEC_NAME}", dataclasses.replace(get_train_spec(), model_args={{"{flavor(spec)}": MODEL_ARGS}}))
'''


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


def _parallelism(spec: JobSpec, c: Candidate) -> dict:
    lay = c.layout
    batches = torchtitan_batches(c)
    # DDP only on a 1-D mesh, and never with experts (they borrow their ranks from dp_shard)
    ddp = lay.zero_stage == 0 and lay.tp * lay.pp * lay.cp == 1 and lay.ep == 1
    reshard = "always" if lay.zero_stage == 3 else "never"
    out = {
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
    if spec.moe is not None:
        out["expert_parallel_degree"] = (lay.ep, f"{spec.moe.n_experts // lay.ep} experts per rank per MoE block")
        out["expert_tensor_parallel_degree"] = (lay.etp, f"expert-data-parallel {lay.edp}")
    if lay.pp > 1:
        out["module_fqns_per_model_part"] = (
            torchtitan_fqns_per_stage(spec, c), f"blocks per stage {list(stage_blocks(spec, c))} (the plan's split)")
    return out


def torchtitan_sections(spec: JobSpec, c: Candidate, ck: CheckpointPlan) -> dict:
    """torchtitan's job config as {section: {key: (value, comment)}} (see module for the mapping)."""
    lay = c.layout
    batches = torchtitan_batches(c)
    sections = {
        "job": {"dump_folder": (f"./outputs/{spec.model_name}-{spec.gpus}gpu", ""),
                "description": (f"course plan: {spec.model_name} on {spec.gpus} x {spec.gpu_name}, {lay.label()}", "")},
        "experimental": {"custom_import": (MODEL_MODULE, f"{MODEL_MODULE}.py registers the plan's model")},
        "model": {"name": (train_spec_name(spec), f"torchtitan's {moe_family(spec) or 'Llama'} code with the plan's "
                                                  "model args"),
                  "flavor": (flavor(spec), f"registered by {MODEL_MODULE}.py: the plan's shape, vocabulary "
                                           f"({spec.shape.vocab_size}) and RoPE base ({spec.shape.rope_theta:g})"),
                  "hf_assets_path": ("./assets/hf/tokenizer", "the tokenizer's files")},
        "optimizer": {"name": ("AdamW", ""), "lr": (learning_rate(spec), ""), "beta2": (0.95, ""),
                      "weight_decay": (0.1, "")},
        "lr_scheduler": {"warmup_steps": (warmup_steps(spec), ""), "decay_type": ("cosine", ""),
                         "min_lr_factor": (0.1, "")},
        "training": {"local_batch_size": (batches["local_batch_size"], "sequences per data-parallel rank per step"
                                          + (" (all the pipeline's micro-batches)" if lay.pp > 1 else "")),
                     "global_batch_size": (batches["global_batch_size"],
                                           f"{lay.dp} dp x {batches['local_batch_size']} x "
                                           f"{batches['accumulation']} accumulation"),
                     "seq_len": (spec.seq, ""), "steps": (train_steps(spec), ""), "max_norm": (1.0, ""),
                     "mixed_precision_param": ("bfloat16", ""), "mixed_precision_reduce": ("float32", "")},
        "parallelism": _parallelism(spec, c),
        "activation_checkpoint": dict(
            [("mode", (lay.recompute, "plan: " + lay.recompute))]
            + ([("selective_ac_option", ("op", "op-level selective checkpointing: the nearest to recomputing "
                                              "the attention core"))] if lay.recompute == "selective" else [])),
        "checkpoint": {"enable": (True, ""), "folder": ("checkpoint", ""),
                       "interval": (ck.save_every_steps, "Young/Daly (plan.md)"),
                       "keep_latest_k": (ck.keep_last, ""), "async_mode": ("async", "")},
    }
    if spec.precision == "fp8":
        sections["model"]["converters"] = (["float8"], "torchao float8 training: nn.Linear -> Float8Linear")
        gather = spec.fp8_param_gather and spec.fp8_recipe == "tensorwise"
        keep = ["output"] + (["router.gate"] if spec.moe is not None else [])
        sections["quantize.linear.float8"] = {
            "recipe_name": (spec.fp8_recipe, "scaling: one scale per tensor" if spec.fp8_recipe == "tensorwise"
                            else "one scale per row"),
            "enable_fsdp_float8_all_gather": (gather, "weights all-gathered in FP8 (1 byte per parameter)" if gather
                                              else "bf16 all-gather (FP8 gather needs tensorwise weights in FP8)"),
            "precompute_float8_dynamic_scale_for_fsdp": (gather, "one all-reduce for every weight's amax" if gather
                                                         else ""),
            "filter_fqns": (keep, "left in bf16: the output head" + (" and the routers" if spec.moe else ""))}
    return sections


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v) if isinstance(v, float) else str(v)


def torchtitan_command(spec: JobSpec, plan_dir: str = ".") -> str:
    """The one command that trains the plan in torchtitan, run on every node (the plan's folder on
    PYTHONPATH for the model module)."""
    return command_line({"PYTHONPATH": f"{plan_dir}${{PYTHONPATH:+:$PYTHONPATH}}"},
                        torchrun_head(spec) + ["-m", "torchtitan.train", "--job.config_file",
                                               f"{plan_dir}/torchtitan.toml"])


def torchtitan_toml(spec: JobSpec, c: Candidate, ck: CheckpointPlan, plan_dir: str = ".") -> str:
    """The torchtitan job config text; the caller checks :func:`torchtitan_unsupported` first."""
    reason = torchtitan_unsupported(spec, c)
    if reason:
        raise ValueError(f"model: {reason}")
    lines = [f"# torchtitan {TORCHTITAN_VERSION} job config generated by `course plan`: {spec.model_name} on "
             f"{spec.gpus} x {spec.gpu_name}, layout {c.layout.label()}.",
             "# Run on every node" + (" (HEAD_NODE = the first node, JOB_ID = one id for all)" if spec.nodes > 1 else "")
             + ":", "#   " + torchtitan_command(spec, plan_dir)]
    lines += [f"# {k}: {v}" for k, v in TORCHTITAN_INPUTS.items()]
    for section, keys in torchtitan_sections(spec, c, ck).items():
        lines.append(f"\n[{section}]")
        for key, (value, comment) in keys.items():
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {comment}" if comment else ""))
    return "\n".join(lines) + "\n"
