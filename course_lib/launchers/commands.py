"""Command lines that start ``python -m course_lib.train`` under torchrun, deepspeed or accelerate.

Every generator returns an argument list (``list[str]``); :func:`shell_join` turns one into a line
for a script. Arguments that hold a shell variable (``"$NODE_RANK"``, ``"${HEAD_NODE}:29500"``) are
double-quoted so the script expands them at run time; everything else is single-quoted.

Every trainer command ends in ``--resume auto``: a job that torchrun restarts (``--max-restarts``),
SLURM requeues, or a person re-runs continues from the newest valid checkpoint in ``--out``. How
much work a restart loses is ``checkpoint.save_every`` steps at most, so set it for long jobs.
"""
from __future__ import annotations

import re
import shlex
from typing import Sequence

from course_lib.launchers.cluster import Cluster
from course_lib.validate import check_choice


def shell_join(args: Sequence[str]) -> str:
    """One shell line: words with ``$`` double-quoted (expanded at run time), others single-quoted."""
    words = []
    for a in args:
        if "$" in a:
            if any(c in a for c in '"`\\'):
                raise ValueError(f"cannot quote {a!r} for the shell (it mixes $ with quotes)")
            words.append(f'"{a}"')
        else:
            words.append(shlex.quote(a))
    return " ".join(words)


def trainer_args(config: str, overrides: Sequence[str] = (), out: str = "runs/launch-train") -> list[str]:
    """``-m course_lib.train`` and its arguments: the config, each ``--set KEY=VALUE``, ``--out``
    and ``--resume auto`` (always: restarted jobs must continue, not start over)."""
    for o in overrides:
        if "=" not in o or o.startswith("="):
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {o!r}")
    args = ["-m", "course_lib.train", "--config", config]
    for o in overrides:
        args += ["--set", o]
    return args + ["--out", out, "--resume", "auto", "--no-progress"]


def torchrun_single_node(config: str, overrides: Sequence[str], cluster: Cluster,
                         out: str = "runs/launch-train", torchrun: str = "torchrun") -> list[str]:
    """torchrun on this machine with ``cluster.nproc_per_node`` ranks.

    ``--standalone`` lets torchrun host its own rendezvous on a free port, so two jobs on one
    machine never collide. ``--max-restarts`` restarts every rank after a failure; with
    ``--resume auto`` the restarted ranks pick up the newest checkpoint."""
    if cluster.nodes != 1:
        raise ValueError(f"nodes must be 1 for a single-node command, got {cluster.nodes}; "
                         f"use torchrun_multi_node")
    return [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", str(cluster.nproc_per_node),
            "--max-restarts", str(cluster.max_restarts)] + trainer_args(config, overrides, out)


def torchrun_multi_node(config: str, overrides: Sequence[str], cluster: Cluster,
                        out: str = "runs/launch-train", *, mode: str = "rdzv",
                        node_rank: str = "$NODE_RANK", endpoint: str | None = None,
                        rdzv_id: str | None = None, torchrun: str = "torchrun") -> list[str]:
    """One torchrun agent's command; run it once on every node.

    ``mode="static"``: ``--nnodes N --node-rank R --master-addr A --master-port P``; every node must
    be told its ``node_rank`` (default: the variable ``$NODE_RANK``) and no restart can replace a
    node. ``mode="rdzv"``: ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID``; the
    agents agree on ranks themselves (no node rank needed) and ``--max-restarts`` lets them restart
    the group after a failure. ``endpoint`` and ``rdzv_id`` default to the cluster's."""
    check_choice("mode", mode, ("rdzv", "static"))
    head = [torchrun, "--nnodes", str(cluster.nodes), "--nproc-per-node", str(cluster.nproc_per_node)]
    if mode == "static":
        head += ["--node-rank", node_rank, "--master-addr", cluster.master_addr,
                 "--master-port", str(cluster.master_port)]
    else:
        head += ["--rdzv-backend", cluster.rdzv_backend, "--rdzv-endpoint", endpoint or cluster.endpoint,
                 "--rdzv-id", rdzv_id or cluster.rdzv_id, "--max-restarts", str(cluster.max_restarts)]
    return head + trainer_args(config, overrides, out)


def hostfile_text(hosts: Sequence[str], slots: int) -> str:
    """DeepSpeed's hostfile: one ``HOST slots=N`` line per node (N = processes on that node)."""
    if not hosts:
        raise ValueError("hosts must name at least one host")
    return "".join(f"{h} slots={slots}\n" for h in hosts)


