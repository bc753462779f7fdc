"""Five famous training runs as published: shape, GPUs, batch, layout, throughput, with sources.

The planner is held against them (tests/test_planner_published.py): each published layout is
expressible with ``--layout``, fits the planner's memory model, lands within 1.5x of the published
throughput, and the planner's own best is never modelled slower. ``docs/published-runs.md`` is the
same table in prose. A field a paper does not state is left out of the layout text (the scorer
then chooses it and says so) and listed in ``assumed``.

Throughput is published as FLOP/s per GPU, under one of two conventions (``flops_counted``):

* ``"hardware"`` - Megatron-LM's formula with full recomputation (Narayanan et al. 2021, eq. 3:
  96 B s l h^2 (1 + s/6h + V/16lh) per iteration; 4 passes of the model), used by Megatron-LM,
  MT-NLG and BLOOM's Megatron-DeepSpeed logs;
* ``"model"`` - model FLOPs (3 passes), the MFU convention (Llama 3).

:func:`published_tokens_per_s` turns it into tokens per second with the kit's own FLOP count
(``estimate.model_flops_per_iteration``, the same formula) so the planner's tokens/s compare.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.estimate import PRESETS, ModelShape, model_flops_per_iteration

_GPT = dict(tied_embeddings=True, learned_pos_emb=True, bias=True, mlp="gelu", norm="layernorm")


@dataclass(frozen=True)
class PublishedRun:
    """One published run (base units: tokens, FLOP/s)."""

    name: str
    source: str                 # paper, arXiv id, where in it
    shape: ModelShape
    gpu: str                    # course plan --gpu
    gpus: int
    gpus_per_node: int
    seq: int
    global_batch: int           # sequences per optimizer step
    tokens: float               # training tokens
    layout: str                 # course plan --layout text (published fields only)
    tflops_per_gpu: float       # published achieved TFLOP/s per GPU
    flops_counted: str          # "hardware" (recomputation counted) or "model"
    attention: str = "eager"
    assumed: tuple = field(default_factory=tuple)  # what the paper does not state, and what is used

    def plan_kwargs(self) -> dict:
        """``course_lib.planner.plan`` / ``make_spec`` keywords for this job."""
        sh = self.shape
        return dict(gpu=self.gpu, gpus=self.gpus, gpus_per_node=self.gpus_per_node, tokens=self.tokens,
                    seq=self.seq, global_batch_tokens=self.global_batch * self.seq, attention=self.attention,
                    shape_overrides=dict(n_layers=sh.n_layers, d_model=sh.d_model, n_heads=sh.n_heads,
                                         n_kv_heads=sh.n_kv_heads, vocab_size=sh.vocab_size, d_ff=sh.d_ff,
                                         seq_len=sh.seq_len, tied_embeddings=sh.tied_embeddings,
                                         learned_pos_emb=sh.learned_pos_emb, bias=sh.bias, mlp=sh.mlp, norm=sh.norm))


def published_tokens_per_s(run: PublishedRun) -> float:
    """The run's throughput in tokens per second for the whole job: GPUs x published FLOP/s per
    GPU / FLOPs per token under the run's counting convention."""
    recompute = "full" if run.flops_counted == "hardware" else "none"
    per_token = model_flops_per_iteration(run.shape, batch=1, seq_len=run.seq, recompute=recompute) / run.seq
    return run.gpus * run.tflops_per_gpu * 1e12 / per_token


