"""Parallelism: the rank launcher plus one short module per form (DDP, ZeRO, FSDP, TP, PP)."""
from course_lib.parallel.ranks.launch import (  # noqa: F401
    DistInfo,
    RankFailedError,
    barrier,
    get_rank,
    get_world_size,
    init_distributed,
    is_main,
    print0,
    run_ranks,
    teardown,
)

# From-scratch data parallelism, imported on first use: `registry.py` (and the config validator)
# import this package and must stay torch-free.
_DDP_EXPORTS = {"NaiveDDP": "course_lib.parallel.data_parallel.naive_ddp",
                "BucketedDDP": "course_lib.parallel.data_parallel.bucketed_ddp",
                "ShardedOptimizer": "course_lib.parallel.data_parallel.zero",
                "SimpleFSDP": "course_lib.parallel.data_parallel.simple_fsdp",
                # measuring what each form holds and sends (compared with course_lib.estimate)
                "count_collectives": "course_lib.parallel.wire",
                "WireCounter": "course_lib.parallel.wire",
                "CollectiveCall": "course_lib.parallel.wire",
                "attach_ddp_counter": "course_lib.parallel.wire",
                "model_state_bytes_on_rank": "course_lib.parallel.memory_census",
                "ModelStateCensus": "course_lib.parallel.memory_census",
                "compare_with_estimate": "course_lib.parallel.memory_census",
                # tensor / sequence, pipeline and context parallelism from scratch
                "ColumnParallelLinear": "course_lib.parallel.tensor_parallel.layers",
                "RowParallelLinear": "course_lib.parallel.tensor_parallel.layers",
                "VocabParallelEmbedding": "course_lib.parallel.tensor_parallel.layers",
                "vocab_parallel_cross_entropy": "course_lib.parallel.tensor_parallel.cross_entropy",
                "copy_to_tp_region": "course_lib.parallel.tensor_parallel.comm_ops",
                "reduce_from_tp_region": "course_lib.parallel.tensor_parallel.comm_ops",
                "gather_from_sequence_region": "course_lib.parallel.tensor_parallel.comm_ops",
                "reduce_scatter_to_sequence_region": "course_lib.parallel.tensor_parallel.comm_ops",
                "scatter_to_sequence_region": "course_lib.parallel.tensor_parallel.comm_ops",
                "TPMLP": "course_lib.parallel.tensor_parallel.blocks",
                "TPAttention": "course_lib.parallel.tensor_parallel.blocks",
                "TPBlock": "course_lib.parallel.tensor_parallel.blocks",
                "sync_sequence_parallel_grads": "course_lib.parallel.tensor_parallel.blocks",
                "TPTinyGPT": "course_lib.parallel.tensor_parallel.gpt",
                "tp_tinygpt": "course_lib.parallel.tensor_parallel.gpt",
                "tinygpt_tp_plan": "course_lib.parallel.tensor_parallel.dtensor_plan",
                "parallelize_tinygpt": "course_lib.parallel.tensor_parallel.dtensor_plan",
                "build_torch_stages": "course_lib.parallel.pipeline.torch_pipelining",
                "torch_pipeline_step": "course_lib.parallel.pipeline.torch_pipelining",
                "named_stage_parameters": "course_lib.parallel.pipeline.torch_pipelining",
                "TORCH_SCHEDULES": "course_lib.parallel.pipeline.torch_pipelining",
                "PipelineStage": "course_lib.parallel.pipeline.stages",
                "build_stage": "course_lib.parallel.pipeline.stages",
                "split_model": "course_lib.parallel.pipeline.stages",
                "even_split": "course_lib.parallel.pipeline.stages",
                "balanced_split": "course_lib.parallel.pipeline.stages",
                "stage_costs": "course_lib.parallel.pipeline.stages",
                "run_schedule": "course_lib.parallel.pipeline.schedules",
                "pipeline_step": "course_lib.parallel.pipeline.schedules",
                "sync_tied_grads": "course_lib.parallel.pipeline.schedules",
                "compute_order": "course_lib.parallel.pipeline.schedules",
                "stage_actions": "course_lib.parallel.pipeline.schedules",
                "measure_bubble": "course_lib.parallel.pipeline.timeline",
                "summarize_timeline": "course_lib.parallel.pipeline.timeline",
                "ring_attention": "course_lib.parallel.context_parallel",
                "RingAttention": "course_lib.parallel.context_parallel",
                "split_sequence": "course_lib.parallel.context_parallel",
                "merge_sequence": "course_lib.parallel.context_parallel",
                "chunk_segments": "course_lib.parallel.context_parallel",
                "ring_attention_bytes_per_rank": "course_lib.parallel.context_parallel",
                "peak_score_elements": "course_lib.parallel.context_parallel",
                "causal_score_elements": "course_lib.parallel.context_parallel"}


def __dir__():
    return sorted(list(globals()) + list(_DDP_EXPORTS))


def __getattr__(name):
    if name in _DDP_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_DDP_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
