"""MoE and FP8 plans (course_lib/planner): the search's expert-parallel rules, the Megatron-LM
arguments held to Megatron-LM core_v0.14.0's own checks for MoE and FP8 (read at commit
23e00ed0963c, line numbers below: "args L" megatron/training/arguments.py, "tc L"
megatron/core/transformer/transformer_config.py, "ps L" megatron/core/parallel_state.py,
"spec L" megatron/core/models/gpt/gpt_layer_specs.py), on top of tests/test_planner_megatron.py's
parser and validate_args checks; and the torchtitan 0.2.0 files read by torchtitan's own code.

Work: three small MoE searches (a few seconds), torchtitan's config imports, meta-device models.
"""
from __future__ import annotations

import argparse
import re

import pytest

from course_lib.planner import Layout, checkpoint_plan, evaluate, make_spec, plan, score_layout
from course_lib.planner.megatron_job import megatron_args_text
from course_lib.planner.search import expert_parallel_sizes
import test_planner_megatron as tm

# MoE / FP8 flags as core_v0.14.0 declares them (type or "switch", default, choices, line)
MOE_FLAGS = {
    "--num-experts": (int, None, None, 2781), "--moe-ffn-hidden-size": (int, None, None, 2791),
    "--moe-router-topk": (int, 2, None, 2832), "--expert-model-parallel-size": (int, 1, None, 2777),
    "--expert-tensor-parallel-size": (int, None, None, 2779),
    "--moe-token-dispatcher-type": (str, "allgather", ("allgather", "alltoall", "flex"), 2869),
    "--moe-grouped-gemm": ("switch", False, None, 2802),
    "--moe-shared-expert-intermediate-size": (int, None, None, 2794),
    "--moe-layer-freq": ("freq", 1, None, 2783),
    "--moe-router-score-function": (str, "softmax", ("softmax", "sigmoid"), 2828),
    "--moe-router-enable-expert-bias": ("switch", False, None, 2843),
    "--moe-router-load-balancing-type": (str, "aux_loss", ("aux_loss", "seq_aux_loss", "sinkhorn", "none"), 2815),
    "--moe-aux-loss-coeff": (float, 0.0, None, 2860), "--moe-router-topk-scaling-factor": (float, None, None, 2841),
    "--moe-router-dtype": (str, None, ("fp32", "fp64"), 2819), "--moe-router-num-groups": (int, None, None, 2836),
    "--moe-router-group-topk": (int, None, None, 2839), "--mtp-num-layers": (int, None, None, 1509),
    "--multi-latent-attention": ("switch", False, None, 1507), "--q-lora-rank": (int, None, None, 2901),
    "--kv-lora-rank": (int, 32, None, 2903), "--qk-head-dim": (int, 128, None, 2905),
    "--qk-pos-emb-head-dim": (int, 64, None, 2907), "--v-head-dim": (int, 128, None, 2909),
    "--kv-channels": (int, None, None, 1427), "--qk-layernorm": ("switch", False, None, 2767),
    "--fp8-format": (str, None, ("e4m3", "hybrid"), 1219),
    "--fp8-recipe": (str, "delayed", ("tensorwise", "delayed", "mxfp8", "blockwise"), 1224),
    "--fp8-param-gather": ("switch", False, None, 1248),
}
DEST = {"--fp8-format": "fp8"}


def moe_freq_type(x: str):
    """args L275-283 and L308-330: an int, or a list expression of digits, [, ], (, ), + and *."""
    if "[" not in x:
        return int(x)
    if re.search(r"[^,\d\[\]\(\)\+\*]", x):
        raise ValueError(f"Invalid pattern: {x}")
    return eval(x)  # as Megatron does, after the same character check


_BASE_PARSER = tm.megatron_parser


def parser() -> argparse.ArgumentParser:
    p = _BASE_PARSER()
    for flag, (kind, default, choices, _line) in MOE_FLAGS.items():
        dest = DEST.get(flag)
        extra = {"dest": dest} if dest else {}
        if kind == "switch":
            p.add_argument(flag, action="store_true", **extra)
        elif kind == "freq":
            p.add_argument(flag, type=moe_freq_type, default=default, **extra)
        else:
            p.add_argument(flag, type=kind, default=default, choices=choices, **extra)
    return p


