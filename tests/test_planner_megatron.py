"""A plan's ``megatron_args.txt`` held to Megatron-LM core_v0.14.0's own checks, by source line.

Megatron-LM's ``megatron/training/arguments.py`` (``parse_args``, ``validate_args``) is not on PyPI,
so its checks were read at tag core_v0.14.0 (commit 23e00ed0963c35382dfe8a5a94fb3cda4d21e133) and
each assertion that concerns what the planner writes is held below, with its line numbers there
("args L..."), together with the layout checks of megatron/core (``transformer_config.py``, "tc L...";
``pipeline_parallel_layer_layout.py``, "ppl L..."). The command is the file's own "Use:" line: its
environment assignments are the environment validate_args sees, its torchrun part is parsed by
torch's own torchrun parser (``torch.distributed.run.get_args_parser``) for the world size, and
the rest - the file's arguments plus what the user adds - by an argparse parser of the flags
involved, declared as arguments.py declares them (type, choices, default; ``allow_abbrev=False``).

Besides validity, the file must describe the plan: degrees, stages, batch and the model of
``train.toml`` (shape, vocabulary after Megatron's padding, RoPE base, dropout 0).

Work: the plans of tests/plan_cases.py (about 4 s, shared with the torchtitan tests when run
together); torch.distributed.run's parser; pure Python otherwise.
"""
from __future__ import annotations

import argparse
import re
import shlex

import pytest

from course_lib.planner import checkpoint_plan
from course_lib.planner.engines import stage_blocks
from course_lib.planner.megatron_job import megatron_args_text
from plan_cases import engine_cases

