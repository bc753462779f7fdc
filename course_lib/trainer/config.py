"""Training configuration: a TOML file plus command-line overrides, validated before anything runs.

    [train]   max_steps, seed, micro_batch, grad_accum, precision, strategy, device, compile, log_every, ...
    [data]    task, seq_len, vocab_size, path, dtype, val_path (task "tokens": a token file, course_lib.data.tokens)
    [model]   preset plus any ModelConfig field (n_layers, d_model, checkpointing, the stabilizers qk_norm,
              z_loss, logit_softcap, attn_logit_softcap, smooth_swiglu, embedding_bound, ...); init_from (an HF
              folder or a consolidated .safetensors file: the weights step 0 starts from)
    [optim]   lr, min_lr, weight_decay, beta1, beta2, eps, fused
    [schedule] kind, warmup_steps, warmup_convention, decay_steps
    [stability] max_grad_norm, spike_policy, lr_factor, lr_steps, max_consecutive_bad, detect_spikes,
              max_rollbacks, rollback_limit
    [checkpoint] save_every, keep_last, async_save, mirror, format
    [profile] enabled, wait, warmup, active, top_ops (torch.profiler around chosen steps)
    [wandb]   mode (disabled | offline | online), project, name (Weights & Biases, course_lib.trainer.wandb_log)
    [fp8]     recipe, backend, keep, fsdp_all_gather (read when train.precision = "fp8"; course_lib.precision.fp8_model)
    [parallel] bucket_mb, reshard_after_forward, cpu_offload, zero_stage, offload_optimizer,
              offload_param (read by the strategy named in train.strategy);
              dp, tp, pp, pp_schedule, virtual_stages, pp_split, sequence_parallel, cp (model parallelism:
              tp * pp * cp > 1 composes tensor, pipeline and context parallelism with train.strategy =
              "ddp", "zero1" or "zero2" as the data-parallel dimension, or tp/cp (pp = 1) with "fsdp":
              FSDP2 over dp x cp on the DTensor-TP model; cp runs ring attention over zig-zag sequence
              chunks, with dp and tp, not with pp; the world size must be dp * tp * pp * cp, checked
              when the ranks start); ep (expert parallel: each MoE layer's experts sharded over ep ranks,
              tokens moved by all-to-all; with tp = pp = cp = 1 under train.strategy "ddp", "ddp-scratch",
              "zero1", "zero2", "fsdp", "fsdp-scratch" or "deepspeed" (ZeRO 0-2), with pp and/or tp
              (sequence_parallel required) under "ddp", "zero1" or "zero2", folded over each pipeline
              stage's dp x tp ranks; ep divides the ranks of a stage and model.moe_experts)

Every unknown section or key, wrong type or out-of-range value is a ``ConfigError`` naming it
(with a "did you mean" for typos), raised before any file is written or model is built.
"""
from __future__ import annotations

import copy
import difflib
import sys
from pathlib import Path
from typing import Any

from course_lib.parallel.registry import strategy_names
from course_lib.validate import SCHEMA as _BASE_SCHEMA
from course_lib.validate import ConfigError, defaults  # noqa: F401  (re-exported: train_config.ConfigError)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# The table of keys, types, defaults and ranges lives in course_lib.validate, below the strategies
# that read it; train.strategy's choices are the registry's names, which only this layer may import.
SCHEMA: dict[str, dict[str, tuple[type, Any, Any]]] = copy.deepcopy(_BASE_SCHEMA)
SCHEMA["train"]["strategy"] = (str, "single", strategy_names())


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_value(where: str, value: Any, kind: type, constraint: Any) -> Any:
    if kind is list and constraint is None:  # an array of names (fp8.keep)
        if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
            return list(value)
        raise ConfigError(f"{where} must be an array of non-empty strings (e.g. [\"lm_head\", \"router\"]); "
                          f"got {type(value).__name__} {value!r}")
    if kind is list:  # one of the named choices, or an array of ints (counts checked in _parallel_checks)
        ints = isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if value in constraint or ints:
            return list(value) if ints else value
        raise ConfigError(f"{where} must be one of {', '.join(constraint)} or an array of ints (e.g. [1, 3]); "
                          f"got {type(value).__name__} {value!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is not bool and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where} must be {kind.__name__}, got {type(value).__name__} {value!r}")
    if isinstance(constraint, tuple) and constraint and isinstance(constraint[0], str):
        if value not in constraint:
            raise ConfigError(f"{where} must be one of {', '.join(constraint)}; got {value!r}")
    elif isinstance(constraint, tuple):
        lo, hi = constraint
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ConfigError(f"{where} must be {span}, got {value!r}")
    return value


