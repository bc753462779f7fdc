"""Bytes of activations saved for the backward pass, after Korthikanti et al. 2022.

Source: V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023, arXiv:2205.05198), Section 4 and Table 2. With s = sequence length, b = micro-batch,
h = hidden size, a = heads, t = tensor-parallel degree, the bytes per transformer layer are

| setting | bytes per layer |
| --- | --- |
| no parallelism | sbh(34 + 5as/h) |
| tensor parallel | sbh(10 + 24/t + 5as/(ht)) |
| tensor + sequence parallel | sbh/t (34 + 5as/h) |
| tensor parallel + selective recompute | sbh(10 + 24/t) |
| tensor + sequence parallel + selective | sbh * 34/t |
| full recompute | 2sbh (the layer input only) |

The paper assumes 2-byte (fp16/bf16) activations, 1-byte dropout masks, dropout after attention
and after both residual branches, a GELU MLP of width 4h, multi-head attention and an attention
that stores its s x s scores ("eager"). Each of those is a keyword here whose default is the
paper's, so a model that differs (TinyGPT has no dropout, may use SwiGLU, grouped-query attention
and fused "flash" attention that keeps no s x s matrix) is described, not approximated.

TinyGPT (course_lib/model/tinygpt.py) in fp32 on a CPU: ``dropout=False, attention="flash",
kv_repeat=True, bytes_per_element=4`` plus ``norm_saves="input+stats"`` (GPT-style, LayerNorm) or
``norm_saves="unfused-rmsnorm"`` (Llama-style) give exactly the bytes autograd saves per block,
for every recompute mode (tests/test_estimate_activations.py).

Tensor parallelism with recomputation (the table's rows with t > 1), per layer and rank:

| recompute | tensor parallel | tensor + sequence parallel (Megatron) | + SP, the kit (``sp_gathered_inputs="keep"``) |
| --- | --- | --- | --- |
| none | sbh(10 + 24/t + 5as/(ht)) | sbh/t (34 + 5as/h) | sbh/t (34 + 5as/h) + 4sbh(1 - 1/t) |
| selective | sbh(10 + 24/t) | 34 sbh/t | 34 sbh/t + 4sbh(1 - 1/t) |
| full | 2sbh | 2sbh/t | 2sbh/t |

(e = 2 bytes.) Sequence parallelism all-gathers the sequence-split input of the QKV and the first
MLP matmul. Megatron-LM saves the sequence shard (e sbh/t) and all-gathers it again in backward
(Korthikanti Sec. 4.2.2); the kit's column-parallel layers (course_lib.parallel.tensor_parallel)
keep the gathered [s, b, h] input instead, 2 x e sbh (1 - 1/t) more per layer and no second
all-gather. ``sp_gathered_inputs`` says which of the two is counted. Full recomputation keeps only
the layer input, which sequence parallelism splits (Korthikanti Sec. 5: 2sbh/t per layer). Measured
equal on 2 gloo ranks for TinyGPT under tp 2, SP off and on, every mode
(tests/test_train_recompute_tp.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.validate import check_bool, check_choice, check_divides, check_int, check_number
from .shapes import default_d_ff

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("eager", "flash")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
NORM_SAVES = ("input", "input+stats", "unfused-rmsnorm")
SP_GATHERED_INPUTS = ("regather", "keep")


@dataclass(frozen=True)
class ActivationBreakdown:
    """Saved-activation **bytes per transformer layer, per micro-batch, on one rank**, by tensor.

    Component names (0 where a setting removes them): norm_inputs, norm_extras, qkv_input, q_k_v,
    attention_core (s x s scores / softmax / dropout, or flash's fp32 log-sum-exp), out_proj_input,
    mlp_input, mlp_hidden, dropout_masks; with full recompute only layer_input.
    """

    components: dict = field(default_factory=dict)
    unit: str = "bytes per layer per micro-batch per rank"

    @property
    def total(self) -> float:
        """Sum of the components, bytes."""
        return float(sum(self.components.values()))


def activation_breakdown_per_layer(*, seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                                   tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                                   dropout: bool = True, attention: str = "eager", mlp: str = "gelu",
                                   d_ff: int | None = None, n_kv_heads: int | None = None,
                                   bytes_per_element: float = 2, residual_bytes: float | None = None,
                                   norm_saves: str = "input", kv_repeat: bool = False,
                                   sp_gathered_inputs: str = "regather") -> ActivationBreakdown:
    """Per-tensor breakdown of `activation_bytes_per_layer` (same arguments). See that function."""
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("d_model", d_model),
                        ("n_heads", n_heads), ("tp", tp)):
        check_int(name, value, 1)
    check_divides("n_heads", n_heads, "d_model", d_model)
    check_divides("tp", tp, "n_heads", n_heads)
    kv = n_heads if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads, 1, n_heads, "n_heads")
    check_divides("n_kv_heads", kv, "n_heads", n_heads)
    check_divides("tp", tp, "n_kv_heads", kv)
    check_bool("sequence_parallel", sequence_parallel)
    if sequence_parallel:
        check_divides("tp", tp, "seq_len", seq_len)
    check_choice("recompute", recompute, RECOMPUTE)
    check_bool("dropout", dropout)
    check_choice("attention", attention, ATTENTION)
    check_choice("mlp", mlp, ("gelu", "swiglu"))
    f = default_d_ff(d_model, mlp) if d_ff is None else check_int("d_ff", d_ff, 1)
    e = check_number("bytes_per_element", bytes_per_element, 0, lo_open=True)
    r = e if residual_bytes is None else check_number("residual_bytes", residual_bytes, 0, lo_open=True)
    check_choice("norm_saves", norm_saves, NORM_SAVES)
    check_bool("kv_repeat", kv_repeat)
    check_choice("sp_gathered_inputs", sp_gathered_inputs, SP_GATHERED_INPUTS)

    s, b, h, a, t = seq_len, micro_batch, d_model, n_heads, tp
    sbh, sb = s * b * h, s * b
    # Tensors that tensor parallelism alone leaves replicated (norms, dropout, the inputs of the
    # column-parallel matmuls) are split along the sequence by sequence parallelism.
    rep = t if sequence_parallel else 1
    # The QKV and first MLP matmul inputs: under SP Megatron keeps the shard, the kit the gathered copy.
    gathered = 1 if sp_gathered_inputs == "keep" else rep
    if recompute == "full":
        # Only the layer's input (the residual stream) is kept; the rest is recomputed in backward.
        return ActivationBreakdown({"layer_input": r * sbh / rep})
    mask = 1 if dropout else 0  # a dropout mask costs 1 byte per element (Korthikanti Sec. 4.1)
    if recompute == "selective":
        core = 0.0  # the attention core (QK^T, softmax, dropout, x V) is recomputed
    elif attention == "eager":
        # softmax output (e) [+ its dropout mask (1) and the dropped-out copy (e)] per score.
        core = a * s * s * b * (e + (1 + e if dropout else 0)) / t
    else:
        # Flash attention keeps no s x s matrix, only an fp32 log-sum-exp per query and head
        # (Dao et al. 2022, Algorithm 2); its dropout mask is regenerated from the RNG state.
        core = 4 * a * s * b / t
    # Q, K, V as attention saves them: K and V have n_kv_heads heads, unless the implementation
    # repeats them to n_heads first (HF `repeat_kv`, TinyGPT) - then attention keeps the copies.
    # Selective recomputation saves the core's inputs, i.e. the un-repeated projections.
    kv_saved = a if (kv_repeat and recompute != "selective") else kv
    norm_input, norm_extra = _one_norm_bytes(norm_saves, r, sbh, sb)
    norm_inputs, norm_extras = 2 * norm_input / rep, 2 * norm_extra / rep
    n_hidden = 2 if mlp == "gelu" else 4  # gelu: its input and output; swiglu: gate, up, silu, product
    return ActivationBreakdown({
        "norm_inputs": norm_inputs,
        "norm_extras": norm_extras,
        "qkv_input": e * sbh / gathered,
        "q_k_v": e * sbh * (1 + 2 * kv_saved / a) / t,
        "attention_core": core,
        "out_proj_input": e * sbh / t,
        "mlp_input": e * sbh / gathered,
        "mlp_hidden": n_hidden * e * s * b * f / t,
        "dropout_masks": 2 * mask * sbh / rep,
    })


def _one_norm_bytes(norm_saves: str, r: float, sbh: float, sb: float) -> tuple[float, float]:
    """(input bytes, extra bytes) one norm keeps for backward, before any parallel split."""
    if norm_saves == "unfused-rmsnorm":
        # x * rsqrt(mean(x^2)) then * weight in separate ops (HF LlamaRMSNorm, TinyGPT): keeps the
        # input upcast to fp32, the fp32 rstd per token and the normalised tensor (residual dtype).
        return 4 * sbh, r * sbh + 4 * sb
    # Fused LayerNorm kernels also keep fp32 mean and rstd per token (8 bytes).
    return r * sbh, (8 * sb if norm_saves == "input+stats" else 0.0)


def activation_bytes_per_layer(*, seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                               tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                               dropout: bool = True, attention: str = "eager", mlp: str = "gelu",
                               d_ff: int | None = None, n_kv_heads: int | None = None,
                               bytes_per_element: float = 2, residual_bytes: float | None = None,
                               norm_saves: str = "input", kv_repeat: bool = False,
                               sp_gathered_inputs: str = "regather") -> float:
    """Bytes of activations one transformer layer saves for backward, **per micro-batch, per rank**.

    Korthikanti et al. 2022, Sec. 4 / Table 2 (formulas in the module docstring); every default is
    the paper's assumption. `recompute`: "none" | "selective" (recompute the attention core,
    Sec. 5) | "full" (keep only the layer input). Keywords for models that differ from the paper:

    - `dropout=False`: no 1-byte masks and no dropped-out copy of the scores;
    - `attention="flash"`: no s x s terms, a 4-byte log-sum-exp per head and query instead;
    - `mlp="swiglu"`: 4 hidden tensors of width d_ff (gate, up, silu, product) instead of 2;
      `d_ff` defaults to 4*d_model (gelu) / `shapes.default_d_ff` (swiglu);
    - `n_kv_heads`: grouped-query attention shrinks K and V; `kv_repeat=True` when the code
      repeats K/V to every query head before attention (attention then saves the copies);
    - `bytes_per_element`: 2 for bf16/fp16, 4 for fp32 (masks stay 1 byte);
    - `residual_bytes`: bytes of the residual stream the norms (and full recompute) keep; under
      torch.autocast with fp32 weights the residual stream stays fp32 (4) while matmul inputs
      are bf16 (`bytes_per_element=2`). Default: `bytes_per_element`;
    - `norm_saves`: "input" (the paper), "input+stats" (PyTorch's fused LayerNorm also keeps fp32
      mean and rstd per token), "unfused-rmsnorm" (see the code);
    - `sp_gathered_inputs` (read with `sequence_parallel=True`): "regather" (Megatron-LM, the
      paper: the QKV and MLP-up matmuls keep their sequence shard, e*sbh/t each, and all-gather it
      again in backward) or "keep" (the kit's tensor-parallel layers keep the all-gathered
      [s, b, h] input, e*sbh each: 2*e*sbh*(1 - 1/t) more per layer).

    Not counted: RoPE copies of Q and K made out of place while the fused QKV output stays alive;
    under torch.autocast, the bf16 weight copies autocast saves (they are the recipe's 2-byte
    parameters, see memory.py) and the extra bf16 input copy each further Linear reading the same
    fp32 tensor makes (SwiGLU's separate gate and up: one more e x sbh); allocator padding and
    workspaces. Returns float bytes.
    """
    return activation_breakdown_per_layer(
        seq_len=seq_len, micro_batch=micro_batch, d_model=d_model, n_heads=n_heads, tp=tp,
        sequence_parallel=sequence_parallel, recompute=recompute, dropout=dropout, attention=attention,
        mlp=mlp, d_ff=d_ff, n_kv_heads=n_kv_heads, bytes_per_element=bytes_per_element,
        residual_bytes=residual_bytes, norm_saves=norm_saves, kv_repeat=kv_repeat,
        sp_gathered_inputs=sp_gathered_inputs).total


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes held by the **first pipeline stage at its peak, per rank**."""

    per_layer: float
    layer_equivalents: float
    in_flight_micro_batches: float
    embedding: float
    output: float
    unit: str = "bytes per rank"

    @property
    def layers(self) -> float:
        """Bytes of the transformer layers (per_layer x layer_equivalents)."""
        return self.per_layer * self.layer_equivalents

    @property
    def total(self) -> float:
        """Layers + embedding-dropout masks + output layer, bytes."""
        return self.layers + self.embedding + self.output


def first_stage_activation_breakdown(*, n_layers: int, pp: int = 1, virtual_stages: int = 1,
                                     schedule: str | None = None, micro_batches: int | None = None,
                                     vocab_size: int | None = None, **layer_kwargs) -> StageActivations:
    """The first stage's peak activations (see `activation_bytes_first_stage`) as StageActivations."""
    check_int("n_layers", n_layers, 1)
    check_int("pp", pp, 1)
    check_int("virtual_stages", virtual_stages, 1)
    if schedule is None:
        schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError("virtual_stages must be >= 2 for schedule='interleaved' "
                         "(one model chunk per rank is schedule='1f1b')")
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(f"virtual_stages must be 1 for schedule={schedule!r}; use schedule='interleaved'")
    check_divides("pp * virtual_stages", pp * virtual_stages, "n_layers", n_layers)
    if micro_batches is not None:
        check_int("micro_batches", micro_batches, 1)
    if schedule == "gpipe" and micro_batches is None:
        raise ValueError("micro_batches is required for schedule='gpipe' (GPipe keeps all of them in flight)")
    per_layer = activation_breakdown_per_layer(**layer_kwargs)
    m = micro_batches
    # Micro-batches whose activations the first stage holds at its peak:
    if schedule == "gpipe":
        in_flight = float(m)  # all forwards run before any backward
    elif schedule == "1f1b":
        in_flight = float(pp if m is None else min(pp, m))  # Korthikanti Sec. 4.2.3
    else:
        # Interleaved 1F1B: Korthikanti Sec. 4.2.3 multiplies by 1 + (p - 1)/(p * v).
        in_flight = pp * (1 + (pp - 1) / (pp * virtual_stages))
    layer_equivalents = n_layers / pp * in_flight

    embedding = output = 0.0
    if vocab_size is not None:
        check_int("vocab_size", vocab_size, 1)
        s, b, h = layer_kwargs["seq_len"], layer_kwargs["micro_batch"], layer_kwargs["d_model"]
        t = layer_kwargs.get("tp", 1)
        rep = t if layer_kwargs.get("sequence_parallel", False) else 1
        e = layer_kwargs.get("bytes_per_element", 2)
        r = layer_kwargs.get("residual_bytes") or e
        # Embedding dropout mask: 1 byte per element per micro-batch in flight (Sec. 4.3: sbhp/t).
        embedding = (s * b * h / rep) * in_flight if layer_kwargs.get("dropout", True) else 0.0
        if pp == 1:
            # Final norm (what each block's norms keep, per `norm_saves`; the paper's "input" is
            # its input in the residual dtype) and output-projection input plus fp32 logits for
            # the cross-entropy, split over the vocabulary (Sec. 4.3: 4sbh/t (1 + v/h) for e = 2).
            norm_input, norm_extra = _one_norm_bytes(
                layer_kwargs.get("norm_saves", "input"), r, s * b * h, s * b)
            # The head is column-parallel: under SP its input is all-gathered first, and the kit
            # keeps the gathered copy (sp_gathered_inputs="keep"), Megatron the shard.
            head_in = rep if layer_kwargs.get("sp_gathered_inputs", "regather") == "regather" else 1
            output = (norm_input + norm_extra) / rep + e * s * b * h / head_in + 4 * s * b * vocab_size / t
    return StageActivations(per_layer.total, layer_equivalents, in_flight, embedding, output)


def activation_bytes_first_stage(*, n_layers: int, pp: int = 1, virtual_stages: int = 1,
                                 schedule: str | None = None, micro_batches: int | None = None,
                                 vocab_size: int | None = None, **layer_kwargs) -> float:
    """Peak activation bytes on the first pipeline stage, **per rank** (the busiest stage).

    Korthikanti et al. 2022, Sec. 4.2.3: under 1F1B the first stage holds p micro-batches of its
    n_layers/p layers, i.e. n_layers layers' worth whatever p is; the interleaved schedule with v
    model chunks per rank multiplies that by 1 + (p - 1)/(p v). `schedule` defaults to "1f1b"
    ("interleaved" when virtual_stages > 1); "gpipe" keeps all `micro_batches` in flight; with
    1F1B and fewer micro-batches than stages only `micro_batches` are in flight. `vocab_size`
    adds Sec. 4.3's embedding-dropout masks and, when pp == 1, the output layer (final norm,
    projection input, fp32 logits). `layer_kwargs` are `activation_bytes_per_layer`'s keywords
    (seq_len, micro_batch, d_model, n_heads, tp, sequence_parallel, recompute, ...). Float bytes.
    """
    return first_stage_activation_breakdown(
        n_layers=n_layers, pp=pp, virtual_stages=virtual_stages, schedule=schedule,
        micro_batches=micro_batches, vocab_size=vocab_size, **layer_kwargs).total


def output_backward_transient_bytes(*, seq_len: int, micro_batch: int, vocab_size: int, tp: int = 1,
                                    bytes_per_element: int = 2, logits_kept: bool = False) -> float:
    """Bytes that exist only around the **start of backward**, on top of the saved activations, per
    rank: the output layer's gradients. The peak of a training step is usually here.

    Eager PyTorch's cross-entropy on fp32 logits [b, s, V/t] creates the gradient of the log-softmax
    output and the gradient of the fp32 logits (4 bytes each per logit); when the logits were
    computed in a 2-byte dtype (autocast) their gradient is cast back (``bytes_per_element`` per
    logit). ``logits_kept``: the loop holds the logits through backward (``logits, loss = model(x,
    y)``), another ``bytes_per_element`` per logit. Korthikanti et al. count what is *saved*; these
    buffers are not, which is why a measured CUDA peak exceeded "states + activations" by about
    three logit tensors for GPT-2 on an H100 (benchmarks/RESULTS-gpu.md). A fused or chunked
    cross-entropy (torch.compile, Liger-style kernels) creates fewer. Float bytes."""
    check_int("seq_len", seq_len, 1)
    check_int("micro_batch", micro_batch, 1)
    check_int("vocab_size", vocab_size, 1)
    check_int("tp", tp, 1)
    check_choice("bytes_per_element", bytes_per_element, (2, 4))
    logits = seq_len * micro_batch * vocab_size / tp
    total = 4 * logits + 4 * logits  # d(log-softmax output) and d(fp32 logits)
    if bytes_per_element != 4:
        total += bytes_per_element * logits  # the gradient cast back to the logits' own dtype
    if logits_kept:
        total += bytes_per_element * logits
    return total
