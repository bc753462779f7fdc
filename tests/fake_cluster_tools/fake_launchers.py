#!/usr/bin/env python3
"""Stand-ins for ``torchrun``, ``deepspeed`` and ``accelerate`` (links to this file, dispatched on
the name they are called by), for tests that run a plan's launch scripts without a cluster.

Each one parses its command line as the real tool does (the same option names and defaults,
checked against the installed torchrun and DeepSpeed by tests/test_plan_scripts.py), works out
the ranks the real tool would start - world size, this node's rank, the rendezvous or main
address - and refuses what would fail or hang on a real cluster (a loopback main address on
several nodes, a machine rank out of range, a process count the machines do not divide). Then,
instead of starting ranks, it hands the trainer part of the command (``-m course_lib.train ...``)
to the trainer's own ``--check-config`` (course_lib.trainer.check_config) in this process, with the
environment the real tool gives rank 0 of this node (WORLD_SIZE, RANK, LOCAL_RANK, ...): the
config is loaded and validated for that world size, torch-free. It exits as the launcher would:
0, or the trainer's 2 on a config error, or 1 for a launch the real tool would refuse.

Each call appends one JSON line to ``$FAKE_LAUNCH_LOG``: the tool, what it parsed, and the
trainer's layout (or its error), for the test to compare with the plan. Options the fakes do not
model (elastic node ranges, ``--nproc-per-node gpu``, DeepSpeed's --include/--exclude) are refused
with a message rather than guessed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LaunchRefused(Exception):
    """What the real tool would refuse, or a cluster would never start (exit 1)."""


# ---------------------------------------------------------------------------------- the trainer

def hand_to_trainer(tool: str, program: list[str], module: bool, env: dict[str, str], facts: dict) -> int:
    """Run the trainer's config check for the command ``program`` (``[module_or_script, *args]``)
    with rank 0's environment ``env``; log and return the exit code."""
    record = {"tool": tool, **facts, "program": program[:1], "node_env": {
        k: os.environ[k] for k in ("SLURM_NODEID", "SLURM_PROCID", "FAKE_NODE_RANK", "SLURM_CPUS_PER_TASK",
                                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE") if k in os.environ}}
    if not module or program[0] != "course_lib.train":
        return _log(record, 1, error=f"{tool} (fake) checks only `-m course_lib.train ...`, got {program[:2]}")
    os.environ.update(env)
    from course_lib.trainer.args import build_parser
    from course_lib.trainer.check_config import check_args, describe
    from course_lib.trainer.config import ConfigError

    try:
        args = build_parser().parse_args(program[1:])
    except SystemExit as exc:  # argparse printed why
        return _log(record, int(exc.code or 2), error="the trainer's command line does not parse")
    try:
        layout = check_args(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return _log(record, 2, error=str(exc))
    print(f"{tool} (fake), node {facts.get('node_rank')}: {describe(layout)}")
    return _log(record, 0, layout=layout, trainer_args=program[1:])


def _log(record: dict, rc: int, **more) -> int:
    record.update(more, rc=rc, torch_imported="torch" in sys.modules)
    if rc and "error" in more:
        print(f"{record['tool']} (fake): {more['error']}", file=sys.stderr)
    path = os.environ.get("FAKE_LAUNCH_LOG")
    if path:
        with open(path, "a") as fh:  # one short line per call: appends from parallel tasks stay whole
            fh.write(json.dumps(record) + "\n")
    return rc


def _rank_env(world: int, nproc: int, node_rank: int, addr: str, port: int) -> dict[str, str]:
    """What torchrun-style launchers export to local rank 0 of node ``node_rank``."""
    return {"WORLD_SIZE": str(world), "RANK": str(node_rank * nproc), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node_rank), "MASTER_ADDR": addr,
            "MASTER_PORT": str(port)}


# ---------------------------------------------------------------------------------- torchrun

def torchrun_parser() -> argparse.ArgumentParser:
    """torch.distributed.run's options that the kit's scripts may use, with torchrun's defaults.
    ``FAKE_TORCHRUN_OLD=1`` plays an older torch, whose torchrun has no ``--shutdown-timeout``."""
    p = argparse.ArgumentParser(prog="torchrun")
    p.add_argument("--nnodes", default="1:1")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="")
    p.add_argument("--rdzv-id", "--rdzv_id", default="none")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="")
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    p.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1)
    if os.environ.get("FAKE_TORCHRUN_OLD") != "1":
        p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=30)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29500)
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("--no-python", "--no_python", action="store_true")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _host_port(endpoint: str, what: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchRefused(f"{what} {endpoint!r} is not HOST:PORT")
    return host, int(port)


def torchrun(argv: list[str]) -> int:
    a = torchrun_parser().parse_args(argv)
    lo, _, hi = a.nnodes.partition(":")
    if hi and hi != lo:
        raise LaunchRefused(f"--nnodes {a.nnodes}: an elastic range (the fake needs a fixed node count)")
    nnodes = int(lo)
    if not a.nproc_per_node.isdigit():
        raise LaunchRefused(f"--nproc-per-node {a.nproc_per_node}: the world would depend on this machine")
    nproc = int(a.nproc_per_node)
    if a.max_restarts < 0:
        raise LaunchRefused("--max-restarts must be >= 0")
    backend, endpoint = a.rdzv_backend, a.rdzv_endpoint
    if a.standalone:  # torchrun hosts its own rendezvous on this machine, on a free port
        if nnodes != 1:
            raise LaunchRefused(f"--standalone with --nnodes {nnodes}: the other nodes could never join")
        backend, endpoint = "c10d", "localhost:0"
        node_rank, addr, port = 0, "localhost", 0
    elif backend == "static":
        if nnodes > 1 and a.master_addr in LOOPBACK:
            raise LaunchRefused(f"--master-addr {a.master_addr} on {nnodes} nodes: the other nodes cannot reach it")
        if not 0 <= a.node_rank < nnodes:
            raise LaunchRefused(f"--node-rank {a.node_rank} is outside 0..{nnodes - 1}")
        node_rank, addr, port = a.node_rank, a.master_addr, a.master_port
    elif backend == "c10d":
        if not endpoint:
            raise LaunchRefused("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT")
        addr, port = _host_port(endpoint, "--rdzv-endpoint")
        if nnodes > 1 and addr in LOOPBACK:
            raise LaunchRefused(f"--rdzv-endpoint {endpoint} on {nnodes} nodes: the other nodes cannot reach it")
        # The rendezvous numbers the agents in the order they join; here, the node the test says.
        node_rank = int(os.environ.get("SLURM_NODEID", os.environ.get("FAKE_NODE_RANK", "0")))
    else:
        raise LaunchRefused(f"--rdzv-backend {backend}: the fake knows static and c10d")
    world = nnodes * nproc
    facts = {"world_size": world, "nnodes": nnodes, "nproc_per_node": nproc, "node_rank": node_rank,
             "rdzv_backend": backend, "rdzv_endpoint": endpoint, "rdzv_id": a.rdzv_id,
             "master_addr": addr, "max_restarts": a.max_restarts,
             "shutdown_timeout": getattr(a, "shutdown_timeout", None)}
    env = {**_rank_env(world, nproc, node_rank, addr, port), "TORCHELASTIC_RUN_ID": a.rdzv_id,
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts)}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # torchrun's default: 1
    return hand_to_trainer("torchrun", [a.training_script, *a.training_script_args], a.module and not a.no_python,
                           env, facts)