def run_command(text: str):
    """tm.run_command with the MoE/FP8 flags declared too."""
    saved = tm.megatron_parser
    tm.megatron_parser = parser
    try:
        return tm.run_command(text)
    finally:
        tm.megatron_parser = saved


def validate_moe(a: argparse.Namespace, env: dict, world: int) -> None:
    """tm.validate plus the MoE and FP8 checks of validate_args / TransformerConfig / parallel_state."""
    tm.validate(a, env, world)
    etp = a.expert_tensor_parallel_size or a.tensor_model_parallel_size                    # args L395-396
    ep, pp = a.expert_model_parallel_size, a.pipeline_model_parallel_size
    if ep > 1:                                                                             # args L951-956
        assert a.num_experts is not None, "num_experts must be non None to use expert model parallelism"
        assert a.num_experts % ep == 0, "Number of experts should be a multiple of expert model parallel_size."
    if a.moe_grouped_gemm:
        assert a.bf16, "Currently GroupedGEMM for MoE only supports bf16 dtype."              # args L790-791
    if a.num_experts is not None:
        assert not a.add_bias_linear, "Bias is not supported for MoE"                          # tc L1197-1198
        assert a.num_experts > 0                                                               # tc L742-743
        if isinstance(a.moe_layer_freq, list):                                                # spec L454-460
            assert len(a.moe_layer_freq) == a.num_layers, "Invalid length of moe_layer_pattern"
    if a.moe_router_enable_expert_bias:                                                       # tc L1200-1204
        assert a.moe_router_score_function == "sigmoid", "Expert bias for aux-loss-free routing only supports sigmoid"
    if a.moe_router_topk == 1 and a.moe_router_score_function == "softmax":                  # tc L1230-1238
        raise AssertionError("Please use --moe-router-pre-softmax when topk is 1.")
    if a.moe_router_group_topk:                                                               # tc L1240-1258
        assert a.moe_router_num_groups, "When using group limited routing, moe_router_num_groups must be specified."
        assert a.num_experts % a.moe_router_num_groups == 0
        assert a.moe_router_group_topk <= a.moe_router_num_groups
    if a.fp8_param_gather:                                                                     # args L615-617, tc L733-734
        assert a.use_distributed_optimizer or a.use_megatron_fsdp, \
            "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp"
        assert a.fp8 is not None, "fp8_param must be used together with fp8 mode."
    # initialize_model_parallel, after validate_args
    assert world % (etp * ep * pp) == 0, "world_size is not divisible by expert_tensor_model_pipeline_parallel size"  # ps L699-705


@pytest.fixture(scope="module")
def moe_plans():
    """name -> (spec, candidate): the searched best of three MoE jobs and two named layouts."""
    out = {}
    jobs = {
        "mixtral-8x7b-16": dict(model="mixtral-8x7b", gpu="h100", gpus=16, tokens="1T", seq=4096),
        "qwen3-30b-a3b-16-fp8": dict(model="qwen3-30b-a3b", gpu="h100", gpus=16, tokens="1T", seq=4096,
                                     precision="fp8", fp8_recipe="tensorwise", fp8_param_gather=True),
    }
    for name, kw in jobs.items():
        p = plan(**kw)
        out[name] = (p.spec, p.best)
    ds = make_spec(model="deepseek-v3", gpu="h800", gpus=2048, tokens="14.8T", seq=4096,
                   global_batch_tokens=15360 * 4096, moe_node_limit=4, precision="fp8", fp8_recipe="blockwise")
    out["deepseek-v3-pp16-ep64"] = (ds, score_layout(ds, "tp1,pp16,dp128,ep64,etp1,zero1,recompute=selective",
                                                     plan=plan_stub(ds)).candidate)
    mx = make_spec(model="mixtral-8x22b", gpu="h100", gpus=128, tokens="1T", seq=4096, global_batch_tokens=256 * 4096)
    out["mixtral-8x22b-tp2-ep8-etp2"] = (mx, evaluate(mx, Layout(2, 8, 8, 1, 1, "selective", 1, 32, 1, (), 8, 2)))
    return out


def plan_stub(spec):
    from course_lib.planner.search import Plan
    return Plan(spec)  # the published layout is scored alone here; the search runs in the published test


