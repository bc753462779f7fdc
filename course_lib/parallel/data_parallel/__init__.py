"""Data parallelism: every rank holds the model and sees its own share of each global batch.

* :mod:`.torch_ddp` - torch's DistributedDataParallel behind the strategy interface.
"""
