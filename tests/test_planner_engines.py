"""A plan's torchtitan job config and Megatron-LM arguments (course_lib/planner/engines.py).

Neither engine installs beside the kit's pinned torch (torchtitan 0.2.0's package imports its GPU
kernels - triton - at import; Megatron-LM needs CUDA and Transformer Engine), so the files are held
against the names read from the engines' sources, embedded below with where they came from:

* torchtitan 0.2.0 (PyPI wheel torchtitan-0.2.0-py3-none-any.whl, torchtitan/config/job_config.py):
  the fields of each JobConfig section the planner writes, and the Literal choices of the ones it
  sets. Its ConfigManager refuses a TOML key that is not a field (``_dict_to_dataclass``).
* Megatron-LM core_v0.14.0 (commit 23e00ed0963c35382dfe8a5a94fb3cda4d21e133,
  megatron/training/arguments.py): each flag the planner writes, as its add_argument declares it
  (a switch, or a value with its type and choices). Parsed with argparse, abbreviations off.

The numbers must agree with the plan: degrees multiply to the GPU count, global batch = per-rank
batch x dp x accumulation, the pipeline's stages carry the plan's blocks. Pure Python, no ranks.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib

import pytest

from course_lib.estimate import ModelShape
from course_lib.planner import Layout, checkpoint_plan, evaluate, make_spec, plan, plan_files
from course_lib.planner.stages import balanced_counts
from course_lib.planner.engines import (megatron_args, megatron_args_text, stage_blocks, torchtitan_batches,
                                        torchtitan_toml)

# torchtitan 0.2.0, torchtitan/config/job_config.py: every field of the sections the planner writes.
TORCHTITAN_0_2_0_FIELDS = {
    "job": {"config_file", "dump_folder", "description", "print_config", "custom_config_module"},
    "model": {"name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "early_step_in_backward"},
    "lr_scheduler": {"warmup_steps", "decay_ratio", "decay_type", "min_lr_factor"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug", "seed", "deterministic", "debug_moe_force_load_balance"},
    "parallelism": {"data_parallel_replicate_degree", "enable_compiled_autograd", "data_parallel_shard_degree",
                    "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel",
                    "enable_async_tensor_parallel", "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "context_parallel_degree",
                    "context_parallel_rotate_method", "expert_parallel_degree", "expert_tensor_parallel_degree"},
    "checkpoint": {"enable", "enable_ft_dataloader_checkpoints", "folder", "interval", "initial_load_path",
                   "initial_load_model_only", "initial_load_in_hf", "initial_load_in_hf_quantized",
                   "last_save_model_only", "last_save_in_hf", "export_dtype", "async_mode", "keep_latest_k",
                   "load_step", "exclude_from_loading", "enable_first_step_checkpoint", "create_seed_checkpoint",
                   "load_only"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto"},
}
# ... and the Literal choices of the fields the planner sets that have them.
TORCHTITAN_0_2_0_CHOICES = {
    ("parallelism", "fsdp_reshard_after_forward"): {"default", "always", "never"},
    ("activation_checkpoint", "mode"): {"selective", "full", "memory_budget", "none"},
    ("lr_scheduler", "decay_type"): {"linear", "sqrt", "cosine"},
    ("checkpoint", "async_mode"): {"disabled", "async", "async_with_pinned_mem"},
    ("training", "mixed_precision_param"): {"bfloat16", "float32"},
    ("training", "mixed_precision_reduce"): {"float32"},
}

# torchtitan passes pipeline_parallel_schedule to torch.distributed.pipelining's get_schedule_class;
# these two resolve there (checked with torch 2.13: Schedule1F1B, ScheduleInterleaved1F1B; importing
# torch.distributed.pipelining costs seconds, so the names are kept here).
TORCH_PIPELINE_SCHEDULES = {"1F1B", "Interleaved1F1B"}

# Megatron-LM core_v0.14.0, megatron/training/arguments.py: None = a switch (store_true), else
# (type, choices or None).
MEGATRON_CORE_V0_14_0_FLAGS = {
    "--tensor-model-parallel-size": (int, None), "--pipeline-model-parallel-size": (int, None),
    "--num-virtual-stages-per-pipeline-rank": (int, None), "--decoder-first-pipeline-num-layers": (int, None),
    "--decoder-last-pipeline-num-layers": (int, None), "--pipeline-model-parallel-layout": (str, None),
    "--context-parallel-size": (int, None), "--sequence-parallel": None, "--use-distributed-optimizer": None,
    "--use-megatron-fsdp": None,
    "--data-parallel-sharding-strategy": (str, ("no_shard", "optim", "optim_grads", "optim_grads_params")),
    "--overlap-grad-reduce": None, "--recompute-granularity": (str, ("full", "selective")),
    "--recompute-method": (str, ("uniform", "block")), "--recompute-num-layers": (int, None),
    "--micro-batch-size": (int, None), "--global-batch-size": (int, None), "--seq-length": (int, None),
    "--max-position-embeddings": (int, None), "--num-layers": (int, None), "--hidden-size": (int, None),
    "--ffn-hidden-size": (int, None), "--num-attention-heads": (int, None), "--group-query-attention": None,
    "--num-query-groups": (int, None), "--vocab-size": (int, None), "--make-vocab-size-divisible-by": (int, None),
    "--position-embedding-type": (str, ("learned_absolute", "rope", "mrope", "relative", "none")),
    "--normalization": (str, ("LayerNorm", "RMSNorm")), "--swiglu": None, "--disable-bias-linear": None,
    "--untie-embeddings-and-output-weights": None,
    "--attention-backend": (str, ("flash", "fused", "unfused", "local", "auto")),
    "--bf16": None, "--lr": (float, None), "--min-lr": (float, None),
    "--lr-decay-style": (str, ("constant", "linear", "cosine", "inverse-square-root", "WSD")),
    "--lr-warmup-iters": (int, None), "--train-iters": (int, None), "--weight-decay": (float, None),
    "--adam-beta2": (float, None), "--clip-grad": (float, None), "--save-interval": (int, None),
}


def megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, kind in MEGATRON_CORE_V0_14_0_FLAGS.items():
        if kind is None:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=kind[0], choices=kind[1])
    return parser


def parse_megatron(text: str) -> argparse.Namespace:
    """The non-comment lines of megatron_args.txt, parsed; every token must be a known flag or its value."""
    tokens = " ".join(line for line in text.splitlines() if not line.startswith("#")).split()
    args, unknown = megatron_parser().parse_known_args(tokens)  # a bad value or choice raises ArgumentError
    assert not unknown, f"not Megatron-LM core_v0.14.0 flags: {unknown}"
    return args


def parse_megatron_layout(text: str) -> list[list[str]]:
    """Stages of a --pipeline-model-parallel-layout as lists of E/t/L (Megatron's documented grammar)."""
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text.replace(",", ""))
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return [list(stage) for stage in text.split("|")]


