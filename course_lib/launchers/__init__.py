"""Launch-command generators behind ``course launch``: one module per job.

* :mod:`.cluster`   - :class:`Cluster`, the validated description of the machines a job gets;
* :mod:`.commands`  - torchrun (single node, multi-node static or rendezvous), deepspeed (+ hostfile)
  and accelerate (+ its config YAML) command lines for the trainer;
* :mod:`.nccl_env`  - the NCCL ``export`` block for GPU clusters;
* :mod:`.slurm`     - an ``sbatch`` script: one torchrun agent per node, requeue at the time limit;
* :mod:`.cli`       - the ``course launch`` subcommand that writes and prints all of them.

Everything here only builds text: nothing needs a GPU, SLURM, DeepSpeed or accelerate to generate.
Every trainer command carries ``--resume auto`` so that a restarted or requeued job continues from
its newest checkpoint instead of starting over.
"""
from course_lib.launchers.cluster import Cluster

__all__ = ["Cluster"]