RUNS: dict[str, PublishedRun] = {
    "megatron-gpt3-175b": PublishedRun(
        "Megatron-LM GPT-3 175B",
        "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
        "arXiv 2104.04473, Sec. 5.1: 175B (96 layers, h 12288, 96 heads, vocab 51,200, seq 2048), 1024 A100s, "
        "batch 1536, 140 TFLOP/s per GPU (34 days for 300B tokens)",
        ModelShape(96, 12288, 96, 51200, 2048, **_GPT), "a100-80gb", 1024, 8, 2048, 1536, 300e9,
        "tp8,pp8,dp16,cp1,zero1,recompute=full,mb1", 140.0, "hardware",
        assumed=("tp8/pp8: the paper prints t = 8, p = 8 for its 145.6B row (Table 1), not beside the 175B "
                 "estimate", "ZeRO-1: Megatron's distributed optimizer", "schedule: v chosen by the scorer")),
    "bloom-176b": PublishedRun(
        "BLOOM-176B",
        "BigScience 2022, BLOOM: A 176B-Parameter Open-Access Multilingual Language Model, arXiv 2211.05100, "
        "Sec. 3.4: 384 A100 80GB (48 nodes), tp 4, pp 12, dp 8, ZeRO-1, bf16, 156 TFLOP/s per GPU; 70 layers, "
        "h 14336, 112 heads, vocab 250,680 (padded 250,880), seq 2048, ALiBi, global batch 2048, micro-batch 2",
        ModelShape(70, 14336, 112, 250880, 2048, tied_embeddings=True, learned_pos_emb=False, bias=True,
                   mlp="gelu", norm="layernorm"),
        "a100-80gb", 384, 8, 2048, 2048, 366e9,
        "tp4,pp12,dp8,zero1,recompute=full,mb2,v1,split=5:6*10:5", 156.0, "hardware",
        assumed=("split 5,6*10,5: Megatron-DeepSpeed counted the embedding as a layer (72 = 12 x 6)",
                 "full recomputation (activation checkpointing on)")),
    "llama3-405b": PublishedRun(
        "Llama 3 405B (8K context, 16,384 GPUs)",
        "Dubey et al. 2024, The Llama 3 Herd of Models, arXiv 2407.21783, Table 4 and Sec. 3.3.2: 16,384 H100, "
        "tp 8, cp 1, pp 16, dp 128, seq 8192, 16 sequences per dp rank (16M tokens), 400 TFLOP/s per GPU "
        "(41% BF16 MFU); 126 layers with one fewer on the first and last stage",
        PRESETS["llama3-405b"], "h100", 16384, 8, 8192, 2048, 15.6e12,
        "tp8,pp16,dp128,cp1,zero1,mb1", 400.0, "model", attention="flash",
        assumed=("virtual stages, recomputation: not in the paper; the scorer chooses (it needs interleaving "
                 "at 16 micro-batches on 16 stages)", "ZeRO-1: the paper shards optimizer state and "
                 "gradients (FSDP); the planner pairs pipelines with ZeRO-0/1")),
    "opt-175b": PublishedRun(
        "OPT-175B",
        "Zhang et al. 2022, OPT: Open Pre-trained Transformer Language Models, arXiv 2205.01068, Sec. 2.4: "
        "992 A100 80GB, FSDP with Megatron-LM tensor parallelism 8, up to 147 TFLOP/s per GPU; 96 layers, "
        "h 12288, 96 heads, seq 2048, batch 2M tokens",
        ModelShape(96, 12288, 96, 50272, 2048, **_GPT), "a100-80gb", 992, 8, 2048, 992, 180e9,
        "tp8,pp1,dp124,cp1,zero3", 147.0, "hardware",
        assumed=("batch 992 sequences (2.03M tokens): the 2M-token batch made divisible by dp 124",
                 "147 TFLOP/s read as Megatron's hardware count", "micro-batch and recomputation chosen by the scorer")),
    "mt-nlg-530b": PublishedRun(
        "Megatron-Turing NLG 530B",
        "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, arXiv 2201.11990, "
        "Sec. 2-3: 280 DGX A100 (2240 GPUs), tp 8, pp 35, dp 8, 105 layers, h 20480, 128 heads, seq 2048, "
        "batch 1920, 60.1 s per iteration, 126 TFLOP/s per GPU",
        ModelShape(105, 20480, 128, 51200, 2048, **_GPT), "a100-80gb", 2240, 8, 2048, 1920, 270e9,
        "tp8,pp35,dp8,cp1,zero1,recompute=full,mb1,v1", 126.0, "hardware",
        assumed=("vocab 51,200 (GPT-2's 50,257 padded, Megatron)", "ZeRO-1 (DeepSpeed), micro-batch 1")),
}


