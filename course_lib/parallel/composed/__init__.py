"""Tensor, pipeline and context parallelism composed with a data-parallel dimension, in the trainer.

| module | job |
| --- | --- |
| ``model_parallel`` | ``ModelParallel``: TP x PP x CP with ddp / zero1 / zero2 over the ``dp_cp`` group |
| ``stage`` | one rank's tensor-parallel pipeline stage and the schedule runner in the trainer's terms |
| ``interleaved`` | ``pp_schedule = "interleaved"``: torch's ``ScheduleInterleaved1F1B`` over virtual stages |
| ``dp`` | the data-parallel dimension of ``ModelParallel`` (one all-reduce, or Megatron's distributed optimizer) |
| ``checkpoint`` | full checkpoints of a TP/PP model in the dense model's names and layout (experts gathered over EP) |
| ``experts`` | ``StageExperts``: an MoE model's experts over ``parallel.ep`` ranks of each pipeline stage (dp x tp) |
| ``fsdp_tp`` | ``FSDPTensorParallel``: FSDP2 over dp (x cp) on the DTensor-TP model, torchtitan's composition |

Chosen by :func:`course_lib.parallel.registry.make_strategy` when ``parallel.tp``, ``pp`` or ``cp`` > 1.
"""
