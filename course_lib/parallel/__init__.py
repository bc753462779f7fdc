"""Parallelism: the rank launcher plus one short module per form (DDP, ZeRO, FSDP, TP, PP)."""
from course_lib.parallel.launch import (  # noqa: F401
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
                "measure_step": "course_lib.parallel.data_parallel.measure_runs",
                "measure_strategies": "course_lib.parallel.data_parallel.measure_runs",
                "measure_cases": "course_lib.parallel.data_parallel.measure_runs"}


def __dir__():
    return sorted(list(globals()) + list(_DDP_EXPORTS))


def __getattr__(name):
    if name in _DDP_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_DDP_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