# flag -> (type or "switch"/"off", default, choices, arguments.py line): as core_v0.14.0 declares them.
FLAGS = {
    "--tensor-model-parallel-size": (int, 1, None, 2318), "--pipeline-model-parallel-size": (int, 1, None, 2320),
    "--decoder-first-pipeline-num-layers": (int, None, None, 2322),
    "--decoder-last-pipeline-num-layers": (int, None, None, 2326),
    "--pipeline-model-parallel-layout": (str, None, None, 2330),
    "--num-virtual-stages-per-pipeline-rank": (int, None, None, 2343),
    "--context-parallel-size": (int, 1, None, 2455), "--sequence-parallel": ("switch", False, None, 1996),
    "--use-distributed-optimizer": ("switch", False, None, 2412), "--use-megatron-fsdp": ("switch", False, None, 2425),
    "--data-parallel-sharding-strategy": (str, "no_shard", ("no_shard", "optim", "optim_grads", "optim_grads_params"),
                                          2428),
    "--overlap-grad-reduce": ("switch", False, None, 2359),
    "--recompute-granularity": (str, None, ("full", "selective"), 1782),
    "--recompute-method": (str, None, ("uniform", "block"), 1803), "--recompute-num-layers": (int, None, None, 1812),
    "--micro-batch-size": (int, None, None, 1746), "--global-batch-size": (int, None, None, 1753),
    "--seq-length": (int, None, None, 2594), "--max-position-embeddings": (int, None, None, 1436),
    "--num-layers": (int, None, None, 1413), "--hidden-size": (int, None, None, 1419),
    "--ffn-hidden-size": (int, None, None, 1421), "--num-attention-heads": (int, None, None, 1424),
    "--group-query-attention": ("switch", False, None, 1432), "--num-query-groups": (int, 1, None, 1434),
    "--vocab-size": (int, None, None, 2511), "--make-vocab-size-divisible-by": (int, 128, None, 1476),
    "--position-embedding-type": (str, "learned_absolute", ("learned_absolute", "rope", "mrope", "relative", "none"),
                                  1439),
    "--rotary-base": (int, 10000, None, 1449), "--normalization": (str, "LayerNorm", ("LayerNorm", "RMSNorm"), 1479),
    "--attention-dropout": (float, 0.1, None, 1714), "--hidden-dropout": (float, 0.1, None, 1716),
    "--swiglu": ("switch", False, None, 1497), "--disable-bias-linear": ("off", True, None, 1963),
    "--untie-embeddings-and-output-weights": ("switch", False, None, 1505),
    "--attention-backend": (str, "auto", ("flash", "fused", "unfused", "local", "auto"), 1426),
    "--bf16": ("switch", False, None, 2277), "--lr": (float, None, None, 2091), "--min-lr": (float, 0.0, None, 2126),
    "--lr-decay-style": (str, "linear", ("constant", "linear", "cosine", "inverse-square-root", "WSD"), 2095),
    "--lr-warmup-iters": (int, 0, None, 2114), "--train-iters": (int, None, None, 1909),
    "--weight-decay": (float, 0.01, None, 1718), "--adam-beta2": (float, 0.999, None, 1732),
    "--clip-grad": (float, 1.0, None, 1727), "--save-interval": (int, None, None, 2154),
    "--ckpt-format": (str, "torch_dist", ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"), 2225),
    "--save": (str, None, None, 2152), "--load": (str, None, None, 2163), "--split": (str, None, None, 2561),
    "--data-path": ("list", None, None, 2553), "--tokenizer-type": (str, None, None, 2524),
    "--tokenizer-model": (str, None, None, 2539),
}
DEST = {"--disable-bias-linear": "add_bias_linear"}  # store_false flags (args L1963)


def megatron_parser() -> argparse.ArgumentParser:
    """The flags above as arguments.py declares them (parse_args: args L91-92, allow_abbrev=False)."""
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, (kind, default, choices, _line) in FLAGS.items():
        if kind == "switch":
            p.add_argument(flag, action="store_true")
        elif kind == "off":
            p.add_argument(flag, action="store_false", dest=DEST[flag])
        elif kind == "list":
            p.add_argument(flag, nargs="*", default=default)
        else:
            p.add_argument(flag, type=kind, default=default, choices=choices)
    return p


def run_command(text: str) -> tuple[dict, int, argparse.Namespace]:
    """The file's "Use:" line, as a shell would run it on one node: (environment it sets, world
    size torchrun starts, Megatron's parsed arguments)."""
    from torch.distributed.run import get_args_parser

    [use] = [line[3:].strip() for line in text.splitlines() if line.startswith("#   ") and "pretrain_gpt.py" in line]
    flags = " ".join(line for line in text.splitlines() if not line.startswith("#"))
    use = re.sub(r"\$\(grep -v '\^#' \S+/megatron_args.txt\)", lambda _: flags, use)
    words = shlex.split(use)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "torchrun", words[:3]
    run = get_args_parser().parse_args(words[1:])  # torch's own parser; the rest is the program's
    assert run.training_script.endswith("/pretrain_gpt.py"), run.training_script
    nnodes = int(run.nnodes.split(":")[-1])
    args, unknown = megatron_parser().parse_known_args(run.training_script_args)
    assert not unknown, f"not Megatron-LM core_v0.14.0 flags (or not yet declared here): {unknown}"
    return env, nnodes * int(run.nproc_per_node), args


def validate(args: argparse.Namespace, env: dict, world: int) -> None:
    """The assertions of validate_args (and megatron/core's layout checks) that concern the file, in
    source order; the messages are Megatron's."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    assert world % (tp * pp * cp) == 0, "world size is not divisible by total_model_size"      # args L361
    assert args.micro_batch_size is not None and args.micro_batch_size > 0                   # args L456-457
    assert args.global_batch_size > 0                                                        # args L463
    assert (args.num_virtual_stages_per_pipeline_rank is not None) + (args.pipeline_model_parallel_layout is not None) \
        <= 1, "No more than one of the following arguments can be set at the same time"        # args L466-477
    vpp = None
    if args.pipeline_model_parallel_layout is not None:                                       # args L479-490
        stages = parse_layout(args.pipeline_model_parallel_layout)
        assert len(stages) % pp == 0, "The length of pipeline_model_parallel_layout must be divisible by pp"
        vpp = len(stages) // pp if len(stages) // pp > 1 else None
        # tc L952-968: no other pipeline layout argument beside it
        assert args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None
        flat = [x for s in stages for x in s]                                                 # ppl L91-106
        assert flat[0] == "E" and flat[-1] == "L", "The first layer must be embedding / the last loss"
        assert flat.count("E") == 1 and flat.count("L") == 1 and flat.count("t") == args.num_layers
    elif args.num_virtual_stages_per_pipeline_rank is not None:                              # args L491-513
        vpp = args.num_virtual_stages_per_pipeline_rank if args.num_virtual_stages_per_pipeline_rank > 1 else None
    elif args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None:
        assert args.num_layers % pp == 0, \
            "Number of layers should be divisible by the pipeline-model-parallel size"        # args L533-534
    if vpp is not None:  # --no-overlap-p2p-communication not given: overlap_p2p_comm is True (args L2348), L538-540
        assert pp > 1, "When interleaved schedule is used, pipeline-model-parallel size should be greater than 1"
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        middle_layers, middle = args.num_layers, pp                                            # tc L1003-1050
        for n in (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers):
            if n is not None:
                assert n > 0 and (vpp is None or n % vpp == 0)
                middle_layers, middle = middle_layers - n, middle - 1
        assert not middle or middle_layers % middle == 0, "number of layers at middle stage must be divisible"
    if args.use_megatron_fsdp:                                                                # args L624-639
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1", \
            "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one"
        assert args.ckpt_format == "fsdp_dtensor", "Megatron FSDP only supports fsdp_dtensor checkpoint format"
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):  # args L736-739
        assert getattr(args, name) is not None, f"{name} argument is None"
    assert args.hidden_size % args.num_attention_heads == 0                                   # args L754
    if cp > 1:
        assert args.seq_length % (cp * 2) == 0, \
            "seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1."  # L757-760
    assert args.max_position_embeddings >= args.seq_length                                   # args L769-772
    assert args.min_lr <= args.lr                                                            # args L776
    if args.save is not None:
        assert args.save_interval is not None and args.save_interval > 0                     # args L777-779
    if args.recompute_granularity == "selective":
        assert args.recompute_method is None, "recompute method is not yet supported for selective"  # L828-831
    if (tp > 1 or cp > 1) and not args.use_megatron_fsdp:  # before Blackwell (get_device_arch_version() < 10)
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", \
            "Using tensor model parallelism or context parallelism require setting the environment variable " \
            "CUDA_DEVICE_MAX_CONNECTIONS to 1"                                                 # args L848-875
    if args.ckpt_format == "fsdp_dtensor":
        assert args.use_megatron_fsdp, "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP."  # L977-978
    assert bool(args.data_path) <= 1, "A single data source must be provided"               # args L981-984
    assert args.num_attention_heads % tp == 0                                                 # tc L681
    assert (args.num_query_groups if args.group_query_attention else args.num_attention_heads) % tp == 0  # tc L696


def parse_layout(text: str) -> list[list[str]]:
    """Stages of a --pipeline-model-parallel-layout as lists of E/t/L/m (ppl L254-292)."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    assert all(ch in "ELtm" for s in stages for ch in s), "Invalid layer character"
    return stages


def built_stages(args: argparse.Namespace, pp: int, vpp: int) -> list[int]:
    """Blocks of each stage Megatron builds, in depth order (stage i on pipeline rank i mod pp)."""
    if args.pipeline_model_parallel_layout:
        return [s.count("t") for s in parse_layout(args.pipeline_model_parallel_layout)]
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    rest = args.num_layers - (first or 0) - (last or 0)
    others = pp - (first is not None) - (last is not None)
    ranks = ([first] if first is not None else []) + [rest // others] * others + ([last] if last is not None else [])
    return [n // vpp for _ in range(vpp) for n in ranks]  # each rank's share cut into vpp equal chunks


@pytest.fixture(scope="module")
def files():
    return [(name, spec, c, megatron_args_text(spec, c, checkpoint_plan(spec, c), "runs/plan"))
            for name, spec, c in engine_cases()]


def test_every_plan_passes_megatrons_checks_for_its_world(files):
    for name, spec, c, text in files:
        env, world, args = run_command(text)
        assert world == spec.gpus, name
        try:
            validate(args, env, world)
        except AssertionError as exc:
            raise AssertionError(f"{name} ({c.layout.label()}): Megatron-LM would refuse it: {exc}") from None


def test_every_file_describes_the_plan(files):
    for name, spec, c, text in files:
        lay, sh = c.layout, spec.shape
        _, world, a = run_command(text)
        tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
        dp = world // (tp * pp * cp)
        assert (tp, pp, cp, dp) == (lay.tp, lay.pp, lay.cp, lay.dp), name
        assert a.sequence_parallel == lay.sequence_parallel, name
        assert a.global_batch_size == spec.global_batch and a.global_batch_size % (a.micro_batch_size * dp) == 0, name
        assert a.global_batch_size // (a.micro_batch_size * dp) == lay.grad_accum and a.seq_length == spec.seq, name
        assert a.use_distributed_optimizer == (lay.zero_stage == 1), name
        assert a.use_megatron_fsdp == (lay.zero_stage >= 2), name
        if lay.zero_stage >= 2:
            assert a.data_parallel_sharding_strategy == {2: "optim_grads", 3: "optim_grads_params"}[lay.zero_stage]
        assert a.recompute_granularity == (None if lay.recompute == "none" else lay.recompute), name
        vpp = (len(parse_layout(a.pipeline_model_parallel_layout)) // pp if a.pipeline_model_parallel_layout
               else a.num_virtual_stages_per_pipeline_rank or 1)
        assert vpp == lay.virtual_stages, name
        if pp > 1:
            assert built_stages(a, pp, vpp) == list(stage_blocks(spec, c)), name
        # the model of train.toml
        assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.ffn_hidden_size) == \
            (sh.n_layers, sh.d_model, sh.n_heads, sh.ffn_dim), name
        assert (a.num_query_groups if a.group_query_attention else a.num_attention_heads) == sh.kv_heads, name
        multiple = a.make_vocab_size_divisible_by * tp  # megatron/training/tokenizer/tokenizer.py L115-121
        padded = -(-sh.vocab_size // multiple) * multiple
        assert padded == (sh.vocab_size if sh.vocab_size % tp == 0 else -(-sh.vocab_size // (128 * tp)) * 128 * tp), \
            (name, padded)
        assert a.attention_dropout == 0.0 and a.hidden_dropout == 0.0, name
        assert (a.position_embedding_type == "learned_absolute") == sh.learned_pos_emb, name
        if not sh.learned_pos_emb:
            assert a.rotary_base == sh.rope_theta, name
        assert (a.normalization == "RMSNorm") == (sh.norm == "rmsnorm") and a.swiglu == (sh.mlp == "swiglu"), name
        assert a.add_bias_linear == sh.bias and a.untie_embeddings_and_output_weights == (not sh.tied_embeddings), name


def test_uneven_and_interleaved_flags(files):
    """BLOOM's 5,6*10,5 as first/last stage sizes, even interleaving as a virtual-stage count,
    uneven interleaving as an explicit layout (Megatron refuses two of them together)."""
    by_name = {name: text for name, _, _, text in files}
    assert "--decoder-first-pipeline-num-layers 5\n" in by_name["bloom-5-6x10-5"]
    assert "--decoder-last-pipeline-num-layers 5\n" in by_name["bloom-5-6x10-5"]
    assert "--num-virtual-stages-per-pipeline-rank 2\n" in by_name["70b-pp4v2"]
    assert "--pipeline-model-parallel-layout Et*6|t*6|t*6|" + "t*7|" * 8 + "t*6L\n" in by_name["70b-pp4v3-uneven"]
    assert "--rotary-base 500000\n" in by_name["llama3-70b-512"]


def test_the_checks_refuse_what_megatron_refuses(files):
    """Each fault of issue 33, put back into a good file, is refused (the checks can fail)."""
    text = dict((name, t) for name, _, _, t in files)
    tp_plan, fsdp_plan = text["70b-8-nodes"], text["llama2-13b-fsdp"]
    faults = [
        (tp_plan.replace("CUDA_DEVICE_MAX_CONNECTIONS=1 ", ""), "CUDA_DEVICE_MAX_CONNECTIONS to 1"),
        (fsdp_plan.replace("--ckpt-format fsdp_dtensor\n", ""), "fsdp_dtensor checkpoint format"),
        (fsdp_plan.replace("CUDA_DEVICE_MAX_CONNECTIONS=8", "CUDA_DEVICE_MAX_CONNECTIONS=1"), "large than one"),
        (text["7b-8k-context"].replace("--seq-length 8192", "--seq-length 8190"), "multiple of 2 * context"),
        (text["70b-pp4v3-uneven"].replace("--pipeline-model-parallel-size 4",
                                          "--pipeline-model-parallel-size 4\n--num-virtual-stages-per-pipeline-rank 3"),
         "No more than one"),
    ]
    for broken, message in faults:
        env, world, args = run_command(broken)
        with pytest.raises(AssertionError, match=re.escape(message)):
            validate(args, env, world)
