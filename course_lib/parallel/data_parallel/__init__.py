"""Data parallelism: every rank holds the model and sees its own share of each global batch.

* :mod:`.naive_ddp` - ``NaiveDDP``: broadcast at start, one all-reduce per gradient after backward;
* :mod:`.bucketed_ddp` - ``BucketedDDP``: bucketed async all-reduces overlapped with backward;
* :mod:`.zero` - ``ShardedOptimizer``: ZeRO-1 (optimizer state sharded) and ZeRO-2 (gradients too);
* :mod:`.simple_fsdp` - ``SimpleFSDP``: ZeRO-3 by hand (Linear/Embedding weights sharded, gathered per layer);
* :mod:`.torch_ddp` - torch's DistributedDataParallel behind the trainer's strategy interface;
* :mod:`.scratch_ddp` - ``BucketedDDP`` behind the same interface (``train.strategy = "ddp-scratch"``).

The from-scratch forms are exported from :mod:`course_lib.parallel` and tested equal to one process
(tests/test_ddp_scratch.py, tests/test_zero_scratch.py).
"""
