"""``course launch``: write (and print) every launch script for a config and a cluster shape.

Files in ``--out`` (default ``runs/launch``): ``launch_torchrun.sh``, ``launch_deepspeed.sh`` +
``hostfile`` + ``ds_config.json`` (for reading: the trainer regenerates it from the TOML),
``accelerate_config.yaml`` + ``launch_accelerate.sh``, ``job.sbatch``. ``--dry-run`` only prints.
Without ``--dry-run`` and with ``--nodes 1`` the single-node torchrun command also runs here.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from course_lib.launchers import commands as C
from course_lib.launchers.cluster import Cluster, restart_comment
from course_lib.launchers.nccl_env import nccl_exports
from course_lib.launchers.slurm import sbatch_script

# Cluster field -> the flag a user typed, so a ValueError from Cluster names the flag.
_FLAGS = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "nproc_per_node": "--nproc-per-node",
          "cpus_per_task": "--cpus-per-task", "time_limit": "--time", "partition": "--partition",
          "master_addr": "--master-addr", "master_port": "--master-port", "max_restarts": "--max-restarts"}


class LaunchError(ValueError):
    """A bad ``course launch`` argument; the message starts with the flag."""


def add_launch_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``launch`` subcommand to ``subparsers`` (from ``add_subparsers``); returns it."""
    p = subparsers.add_parser("launch", help="write torchrun / deepspeed / accelerate / SLURM launch scripts")
    p.add_argument("--config", required=True, help="trainer TOML, e.g. labs/configs/tiny-cpu.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="trainer override, repeatable (e.g. --set train.strategy=ddp)")
    p.add_argument("--max-steps", type=int, help="same as --set train.max_steps=N")
    p.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per machine; 0 = CPU cluster (default)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per machine (default: gpus per node, or 1)")
    p.add_argument("--cpus-per-task", type=int, default=8, help="cores per node's task (SLURM), default 8")
    p.add_argument("--time", default="01:00:00", help="SLURM time limit HH:MM:SS (default 01:00:00)")
    p.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous host outside SLURM")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous TCP port (1024-65535)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="torchrun restarts after a failure (default 3 on GPUs, 0 on CPU: restarting a "
                        "multi-rank gloo job can hang, rerun the script instead)")
    p.add_argument("--train-out", help="the trainer's --out (default runs/<config name>-launch)")
    p.add_argument("--out", default="runs/launch", help="folder for the scripts (default runs/launch)")
    p.add_argument("--dry-run", action="store_true", help="print the scripts, write and run nothing")
    p.set_defaults(func=run_launch)
    return p


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The Cluster the flags describe; a bad value raises LaunchError naming the flag."""
    try:
        return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, nproc_per_node=args.nproc_per_node,
                       cpus_per_task=args.cpus_per_task, time_limit=args.time, partition=args.partition,
                       master_addr=args.master_addr, master_port=args.master_port,
                       max_restarts=args.max_restarts)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        field = text.split(" ", 1)[0]
        raise LaunchError(f"{_FLAGS.get(field, field)}: {text}") from None


# What each launcher program is and where it comes from, said when it is missing: a bare
# `torchrun: command not found` (exit 127) tells a newcomer nothing about the venv.
_PROGRAMS = {
    "torchrun": "comes with torch: activate the kit's environment first (source .venv/bin/activate)",
    "deepspeed": "comes with DeepSpeed, which ./kit installs: activate the kit's environment first "
                 "(source .venv/bin/activate)",
    "accelerate": "Hugging Face accelerate: ./kit setup installs it in the kit's venv, elsewhere pip install "
                  "accelerate (launch_torchrun.sh needs nothing extra)",
}


def _needs(program: str) -> str:
    """A line that stops the script with what to install when ``program`` is not on PATH."""
    return (f"command -v {program} >/dev/null 2>&1 || {{ echo \"$0: '{program}' not found: "
            f"{_PROGRAMS[program]}\" >&2; exit 127; }}")


def omp_threads_export(nproc_per_node: int) -> str:
    """The shell line that gives each of ``nproc_per_node`` ranks its share of this node's cores,
    unless OMP_NUM_THREADS is already set. Without it torchrun sets 1 itself and prints its
    "Setting OMP_NUM_THREADS environment variable for each process to be 1" banner every start."""
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    share = f"$(nproc) / {nproc_per_node}"
    return ("# Each rank's share of the node's cores (torchrun would set 1 and print a banner about it).\n"
            f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( {share} > 1 ? {share} : 1 ))}}"')


def omp_threads_env(nproc_per_node: int, env: dict[str, str]) -> dict[str, str]:
    """``env`` with OMP_NUM_THREADS set to each rank's share of this machine's cores (kept if set):
    what :func:`omp_threads_export` does, for the torchrun that ``course launch`` runs here."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS") or str(max(1, cores // nproc_per_node))}


def _script(title: str, body: str, env: str = "", needs: str = "") -> str:
    head = f"#!/usr/bin/env bash\n# {title}\n# Generated by `course launch`; run from the kit's root.\nset -euo pipefail\n"
    return head + (_needs(needs) + "\n" if needs else "") + (env + "\n" if env else "") + body + "\n"


def build_files(args: argparse.Namespace) -> dict[str, str]:
    """File name -> text for every script (pure: writes nothing)."""
    cluster = cluster_from_args(args)
    if not Path(args.config).is_file():
        raise LaunchError(f"--config: no such file: {args.config}")
    overrides = list(args.set)
    for o in overrides:
        if "=" not in o or "." not in o.split("=", 1)[0]:
            raise LaunchError(f"--set: expected SECTION.KEY=VALUE, got {o!r}")
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise LaunchError(f"--max-steps: must be >= 1, got {args.max_steps}")
        overrides.append(f"train.max_steps={args.max_steps}")
    # Check the trainer config here: a config error under torchrun would be retried
    # --max-restarts times on every node before anyone sees it.
    from course_lib.trainer import config as train_config

    try:
        train_config.load(args.config, overrides)
    except train_config.ConfigError as exc:
        raise LaunchError(f"--config/--set: {exc}") from None
    train_out = args.train_out or f"runs/{Path(args.config).stem}-launch"
    cfg, out = args.config, train_out
    nccl = nccl_exports(cluster)
    if cluster.nodes == 1:
        torchrun = C.shell_join(C.torchrun_single_node(cfg, overrides, cluster, out))
        hosts = ["localhost"]
        node_note = ""
    else:
        torchrun = ('RDZV_HOST="${RDZV_HOST:?set RDZV_HOST to the first node (the rendezvous host)}"\n'
                    + C.shell_join(C.torchrun_multi_node(cfg, overrides, cluster, out,
                                                         endpoint=f"${{RDZV_HOST}}:{cluster.master_port}")))
        hosts = [f"node{i}" for i in range(cluster.nodes)]
        node_note = "# Replace node0.. with your host names; deepspeed reaches them over ssh (pdsh).\n"
    ds = C.shell_join(C.deepspeed_command(cfg, overrides, cluster, out,
                                          hostfile=str(Path(args.out) / "hostfile")))
    acc_rank = "0" if cluster.nodes == 1 else "$NODE_RANK"
    acc = C.shell_join(C.accelerate_command(cfg, overrides, cluster, out,
                                            config_file=str(Path(args.out) / "accelerate_config.yaml"),
                                            machine_rank=acc_rank))
    if cluster.nodes > 1:
        acc = 'NODE_RANK="${NODE_RANK:?set NODE_RANK to this node (0 .. nodes-1)}"\n' + acc
    files = {
        "launch_torchrun.sh": _script(f"torchrun: {cluster.nodes} node(s) x {cluster.nproc_per_node} rank(s)"
                                      + ("; run on every node" if cluster.nodes > 1 else ""), torchrun,
                                      "\n".join(x for x in (restart_comment(cluster), omp_threads_export(
                                          cluster.nproc_per_node), nccl) if x), needs="torchrun"),
        "hostfile": node_note + C.hostfile_text(hosts, cluster.nproc_per_node),
        "launch_deepspeed.sh": _script("deepspeed launcher; the trainer writes its ds_config.json to "
                                       f"{out}/ds_config.json (a copy is in {args.out}/ds_config.json)", ds,
                                       nccl + (C.deepspeed_env_block(nccl, args.out) if cluster.nodes > 1 else ""),
                                       needs="deepspeed"),
        "accelerate_config.yaml": C.accelerate_config_yaml(cluster),
        "launch_accelerate.sh": _script("accelerate launch" + ("; run on every node with NODE_RANK set"
                                                               if cluster.nodes > 1 else ""), acc, nccl,
                                        needs="accelerate"),
        "job.sbatch": sbatch_script(cfg, overrides, cluster, out).replace("{DIR}", args.out),
    }
    ds_json = _ds_config_json(cfg, overrides, cluster)
    if ds_json:
        files["ds_config.json"] = ds_json
    return files


def _ds_config_json(cfg_path: str, overrides: list[str], cluster: Cluster) -> str:
    """The DeepSpeed JSON the trainer will build, for reading ("" if the config does not load)."""
    from course_lib.trainer import config as train_config
    from course_lib.parallel.deepspeed.config import build_ds_config

    try:
        cfg = train_config.load(cfg_path, overrides + ["train.strategy=deepspeed", "checkpoint.format=auto"])
        ds = build_ds_config(cfg, world_size=cluster.world_size, device="cuda" if cluster.on_gpus else "cpu")
    except Exception as exc:  # noqa: BLE001 - shown to the user, the scripts are still useful
        print(f"note: no ds_config.json: {exc}", file=sys.stderr)
        return ""
    return json.dumps(ds, indent=2) + "\n"


def run_launch(args: argparse.Namespace) -> int:
    """Print (and unless ``--dry-run`` write) the scripts; run torchrun here when ``--nodes 1``.
    Exit codes: 2 for a bad flag, otherwise torchrun's exit code (0 when nothing runs)."""
    try:
        files = build_files(args)
    except LaunchError as exc:
        print(f"course launch: {exc}", file=sys.stderr)
        return 2
    for name, text in files.items():
        print(f"===== {name} =====\n{text}")
    if args.dry_run:
        print("(dry run: nothing written, nothing started)")
        return 0
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = folder / name
        path.write_text(text)
        if name.endswith((".sh", ".sbatch")):
            path.chmod(0o755)
    print(f"wrote {len(files)} files to {folder}")
    if args.nodes != 1:
        print(f"multi-node: submit with `sbatch {folder}/job.sbatch` (create the trainer's --out folder first)")
        return 0
    cluster = cluster_from_args(args)
    argv = C.torchrun_single_node(args.config, _overrides(args), cluster,
                                  args.train_out or f"runs/{Path(args.config).stem}-launch")
    # Run torchrun from this interpreter's environment (the script says plain `torchrun`).
    argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]
    print("running: " + " ".join(shlex.quote(a) for a in argv), flush=True)
    return subprocess.call(argv, env=omp_threads_env(cluster.nproc_per_node, dict(os.environ)))


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = [f"train.max_steps={args.max_steps}"] if args.max_steps is not None else []
    return list(args.set) + extra


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.launchers.cli [flags]``: the same as ``course launch [flags]``."""
    parser = argparse.ArgumentParser(prog="course")
    add_launch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["launch", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
