"""A plan's torchtitan files, read by torchtitan 0.2.0's own code (course_lib/planner/torchtitan_job.py).

torchtitan 0.2.0 is a dev dependency (pyproject.toml), imported without its package ``__init__``
(which pulls in triton; tests/engine_code.py says why and how). For every plan of tests/plan_cases.py
whose model torchtitan's Llama can be, the files are written as `course plan` writes them and:

* ``ConfigManager().parse_args(["--job.config_file", FILE])`` loads the TOML (it refuses a key that
  is not a JobConfig field) and every value is the plan's;
* ``ParallelDims`` (built as ``Trainer._create_parallel_dims`` does, torchtitan/train.py 373-382)
  accepts the degrees for the plan's world size; the accumulation torchtitan derives (train.py
  195-213) and the pipeline's stages per rank (distributed/pipeline_parallel.py: 183-192 and
  ``pipeline_module_split``'s ``_get_stage_indices``, 444-452) are the plan's;
* the model: ``[experimental] custom_import`` is imported as train.py does (lines 78-79), then
  ``get_train_spec(model.name).model_args[model.flavor]`` (train.py 124, 141-143) is built on the
  meta device with torchtitan's ``Transformer``: its parameter count is the plan's exactly, and its
  vocabulary, MLP width, KV heads and RoPE frequencies are the plan's; every module name of
  ``module_fqns_per_model_part`` is one of its modules, each block once, in order.

Models torchtitan's Llama cannot be (GPT-2, BLOOM) get no torchtitan files, and plan.md says why.

Work: the plans of tests/plan_cases.py (about 4 s); torchtitan's imports (a few seconds); one
meta-device model per Llama plan (no memory, well under a second each).
"""
from __future__ import annotations

import importlib
import math
import sys
import tomllib

import pytest

from course_lib.planner import checkpoint_plan, plan, plan_files
from course_lib.planner.engines import stage_blocks
from course_lib.planner.torchtitan_job import (MODEL_MODULE, torchtitan_batches, torchtitan_model_py, torchtitan_toml,
                                               torchtitan_unsupported)