def deepspeed_command(config: str, overrides: Sequence[str], cluster: Cluster,
                      out: str = "runs/launch-train", hostfile: str = "hostfile",
                      deepspeed: str = "deepspeed") -> list[str]:
    """The ``deepspeed`` launcher over ``hostfile`` (ssh/pdsh to each host when there are several).

    Sets ``--set train.strategy=deepspeed`` and ``checkpoint.format=auto`` (replacing any other
    strategy or format override: the engine writes its own checkpoints, and a TOML planned for FSDP
    says "sharded", which the deepspeed strategy refuses): the trainer
    builds its DeepSpeed config from the TOML (:func:`course_lib.parallel.deepspeed.config.build_ds_config`)
    and writes it to ``OUT/ds_config.json``, so the TOML stays the one source of truth.
    ``--num_gpus`` is given even on CPU: without it DeepSpeed counts NUMA nodes there (1 process)."""
    # Any other strategy would ignore the engine this launcher is for, so it is replaced.
    overrides = [o for o in overrides if not o.replace(" ", "").startswith(("train.strategy=", "checkpoint.format="))]
    overrides += ["train.strategy=deepspeed", "checkpoint.format=auto"]
    head = [deepspeed, "--hostfile", hostfile, "--num_nodes", str(cluster.nodes),
            "--num_gpus", str(cluster.nproc_per_node)]
    if cluster.nodes == 1:  # several nodes: DeepSpeed takes the hostfile's first host as master
        head += ["--master_addr", cluster.master_addr]
    return head + ["--master_port", str(cluster.master_port), "--module"] \
        + trainer_args(config, overrides, out)[1:]


def deepspeed_env_block(env: str, folder: str) -> str:
    """Shell lines that pass every variable ``env`` exports to the ranks on the other nodes.

    DeepSpeed's multi-node launcher starts them over pdsh with only ``NCCL*``, ``PYTHON*``, ``UCX*``,
    ``MV2*`` and ``MLFLOW*`` of this shell's variables, plus the ``KEY=VALUE`` lines of the file
    ``DS_ENV_FILE`` names (default ``.deepspeed_env``, in ``~`` or the working folder;
    deepspeed/launcher/runner.py). The script writes that file when it runs, with this node's
    values (so an override from the environment travels too): no comment lines, DeepSpeed reads
    every line as ``KEY=VALUE``, so no variables means no file ("")."""
    names = re.findall(r"^export ([A-Z_][A-Z0-9_]*)=", env, flags=re.M)
    if not names:
        return ""
    lines = " ".join(f'"{n}=${n}"' for n in names)
    return (f"# DeepSpeed's pdsh launcher passes on only NCCL*, PYTHON*, UCX*, MV2* and MLFLOW* variables and the\n"
            f"# lines of the file DS_ENV_FILE names: every variable above goes there, with this node's values.\n"
            f'export DS_ENV_FILE="{folder}/.deepspeed_env"\n'
            f"printf '%s\\n' {lines} >\"$DS_ENV_FILE\"\n")


def accelerate_config_yaml(cluster: Cluster, machine_rank: int = 0, mixed_precision: str = "no") -> str:
    """An ``accelerate launch --config_file`` YAML for ``cluster``, written by hand (no network,
    no ``accelerate config`` prompt). ``machine_rank`` is overridden per node on the command line.

    accelerate is only the *launcher* here: the trainer chooses its strategy and precision from
    the TOML, so ``mixed_precision`` stays "no" (the trainer's own precision policy applies)."""
    check_choice("mixed_precision", mixed_precision, ("no", "bf16", "fp16"))
    lines = [
        "# accelerate launch config generated by `course launch`",
        "compute_environment: LOCAL_MACHINE",
        f"distributed_type: {'MULTI_GPU' if cluster.on_gpus else 'MULTI_CPU'}",
        f"num_machines: {cluster.nodes}",
        f"num_processes: {cluster.world_size}  # all machines together",
        f"machine_rank: {machine_rank}",
        f"main_process_ip: {cluster.master_addr}",
        f"main_process_port: {cluster.master_port}",
        "rdzv_backend: static",
        "same_network: true",
        f"mixed_precision: '{mixed_precision}'",
        f"use_cpu: {'false' if cluster.on_gpus else 'true'}",
        "gpu_ids: all" if cluster.on_gpus else "",
        "main_training_function: main",
        "downcast_bf16: 'no'",
        "tpu_use_cluster: false",
        "tpu_use_sudo: false",
    ]
    return "\n".join(line for line in lines if line) + "\n"


def accelerate_command(config: str, overrides: Sequence[str], cluster: Cluster,
                       out: str = "runs/launch-train", config_file: str = "accelerate_config.yaml",
                       machine_rank: str = "$NODE_RANK", accelerate: str = "accelerate") -> list[str]:
    """``accelerate launch --config_file FILE --machine_rank R -m course_lib.train ...`` for one node."""
    return [accelerate, "launch", "--config_file", config_file, "--machine_rank", machine_rank] \
        + trainer_args(config, overrides, out)