def test_expert_parallel_rules():
    spec = make_spec(model="mixtral-8x7b", gpu="h100", gpus=64, tokens="1T", seq=4096)
    # ep divides 8 experts; etp is 1 or tp; ep x etp divides tp cp dp; torchtitan: ep a multiple of cp (etp = tp)
    # or of tp x cp (etp = 1)
    assert expert_parallel_sizes(spec, 2, 1, 32) == [(2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (8, 2)]
    assert expert_parallel_sizes(spec, 1, 2, 32) == [(2, 1), (4, 1), (8, 1)]
    assert expert_parallel_sizes(make_spec(model="llama2-7b", gpu="h100", gpus=8, tokens="1T"), 1, 1, 8) == [(1, 1)]
    from course_lib.planner import PlanError
    with pytest.raises(PlanError, match="^--layout: ep3"):
        score_layout(spec, "tp1,pp1,dp64,ep3")
    with pytest.raises(PlanError, match="^--layout: ep/etp: only for a mixture-of-experts"):
        score_layout(make_spec(model="llama2-7b", gpu="h100", gpus=8, tokens="1T"), "tp1,dp8,ep2")


def test_megatron_accepts_every_moe_and_fp8_plan_and_it_describes_the_plan(moe_plans):
    for name, (spec, c) in moe_plans.items():
        text = megatron_args_text(spec, c, checkpoint_plan(spec, c), "runs/plan")
        env, world, a = run_command(text)
        assert world == spec.gpus, name
        try:
            validate_moe(a, env, world)
        except AssertionError as exc:
            raise AssertionError(f"{name} ({c.layout.label()}): Megatron-LM would refuse it: {exc}") from None
        moe, lay = spec.moe, c.layout
        assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size) == (moe.n_experts, moe.top_k,
                                                                               moe.expert_d_ff), name
        assert (a.expert_model_parallel_size, a.expert_tensor_parallel_size) == (lay.ep, lay.etp), name
        assert a.moe_token_dispatcher_type == "alltoall" and a.moe_grouped_gemm and a.moe_aux_loss_coeff > 0, name
        pattern = a.moe_layer_freq if isinstance(a.moe_layer_freq, list) else [1] * a.num_layers
        assert [bool(x) for x in pattern] == [moe.is_moe_layer(i) for i in range(moe.n_layers)], name
        assert (a.moe_shared_expert_intermediate_size or 0) == moe.n_shared_experts * moe.shared_width, name
        assert a.ffn_hidden_size == (moe.d_ff or moe.expert_d_ff) and a.num_attention_heads == moe.n_heads, name
        assert (a.kv_channels or moe.d_model // moe.n_heads) == moe.attn_head_dim or a.multi_latent_attention, name
        assert a.qk_layernorm == moe.qk_norm and a.multi_latent_attention == (moe.mla is not None), name
        assert (a.fp8 == "hybrid") == (spec.precision == "fp8") and a.fp8_param_gather == spec.fp8_param_gather, name
        if spec.precision == "fp8":
            assert a.fp8_recipe == spec.fp8_recipe, name
    ds = moe_plans["deepseek-v3-pp16-ep64"][1]
    assert ds.layout.ep == 64 and ds.layout.pp == 16


def test_the_moe_checks_refuse_what_megatron_refuses(moe_plans):
    spec, c = moe_plans["deepseek-v3-pp16-ep64"]
    good = megatron_args_text(spec, c, checkpoint_plan(spec, c), "runs/plan")
    faults = [
        (good.replace("--expert-model-parallel-size 64", "--expert-model-parallel-size 96"), "multiple of expert"),
        (good.replace("--expert-model-parallel-size 64", "--expert-model-parallel-size 256"),
         "not divisible by expert_tensor_model_pipeline_parallel"),
        (good.replace("--moe-router-score-function sigmoid", "--moe-router-score-function softmax"), "sigmoid"),
        (good.replace("[1]*58", "[1]*57"), "Invalid length of moe_layer_pattern"),
        (good.replace("--use-distributed-optimizer\n", ""), "--fp8-param-gather only supported")
        if "--fp8-param-gather" in good else (good.replace("--bf16", ""), "GroupedGEMM for MoE only supports bf16"),
    ]
    for broken, message in faults:
        env, world, a = run_command(broken)
        with pytest.raises(AssertionError, match=re.escape(message)):
            validate_moe(a, env, world)


def test_torchtitan_reads_every_moe_and_fp8_plan(moe_plans, tmp_path):
    """torchtitan 0.2.0's ConfigManager loads the file, ParallelDims (with its ep/etp rules) accepts
    the degrees, and the model module builds torchtitan's own DeepSeek-V3 / Qwen3 with exactly the
    plan's parameters (meta device). Mixtral has no torchtitan model and gets no file."""
    import sys

    import torch
    from engine_code import torchtitan, without_triton
    from course_lib.planner.torchtitan_job import (MODEL_MODULE, torchtitan_model_py, torchtitan_toml,
                                                   torchtitan_unsupported)
    from test_planner_engines import load_model_args

    without_triton()
    titan = {name: torchtitan(name) for name in ("config.manager", "distributed.parallel_dims", "protocols.train_spec")}
    checked = set()
    for name, (spec, c) in moe_plans.items():
        why = torchtitan_unsupported(spec, c)
        if name.startswith("mixtral"):
            assert "has no code for" in why, name
            continue
        if spec.precision == "fp8" and spec.fp8_recipe == "blockwise":
            assert "not 'blockwise'" in why, name
            spec = dataclasses_replace(spec, fp8_recipe="rowwise")
        assert not torchtitan_unsupported(spec, c), name
        folder = tmp_path / name
        folder.mkdir()
        (folder / "torchtitan.toml").write_text(torchtitan_toml(spec, c, checkpoint_plan(spec, c), str(folder)))
        (folder / f"{MODEL_MODULE}.py").write_text(torchtitan_model_py(spec, c))
        cfg = titan["config.manager"].ConfigManager().parse_args(["--job.config_file", str(folder / "torchtitan.toml")])
        par, lay = cfg.parallelism, c.layout
        dims = titan["distributed.parallel_dims"].ParallelDims(
            dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
            ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=spec.gpus)
        assert (dims.ep, dims.etp, dims.tp, dims.pp, dims.dp_shard) == (lay.ep, lay.etp, lay.tp, lay.pp, lay.dp), name
        fp8 = spec.precision == "fp8"
        assert cfg.model.converters == (["float8"] if fp8 else []), name
        if fp8:
            f8 = cfg.quantize.linear.float8
            assert f8.recipe_name == spec.fp8_recipe and "output" in f8.filter_fqns, name
            assert f8.enable_fsdp_float8_all_gather == (spec.fp8_param_gather and spec.fp8_recipe == "tensorwise")
        args = load_model_args(titan, cfg, folder)
        model_cls = titan["protocols.train_spec"].get_train_spec(cfg.model.name).model_cls
        with torch.device("meta"):
            model = model_cls(args)
        assert sum(p.numel() for p in model.parameters()) == spec.moe.num_params(), name
        # the module names the router filter keeps in bf16 exist
        if fp8:
            assert any(n.endswith("router.gate") for n, _ in model.named_modules()), name
        checked.add(name)
        sys.modules.pop(MODEL_MODULE, None)
    assert checked == {"qwen3-30b-a3b-16-fp8", "deepseek-v3-pp16-ep64"}
    # one fault each: torchtitan's own checks refuse an ep its mesh cannot fold, an unknown key
    with pytest.raises(AssertionError):
        titan["distributed.parallel_dims"].ParallelDims(dp_shard=8, dp_replicate=1, cp=2, tp=1, pp=1, ep=3, etp=1,
                                                        world_size=16)


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_moe_plan_files_are_the_engines_and_plan_md_explains_the_experts(tmp_path):
    from course_lib.planner import plan_files

    p = plan(model="qwen3-30b-a3b", gpu="h100", gpus=8, tokens="1T", seq=4096, precision="fp8", fp8_param_gather=True)
    files = plan_files(p, tmp_path, validate_ds=False)
    # the kit's trainer files would describe its dense stand-in: only the engines' files are written
    assert sorted(files) == ["budget.json", "megatron_args.txt", "plan.md", "torchtitan.toml", "torchtitan_model.py"]
    md, lay = files["plan.md"], p.best.layout
    assert "## Experts" in md and f"expert-data-parallel {lay.edp}" in md and "## FP8" in md
    assert f"each GPU holds {128 // lay.ep} experts per block" in md and "launch_torchrun.sh" not in md
    assert p.spec.recipe == "fp8-params-adam" and p.best.memory["params"] == pytest.approx(
        p.best.memory["dense_params"] / 1 * 1 + p.best.memory["expert_params"], rel=1e-9)  # 1 byte per weight