# ---------------------------------------------------------------------------------- deepspeed

def deepspeed_parser() -> argparse.ArgumentParser:
    """deepspeed.launcher.runner's options, with its defaults."""
    p = argparse.ArgumentParser(prog="deepspeed")
    p.add_argument("-H", "--hostfile", default="/job/hostfile")
    p.add_argument("-i", "--include", default="")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--master_addr", default="")
    p.add_argument("--node_rank", type=int, default=-1)
    p.add_argument("--launcher", default="pdsh")
    p.add_argument("--launcher_args", default="")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--no_ssh_check", action="store_true")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def parse_hostfile(text: str) -> dict[str, int]:
    """host -> slots, as DeepSpeed reads a hostfile: ``HOST slots=N`` lines, '#' comments and blank
    lines skipped; a bad line, a repeated host or no host at all is an error."""
    pool: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.search(r"^(\S+)\s+slots=(\d+)", line)
        if not match:
            raise LaunchRefused(f"hostfile: bad entry {line!r}")
        if match.group(1) in pool:
            raise LaunchRefused(f"hostfile: {match.group(1)} is listed twice")
        pool[match.group(1)] = int(match.group(2))
    if not pool:
        raise LaunchRefused("hostfile: empty")
    return pool


def deepspeed(argv: list[str]) -> int:
    a = deepspeed_parser().parse_args(argv)
    if a.include or a.exclude:
        raise LaunchRefused("--include/--exclude: not modelled by the fake")
    if not Path(a.hostfile).is_file():  # DeepSpeed then counts this machine's accelerators
        raise LaunchRefused(f"hostfile {a.hostfile} not found: the world would depend on this machine")
    pool = parse_hostfile(Path(a.hostfile).read_text())
    hosts = list(pool)[: a.num_nodes] if a.num_nodes > 0 else list(pool)
    slots = {h: (a.num_gpus if a.num_gpus > 0 else pool[h]) for h in hosts}  # --num_gpus replaces slots
    world = sum(slots.values())
    multi = len(hosts) > 1 or a.force_multi
    addr = a.master_addr or (hosts[0] if multi else "127.0.0.1")
    if len(hosts) > 1 and addr in LOOPBACK:
        raise LaunchRefused(f"master address {addr} on {len(hosts)} hosts: the other hosts cannot reach it")
    nproc = slots[hosts[0]]
    facts = {"world_size": world, "nnodes": len(hosts), "nproc_per_node": nproc, "node_rank": 0,
             "hosts": slots, "master_addr": addr, "hostfile": a.hostfile}
    user_args = list(a.user_args) + ([] if a.no_local_rank else ["--local_rank=0"])  # what launch.py appends
    return hand_to_trainer("deepspeed", [a.user_script, *user_args], a.module and not a.no_python,
                           _rank_env(world, nproc, 0, addr, a.master_port), facts)