def validate(raw: dict[str, Any], *, init_source: bool = True) -> dict[str, dict[str, Any]]:
    """Merge ``raw`` over the defaults and check every key, type and range. Returns a new dict.
    ``init_source=False`` leaves ``model.init_from``'s weights unread: a ``--resume auto`` run takes
    every weight from its own checkpoint, so its source may be gone (the trainer checks it when
    there is nothing to resume)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a table of sections, got {type(raw).__name__}")
    cfg = defaults()
    for section, values in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"unknown config section [{section}]{_suggest(section, SCHEMA)}; "
                              f"sections: {', '.join(SCHEMA)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table, got {type(values).__name__}")
        for key, value in values.items():
            where = f"{section}.{key}"
            if section == "model" and key not in SCHEMA["model"]:
                cfg["model"][key] = value  # ModelConfig checks the rest (see build_model_config)
                continue
            if key not in SCHEMA[section]:
                raise ConfigError(f"unknown config key {where}{_suggest(key, SCHEMA[section])}; "
                                  f"keys of [{section}]: {', '.join(SCHEMA[section])}")
            kind, _, constraint = SCHEMA[section][key]
            cfg[section][key] = _check_value(where, value, kind, constraint)
    _cross_checks(cfg)
    mcfg = build_model_config(cfg)  # model keys are checked now, not after files exist
    if init_source:
        _init_from_check(cfg, mcfg)
    _token_file_checks(cfg, mcfg)
    _expert_parallel_checks(cfg, mcfg)
    _parallel_checks(cfg, mcfg)
    _stabilizer_checks(cfg, mcfg)
    _fp8_checks(cfg)
    return cfg


def _stabilizer_checks(cfg: dict, mcfg) -> None:
    """The architecture-level stabilizers (model.qk_norm, z_loss, logit_softcap, attn_logit_softcap,
    smooth_swiglu) run where TinyGPT's own forward runs: one process or data parallelism. The
    tensor-, pipeline- and context-parallel models compute attention and the loss in code of their
    own, which does not have them yet; refused by name rather than silently dropped."""
    on = mcfg.stabilizers
    if on and model_parallel_size(cfg) > 1:
        par = cfg["parallel"]
        keys = " and ".join(f"parallel.{k} = {par[k]}" for k in ("tp", "pp", "cp") if par[k] > 1)
        raise ConfigError(f"{', '.join(on)} with {keys}: the architecture-level stabilizers run in TinyGPT's own "
                          f"forward, under one process or data parallelism (train.strategy single, ddp, zero1, "
                          f"zero2, fsdp, deepspeed with tp = pp = cp = 1); the model-parallel layouts do not "
                          f"carry them yet")


def _fp8_checks(cfg: dict) -> None:
    """``train.precision = "fp8"`` with ``[fp8]``: a recipe and backend that can run (torchao
    installed when asked for by name), and the layouts it composes with (data parallelism)."""
    t, f8 = cfg["train"], cfg["fp8"]
    if t["precision"] != "fp8":
        if f8["fsdp_all_gather"]:
            raise ConfigError(f"fp8.fsdp_all_gather = true needs train.precision = 'fp8' (got {t['precision']!r})")
        return
    from course_lib.precision.fp8_model import resolve_backend

    try:
        backend = resolve_backend(f8["backend"], f8["recipe"])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _fp8_layout_checks(cfg, backend)
    if f8["fsdp_all_gather"] and (t["strategy"] != "fsdp" or backend != "torchao" or f8["recipe"] != "tensorwise"):
        raise ConfigError(f"fp8.fsdp_all_gather = true needs train.strategy = 'fsdp', fp8.recipe = 'tensorwise' and "
                          f"torchao (fp8.backend 'torchao' or 'auto' with torchao installed); got strategy "
                          f"{t['strategy']!r}, recipe {f8['recipe']!r}, backend {backend!r}")


def _fp8_layout_checks(cfg: dict, backend: str) -> None:
    """FP8 under the model-parallel layouts: what runs equals one FP8 process on the same batch
    (tests/test_train_fp8_layouts.py), everything else is refused with its reason.

    * tp > 1 (kit backend, ddp / zero1 / zero2): a column- or row-parallel layer cut from an
      Fp8Linear runs its GEMMs in FP8 (tensor_parallel.fp8_gemm); every scale whose block runs along
      the split features (tensorwise and delayed amaxes, rowwise along a split contraction, tiles
      straddling two shards) takes the amax max-reduced over the tp group, so the FP8 values are one
      process's. torchao is refused (its Float8Linear would be cut into plain TP layers, and its own
      Float8ColwiseParallel / Float8RowwiseParallel need the DTensor plan, not wired), and so is
      fsdp with tp (the DTensor plan would hand the kit's Fp8Linear DTensor shards: not tried).
    * pp > 1: a stage runs its own blocks' FP8 Linear layers on whole micro-batches, as one process
      does, so current scaling (tensorwise, rowwise, blockwise, mxfp8; kit or torchao) is equal.
      Delayed scaling's amax history records every GEMM in the order it runs: with more than one
      micro-batch the schedule orders forwards and backwards differently from one process, so it
      is refused there, and the interleaved schedule (torch's shape inference runs the stages on
      stand-in tensors) is refused for FP8.
    * cp > 1 (kit backend): every Fp8Linear max-reduces the amax of a scale that spans the tokens
      over the cp group (fp8_linear.set_token_group); 1-token rows are local; the 1 x 128 / 1 x 32
      tiles along the tokens of the weight-gradient GEMM are local only when each zig-zag piece
      (data.seq_len / (2 cp) tokens) holds whole tiles. torchao computes its scales from the
      rank's own chunk: refused. fsdp x cp (the DTensor plan) is not tried with FP8: refused.
    """
    par, t, f8 = cfg["parallel"], cfg["train"], cfg["fp8"]
    tp, pp, cp, recipe = par["tp"], par["pp"], par["cp"], f8["recipe"]
    if tp > 1 and backend != "kit":
        raise ConfigError(f"fp8.backend = {f8['backend']!r} resolves to torchao, which does not compose with "
                          f"parallel.tp = {tp} here: the tensor-parallel layers are cut from plain Linear weights "
                          f"and would drop its Float8Linear (high precision), and torchao's own "
                          f"Float8ColwiseParallel / Float8RowwiseParallel need the DTensor plan, which is not "
                          f"wired for FP8; set fp8.backend = 'kit' (its FP8 GEMMs reduce the scales that span "
                          f"the tp shards over the tp group)")
    if tp > 1 and t["strategy"] == "fsdp":
        raise ConfigError(f"train.precision = 'fp8' with train.strategy = 'fsdp' and parallel.tp = {tp} is not "
                          f"built: fsdp with tp runs the DTensor plan, which would hand the kit's FP8 Linear "
                          f"DTensor shards (not tried); use train.strategy = 'ddp', 'zero1' or 'zero2' with "
                          f"parallel.tp (the kit's tensor-parallel layers, FP8 scales reduced over tp)")
    if pp > 1:
        if par["pp_schedule"] == "interleaved":
            raise ConfigError("train.precision = 'fp8' with parallel.pp_schedule = 'interleaved' is not built: "
                              "torch's schedule runs the stages on stand-in tensors to infer shapes, which the FP8 "
                              "Linear layers were not tried with; use parallel.pp_schedule = 'gpipe' or '1f1b'")
        if recipe == "delayed" and t["grad_accum"] > 1:
            raise ConfigError(f"fp8.recipe = 'delayed' with parallel.pp = {pp} and train.grad_accum = "
                              f"{t['grad_accum']} differs from one process: the amax history records every GEMM "
                              f"as it runs, and the pipeline runs a stage's forwards and backwards of the "
                              f"micro-batches in another order ({par['pp_schedule']}: forwards ahead), so its "
                              f"scales would differ. Use fp8.recipe = 'tensorwise' or 'rowwise' (current "
                              f"scaling), or train.grad_accum = 1")
    if cp > 1:
        if t["strategy"] == "fsdp":
            raise ConfigError(f"train.precision = 'fp8' with train.strategy = 'fsdp' and parallel.cp = {cp} is not "
                              f"built (the DTensor plan's weights were not tried with the FP8 Linear layers); use "
                              f"train.strategy = 'ddp', 'zero1' or 'zero2' with parallel.cp")
        if backend != "kit":
            raise ConfigError(f"fp8.backend = {f8['backend']!r} resolves to torchao, which does not compose with "
                              f"parallel.cp = {cp}: its Float8Linear takes its scales from this rank's chunk of "
                              f"each sequence (a tensorwise amax, and the rowwise scales along the tokens of the "
                              f"weight-gradient GEMM, span the whole sequence), so its FP8 values would differ "
                              f"from one process's; set fp8.backend = 'kit' (its scales are max-reduced over the "
                              f"cp group)")
        from course_lib.precision.recipes import get_recipe

        tile = get_recipe(recipe).activation_block[1]
        piece = cfg["data"]["seq_len"] // (2 * cp)
        if tile not in (-1, 1) and piece % tile:
            raise ConfigError(f"fp8.recipe = {recipe!r} with parallel.cp = {cp} needs data.seq_len / (2 x cp) "
                              f"(= {piece} tokens, one zig-zag piece) to be a multiple of {tile}: its weight-"
                              f"gradient GEMM scales 1 x {tile} tiles of consecutive tokens, and a tile that "
                              f"straddles two pieces would lie on two ranks; use data.seq_len a multiple of "
                              f"{2 * cp * tile}, or fp8.recipe = 'tensorwise', 'delayed' or 'rowwise'")


def _cross_checks(cfg: dict) -> None:
    o, s, t = cfg["optim"], cfg["schedule"], cfg["train"]
    if o["lr"] <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {o['lr']}")
    if o["min_lr"] > o["lr"]:
        raise ConfigError(f"optim.min_lr ({o['min_lr']}) must be <= optim.lr ({o['lr']})")
    if s["warmup_steps"] > t["max_steps"]:
        raise ConfigError(f"schedule.warmup_steps ({s['warmup_steps']}) must be <= train.max_steps "
                          f"({t['max_steps']})")
    if s["kind"] == "wsd" and s["decay_steps"] > t["max_steps"] - s["warmup_steps"]:
        raise ConfigError("schedule.decay_steps must be <= train.max_steps - schedule.warmup_steps")
    if cfg["data"]["task"] in ("copy", "reverse", "sort") and cfg["data"]["seq_len"] % 2:
        raise ConfigError(f"data.seq_len must be even for the {cfg['data']['task']} task")
    path = cfg["data"]["path"]
    if path and cfg["data"]["task"] not in ("text", "tokens"):
        raise ConfigError(f"data.path is only read by the text and tokens tasks; data.task is {cfg['data']['task']!r}")
    if cfg["data"]["val_path"] and cfg["data"]["task"] != "tokens":
        raise ConfigError(f"data.val_path is only read by the tokens task; data.task is {cfg['data']['task']!r}")
    if cfg["data"]["task"] == "tokens" and not path:
        raise ConfigError("data.task = 'tokens' needs data.path: a flat file of uint16/uint32 token ids "
                          "(`course data prepare` writes one from text)")
    if path and cfg["data"]["task"] == "text" and not Path(path).is_file():
        raise ConfigError(f"data.path: no such file {path!r} (a UTF-8 text file; \"\" = the bundled notes)")
    if cfg["checkpoint"]["mirror"]:
        _mirror_check(t["strategy"])
    if model_parallel_size(cfg) == 1:  # under tp/pp/cp the layout decides (_parallel_checks)
        _checkpoint_format_check(t["strategy"], cfg["checkpoint"]["format"])
    if t["strategy"] == "deepspeed" and (o["fused"] or t["compile"]):
        key = "optim.fused" if o["fused"] else "train.compile"
        raise ConfigError(f"{key} does not apply to train.strategy = 'deepspeed': the engine builds its own "
                          f"optimizer and wraps the model (set {key} = false)")
    par = cfg["parallel"]
    if t["strategy"] == "deepspeed" and par["offload_param"] != "none" and par["zero_stage"] != 3:
        raise ConfigError(f"parallel.offload_param = {par['offload_param']!r} needs parallel.zero_stage = 3 "
                          f"(got {par['zero_stage']}): only ZeRO-3 partitions the parameters it could offload")
    if t["strategy"] == "deepspeed" and par["offload_optimizer"] != "none" and par["zero_stage"] == 0:
        raise ConfigError("parallel.offload_optimizer needs parallel.zero_stage >= 1 (ZeRO-Offload "
                          "moves the partitioned optimizer state; stage 0 does not partition it)")
    if cfg["stability"]["spike_policy"] == "rollback" and cfg["checkpoint"]["save_every"] == 0:
        raise ConfigError("stability.spike_policy = 'rollback' needs checkpoint.save_every > 0 "
                          "(there must be a checkpoint to roll back to)")
    from course_lib.trainer.wandb_log import missing_package_message

    if (why := missing_package_message(cfg["wandb"]["mode"])) is not None:
        raise ConfigError(why)
    prof = cfg["profile"]  # the profiled window (course_lib.trainer.profiling) must fit the run
    window = prof["wait"] + prof["warmup"] + prof["active"]
    if prof["enabled"] and window > t["max_steps"]:
        raise ConfigError(f"profile.wait + profile.warmup + profile.active = {prof['wait']} + {prof['warmup']} + "
                          f"{prof['active']} = {window} steps must be <= train.max_steps ({t['max_steps']}): the "
                          f"profiled steps would never run")


def _token_file_checks(cfg: dict, mcfg) -> None:
    """data.task = 'tokens': data.path and data.val_path exist, hold whole ``data.dtype`` ids, at
    least one sequence, and no id the model's embedding lacks (reads each file once)."""
    d = cfg["data"]
    if d["task"] != "tokens":
        return
    from course_lib.data.tokens import WHOLE_MODEL_STRATEGIES, check_token_file

    if d["val_path"] and (cfg["train"]["strategy"] not in WHOLE_MODEL_STRATEGIES or model_parallel_size(cfg) > 1):
        raise ConfigError(f"data.val_path is evaluated after the last step by rank 0 on its whole model: "
                          f"train.strategy one of {', '.join(WHOLE_MODEL_STRATEGIES)} with parallel.tp = pp = cp "
                          f"= 1; with train.strategy = {cfg['train']['strategy']!r} and tp x pp x cp = "
                          f"{model_parallel_size(cfg)} rank 0 holds a shard (leave data.val_path empty)")
    for key in ("path", "val_path"):
        if d[key]:
            try:
                check_token_file(d[key], d["dtype"], seq_len=d["seq_len"], vocab_size=mcfg.vocab_size,
                                 key=f"data.{key}")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None


def _checkpoint_format_check(strategy: str, fmt: str) -> None:
    """``checkpoint.format`` against ``train.strategy`` (registry.CHECKPOINT_FORMATS): a pair that
    cannot save is refused here, not at the first save after every step has trained."""
    from course_lib.parallel.registry import CHECKPOINT_FORMATS

    formats, why = CHECKPOINT_FORMATS[strategy]
    if fmt == "auto" or fmt in formats:
        return
    accepted = ", ".join(repr(f) for f in ("auto", *formats) if f in ("auto", "full", "sharded"))
    raise ConfigError(f"checkpoint.format = {fmt!r} does not fit train.strategy = {strategy!r}: {why}. "
                      f"checkpoint.format accepts {accepted} with train.strategy = {strategy!r}")


def _mirror_check(strategy: str) -> None:
    """``checkpoint.mirror`` copies full and sharded (DCP) checkpoints; refuse it for DeepSpeed's
    partitioned ones (written by the engine, outside the kit's commit protocol)."""
    if strategy != "deepspeed":
        return
    raise ConfigError(f"checkpoint.mirror copies full and sharded (DCP) checkpoints, and train.strategy = "
                      f"{strategy!r} saves DeepSpeed's partitioned checkpoints, which stay in the run folder: "
                      f"set checkpoint.mirror = '' and copy OUT/checkpoints with your storage tools, or use "
                      f"train.strategy = 'zero1' or 'zero2' (full checkpoints) or 'fsdp' (sharded), which mirror")


def model_parallel_size(cfg: dict) -> int:
    """Ranks per data-parallel replica: tp * pp * cp (1 = no model parallelism)."""
    par = cfg["parallel"]
    return par["tp"] * par["pp"] * par["cp"]


def _parallel_checks(cfg: dict, mcfg) -> None:
    """``[parallel]`` model-parallel keys against each other, the strategy and the model shape.
    The world size (dp * tp * pp * cp) is checked when the ranks start (course_lib.train)."""
    par, t = cfg["parallel"], cfg["train"]
    tp, pp, v, sched = par["tp"], par["pp"], par["virtual_stages"], par["pp_schedule"]
    if par["sequence_parallel"] and tp == 1:
        raise ConfigError("parallel.sequence_parallel = true needs parallel.tp > 1 (it splits the sequence "
                          "over the tensor-parallel ranks); got parallel.tp = 1")
    if v > 1 and sched != "interleaved":
        raise ConfigError(f"parallel.virtual_stages = {v} needs parallel.pp_schedule = 'interleaved' "
                          f"(got {sched!r}); gpipe and 1f1b run one stage per rank (virtual_stages = 1)")
    if sched == "interleaved" and pp == 1:
        raise ConfigError("parallel.pp_schedule = 'interleaved' needs parallel.pp > 1 (it interleaves "
                          "parallel.virtual_stages stages per pipeline rank)")
    _split_checks(cfg, mcfg)
    if model_parallel_size(cfg) == 1:
        if par["dp"]:
            raise ConfigError(f"parallel.dp = {par['dp']} is read with parallel.tp or parallel.pp > 1 only (plain "
                              f"data parallelism uses every rank started); leave it 0")
        return
    keys = " and ".join(f"parallel.{k} = {par[k]}" for k in ("tp", "pp", "cp") if par[k] > 1)
    _model_parallel_strategy_check(cfg)
    if mcfg.moe_experts is not None:
        _moe_model_parallel_checks(cfg, mcfg, keys)
    # FSDP2 over dp on a DTensor-TP model (course_lib.parallel.composed.fsdp_tp); not on pipeline stages.
    fsdp_tp = t["strategy"] == "fsdp" and pp == 1
    if t["strategy"] == "fsdp" and pp > 1:
        raise ConfigError(f"train.strategy = 'fsdp' with parallel.pp = {pp} is not supported (FSDP2 on pipeline "
                          f"stages is not built): fsdp composes with parallel.tp (pp = 1); for pp > 1 use "
                          f"train.strategy = 'ddp', 'zero1' or 'zero2'")
    if t["compile"] and sched == "interleaved" and pp > 1:
        raise ConfigError("train.compile = true does not apply to parallel.pp_schedule = 'interleaved': torch's "
                          "schedule calls its stage modules itself; set train.compile = false or use '1f1b'")
    if cfg["checkpoint"]["format"] == "sharded" and not fsdp_tp:
        raise ConfigError(f"checkpoint.format = 'sharded' does not fit {keys}: the shards are saved in the "
                          f"dense layout (full checkpoints); use 'auto' or 'full'")
    if cfg["checkpoint"]["format"] == "full" and fsdp_tp:
        raise ConfigError(f"checkpoint.format = 'full' does not fit train.strategy = 'fsdp' with {keys}: its "
                          f"DTensor shards save through DCP only; use 'auto' or 'sharded'")
    if fsdp_tp and (mcfg.checkpointing != "none" or mcfg.offload_activations):
        raise ConfigError(f"train.strategy = 'fsdp' with {keys} runs the DTensor plan, which has no "
                          f"recomputation yet: set model.checkpointing = 'none' and model.offload_activations = "
                          f"false, or use train.strategy = 'zero2' (recomputation composes with tp and cp there)")
    if par["cp"] > 1:
        _context_parallel_checks(cfg, mcfg)
        if fsdp_tp and par["sequence_parallel"]:
            raise ConfigError(f"train.strategy = 'fsdp' with parallel.cp = {par['cp']} runs without "
                              f"parallel.sequence_parallel (the DTensor plan's sequence split is not wired to "
                              f"the ring's chunks); set parallel.sequence_parallel = false, or use 'ddp'/'zero1'/"
                              f"'zero2', where cp, tp and sequence parallelism compose")
    if tp > 1:
        for name, value in (("model.n_heads", mcfg.n_heads), ("model.n_kv_heads", mcfg.kv_heads),
                            ("model.vocab_size", mcfg.vocab_size), ("the MLP width (model.d_ff)", mcfg.ffn_dim)):
            if value % tp:
                raise ConfigError(f"parallel.tp = {tp} must divide {name} ({value}): each tensor-parallel "
                                  f"rank holds an equal share; accepted tp: divisors of {value}")
        if mcfg.dropout:
            raise ConfigError(f"parallel.tp = {tp} needs model.dropout = 0 (got {mcfg.dropout}): dropout inside "
                              f"a tensor-parallel region needs a per-rank random stream, not built here")
        if par["sequence_parallel"] and cfg["data"]["seq_len"] % tp:
            raise ConfigError(f"parallel.sequence_parallel needs data.seq_len ({cfg['data']['seq_len']}) "
                              f"divisible by parallel.tp ({tp})")
    stages = pp * v
    if stages > mcfg.n_layers:
        what = (f"parallel.pp x parallel.virtual_stages = {pp} x {v} = {stages} stages" if v > 1
                else f"parallel.pp = {pp} stages")
        raise ConfigError(f"{what}, but model.n_layers = {mcfg.n_layers}: every stage needs at least one "
                          f"block; accepted: pp * virtual_stages in [1, {mcfg.n_layers}]")
    if sched == "interleaved":  # tp > 1, bf16 and fp16 run (course_lib.parallel.composed.interleaved)
        m = t["grad_accum"]
        rounds = max(1, m // pp)
        if m % rounds:  # torch's ScheduleInterleaved1F1B refuses it at its first step otherwise
            raise ConfigError(f"train.grad_accum ({m}) must be a multiple of max(1, grad_accum // parallel.pp) = "
                              f"{rounds} for parallel.pp_schedule = 'interleaved': any value <= {2 * pp - 1} "
                              f"or a multiple of {pp}")


def _moe_model_parallel_checks(cfg: dict, mcfg, keys: str) -> None:
    """An MoE model with tp/pp > 1 (course_lib.parallel.composed.experts): experts folded over each
    pipeline stage's dp x tp ranks, expert-tensor-parallel size 1. What is not built is refused here,
    naming why."""
    par, t = cfg["parallel"], cfg["train"]
    what = f"model.moe_experts with {keys}"
    if par["cp"] > 1:
        raise ConfigError(f"{what} is not built: context parallelism splits each sequence into zig-zag chunks, "
                          f"and the MoE layer's capacity and balancing loss are not computed over them; set "
                          f"parallel.cp = 1 (MoE composes with parallel.pp and with parallel.tp under "
                          f"sequence parallelism)")
    if par["tp"] > 1 and not par["sequence_parallel"]:
        raise ConfigError(f"{what} needs parallel.sequence_parallel = true: each tensor-parallel rank then routes "
                          f"its own slice of the tokens to whole experts (expert-tensor-parallel size 1, as Megatron "
                          f"requires sequence parallelism with experts and tp); without it every tp rank would route "
                          f"the same tokens. Expert-tensor-parallel = tp (experts cut by tp) is not built")
    if par["pp"] > 1 and par["pp_schedule"] == "interleaved":
        raise ConfigError(f"{what} runs with parallel.pp_schedule = 'gpipe' or '1f1b': torch's interleaved schedule "
                          f"runs the backward itself, and the balancing loss of a stage other than the last joins "
                          f"the backward in our runner (course_lib.parallel.composed.stage.run_pipeline)")
    if t["strategy"] == "fsdp":
        raise ConfigError(f"{what} does not run with train.strategy = 'fsdp': the DTensor tensor-parallel plan has "
                          f"no MoE layer; use 'ddp', 'zero1' or 'zero2'")
    if par["pp"] > 1 and t["precision"] == "fp16":
        raise ConfigError(f"{what} does not run with train.precision = 'fp16': a stage's balancing loss would join "
                          f"its backward scaled by the loss scale, which no test holds yet; use 'fp32' or 'bf16'")
    fp8_why = ("under tp the router and shared experts are replicated and read this rank's slice of the tokens, "
               "so a scale spanning the tokens would need their amax over the tp group; with pp, not tried. FP8 "
               "runs with parallel.ep under data parallelism" if par["tp"] > 1 else
               "not tried with the experts of a pipeline stage; FP8 runs with parallel.ep under data parallelism")
    _moe_unsupported_checks(cfg, mcfg, what, "leave it out, or run the MoE model with data parallelism only", fp8_why)


def _moe_unsupported_checks(cfg: dict, mcfg, what: str, fix: str, fp8_why: str | None = None) -> None:
    """The trainer options not tried with sharded or sequence-split experts, refused naming why;
    ``fp8_why``: why train.precision = 'fp8' is refused here (None: FP8 runs, as with parallel.ep
    under data parallelism: the experts stay in high precision, precision.fp8_model)."""
    t = cfg["train"]
    others = [(bad, key) for bad, key in (
        (t["compile"], "train.compile = true (the all-to-all reads its split sizes on the host)"),
        (t["precision"] == "fp8" and fp8_why is not None, f"train.precision = 'fp8' ({fp8_why})"),
        (mcfg.checkpointing != "none", f"model.checkpointing = {mcfg.checkpointing!r} (recomputation would "
                                       f"run the all-to-all again in backward: not tried)"),
        (mcfg.offload_activations, "model.offload_activations = true (not tried with the expert dispatch)"),
        (bool(cfg["data"]["val_path"]), "data.val_path (rank 0 evaluates alone, and its experts are a slice)"),
    ) if bad]
    if others:
        raise ConfigError(f"{what} does not run with {others[0][1]}; {fix}")


def _expert_parallel_checks(cfg: dict, mcfg) -> None:
    """``parallel.ep`` (course_lib.parallel.expert_parallel.in_trainer): an MoE model whose expert count
    it divides, a data-parallel dimension that keeps the expert slices apart (ddp, ddp-scratch,
    zero1, zero2, fsdp, fsdp-scratch, deepspeed at ZeRO 0-2: registry.EXPERT_PARALLEL_STRATEGIES; with
    tp/pp > 1 ddp, zero1, zero2: course_lib.parallel.composed.experts, checked with the other
    model-parallel keys). That ep divides the world size (the ranks of a pipeline stage) is checked
    when the ranks start (trainer.check_config.check_world)."""
    from course_lib.parallel.registry import EXPERT_PARALLEL_DP

    par, t = cfg["parallel"], cfg["train"]
    ep = par["ep"]
    if ep == 1:
        return
    what = f"parallel.ep = {ep}"
    if mcfg.moe_experts is None:
        raise ConfigError(f"{what} shards the experts of an MoE model, but model.moe_experts is not set (a dense "
                          f"model has none); set model.moe_experts (e.g. model.preset = 'moe-tiny') or parallel.ep = 1")
    if mcfg.moe_experts % ep:
        raise ConfigError(f"{what} must divide model.moe_experts ({mcfg.moe_experts}): every EP rank holds "
                          f"moe_experts / ep experts; accepted ep: the divisors of {mcfg.moe_experts} that divide "
                          f"the world size")
    if model_parallel_size(cfg) > 1:  # the model-parallel checks name what composes (_moe_model_parallel_checks)
        return
    if t["strategy"] not in EXPERT_PARALLEL_DP:
        why = {
            "single": "'single' is one process (ep = 1)",
        }.get(t["strategy"], "not built")
        raise ConfigError(f"{what} does not run with train.strategy = {t['strategy']!r}: {why}. With parallel.ep "
                          f"> 1 train.strategy must be one of {', '.join(repr(n) for n in EXPERT_PARALLEL_DP)}")
    if t["strategy"] == "deepspeed":  # course_lib.parallel.deepspeed.experts
        if par["zero_stage"] == 3:
            raise ConfigError(f"{what} with train.strategy = 'deepspeed' needs parallel.zero_stage 0, 1 or 2 (got 3): "
                              f"DeepSpeed does not support MoE expert parameters under ZeRO-3 except those of its own "
                              f"AutoEP layers (for any other MoE its engine stops with 'MoE not supported with Stage "
                              f"3'), and the kit's experts keep the kit's router and dispatch")
        if par["offload_optimizer"] != "none":
            raise ConfigError(f"{what} with train.strategy = 'deepspeed' runs without parallel.offload_optimizer "
                              f"(ZeRO-Offload's CPU gradient buffers were not tried with DeepSpeed's expert groups); "
                              f"set parallel.offload_optimizer = 'none'")
    if cfg["checkpoint"]["format"] == "sharded" and t["strategy"] in ("ddp", "ddp-scratch"):
        raise ConfigError(f"checkpoint.format = 'sharded' does not fit {what} with train.strategy = "
                          f"{t['strategy']!r}: its "
                          f"expert slices are plain tensors, not DTensors over an (expert-dp, ep) mesh, so DCP "
                          f"could not reshard them across EP sizes; full checkpoints gather the experts into the "
                          f"one-process layout (use 'auto' or 'full'), or use train.strategy = 'fsdp', whose "
                          f"sharded checkpoints do reshard")
    fp8_why = ("not tried with DeepSpeed's expert groups: FP8 runs with parallel.ep under ddp, ddp-scratch, "
               "zero1, zero2, fsdp and fsdp-scratch, and with deepspeed at ep = 1"
               if t["strategy"] == "deepspeed" else None)
    _moe_unsupported_checks(cfg, mcfg, what, "set parallel.ep = 1 or leave it out", fp8_why)


def _split_checks(cfg: dict, mcfg) -> None:
    """``parallel.pp_split`` against pp, virtual_stages and model.n_layers (the stage count itself
    is checked with the other model-parallel keys)."""
    from course_lib.estimate.stage_split import split_for_config

    par = cfg["parallel"]
    stages = par["pp"] * par["virtual_stages"]
    if stages > mcfg.n_layers:
        return  # "every stage needs at least one block" is said below, with the keys that set it
    try:
        split_for_config(cfg, mcfg)
    except ValueError as exc:
        raise ConfigError(f"parallel.pp_split = {par['pp_split']!r}: {exc}; accepted: 'even', 'balanced' or "
                          f"{stages} ints >= 1 (parallel.pp x parallel.virtual_stages = {par['pp']} x "
                          f"{par['virtual_stages']}) summing to model.n_layers = {mcfg.n_layers}") from None


def _model_parallel_strategy_check(cfg: dict) -> None:
    """With tp/pp/cp > 1, ``train.strategy`` names the data-parallel dimension: only the modes of
    course_lib.parallel.composed.dp compose; the others are refused naming what does."""
    from course_lib.parallel.registry import MODEL_PARALLEL_DP

    par, name = cfg["parallel"], cfg["train"]["strategy"]
    if name in MODEL_PARALLEL_DP:
        return
    keys = " and ".join(f"parallel.{k} = {par[k]}" for k in ("tp", "pp", "cp") if par[k] > 1)
    composing = ", ".join(repr(n) for n in MODEL_PARALLEL_DP)
    why = {
        "deepspeed": ("the DeepSpeed engine runs here as data parallelism only (parallel.tp = parallel.pp = "
                      "parallel.cp = 1): ZeRO stages 0-3 (parallel.zero_stage) with optional CPU offload "
                      "(parallel.offload_optimizer, parallel.offload_param); its own pipeline and tensor-"
                      "parallel engines are not wired into the trainer"),
        "ddp-scratch": "the from-scratch BucketedDDP wraps a whole model over every rank (data parallelism only)",
        "fsdp-scratch": "the from-scratch SimpleFSDP shards a whole model over every rank (data parallelism only)",
        "single": "'single' is one process",
    }.get(name, f"{name!r} is not a data-parallel dimension of the model-parallel strategy")
    raise ConfigError(f"{keys} does not compose with train.strategy = {name!r}: {why}. With tensor/pipeline/"
                      f"context parallelism, train.strategy names the data-parallel dimension: one of "
                      f"{composing}")


def _context_parallel_checks(cfg: dict, mcfg) -> None:
    """parallel.cp > 1 (course_lib.parallel.context_parallel.in_trainer): what the ring supports."""
    par, t = cfg["parallel"], cfg["train"]
    cp, seq = par["cp"], cfg["data"]["seq_len"]
    what = f"parallel.cp = {cp}"
    if par["pp"] > 1:
        raise ConfigError(f"{what} with parallel.pp = {par['pp']} is not built (context parallelism runs with "
                          f"parallel.tp and data parallelism); set parallel.pp = 1 or parallel.cp = 1")
    split = 2 * cp * (par["tp"] if par["sequence_parallel"] else 1)
    if seq % split:
        why = (f"2 * cp * tp = {split}: zig-zag gives each cp rank 2 of 2 * cp equal pieces, and sequence "
               f"parallelism splits those over tp" if par["sequence_parallel"]
               else f"2 * cp = {split}: zig-zag gives each cp rank 2 of 2 * cp equal pieces")
        raise ConfigError(f"{what} needs data.seq_len ({seq}) divisible by {why}")
    if mcfg.dropout:
        raise ConfigError(f"{what} needs model.dropout = 0 (got {mcfg.dropout}): ring attention has no "
                          f"attention dropout")
    if mcfg.attention_window is not None:
        raise ConfigError(f"{what} runs full causal attention only; model.attention_window = "
                          f"{mcfg.attention_window} is not supported by the ring (leave model.attention_window out)")
    if mcfg.offload_activations:  # recomputation (full / selective) re-runs the ring in backward: it works
        raise ConfigError(f"{what} supports model.offload_activations = false only (not tested with the ring)")
    if t["compile"]:
        raise ConfigError(f"train.compile = true does not apply to {what}: ring attention's point-to-point "
                          f"transfers run in Python between the compiled parts; set train.compile = false")
    # model.position: "learned" reads the table at each token's true position, "rope" the rotation
    # rows at them, "none" needs nothing: all three run.


def vocab_size_of(cfg: dict) -> int:
    """Token vocabulary the data produces: 256 for bytes, data.vocab_size otherwise."""
    return 256 if cfg["data"]["task"] == "text" else cfg["data"]["vocab_size"]


def build_model_config(cfg: dict):
    """The ModelConfig for ``cfg``: preset + overrides, vocabulary and context sized to the data."""
    from course_lib.model.config import ModelConfig  # torch-free: validating a config imports no torch

    overrides = {k: v for k, v in cfg["model"].items() if k not in SCHEMA["model"]}
    overrides.setdefault("vocab_size", vocab_size_of(cfg))
    overrides.setdefault("block_size", cfg["data"]["seq_len"])
    try:
        mcfg = ModelConfig.preset(cfg["model"]["preset"], **overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[model]: {exc}") from None
    if mcfg.vocab_size < vocab_size_of(cfg):
        raise ConfigError(f"model.vocab_size ({mcfg.vocab_size}) is smaller than the data's "
                          f"vocabulary ({vocab_size_of(cfg)})")
    if mcfg.block_size < cfg["data"]["seq_len"]:
        raise ConfigError(f"model.block_size ({mcfg.block_size}) must be >= data.seq_len "
                          f"({cfg['data']['seq_len']})")
    return mcfg


def _init_from_check(cfg: dict, mcfg) -> None:
    """``model.init_from`` names weights that fit the model: every config field that changes what
    the weights compute, then every tensor's shape, both values named (torch-free: JSON and the
    safetensors header only)."""
    path = cfg["model"]["init_from"]
    if not path:
        return
    from course_lib.model.init_source import check_init_source

    try:
        check_init_source(path, mcfg)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model.init_from = {path!r}: {exc}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is parsed as TOML (numbers,
    booleans, quoted or bare strings)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()  # a bare word such as bf16 or cosine
    return section, key, value


def load(path: str | Path | None, overrides: list[str] = (), *,
         init_source: bool = True) -> dict[str, dict[str, Any]]:
    """Read ``path`` (TOML; None = defaults only), apply ``section.key=value`` overrides, validate
    (``init_source``: see :func:`validate`)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    raw = copy.deepcopy(raw)
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})[key] = value
    return validate(raw, init_source=init_source)
