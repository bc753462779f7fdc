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
