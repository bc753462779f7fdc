"""One layout's memory per GPU and modelled step time, every term kept for the breakdown.

Memory (bytes per GPU, the busiest rank = the first pipeline stage) comes from
:mod:`course_lib.estimate`: model states (``model_state_bytes``, ZeRO sharded over dp x cp, the
ranks that hold the same weights), saved activations (``activation_bytes_first_stage``, Korthikanti
et al. 2022, sequence split by cp), the output layer's backward transient
(``output_backward_transient_bytes``; with pp > 1 it sits on the last stage, added here anyway: a
conservative bound), for ZeRO-3 two gathered layers of bf16 weights (the layer running and the one
prefetched), and with recomputation the one layer being recomputed (``recompute_working_bytes``).

Step time (seconds), the model in words:

* compute = hardware FLOPs of the step (``model_flops_per_iteration``, recomputation included)
  / (gpus x peak x mfu). ``mfu`` is the fraction of peak the matmuls sustain (default 0.5);
* tp = Megatron TP traffic (``tp_comm_bytes_per_layer``) x layers per stage x micro-batches, over
  NVLink (tp stays inside a node). On the critical path: not overlapped;
* cp = ring-attention K/V traffic (``cp_comm_bytes_per_layer``), same count, not overlapped
  (a conservative choice: real ring attention hides part of it behind the attention math);
* pp = point-to-point sends: one activation forward and one gradient backward per micro-batch
  per stage boundary (s/cp x b x h x 2 bytes each), over whichever link the neighbours share;
  interleaved 1F1B sends v times as many (every micro-batch passes each rank v times);
* bubble = ``bubble_fraction(pp, m)`` (1F1B, relative to ideal; interleaved 1F1B with v virtual
  stages per rank: (pp - 1)/(m v)) x (compute + tp + cp + pp);
* stages: a pipeline runs at its busiest rank's pace, so compute is the balanced time x the
  busiest rank's forward FLOPs over the mean rank's (``stages.stage_imbalance``: blocks, plus the
  LM head on the last stage; 1 without a pipeline), and tp/cp traffic counts the busiest rank's
  blocks. Memory: the busiest rank's parameters and activations (``stages``; uneven splits
  ``parallel.pp_split``, explicit or balanced with the end stages' weights);
* dp = data-parallel / ZeRO traffic (``comm_elements_per_step`` over dp x cp ranks, bf16) over
  NVLink if the group fits in a node, InfiniBand otherwise. DDP and ZeRO-1 reduce once per step;
  ZeRO-2 reduce-scatters every micro-batch (it keeps no full gradient to accumulate into); ZeRO-3
  also all-gathers the weights twice per micro-batch. **Overlap assumption**: a fraction
  ``overlap`` (default 0.5) of the compute time hides this traffic; only the rest is exposed.

step = (compute + tp + cp + pp) x (1 + bubble) + exposed dp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from course_lib.estimate import (activation_breakdown_per_layer, activation_bytes_first_stage, bubble_fraction, comm_elements_per_step,
                                 engine_accumulation,
                                 cp_comm_bytes_per_layer, model_flops_per_iteration, model_state_bytes,
                                 output_backward_transient_bytes, resolve_recipe, tp_comm_bytes_per_layer,
                                 training_step_peak_bytes)
from course_lib.estimate.activations import activation_bytes_per_layer
from course_lib.estimate.memory import StepPeak, accumulated_grad_bytes
from course_lib.estimate.moe import alltoall_bytes_per_layer, expected_tokens_off_rank, moe_model_state_bytes
from course_lib.estimate.stage_split import even_blocks
from course_lib.planner.spec import JobSpec
from course_lib.planner.stages import compact_counts, in_flight_layers, rank_blocks, stage_imbalance

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tp x pp x dp x cp = gpus, ZeRO stage, recomputation, micro-batch."""

    tp: int
    pp: int
    dp: int
    cp: int
    zero_stage: int
    recompute: str
    micro_batch: int
    grad_accum: int  # micro-batches per optimizer step per data-parallel rank
    virtual_stages: int = 1  # stages per pipeline rank: > 1 is interleaved 1F1B (Narayanan et al. 2021)
    split: tuple = ()        # blocks per stage (pp x virtual_stages ints); () = as even as possible
    ep: int = 1              # expert-parallel degree (MoE): each rank holds n_experts / ep experts per block
    etp: int = 1             # expert tensor-parallel degree: 1 or tp (Megatron and torchtitan allow no other)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks holding the same experts, tp cp dp / (ep etp)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def schedule(self) -> str:
        """The pipeline schedule: "interleaved" with virtual stages, "1f1b" otherwise."""
        return "interleaved" if self.virtual_stages > 1 else "1f1b"

    def blocks_per_stage(self, n_layers: int) -> tuple:
        """Blocks on each of the pp x virtual_stages stages (the split, or as even as possible)."""
        return tuple(self.split) if self.split else tuple(even_blocks(n_layers, self.pp * self.virtual_stages))

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism whenever tp > 1: same traffic as plain TP, less memory (Korthikanti)."""
        return self.tp > 1

    @property
    def sharding(self) -> str:
        """How model state is split over data-parallel ranks, in words."""
        return {0: "replicated (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP full shard"}[self.zero_stage]

    def label(self) -> str:
        """Compact text, e.g. ``tp8 pp1 dp8 cp1 Z1 rc=selective mb1x128``; virtual stages and an
        explicit split show on pp: ``pp16v2[7,8*14,7]``."""
        pp = f"pp{self.pp}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else "") \
            + (f"[{compact_counts(self.split)}]" if self.split else "")
        experts = f" ep{self.ep}" + (f" etp{self.etp}" if self.etp > 1 else "") if self.ep > 1 or self.etp > 1 else ""
        return (f"tp{self.tp} {pp} dp{self.dp} cp{self.cp}{experts} Z{self.zero_stage} "
                f"rc={self.recompute} mb{self.micro_batch}x{self.grad_accum}")


@dataclass(frozen=True)
class Candidate:
    """A layout with its memory (bytes per GPU) and step-time terms (seconds)."""

    layout: Layout
    memory: dict = field(default_factory=dict)   # params, grads, optimizer, activations, transient
    time: dict = field(default_factory=dict)     # compute, tp, cp, pp, bubble, dp_total, dp_exposed
    usable_bytes: float = 0.0
    tokens_per_step: int = 0
    model_flops: float = 0.0
    links: dict = field(default_factory=dict)    # group -> "NVLink" / "inter-node"
    stage_blocks: tuple = ()                     # blocks per pipeline stage (pp x virtual_stages)

    @property
    def memory_total(self) -> float:
        """Peak bytes per GPU (the step's peak, see training_step_peak_bytes)."""
        return self.memory["peak"]

    @property
    def fits(self) -> bool:
        """True when the peak is within device memory minus the headroom."""
        return self.memory_total <= self.usable_bytes

    @property
    def step_s(self) -> float:
        """Modelled seconds per optimizer step."""
        return self.time["step"]

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second for the whole job."""
        return self.tokens_per_step / self.step_s

    @property
    def comm_s(self) -> float:
        """Exposed communication seconds per step (tp + cp + pp + exposed dp)."""
        t = self.time
        return t["tp"] + t["cp"] + t["pp"] + t["dp_exposed"]

    def mfu(self, spec: JobSpec) -> float:
        """Model FLOPs utilisation the model predicts (model FLOPs, no recomputation)."""
        return self.model_flops / (self.step_s * spec.gpus * spec.gpu_peak_flops)


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether a process group of ``size`` ranks spaced ``stride`` apart crosses a node boundary
    (ranks are numbered node by node; tp innermost, then cp, dp, pp - Megatron's order)."""
    return size > 1 and stride * (size - 1) >= gpus_per_node


#: DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements): ZeRO-2 fills a bucket
#: this large with gradients before each reduce-scatter (the kit's DeepSpeed JSON keeps the default).
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000


def layer_kwargs(spec: JobSpec, lay: Layout) -> dict:
    """The keywords ``activation_bytes_per_layer`` gets for this job and layout (one source of
    truth: tests call the estimator with exactly these)."""
    sh = spec.shape
    return dict(seq_len=spec.seq // lay.cp, micro_batch=lay.micro_batch, d_model=sh.d_model,
                n_heads=sh.n_heads, tp=lay.tp, sequence_parallel=lay.sequence_parallel,
                recompute=lay.recompute, dropout=False, attention=spec.attention, mlp=sh.mlp,
                d_ff=sh.ffn_dim, n_kv_heads=sh.kv_heads, bytes_per_element=2)


def recompute_working_bytes(spec: JobSpec, lay: Layout) -> float:
    """Bytes a recomputing backward re-creates for one layer and micro-batch at a time, per GPU:
    full recomputation rebuilds the whole layer's activations, selective the attention core (the
    s x s scores under eager attention). 0 without recomputation."""
    if lay.recompute == "none":
        return 0.0
    parts = activation_breakdown_per_layer(**{**layer_kwargs(spec, lay), "recompute": "none"}).components
    return sum(parts.values()) if lay.recompute == "full" else parts["attention_core"]


def busiest_rank_params_and_activations(spec: JobSpec, lay: Layout) -> tuple[float, float, list[int]]:
    """(parameters, activation bytes, blocks per pipeline rank) of the busiest pipeline rank, per GPU.

    Equal blocks on every stage: ``params_on_busiest_rank`` and the first stage's activations
    (``activation_bytes_first_stage``, Korthikanti et al.; with virtual stages their interleaved
    factor). Uneven ranks (an explicit or balanced split): the largest ``params_on_rank`` and the
    largest ``in_flight_layers`` x one layer's activations over the ranks (``params_on_rank``
    replicates a learned position table over tp, ``params_on_busiest_rank`` divides it). The two maxima may sit on
    different ranks: their sum is a bound on the busiest rank, as the even case's (heaviest
    end-stage weights plus the first stage's activations) always was."""
    memo = job_cache(spec)
    params, per_rank = _rank_params(spec, lay, memo)
    return params, _busiest_activations(spec, lay, memo), list(per_rank)


# --------------------------------------------------------------------------------------------
# Pieces of a layout's memory and time that depend on a few of its fields only. The search asks
# for thousands of layouts that differ in one field (ZeRO stage, micro-batch, recomputation), so
# each piece is computed once per job and reused: the same calls with the same arguments, hence
# bit-for-bit the same numbers as computing them afresh.
# --------------------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def job_cache(spec: JobSpec) -> dict:
    """The cache of one job's layout pieces (keyed by the fields each piece reads). Specs are
    frozen, so equal specs share it; the 64 most recent jobs are kept."""
    return {}


def cached(memo: dict, key, make):
    """``memo[key]``, computed by ``make()`` the first time (memo: a ``job_cache``)."""
    try:
        return memo[key]
    except KeyError:
        value = memo[key] = make()
        return value


def _counts(spec: JobSpec, lay: Layout, memo: dict) -> tuple:
    """Blocks per stage (``Layout.blocks_per_stage``), keyed by (pp, v, split)."""
    return cached(memo, ("counts", lay.pp, lay.virtual_stages, lay.split),
                 lambda: tuple(lay.blocks_per_stage(spec.shape.n_layers)))


def _rank_params(spec: JobSpec, lay: Layout, memo: dict) -> tuple[float, tuple]:
    """(parameters on the busiest pipeline rank, blocks per rank), keyed by (tp, pp, v, split)."""
    def make():
        sh = spec.shape
        counts = _counts(spec, lay, memo)
        per_rank = tuple(rank_blocks(counts, lay.pp))
        if len(set(counts)) == 1:
            return sh.params_on_busiest_rank(tp=lay.tp, pp=lay.pp), per_rank
        return max(sh.params_on_rank(tp=lay.tp, pp=lay.pp, stage=r, blocks=b) for r, b in enumerate(per_rank)), per_rank
    return cached(memo, ("params", lay.tp, lay.pp, lay.virtual_stages, lay.split), make)


def _per_layer(spec: JobSpec, lay: Layout, memo: dict) -> float:
    """One layer's activation bytes for one micro-batch, keyed by (tp, cp, mb, recompute)."""
    return cached(memo, ("layer", lay.tp, lay.cp, lay.micro_batch, lay.recompute),
                 lambda: activation_bytes_per_layer(**layer_kwargs(spec, lay)))


def _busiest_activations(spec: JobSpec, lay: Layout, memo: dict) -> float:
    """The busiest rank's saved activation bytes (see ``busiest_rank_params_and_activations``)."""
    def make():
        sh = spec.shape
        counts = _counts(spec, lay, memo)
        if len(set(counts)) == 1:
            return activation_bytes_first_stage(n_layers=sh.n_layers, pp=lay.pp, virtual_stages=lay.virtual_stages,
                                                micro_batches=lay.grad_accum, vocab_size=sh.vocab_size,
                                                **layer_kwargs(spec, lay))
        per_layer = _per_layer(spec, lay, memo)
        _, per_rank = _rank_params(spec, lay, memo)
        return max(per_layer * in_flight_layers(b, lay.pp, lay.virtual_stages, lay.grad_accum, r)
                   for r, b in enumerate(per_rank))
    return cached(memo, ("acts", lay.tp, lay.pp, lay.virtual_stages, lay.split, lay.cp, lay.micro_batch,
                        lay.recompute, lay.grad_accum), make)


def _transient(spec: JobSpec, lay: Layout, memo: dict) -> float:
    """Transient bytes before the ZeRO-2 bucket: the output layer's backward, ZeRO-3's two gathered
    layers, the layer being recomputed; keyed by (tp, cp, mb, zero-3 or not, recompute)."""
    def make():
        sh = spec.shape
        transient = output_backward_transient_bytes(seq_len=spec.seq // lay.cp, micro_batch=lay.micro_batch,
                                                    vocab_size=sh.vocab_size, tp=lay.tp, bytes_per_element=2)
        if lay.zero_stage == 3:  # the layer computing plus the one prefetched, gathered in bf16
            transient += 2 * 2 * sh.layer_params() / lay.tp
        transient += recompute_working_bytes(spec, lay)
        return transient
    return cached(memo, ("transient", lay.tp, lay.cp, lay.micro_batch, lay.zero_stage == 3, lay.recompute), make)


def moe_states(spec: JobSpec, lay: Layout):
    """The MoE model state of the busiest pipeline rank (``estimate.moe_model_state_bytes``: the
    non-expert part ZeRO-sharded over dp x cp, the experts over ep x etp and ZeRO-sharded over the
    expert-data-parallel group), the rank's blocks taken in depth order (the dense blocks first)."""
    memo = job_cache(spec)

    def make():
        _, per_rank = _rank_params(spec, lay, memo)
        recipe = resolve_recipe(spec.recipe)
        options = [moe_model_state_bytes(spec.moe, recipe=recipe, zero_stage=lay.zero_stage, dp=lay.dp, tp=lay.tp,
                                         pp=lay.pp, cp=lay.cp, ep=lay.ep, etp=lay.etp, stage=r, blocks=list(per_rank))
                   for r in range(lay.pp)]
        return max(options, key=lambda st: st.total)
    return cached(memo, ("moe_states", lay.tp, lay.pp, lay.virtual_stages, lay.split, lay.cp, lay.dp, lay.ep, lay.etp,
                         lay.zero_stage), make)


def _moe_memory(spec: JobSpec, lay: Layout, memo: dict) -> tuple[dict, float]:
    """``_memory`` for a mixture-of-experts job: the same parts, the states from ``moe_states``
    and their live gradients summed part by part (each part has its own sharding group)."""
    st = moe_states(spec, lay)
    acts = _busiest_activations(spec, lay, memo)
    transient = _transient(spec, lay, memo)
    acc = engine_accumulation(lay.zero_stage)
    live = (accumulated_grad_bytes(st.dense, acc) + accumulated_grad_bytes(st.experts, acc)) if lay.grad_accum > 1 else 0.0
    peak = StepPeak(st.total - st.grads + live + acts + transient, st.total)
    memory = {"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "activations": acts,
              "transient": transient, "accumulated_grads": live, "peak": peak.peak, "peak_at": peak.where,
              "expert_params": st.experts.num_params, "dense_params": st.dense.num_params}
    return memory, st.dense.num_params + st.experts.num_params


def _memory(spec: JobSpec, lay: Layout, memo: dict) -> tuple[dict, float]:
    """(memory dict of ``evaluate``, parameters on the busiest rank), keyed by the whole layout."""
    if spec.moe is not None:
        return cached(memo, ("memory", lay), lambda: _moe_memory(spec, lay, memo))

    def make():
        recipe = resolve_recipe(spec.recipe)
        rank_params, _ = _rank_params(spec, lay, memo)
        acts = _busiest_activations(spec, lay, memo)
        states = cached(memo, ("states", rank_params, lay.zero_stage, lay.dp * lay.cp),
                       lambda: model_state_bytes(rank_params, recipe=recipe, zero_stage=lay.zero_stage,
                                                 dp=lay.dp * lay.cp))
        transient = _transient(spec, lay, memo)
        # Accumulation keeps the gradients summed so far live from the second micro-batch on: full
        # tensors for DDP / ZeRO-1 (one reduce per step), the shard for ZeRO-2/3, which reduce-scatter
        # every micro-batch (as the dp traffic below assumes) through a bucket of DeepSpeed's default size.
        accumulation = engine_accumulation(lay.zero_stage)
        bucket = (min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, rank_params) * recipe.grad_bytes if lay.zero_stage == 2
                  else 0.0)
        peak = training_step_peak_bytes(states, acts, transient_bytes=transient, grad_accum=lay.grad_accum,
                                        accumulation=accumulation, reduce_bucket_bytes=bucket)
        live_grads = peak.backward_start - (states.total - states.grads + acts + transient + bucket)
        memory = {"params": states.params, "grads": states.grads, "optimizer": states.optimizer,
                  "activations": acts, "transient": transient + bucket, "accumulated_grads": live_grads,
                  "peak": peak.peak, "peak_at": peak.where}
        return memory, rank_params
    return cached(memo, ("memory", lay), make)