# ---------------------------------------------------------------------------------- accelerate

def accelerate_parser() -> argparse.ArgumentParser:
    """``accelerate launch`` options the kit's scripts may use (accelerate's spellings)."""
    p = argparse.ArgumentParser(prog="accelerate launch")
    p.add_argument("--config_file", default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--multi_gpu", action="store_true")
    p.add_argument("--num_processes", type=int, default=None)
    p.add_argument("--num_machines", type=int, default=None)
    p.add_argument("--machine_rank", type=int, default=None)
    p.add_argument("--main_process_ip", default=None)
    p.add_argument("--main_process_port", type=int, default=None)
    p.add_argument("--rdzv_backend", default=None)
    p.add_argument("--mixed_precision", default=None)
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def accelerate(argv: list[str]) -> int:
    if not argv or argv[0] != "launch":
        raise LaunchRefused("the fake knows `accelerate launch` only")
    a = accelerate_parser().parse_args(argv[1:])
    if not a.config_file or not Path(a.config_file).is_file():
        raise LaunchRefused(f"--config_file {a.config_file}: not found (the fake reads no default config)")
    import yaml  # accelerate reads its config with PyYAML

    cfg = yaml.safe_load(Path(a.config_file).read_text()) or {}
    value = {k: getattr(a, k) if getattr(a, k) is not None else cfg.get(k)  # the command line wins
             for k in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")}
    machines, processes = int(value["num_machines"] or 1), int(value["num_processes"] or 1)
    rank, addr = int(value["machine_rank"] or 0), str(value["main_process_ip"] or "127.0.0.1")
    port = int(value["main_process_port"] or 29500)
    if processes % machines:
        raise LaunchRefused(f"num_processes {processes} is not a multiple of num_machines {machines}: "
                            f"accelerate starts num_processes // num_machines per machine")
    if not 0 <= rank < machines:
        raise LaunchRefused(f"machine_rank {rank} is outside 0..{machines - 1}")
    if machines > 1 and addr in LOOPBACK:
        raise LaunchRefused(f"main_process_ip {addr} on {machines} machines: the other machines cannot reach it")
    nproc = processes // machines
    world = machines * nproc
    facts = {"world_size": world, "nnodes": machines, "nproc_per_node": nproc, "node_rank": rank,
             "master_addr": addr, "distributed_type": cfg.get("distributed_type")}
    return hand_to_trainer("accelerate", [a.training_script, *a.training_script_args], a.module and not a.no_python,
                           _rank_env(world, nproc, rank, addr, port), facts)


TOOLS = {"torchrun": torchrun, "deepspeed": deepspeed, "accelerate": accelerate}


def main() -> int:
    tool = Path(sys.argv[0]).name
    try:
        return TOOLS[tool](sys.argv[1:])
    except LaunchRefused as exc:
        return _log({"tool": tool, "argv": sys.argv[1:]}, 1, error=str(exc))


if __name__ == "__main__":
    sys.exit(main())
