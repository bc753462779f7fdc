"""The job a planner is asked about, validated before any search: every error names its flag.

:func:`make_spec` turns what an engineer typed (``--model llama2-70b --gpu a100-80gb --gpus 64
--gpus-per-node 8 --tokens 2e12``) into a :class:`JobSpec` of plain numbers: the model shape, the
device's memory and peak FLOP/s, the two link bandwidths, the batch in sequences. Bad input raises
:class:`PlanError`, whose message starts with the flag (``--gpus: ...``) and says what is accepted.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from course_lib.estimate import ACCELERATORS, MOE_PRESETS, PRESETS, RECIPES, ModelShape, MoEShape
from course_lib.planner.hardware import INTERCONNECTS, default_interconnect, gpu_names, resolve_gpu

# Context-parallel degrees the search tries (and the batch check must allow): defined here, the
# lower module, because the search imports this one.
CONTEXT_PARALLEL = (1, 2, 4, 8)


class PlanError(ValueError):
    """Bad planner input; the message starts with the flag responsible (``--gpus: ...``)."""


ATTENTION = ("eager", "flash")
#: Matmul precisions a plan can name: "bf16", or "fp8" (FP8 linears: torchtitan's float8 converter,
#: Megatron's --fp8-format hybrid; the planner models their memory and all-gather bytes, not their speed).
PRECISIONS = ("bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "delayed")


@dataclass(frozen=True)
class JobSpec:
    """Everything the search needs, in base units (bytes, FLOP/s, bytes/s, seconds, tokens)."""

    model_name: str
    shape: ModelShape
    gpu_key: str
    gpu_name: str
    gpu_memory_bytes: float
    gpu_peak_flops: float          # dense bf16 FLOP/s per GPU
    gpus: int
    gpus_per_node: int
    tokens: float                  # training tokens in total
    seq: int                       # tokens per sequence
    global_batch: int              # sequences per optimizer step
    interconnect: str
    intra_node_bytes_per_s: float  # per GPU, per direction
    inter_node_bytes_per_s: float
    mfu: float                     # fraction of peak the matmuls sustain
    overlap: float                 # fraction of compute time that hides DP/ZeRO traffic
    headroom: float                # fraction of device memory kept free
    mtbf_hours: float              # mean time between failures of ONE node
    storage_bytes_per_s: float     # aggregate checkpoint write bandwidth
    recipe: str
    attention: str
    batch_note: str = ""
    # Mixture-of-experts: the published shape (None for a dense model). ``shape`` is then its
    # active_equivalent() - the dense model that does per token what the MoE does - for the
    # activation, attention and FLOP terms; parameters and expert traffic come from ``moe``.
    moe: MoEShape | None = None
    # DeepSeek-V3's node-limited routing: a token's experts sit on at most this many nodes and each
    # node receives it once over the network (None: no limit, a copy per expert)
    moe_node_limit: int | None = None
    precision: str = "bf16"        # "bf16" or "fp8" (PRECISIONS)
    fp8_recipe: str = "tensorwise"  # FP8 scaling recipe (FP8_RECIPES) when precision is fp8
    fp8_param_gather: bool = False  # weights kept and all-gathered in FP8 (1 byte per parameter)

    @property
    def nodes(self) -> int:
        """Machines in the job (gpus / gpus_per_node)."""
        return self.gpus // self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        """Device memory minus the headroom, bytes per GPU: what a layout may use."""
        return self.gpu_memory_bytes * (1 - self.headroom)

    @property
    def global_batch_tokens(self) -> int:
        """Tokens per optimizer step (global_batch x seq)."""
        return self.global_batch * self.seq


def _number(flag: str, value, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise PlanError(f"{flag}: must be a number, got {value!r}")
    low = lo is not None and (value <= lo if lo_open else value < lo)
    if low or (hi is not None and value > hi):
        rng = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise PlanError(f"{flag}: must be {rng}, got {value}")
    return float(value)


def _int(flag: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{flag}: must be a whole number, got {value!r}")
    if value < lo:
        raise PlanError(f"{flag}: must be >= {lo}, got {value}")
    return value


def parse_tokens(text) -> float:
    """A token count from ``2e12``, ``2T``, ``4M``, ``500B``, ``4096`` (K/M/B/G/T = 1e3..1e12) or
    binary ``4Mi`` (Ki/Mi/Gi/Ti = 2**10..2**40: Llama 2's "4M-token batch" is 4Mi = 1024 x 4096)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip().upper()
    binary = {"KI": 2.0**10, "MI": 2.0**20, "GI": 2.0**30, "TI": 2.0**40}.get(s[-2:])
    scale = binary or {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(s[-1:], 1.0)
    body = s[:-2] if binary else (s[:-1] if scale != 1.0 else s)
    try:
        return float(body) * scale
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (e.g. 2e12, 2T, 4M)") from None


def _moe_shape(model: str, given: dict) -> MoEShape:
    import dataclasses as dc

    fields = {f.name for f in dc.fields(MoEShape)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise PlanError(f"--{unknown[0].replace('_', '-')}: not a field of the MoE shape {model}")
    try:
        return dc.replace(MOE_PRESETS[model], **given)
    except (TypeError, ValueError) as exc:
        field = str(exc).split(" ", 1)[0].split("(", 1)[0]
        raise PlanError(f"--{field.replace('_', '-')}: {exc}") from None


def _shape(model: str | None, shape_overrides: dict) -> tuple[str, ModelShape]:
    given = {k: v for k, v in (shape_overrides or {}).items() if v is not None}
    if model in MOE_PRESETS:
        return model, _moe_shape(model, given).active_equivalent()
    if model is None and not given:
        raise PlanError(f"--model: required (presets: {', '.join(sorted(PRESETS))}), "
                        "or give the shape with --n-layers --d-model --n-heads --vocab-size")
    try:
        if model is not None:
            if model not in PRESETS:
                raise PlanError(f"--model: unknown model {model!r}; presets: {', '.join(sorted(PRESETS))}; "
                                f"mixture-of-experts: {', '.join(sorted(MOE_PRESETS))} "
                                "(or describe it with --n-layers --d-model --n-heads --vocab-size)")
            return model, dataclasses.replace(PRESETS[model], **given)
        missing = [f"--{k.replace('_', '-')}" for k in ("n_layers", "d_model", "n_heads", "vocab_size")
                   if k not in given]
        if missing:
            raise PlanError(f"{missing[0]}: required for a custom shape without --model (missing: {' '.join(missing)})")
        given.setdefault("seq_len", 4096)
        llama = dict(tied_embeddings=False, learned_pos_emb=False, bias=False, mlp="swiglu", norm="rmsnorm")
        return "custom", ModelShape(**{**llama, **given})
    except (TypeError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        field = str(exc).split(" ", 1)[0].split("(", 1)[0]
        raise PlanError(f"--{field.replace('_', '-')}: {exc}") from None


def make_spec(*, model: str | None = None, gpu: str, gpus: int, gpus_per_node: int = 8, tokens,
              seq: int | None = None, global_batch_tokens="4Mi", interconnect: str | None = None,
              intra_node_gbps: float | None = None, inter_node_gbps: float | None = None,
              gpu_memory_gib: float | None = None, gpu_tflops: float | None = None, mfu: float = 0.5,
              overlap: float = 0.5, headroom: float = 0.10, mtbf_hours: float = 5000.0,
              storage_gbps: float = 10.0, recipe: str = "mixed-adam", attention: str = "eager",
              shape_overrides: dict | None = None, allow_batch_rounding: bool = False,
              moe_node_limit: int | None = None, precision: str = "bf16", fp8_recipe: str = "tensorwise",
              fp8_param_gather: bool = False) -> JobSpec:
    """Validate the planner's inputs (units as the CLI flags: GiB, TFLOP/s, GB/s, hours) and
    return a JobSpec in base units. Raises PlanError naming the flag; see ``course plan --help``.
    A mixture-of-experts ``model`` (MOE_PRESETS: deepseek-v3, mixtral-8x7b, ...) makes the search
    add expert parallelism (ep, etp); ``precision="fp8"`` writes FP8 engine files and, with
    ``fp8_param_gather``, counts FP8 weights (recipe fp8-params-adam) and 1-byte all-gathers.
    The global batch is kept exactly: one that is not whole sequences or that no layout's
    data-parallel degree divides is refused (``--global-batch-tokens``, with the nearest batches
    that work) unless ``allow_batch_rounding`` (``--round-batch``), and then the note says so."""
    name, shape = _shape(model, shape_overrides or {})
    moe = _moe_shape(model, {k: v for k, v in (shape_overrides or {}).items() if v is not None}) \
        if model in MOE_PRESETS else None
    if precision not in PRECISIONS:
        raise PlanError(f"--precision: must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if fp8_recipe not in FP8_RECIPES:
        raise PlanError(f"--fp8-recipe: must be one of {', '.join(FP8_RECIPES)}; got {fp8_recipe!r}")
    if fp8_param_gather and precision != "fp8":
        raise PlanError("--fp8-param-gather: needs --precision fp8")
    if fp8_param_gather and recipe == "mixed-adam":
        recipe = "fp8-params-adam"  # the weights live in FP8: 1 byte each instead of 2
    if moe_node_limit is not None:
        if moe is None:
            raise PlanError("--moe-node-limit: only for a mixture-of-experts --model")
        _int("--moe-node-limit", moe_node_limit, 1)
    key = resolve_gpu(gpu) if isinstance(gpu, str) else None
    if key is None and (gpu_memory_gib is None or gpu_tflops is None):
        raise PlanError(f"--gpu: unknown GPU {gpu!r}; known: {', '.join(gpu_names())} "
                        "(or describe it with --gpu-memory-gib and --gpu-tflops)")
    acc = ACCELERATORS.get(key) if key else None
    mem_gib = _number("--gpu-memory-gib", gpu_memory_gib, 0, lo_open=True) if gpu_memory_gib is not None \
        else acc.memory_gib
    peak = _number("--gpu-tflops", gpu_tflops, 0, lo_open=True) * 1e12 if gpu_tflops is not None \
        else (acc.bf16 or acc.fp16)  # V100: no bf16 tensor cores, fp16 is its half precision
    _int("--gpus-per-node", gpus_per_node, 1)
    _int("--gpus", gpus, 1)
    if gpus % gpus_per_node:
        raise PlanError(f"--gpus: must be a multiple of --gpus-per-node ({gpus_per_node}) - whole nodes; "
                        f"got {gpus} (try " + (f"{gpus // gpus_per_node * gpus_per_node} or " if gpus > gpus_per_node else "")
                        + f"{(gpus // gpus_per_node + 1) * gpus_per_node}"
                        + (f", or --gpus-per-node {gpus} for part of one node" if gpus < gpus_per_node else "") + ")")
    try:
        n_tokens = parse_tokens(tokens)
    except ValueError as exc:
        raise PlanError(f"--tokens: {exc}") from None
    _number("--tokens", n_tokens, 0, lo_open=True)
    seq_len = shape.seq_len if seq is None else _int("--seq", seq, 1)
    try:
        batch_tokens = parse_tokens(global_batch_tokens)
    except ValueError as exc:
        raise PlanError(f"--global-batch-tokens: {exc}") from None
    _number("--global-batch-tokens", batch_tokens, 0, lo_open=True)
    raw = batch_tokens / seq_len
    if raw < 1:
        raise PlanError(f"--global-batch-tokens: {batch_tokens:g} tokens is less than one sequence "
                        f"of --seq {seq_len}")
    batch, note = exact_batch(raw, batch_tokens, seq_len, data_parallel_degrees(shape, seq_len, gpus, gpus_per_node),
                              allow_batch_rounding)
    if interconnect is None:
        interconnect = default_interconnect(key or "")
    if interconnect not in INTERCONNECTS:
        raise PlanError(f"--interconnect: unknown preset {interconnect!r}; presets: {', '.join(INTERCONNECTS)}")
    link = INTERCONNECTS[interconnect]
    intra = _number("--intra-node-gbps", intra_node_gbps, 0, lo_open=True) * 1e9 if intra_node_gbps is not None \
        else link.intra_node_bytes_per_s
    inter = _number("--inter-node-gbps", inter_node_gbps, 0, lo_open=True) * 1e9 if inter_node_gbps is not None \
        else link.inter_node_bytes_per_s
    if recipe not in RECIPES:
        raise PlanError(f"--recipe: unknown {recipe!r}; recipes: {', '.join(RECIPES)}")
    if attention not in ATTENTION:
        raise PlanError(f"--attention: must be one of {', '.join(ATTENTION)}; got {attention!r}")
    return JobSpec(
        model_name=name, shape=shape, gpu_key=key or "custom", gpu_name=acc.name if acc else f"custom GPU ({gpu})",
        gpu_memory_bytes=mem_gib * 2**30, gpu_peak_flops=peak, gpus=gpus, gpus_per_node=gpus_per_node,
        tokens=n_tokens, seq=seq_len, global_batch=batch, interconnect=interconnect,
        intra_node_bytes_per_s=intra, inter_node_bytes_per_s=inter,
        mfu=_number("--mfu", mfu, 0, 1, lo_open=True), overlap=_number("--overlap", overlap, 0, 1),
        headroom=_number("--headroom", headroom, 0, 0.9), mtbf_hours=_number("--mtbf-hours", mtbf_hours, 0, lo_open=True),
        storage_bytes_per_s=_number("--storage-gbps", storage_gbps, 0, lo_open=True) * 1e9,
        recipe=recipe, attention=attention, batch_note=note, moe=moe, moe_node_limit=moe_node_limit,
        precision=precision, fp8_recipe=fp8_recipe, fp8_param_gather=fp8_param_gather)


def data_parallel_degrees(shape: ModelShape, seq: int, gpus: int, gpus_per_node: int) -> list[int]:
    """Every dp = gpus / (tp pp cp) the search's rules allow (tp and cp as in
    ``search.layouts``, pp any divisor up to the layers), sorted."""
    out = set()
    for tp in range(1, gpus_per_node + 1):
        if gpus_per_node % tp or shape.n_heads % tp or shape.kv_heads % tp or shape.ffn_dim % tp:
            continue
        for cp in CONTEXT_PARALLEL:
            if tp * cp > gpus_per_node or seq % cp or gpus % (tp * cp):
                continue
            rest = gpus // (tp * cp)
            out.update(rest // pp for pp in range(1, min(rest, shape.n_layers) + 1) if rest % pp == 0)
    return sorted(out)


def exact_batch(sequences: float, batch_tokens: float, seq: int, dps: list[int], allow_rounding: bool) -> tuple[int, str]:
    """The global batch in sequences when it is whole and some data-parallel degree in ``dps``
    divides it: (sequences, ""). Otherwise PlanError naming --global-batch-tokens with the
    nearest batches below and above that work, or, with ``allow_rounding``, the nearer of the two
    (the lower on a tie) and a note that says so."""
    def works(b: int) -> bool:
        return b >= 1 and any(b % d == 0 for d in dps)

    whole = abs(sequences - round(sequences)) < 1e-9
    if whole and works(int(round(sequences))):
        return int(round(sequences)), ""
    lo = int(sequences) if not whole else int(round(sequences)) - 1
    while lo >= 1 and not works(lo):
        lo -= 1
    hi = int(sequences) + 1
    while not works(hi):
        hi += 1
    why = ("is not a whole number of sequences" if not whole else
           f"is not divisible by any data-parallel degree a layout can have ({', '.join(map(str, dps[:8]))}"
           f"{', ...' if len(dps) > 8 else ''})")
    options = ([lo] if lo >= 1 else []) + [hi]
    nearest = " or ".join(f"{b * seq:,} tokens ({b} sequences)" for b in options)
    if not allow_rounding:
        raise PlanError(f"--global-batch-tokens: {batch_tokens:,.0f} tokens = {sequences:g} sequences of {seq} tokens, "
                        f"which {why}; nearest that work: {nearest}. Pass one of them with --global-batch-tokens, "
                        f"or --round-batch to let the planner round")
    batch = min(options, key=lambda b: (abs(b - sequences), b))
    return batch, (f"global batch rounded from {sequences:g} to {batch} sequences ({batch * seq:,} tokens) because "
                   f"--round-batch was given: {sequences:g} {why}; --global-batch-tokens {batch * seq} keeps it exact")
