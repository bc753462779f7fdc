"""DeepSpeed behind the strategy interface (``train.strategy = "deepspeed"``), and what it needs around
its engine. Importing this package imports no DeepSpeed (``course doctor`` reads the build locks).

| module | job |
| --- | --- |
| ``engine`` | ``DeepSpeedStrategy``: ``deepspeed.initialize`` with the kit's model, optimizer and config |
| ``config`` | the DeepSpeed JSON built from the trainer's config and checked by DeepSpeed's own parser |
| ``init_step`` | undoes the optimizer step DeepSpeed takes while it builds the engine (ZeRO-0, bf16/fp16) |
| ``checkpoints`` | DeepSpeed's own shards, committed the kit's way (manifest, agreement, retention) |
| ``experts`` | ``parallel.ep > 1``: the kit's experts as DeepSpeed expert params over its own expert groups |
| ``ops`` | builds the JIT ops once into the venv's cache (``python -m course_lib.parallel.deepspeed.ops``) |
| ``op_locks`` | torch's JIT-op build locks: stale ones found, never waited on forever |
"""