def layout_memory(spec: JobSpec, lay: Layout) -> dict:
    """The memory half of :func:`evaluate` (bytes per GPU by component, ``"peak"`` the step's peak):
    what the search needs to drop a layout that cannot fit before modelling its step time."""
    return dict(_memory(spec, lay, job_cache(spec))[0])


def evaluate(spec: JobSpec, lay: Layout) -> Candidate:
    """Memory per GPU and step time of ``lay`` for ``spec`` (no feasibility filtering here)."""
    sh = spec.shape
    memo = job_cache(spec)
    memory, rank_params = _memory(spec, lay, memo)
    memory = dict(memory)
    shard_group = lay.dp * lay.cp
    _, per_rank = _rank_params(spec, lay, memo)

    layers, m, s_local = max(per_rank), lay.grad_accum, spec.seq // lay.cp
    hw_flops = cached(memo, ("flops", lay.recompute), lambda: model_flops_per_iteration(
        sh, batch=spec.global_batch, seq_len=spec.seq, recompute=lay.recompute))
    model_flops = cached(memo, ("model_flops",), lambda: model_flops_per_iteration(
        sh, batch=spec.global_batch, seq_len=spec.seq))
    # The pipeline runs at its busiest rank's pace: the mean rank's compute x max/mean load.
    counts = _counts(spec, lay, memo)
    imbalance = cached(memo, ("imbalance", lay.pp, lay.virtual_stages, lay.split),
                      lambda: stage_imbalance(sh, counts, lay.pp, spec.seq))
    ideal = spec.gpus * spec.gpu_peak_flops * spec.mfu
    compute = hw_flops / ideal * imbalance

    gpn, nvlink, ib = spec.gpus_per_node, spec.intra_node_bytes_per_s, spec.inter_node_bytes_per_s
    links = {"tp": spans_nodes(1, lay.tp, gpn), "cp": spans_nodes(lay.tp, lay.cp, gpn),
             "dp": spans_nodes(lay.tp * lay.cp, lay.dp, gpn),
             "pp": spans_nodes(lay.tp * lay.cp * lay.dp, lay.pp, gpn)}
    bw = {k: (ib if crosses else nvlink) for k, crosses in links.items()}

    tp_s = 0.0
    if lay.tp > 1:
        per_layer = cached(memo, ("tp_comm", lay.tp, lay.cp, lay.micro_batch, lay.recompute), lambda: tp_comm_bytes_per_layer(
            seq_len=s_local, micro_batch=lay.micro_batch, d_model=sh.d_model, tp=lay.tp,
            sequence_parallel=lay.sequence_parallel, recompute=lay.recompute).bytes_per_rank)
        tp_s = per_layer * layers * m / bw["tp"]
    cp_s = 0.0
    if lay.cp > 1:
        per_layer = cached(memo, ("cp_comm", lay.tp, lay.cp, lay.micro_batch), lambda: cp_comm_bytes_per_layer(
            seq_len=spec.seq, micro_batch=lay.micro_batch, n_kv_heads=max(1, sh.kv_heads // lay.tp),
            head_dim=sh.head_dim, cp=lay.cp).bytes_per_rank)
        cp_s = per_layer * layers * m / bw["cp"]
    pp_s = 0.0
    if lay.pp > 1:  # one activation forward + one gradient backward per micro-batch (bf16)
        message = s_local * lay.micro_batch * sh.d_model * 2 / (lay.tp if lay.sequence_parallel else 1)
        # interleaved: each micro-batch crosses pp x v - 1 stage boundaries, v per rank and direction
        pp_s = 2 * message * m * lay.virtual_stages / bw["pp"]
    bubble = cached(memo, ("bubble", lay.pp, m, lay.virtual_stages), lambda: bubble_fraction(
        lay.pp, m, schedule=lay.schedule, virtual_stages=lay.virtual_stages)) if lay.pp > 1 else 0.0
    groups = [(rank_params, shard_group)]
    if spec.moe is not None:  # the experts reduce over their own (expert-data-parallel) group
        groups = [(memory["dense_params"], shard_group), (memory["expert_params"], lay.edp)]
    # FP8 all-gather (weights kept in FP8): the gathered bytes per parameter are 1, not 2
    gather_bytes = 1 if spec.fp8_param_gather else 2
    dp_bytes = 0.0
    for params, group in groups:
        if group <= 1:
            continue
        strategy = "ddp" if lay.zero_stage == 0 else f"zero{lay.zero_stage}"
        one_pass = cached(memo, ("dp_comm", params, group), lambda: comm_elements_per_step(
            params, "zero1", world_size=group).bytes_per_rank(2) / 2)
        gather = one_pass * gather_bytes / 2
        if lay.zero_stage == 3:
            dp_bytes += one_pass * m + 2 * gather * m  # reduce-scatter + 2 all-gathers, every micro-batch
        elif lay.zero_stage == 2:
            dp_bytes += one_pass * m + gather          # reduce-scatter per micro-batch, one all-gather
        elif lay.zero_stage == 1:
            dp_bytes += one_pass + gather
        else:
            dp_bytes += 2 * one_pass                   # all-reduce
    dp_s = dp_bytes / bw["dp"]
    ep_s, ep_links = expert_alltoall_seconds(spec, lay, layers_on_rank=_moe_layers_on_busiest(spec, lay, per_rank)) \
        if spec.moe is not None and lay.ep > 1 else (0.0, "-")
    # DP/ZeRO traffic and the expert all-to-alls overlap with compute (Megatron's
    # --overlap-moe-expert-parallel-comm, DeepSeek-V3's DualPipe): together, up to `overlap` of it
    dp_exposed = max(0.0, dp_s + ep_s - spec.overlap * compute)
    busy = compute + tp_s + cp_s + pp_s
    bubble_s = bubble * busy
    time = {"compute": compute, "recompute": (hw_flops - model_flops) / ideal * imbalance,
            "stage_imbalance": imbalance,
            "tp": tp_s, "cp": cp_s, "pp": pp_s, "bubble": bubble_s, "bubble_fraction": bubble,
            "dp_total": dp_s, "ep": ep_s, "dp_exposed": dp_exposed, "step": busy + bubble_s + dp_exposed}
    link_names = {k: ("inter-node" if v else "NVLink") if getattr(lay, k) > 1 else "-" for k, v in links.items()}
    link_names["ep"] = ep_links
    return Candidate(lay, memory, time, spec.usable_bytes, spec.global_batch_tokens, model_flops, link_names, counts)


def _moe_layers_on_busiest(spec: JobSpec, lay: Layout, per_rank) -> int:
    """MoE blocks on the pipeline rank with the most of them (blocks in depth order, dense first)."""
    out, first = 0, 0
    for n in per_rank:
        out = max(out, sum(spec.moe.is_moe_layer(i) for i in range(first, first + n)))
        first += n
    return out


def expert_alltoall_seconds(spec: JobSpec, lay: Layout, *, layers_on_rank: int) -> tuple[float, str]:
    """Seconds of expert-parallel all-to-all per step on the busiest rank, and the link it uses.

    Bytes: ``estimate.alltoall_bytes_per_layer`` with uniform routing
    (``expected_tokens_off_rank`` of the rank's tokens: seq / cp x micro-batch, / tp under sequence
    parallelism), per MoE block and micro-batch; the dispatch in FP8 for an FP8 plan (DeepSeek-V3
    Sec. 3.3.2 dispatches FP8, combines BF16). EP ranks are folded onto tp x cp x dp with stride
    etp, so ep etp / gpus-per-node nodes hold the group; copies to a rank on another node cross
    the network, the rest NVLink, both at once: time = max(network bytes / its bandwidth, NVLink
    bytes / its bandwidth). With node-limited routing (``moe_node_limit`` M) a token crosses the
    network once per destination node, to at most M nodes: its network copies are
    min(expected distinct nodes of its top_k experts, M) x (nodes - 1) / nodes."""
    moe = spec.moe
    tokens = spec.seq // lay.cp * lay.micro_batch // (lay.tp if lay.sequence_parallel else 1)
    off = expected_tokens_off_rank(tokens, moe.top_k, lay.ep)
    dispatch_bytes = 1 if spec.precision == "fp8" else 2
    a = alltoall_bytes_per_layer(tokens_off_rank=off, d_model=moe.d_model, ep=lay.ep, n_experts=moe.n_experts,
                                 recompute=lay.recompute)
    # the dispatch (forward, and its recomputation) in the plan's dispatch precision
    total = a.total - a.dispatch * (2 - dispatch_bytes) / 2 * (2 if lay.recompute == "full" else 1)
    per_node = max(1, min(lay.ep, spec.gpus_per_node // lay.etp))
    nodes = -(-lay.ep // per_node)
    if nodes == 1:
        return total * layers_on_rank * lay.grad_accum / spec.intra_node_bytes_per_s, "NVLink"
    off_node = (lay.ep - per_node) / (lay.ep - 1)  # of the off-rank copies, the share on other nodes
    if spec.moe_node_limit is not None:
        distinct = nodes * (1 - (1 - 1 / nodes) ** moe.top_k)
        copies = min(distinct, spec.moe_node_limit) * (nodes - 1) / nodes
        off_node = min(off_node, copies / (moe.top_k * (lay.ep - 1) / lay.ep))
    network = total * off_node * layers_on_rank * lay.grad_accum / spec.inter_node_bytes_per_s
    nvlink = total * (1 - off_node) * layers_on_rank * lay.grad_accum / spec.intra_node_bytes_per_s
    return max(network, nvlink), "inter-node"