BLOOM = ModelShape(70, 14336, 112, 250880, 2048, tied_embeddings=True, learned_pos_emb=False, bias=True,
                   mlp="gelu", norm="layernorm")
SEVEN_B = dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T")
SEVENTY_B = dict(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)


@pytest.fixture(scope="module")
def cases():
    """(spec, candidate) pairs covering every mapping: DDP, ZeRO-1/3, cp, tp+pp, even and uneven
    splits, interleaving with even and uneven stages, a two-stage uneven pipeline, full and selective
    recomputation, a GPT-style (non-Llama) shape."""
    s7, s70 = make_spec(**SEVEN_B), make_spec(**SEVENTY_B)
    s7_8k = make_spec(**SEVEN_B, seq=8192)
    bloom = make_spec(gpu="a100-80gb", gpus=384, gpus_per_node=8, tokens="366B", global_batch_tokens=2048 * 2048,
                      shape_overrides={f.name: getattr(BLOOM, f.name) for f in dataclasses.fields(BLOOM)})
    m7 = s7.global_batch // 8
    lays = [(s7, Layout(1, 1, 8, 1, 0, "none", 1, m7)), (s7, Layout(1, 1, 8, 1, 3, "full", 1, m7)),
            (s7_8k, Layout(1, 1, 4, 2, 3, "none", 1, s7_8k.global_batch // 4)),
            (s70, Layout(4, 2, 8, 1, 1, "selective", 1, 128)), (s70, Layout(8, 4, 2, 1, 1, "selective", 1, 512, 2)),
            (s70, Layout(8, 4, 2, 1, 1, "selective", 1, 512, 3, balanced_counts(s70.shape, 12, s70.seq))),
            (s70, Layout(8, 2, 4, 1, 1, "full", 1, 256, 1, (39, 41))),
            (bloom, Layout(4, 12, 8, 1, 1, "full", 2, 128, 1, (5,) + (6,) * 10 + (5,)))]
    return [(spec, evaluate(spec, lay)) for spec, lay in lays]


def test_torchtitan_toml_keys_are_torchtitans_and_numbers_match_the_plan(cases):
    for spec, c in cases:
        lay = c.layout
        cfg = tomllib.loads(torchtitan_toml(spec, c, checkpoint_plan(spec, c)))
        for section, keys in cfg.items():
            assert section in TORCHTITAN_0_2_0_FIELDS, section
            assert set(keys) <= TORCHTITAN_0_2_0_FIELDS[section], (section, set(keys) - TORCHTITAN_0_2_0_FIELDS[section])
        for (section, key), choices in TORCHTITAN_0_2_0_CHOICES.items():
            if key in cfg.get(section, {}):
                assert cfg[section][key] in choices, (section, key)
        par, tr = cfg["parallelism"], cfg["training"]
        dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
        assert dp == lay.dp
        assert dp * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] * par["context_parallel_degree"] \
            == spec.gpus
        assert par["pipeline_parallel_schedule"] in TORCH_PIPELINE_SCHEDULES
        # torchtitan: accumulation = global / (local x dp); a pipeline cuts local into micro-batches
        accumulation = tr["global_batch_size"] // (tr["local_batch_size"] * dp)
        assert tr["global_batch_size"] == tr["local_batch_size"] * dp * accumulation == spec.global_batch
        assert accumulation == torchtitan_batches(c)["accumulation"]
        if lay.pp > 1:
            assert tr["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == lay.grad_accum
            assert tr["local_batch_size"] % par["pipeline_parallel_microbatch_size"] == 0
            parts = par["module_fqns_per_model_part"]
            assert len(parts) == lay.pp * lay.virtual_stages
            assert [sum(n.startswith("layers.") for n in p) for p in parts] == list(stage_blocks(spec, c))
            flat = [n for p in parts for n in p]
            n = spec.shape.n_layers
            assert flat == ["tok_embeddings"] + [f"layers.{i}" for i in range(n)] + ["norm", "output"]
            assert par["pipeline_parallel_schedule"] == ("Interleaved1F1B" if lay.virtual_stages > 1 else "1F1B")
        else:
            assert accumulation == lay.grad_accum and tr["local_batch_size"] == lay.micro_batch
        assert cfg["activation_checkpoint"]["mode"] == lay.recompute
        ddp = par["data_parallel_replicate_degree"] > 1
        assert ddp == (lay.zero_stage == 0 and lay.tp * lay.pp * lay.cp == 1 and lay.dp > 1)
        assert (par["fsdp_reshard_after_forward"] == "always") == (lay.zero_stage == 3)
        assert tr["seq_len"] == spec.seq


def test_megatron_args_parse_and_match_the_plan(cases):
    for spec, c in cases:
        lay = c.layout
        a = parse_megatron(megatron_args_text(spec, c, checkpoint_plan(spec, c)))
        assert a.tensor_model_parallel_size == lay.tp and a.pipeline_model_parallel_size == lay.pp
        assert a.context_parallel_size == lay.cp and a.sequence_parallel == (lay.tp > 1)
        dp = spec.gpus // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size)
        assert dp == lay.dp and dp * lay.tp * lay.pp * lay.cp == spec.gpus
        # Megatron: micro-batches per step = global / (micro x dp)
        assert a.global_batch_size % (a.micro_batch_size * dp) == 0
        assert a.global_batch_size // (a.micro_batch_size * dp) == lay.grad_accum
        assert a.seq_length == spec.seq and a.num_layers == spec.shape.n_layers
        assert a.recompute_granularity == (None if lay.recompute == "none" else lay.recompute)
        assert a.use_distributed_optimizer == (lay.zero_stage == 1)
        if lay.zero_stage >= 2:
            assert a.use_megatron_fsdp and a.data_parallel_sharding_strategy == \
                {2: "optim_grads", 3: "optim_grads_params"}[lay.zero_stage]
        # Megatron takes at most one of the virtual-stage flags; the stages it builds are the plan's
        counts = list(stage_blocks(spec, c))
        if a.pipeline_model_parallel_layout:
            assert a.num_virtual_stages_per_pipeline_rank is None and a.decoder_first_pipeline_num_layers is None
            stages = parse_megatron_layout(a.pipeline_model_parallel_layout)
            assert len(stages) == lay.pp * lay.virtual_stages and [s.count("t") for s in stages] == counts
            assert stages[0][0] == "E" and stages[-1][-1] == "L"
            assert sum(s.count("E") + s.count("L") for s in stages) == 2
        else:
            assert (a.num_virtual_stages_per_pipeline_rank or 1) == lay.virtual_stages
            first = a.decoder_first_pipeline_num_layers
            last = a.decoder_last_pipeline_num_layers
            if first is None and last is None:
                assert len(set(counts)) == 1
            else:  # Megatron spreads the rest evenly over the other stages
                assert lay.virtual_stages == 1
                rest = spec.shape.n_layers - (first or 0) - (last or 0)
                others = lay.pp - (first is not None) - (last is not None)
                assert rest % others == 0
                built = ([first] if first is not None else []) + [rest // others] * others \
                    + ([last] if last is not None else [])
                assert built == counts


def test_uneven_and_interleaved_flags(cases):
    """The flags issue 21 names: BLOOM's 5,6*10,5 as first/last stage sizes, virtual stages as
    --num-virtual-stages-per-pipeline-rank, uneven interleaving as an explicit layout."""
    by_label = {c.layout.label(): megatron_args(spec, c) for spec, c in cases}
    bloom = by_label["tp4 pp12[5,6*10,5] dp8 cp1 Z1 rc=full mb2x128"]
    assert "--decoder-first-pipeline-num-layers 5" in bloom and "--decoder-last-pipeline-num-layers 5" in bloom
    assert "--num-virtual-stages-per-pipeline-rank 2" in by_label["tp8 pp4v2 dp2 cp1 Z1 rc=selective mb1x512"]
    inter = by_label["tp8 pp4v3[6*3,7*8,6] dp2 cp1 Z1 rc=selective mb1x512"]  # 80 blocks, balanced
    assert "--pipeline-model-parallel-layout Et*6|t*6|t*6|" + "t*7|" * 8 + "t*6L" in inter


def test_plan_writes_both_files_and_names_them(tmp_path):
    p = plan(**SEVEN_B)
    files = plan_files(p, tmp_path, validate_ds=False)
    assert {"torchtitan.toml", "megatron_args.txt"} <= set(files)
    assert "`torchtitan.toml`" in files["plan.md"] and "`megatron_args.txt`" in files["plan.md"]
    tomllib.loads(files["torchtitan.toml"])
    assert parse_megatron(files["megatron_args.txt"]).global_batch_size == p.spec.global_batch