# ------------------------------------------------------------------------------------------------
# Mixture-of-experts runs. Their throughput is published as GPU-hours per token or as MFU (on
# *active* parameters), so each row says which; the kit's FLOPs per token are
# ``estimate.moe_flops_per_token`` (6 x active matmul parameters + the attention term).
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PublishedMoERun:
    """One published mixture-of-experts run (base units: tokens, seconds)."""

    name: str
    source: str
    model: str                  # course plan --model (estimate.MOE_PRESETS)
    gpu: str
    gpus: int
    gpus_per_node: int
    seq: int
    global_batch: int           # sequences per optimizer step
    tokens: float
    layout: str                 # course plan --layout text (published fields only)
    gpu_hours_per_trillion: float | None = None  # published GPU-hours per 1e12 training tokens
    mfu: float | None = None    # published model FLOPs utilisation (active parameters)
    precision: str = "bf16"
    fp8_recipe: str = "tensorwise"
    moe_node_limit: int | None = None
    attention: str = "flash"
    assumed: tuple = field(default_factory=tuple)

    def plan_kwargs(self) -> dict:
        """``course_lib.planner.plan`` / ``make_spec`` keywords for this job."""
        return dict(model=self.model, gpu=self.gpu, gpus=self.gpus, gpus_per_node=self.gpus_per_node,
                    tokens=self.tokens, seq=self.seq, global_batch_tokens=self.global_batch * self.seq,
                    attention=self.attention, precision=self.precision, fp8_recipe=self.fp8_recipe,
                    moe_node_limit=self.moe_node_limit)


def published_moe_tokens_per_s(run: PublishedMoERun) -> float:
    """The run's tokens per second for the whole job: GPUs x 1e12 / (GPU-hours per trillion x 3600),
    or GPUs x MFU x dense bf16 peak / ``moe_flops_per_token`` (active parameters) at the run's sequence."""
    if run.gpu_hours_per_trillion is not None:
        return run.gpus * 1e12 / (run.gpu_hours_per_trillion * 3600)
    from course_lib.estimate import ACCELERATORS, moe_flops_per_token, moe_preset
    from course_lib.planner.hardware import resolve_gpu

    peak = ACCELERATORS[resolve_gpu(run.gpu)].bf16
    return run.gpus * run.mfu * peak / moe_flops_per_token(moe_preset(run.model), seq_len=run.seq)


MOE_RUNS: dict[str, PublishedMoERun] = {
    "deepseek-v3": PublishedMoERun(
        "DeepSeek-V3 (671B, 37B active)",
        "DeepSeek-AI 2024, DeepSeek-V3 Technical Report, arXiv 2412.19437: Sec. 3.1-3.2 (2,048 H800 in nodes of 8, "
        "16-way pipeline (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor "
        "parallelism), Sec. 3.3 (FP8 training, 1x128 / 128x128 block scaling), Sec. 2.1.2 (each token sent to at "
        "most 4 nodes), Sec. 4.2 (sequence 4096, batch 15,360 sequences, 14.8T tokens), Table 1 (180K H800 GPU-hours "
        "per trillion tokens; 2,664K pre-training + 119K context extension + 5K post-training = 2.788M)",
        "deepseek-v3", "h800", 2048, 8, 4096, 15360, 14.8e12,
        "tp1,pp16,dp128,ep64,etp1,zero1", gpu_hours_per_trillion=180e3, precision="fp8", fp8_recipe="blockwise",
        moe_node_limit=4,
        assumed=("global batch 15,360 sequences: the batch after its ramp (3,072 -> 15,360 over the first 469B tokens)",
                 "recomputation: the paper recomputes RMSNorm and the MLA up-projections; the scorer chooses",
                 "pipeline split of the 61 blocks (DualPipe, MTP on the last stage): the scorer's balanced split",
                 "DualPipe's overlap of the all-to-all with computation: the planner's --overlap 0.5")),
    "mixtral-8x22b-megatron": PublishedMoERun(
        "Megatron-Core Mixtral 8x22B (Parallel Folding)",
        "Liu et al. 2025, MoE Parallel Folding: Heterogeneous Parallelism Mappings for Efficient Large-Scale MoE Model "
        "Training with Megatron Core, arXiv 2504.14960, abstract: up to 49.3% MFU for Mixtral 8x22B on H100 GPUs",
        "mixtral-8x22b", "h100", 128, 8, 4096, 256, 1e12, "ep8", mfu=0.493,
        assumed=("128 GPUs, sequence 4096, global batch 256 sequences: not the paper's table, which this row does not "
                 "hold; MFU is per GPU, so the job size changes little", "tp, pp, ZeRO, recomputation, etp: chosen by "
                 "the scorer; ep 8 (one expert per rank, the fold the paper's title names)",
                 "MFU on the kit's active-parameter FLOPs (6 x active + attention), Megatron's count may differ")),
}