from engine_code import torchtitan
from plan_cases import SEARCHED, engine_cases

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def titan():
    """torchtitan 0.2.0's modules the checks use."""
    return {name: torchtitan(name) for name in ("config.manager", "distributed.parallel_dims",
                                                 "protocols.train_spec", "models.llama3.model.model")}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (spec, candidate, folder with torchtitan.toml + torchtitan_model.py) for the Llama plans."""
    out = {}
    for name, spec, c in engine_cases():
        if torchtitan_unsupported(spec):
            continue
        folder = tmp_path_factory.mktemp(name)
        (folder / "torchtitan.toml").write_text(torchtitan_toml(spec, c, checkpoint_plan(spec, c), str(folder)))
        (folder / f"{MODEL_MODULE}.py").write_text(torchtitan_model_py(spec))
        out[name] = (spec, c, folder)
    return out


def load_model_args(titan, cfg, folder):
    """The model args torchtitan's Trainer builds for ``cfg``: it imports ``[experimental]
    custom_import`` (the plan's folder on sys.path, as the command's PYTHONPATH), then looks the
    model up by name and flavor, then lets the args read the job config."""
    registry = titan["protocols.train_spec"]._extra_train_specs
    registry.clear()  # each plan's module registers the same name: one registration per process
    sys.modules.pop(cfg.experimental.custom_import, None)
    sys.path.insert(0, str(folder))
    try:
        if cfg.experimental.custom_import:
            importlib.import_module(cfg.experimental.custom_import)
        args = titan["protocols.train_spec"].get_train_spec(cfg.model.name).model_args[cfg.model.flavor]
    finally:
        sys.path.remove(str(folder))
    args.update_from_config(cfg)
    return args


def test_torchtitan_reads_every_llama_plan_as_planned(titan, written):
    import torch

    assert {"7b-one-node", "70b-8-nodes", "7b-8k-context", "llama3-8b-2-nodes", "llama3-70b-512",
            "70b-pp4v3-uneven", "llama2-70b-78-layers"} <= set(written)
    model_mod = titan["models.llama3.model.model"]
    for name, (spec, c, folder) in written.items():
        lay, sh = c.layout, spec.shape
        cfg = titan["config.manager"].ConfigManager().parse_args(["--job.config_file", str(folder / "torchtitan.toml")])
        par, tr = cfg.parallelism, cfg.training
        dims = titan["distributed.parallel_dims"].ParallelDims(   # as Trainer._create_parallel_dims
            dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
            ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=spec.gpus)
        assert (dims.tp, dims.pp, dims.cp, dims.dp_replicate * dims.dp_shard) == (lay.tp, lay.pp, lay.cp, lay.dp), name
        assert dims.dp_replicate > 1 or lay.zero_stage > 0 or lay.dp == 1 or lay.tp * lay.pp * lay.cp > 1, name
        assert (par.fsdp_reshard_after_forward == "always") == (lay.zero_stage == 3), name
        # train.py 195-213: accumulation = global / (local x dp); global must be a multiple
        dp = dims.dp_replicate * dims.dp_shard
        assert tr.global_batch_size % (tr.local_batch_size * dp) == 0, name
        accumulation = tr.global_batch_size // (tr.local_batch_size * dp)
        assert tr.global_batch_size == spec.global_batch and tr.seq_len == spec.seq, name
        assert accumulation == torchtitan_batches(c)["accumulation"], name
        assert cfg.activation_checkpoint.mode == lay.recompute and cfg.model.converters == [], name
        if lay.pp > 1:
            # pipeline_parallel.py 183-192: local batch cut into micro-batches of the given size
            assert tr.local_batch_size % par.pipeline_parallel_microbatch_size == 0, name
            assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == lay.grad_accum, name
            assert accumulation == 1, name
            parts = par.module_fqns_per_model_part
            assert len(parts) % lay.pp == 0 and len(parts) // lay.pp == lay.virtual_stages, name  # 444-452
            schedule = torch.distributed.pipelining.schedules.get_schedule_class(par.pipeline_parallel_schedule)
            single = issubclass(schedule, torch.distributed.pipelining.schedules.PipelineScheduleSingle)
            assert single == (lay.virtual_stages == 1), name  # one stage per rank, or a looped schedule
            assert [sum(n.startswith("layers.") for n in p) for p in parts] == list(stage_blocks(spec, c)), name
        else:
            assert accumulation == lay.grad_accum and tr.local_batch_size == lay.micro_batch, name

        args = load_model_args(titan, cfg, folder)
        with torch.device("meta"):
            model = model_mod.Transformer(args)
        assert sum(p.numel() for p in model.parameters()) == sh.num_params(), name
        assert model.tok_embeddings.num_embeddings == model.output.out_features == sh.vocab_size, name
        assert model.layers["0"].feed_forward.w1.out_features == sh.ffn_dim, name
        assert model.layers["0"].attention.wk.out_features == sh.kv_heads * sh.head_dim, name
        assert args.max_seq_len == spec.seq and args.norm_eps == 1e-5, name
        # RoPE: torchtitan's own frequencies (its Llama 3.1 scaling always applied) are the plan's
        # unscaled theta ** (-2i / head_dim)
        freqs = model_mod.precompute_freqs_cis(sh.head_dim, 2, args.rope_theta, args.rope_scaling_args)
        plain = 1.0 / (sh.rope_theta ** (torch.arange(0, sh.head_dim, 2).double() / sh.head_dim))
        assert torch.allclose(freqs[1].angle().double(), plain, rtol=1e-5, atol=0), name
        if lay.pp > 1:
            flat = [n for p in par.module_fqns_per_model_part for n in p]
            assert flat == ["tok_embeddings"] + [f"layers.{i}" for i in range(sh.n_layers)] + ["norm", "output"]
            for fqn in flat:
                model.get_submodule(fqn)


def test_models_torchtitan_cannot_be_get_no_file_and_plan_md_says_why(tmp_path):
    skipped = {name for name, spec, _ in engine_cases() if torchtitan_unsupported(spec)}
    assert skipped == {"gpt2-xl", "gpt2-small-tp2", "bloom-5-6x10-5"}
    p = plan(**SEARCHED["gpt2-xl"])
    files = plan_files(p, tmp_path, validate_ds=False)
    assert "torchtitan.toml" not in files and "torchtitan_model.py" not in files
    assert "no `torchtitan.toml`: gpt2-xl has learned position embeddings, layernorm (not RMSNorm), a gelu MLP " \
           "(not SwiGLU), biases, tied input and output embeddings" in files["plan.md"]
    with pytest.raises(ValueError, match="^model: gpt2-xl has learned position"):
        torchtitan_toml(p.spec, p.best, checkpoint_plan(p.spec, p.best))


def test_llama_plans_write_both_files_and_plan_md_starts_each_engine(tmp_path):
    p = plan(**SEARCHED["llama3-8b-2-nodes"])
    files = plan_files(p, tmp_path, validate_ds=False)
    cfg = tomllib.loads(files["torchtitan.toml"])
    assert cfg["experimental"]["custom_import"] == MODEL_MODULE and cfg["model"]["flavor"] == "llama3-8b"
    md = files["plan.md"]
    section = md[md.index("## How to start it"):md.index("## Checkpoints")]
    for engine in ("torchrun", "SLURM", "DeepSpeed", "accelerate", "Megatron-LM", "torchtitan"):
        assert f"{engine}" in section, engine
    assert f"PYTHONPATH={tmp_path}" in section and f"-m torchtitan.train --job.config_file {tmp_path}/torchtitan.toml" \
        in section
    assert "`TOKENIZER`" in section and "`DATA_PREFIX`" in section and "`CKPT_DIR`" in section
    assert f"mkdir -p runs/llama3-8b-16gpu && sbatch {tmp_path}/job.sbatch" in section
    assert math.isclose(float(tomllib.loads(files["train.toml"])["model"]["rope_theta"]), 500000.0)


def test_the_precision_and_weight_decay_plan_md_states_are_what_torchtitan_runs(titan, written, tmp_path):
    """torchtitan 0.2.0's own code decides the precision: ``maybe_enable_amp`` (autocast under DDP
    or one GPU, nothing when TP/PP run without FSDP) and ``parallelize_llama`` (fully_shard's
    MixedPrecisionPolicy when ``ParallelDims.fsdp_enabled``). For every Llama plan and a TP-only
    one (llama2-7b on 8 H100 with one sequence per step: tp8 dp1, the review's case, issue 44),
    what torchtitan will run is what the file's comment, plan.md and budget.json say; for the
    TP-only plan that is fp32, with its own memory in the budget. ``build_optimizers`` gives every
    parameter the file's weight decay, norm weights too, as plan.md says."""
    import contextlib
    import json

    import torch

    from course_lib.planner.torchtitan_job import torchtitan_precision

    amp = torchtitan("distributed.utils").maybe_enable_amp
    tp_only = plan(model="llama2-7b", gpu="h100-80gb", gpus=8, gpus_per_node=8, tokens="1T", seq=4096,
                   global_batch_tokens=4096)
    lay = tp_only.best.layout
    assert (lay.tp, lay.dp, lay.cp, lay.pp) == (8, 1, 1, 1)
    files = plan_files(tp_only, tmp_path, validate_ds=False)
    (tmp_path / "torchtitan.toml").write_text(files["torchtitan.toml"])
    (tmp_path / f"{MODEL_MODULE}.py").write_text(files[f"{MODEL_MODULE}.py"])
    cases = {**written, "7b-tp8-dp1": (tp_only.spec, tp_only.best, tmp_path)}
    seen = set()
    for name, (spec, c, folder) in cases.items():
        cfg = titan["config.manager"].ConfigManager().parse_args(["--job.config_file", str(folder / "torchtitan.toml")])
        par = cfg.parallelism
        dims = titan["distributed.parallel_dims"].ParallelDims(
            dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
            ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=spec.gpus)
        ctx = amp(dims, cfg.training.mixed_precision_param, "cpu")
        mixed = dims.fsdp_enabled or isinstance(ctx, torch.autocast)
        if not dims.fsdp_enabled:
            assert isinstance(ctx, torch.autocast) != isinstance(ctx, contextlib.nullcontext), name
        prec = torchtitan_precision(spec, c)
        assert prec["mixed"] == mixed, (name, prec["how"])
        line = next(x for x in (folder / "torchtitan.toml").read_text().splitlines()
                    if x.startswith("mixed_precision_param"))
        assert ("NO EFFECT" in line) == (not mixed), name
        seen.add(mixed)
    assert seen == {True, False}  # both kinds were checked
    md, bud = files["plan.md"], json.loads(files["budget.json"])["torchtitan"]
    assert "**It trains this layout in fp32, not bf16**" in md and "maybe_enable_amp" in md
    assert bud["precision"] == "fp32" and bud["fits"] is True
    mem = bud["memory_gib_per_gpu"]
    bf16 = json.loads(files["budget.json"])["memory_gib_per_gpu"]
    assert mem["activations"] > 1.5 * bf16["activations"] and mem["peak"] > bf16["peak"]  # fp32 activations
    assert f"about {mem['peak']:.2f} GiB per GPU" in md
    assert "applies `weight_decay` to every parameter, norm weights included" in md
    # torchtitan's optimizer over its own model of this plan (meta device): one weight decay for all
    cfg = titan["config.manager"].ConfigManager().parse_args(["--job.config_file", str(tmp_path / "torchtitan.toml")])
    args = load_model_args(titan, cfg, tmp_path)
    with torch.device("meta"):
        model = titan["models.llama3.model.model"].Transformer(args)
    import dataclasses
    optim_cfg = dataclasses.replace(cfg.optimizer, implementation="for-loop")  # fused kernels need a device
    opts = torchtitan("components.optimizer").build_optimizers([model], optim_cfg, dims)
    groups = [g for o in opts.optimizers for g in o.param_groups]
    in_groups = {id(p) for g in groups for p in g["params"]}
    assert {g["weight_decay"] for g in groups} == {0.1} and cfg.optimizer.weight_decay == 0.1
    norms = [p for p in model.parameters() if p.dim() == 1]
    assert norms and all(id(p) in in_groups for p in model.parameters())  # 1-D norm weights decayed too
