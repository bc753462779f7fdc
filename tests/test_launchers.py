"""`course launch` and the generators in course_lib/launchers/.

Generated scripts must parse (``bash -n``) and pass ``shellcheck``; the single-node torchrun
command really trains on 2 CPU ranks; the sbatch script's body really trains with SLURM faked by
the srun and scontrol of tests/fake_cluster_tools (``COURSE_SRUN``/``COURSE_SCONTROL``, helpers in
tests/fake_cluster.py), and its USR1 trap requeues; bad input names the field or flag;
``--dry-run`` writes nothing.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time

import pytest

from course_lib.launchers import commands as C
from course_lib.launchers.cli import add_launch_parser
from course_lib.launchers.cluster import Cluster
from course_lib.launchers.nccl_env import nccl_exports
from course_lib.launchers.slurm import sbatch_script
from fake_cluster import ROOT, fake_slurm_env, metrics_rows, run_env

CONFIG = "labs/configs/tiny-cpu.toml"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="course")
    add_launch_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["launch", *argv])


# --------------------------------------------------------------------------------------------
# validation: errors name the field / flag
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(nodes=0), "nodes"), (dict(gpus_per_node=-1), "gpus_per_node"),
    (dict(gpus_per_node=4, nproc_per_node=8), "nproc_per_node"), (dict(cpus_per_task=0), "cpus_per_task"),
    (dict(time_limit="1:00"), "time_limit"), (dict(time_limit="01:60:00"), "time_limit"),
    (dict(time_limit="00:00:00"), "time_limit"), (dict(master_port=80), "master_port"),
    (dict(master_port=70000), "master_port"), (dict(partition="gpu; rm"), "partition"),
    (dict(rdzv_backend="etcd"), "rdzv_backend"), (dict(rdzv_endpoint="nohostport"), "rdzv_endpoint"),
])
def test_cluster_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Cluster(**kwargs)


def test_cluster_defaults_and_derived_values():
    c = Cluster(nodes=2, gpus_per_node=8, time_limit="72:30:00")
    assert c.nproc_per_node == 8 and c.world_size == 16 and c.time_limit_s == 72 * 3600 + 1800
    assert Cluster().nproc_per_node == 1 and Cluster().endpoint == "127.0.0.1:29500"


@pytest.mark.parametrize("argv, flag", [
    (["--nodes", "0"], "--nodes"), (["--gpus-per-node", "-2"], "--gpus-per-node"),
    (["--time", "soon"], "--time"), (["--master-port", "22"], "--master-port"),
    (["--nproc-per-node", "0"], "--nproc-per-node"), (["--set", "nokey"], "--set"),
    (["--max-steps", "0"], "--max-steps"), (["--config", "no/such.toml"], "--config"),
    (["--set", "train.strategy=nope"], "--config/--set"),
])
def test_cli_errors_name_the_flag(argv, flag, tmp_path, capsys):
    args = parse(["--config", CONFIG, "--out", str(tmp_path / "l"), "--dry-run", *argv])
    assert args.func(args) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "l").exists()


def test_dry_run_writes_nothing_and_prints_every_file(tmp_path, capsys):
    out = tmp_path / "launch"
    args = parse(["--config", CONFIG, "--nodes", "2", "--gpus-per-node", "4", "--out", str(out),
                  "--train-out", str(tmp_path / "train"), "--dry-run"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    for name in ("launch_torchrun.sh", "launch_deepspeed.sh", "hostfile", "accelerate_config.yaml",
                 "launch_accelerate.sh", "job.sbatch"):
        assert f"===== {name} =====" in text
    assert not out.exists() and not (tmp_path / "train").exists()


# --------------------------------------------------------------------------------------------
# what the generators contain
# --------------------------------------------------------------------------------------------

def test_commands_resume_and_rendezvous():
    c = Cluster(nodes=4, gpus_per_node=8, master_addr="n0", max_restarts=2)
    static = C.torchrun_multi_node(CONFIG, ["train.strategy=ddp"], c, mode="static")
    assert static[static.index("--node-rank") + 1] == "$NODE_RANK" and "--master-addr" in static
    rdzv = C.torchrun_multi_node(CONFIG, [], c)
    assert rdzv[rdzv.index("--rdzv-endpoint") + 1] == "n0:29500"
    assert rdzv[rdzv.index("--max-restarts") + 1] == "2" and "--node-rank" not in rdzv
    ds = C.deepspeed_command(CONFIG, ["train.strategy=ddp"], c)
    assert "train.strategy=deepspeed" in ds and "train.strategy=ddp" not in ds and "--master_addr" not in ds
    acc = C.accelerate_command(CONFIG, [], c)
    for cmd in (static, rdzv, ds, acc, C.torchrun_single_node(CONFIG, [], Cluster(nproc_per_node=2))):
        assert cmd[cmd.index("--resume") + 1] == "auto"
    assert C.hostfile_text(["a", "b"], 8) == "a slots=8\nb slots=8\n"
    yaml = C.accelerate_config_yaml(c)
    assert "num_machines: 4" in yaml and "num_processes: 32" in yaml and "MULTI_GPU" in yaml
    assert "MULTI_CPU" in C.accelerate_config_yaml(Cluster(nodes=2))
    with pytest.raises(ValueError, match="nodes"):
        C.torchrun_single_node(CONFIG, [], c)


def test_nccl_block_only_on_gpus():
    assert nccl_exports(Cluster()) == ""
    block = nccl_exports(Cluster(gpus_per_node=8), socket_ifname="ib0")
    for var in ("NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCH_NCCL_BLOCKING_WAIT"):
        assert f"# {var}: " in block and f"export {var}=" in block
    assert 'NCCL_SOCKET_IFNAME:-ib0' in block


def test_sbatch_header():
    text = sbatch_script(CONFIG, [], Cluster(nodes=2, gpus_per_node=4, partition="gpu", time_limit="02:00:00"))
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=02:00:00", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@120", 'show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p',
                 "--shutdown-timeout 105"):
        assert line in text
    with pytest.raises(ValueError, match="signal_lead_s"):
        sbatch_script(CONFIG, [], Cluster(time_limit="00:01:00"))


# --------------------------------------------------------------------------------------------
# bash -n and shellcheck over every generated script
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [[], ["--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu"]])
def test_scripts_parse_and_pass_shellcheck(shape, tmp_path):
    out = tmp_path / "launch"
    args = parse(["--config", CONFIG, "--out", str(out), "--set", "train.strategy=ddp", *shape])
    from course_lib.launchers.cli import build_files

    files = build_files(args)
    out.mkdir()
    scripts = []
    for name, text in files.items():
        (out / name).write_text(text)
        if name.endswith((".sh", ".sbatch")):
            scripts.append(out / name)
    assert len(scripts) == 4
    for path in scripts:
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, f"{path.name}: {res.stderr}"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck); bash -n passed")
    res = subprocess.run(["shellcheck", "-s", "bash", *map(str, scripts)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# --------------------------------------------------------------------------------------------
# real runs on 2 CPU ranks
# --------------------------------------------------------------------------------------------

def test_single_node_launch_trains_here(tmp_path):
    """`course launch --nodes 1` (not a dry run) writes the scripts and runs torchrun here."""
    train = tmp_path / "train"
    argv = ["--config", CONFIG, "--set", "train.strategy=ddp", "--set", "schedule.warmup_steps=1", "--max-steps", "4", "--nproc-per-node", "2",
            "--out", str(tmp_path / "launch"), "--train-out", str(train)]
    res = subprocess.run([sys.executable, "-m", "course_lib.launchers.cli", *argv], cwd=ROOT, env=run_env(),
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert [r["step"] for r in metrics_rows(train)] == [1, 2, 3, 4]
    assert (tmp_path / "launch" / "launch_torchrun.sh").exists()


def test_sbatch_body_trains_on_two_fake_nodes_then_usr1_checkpoints_and_requeues(tmp_path):
    """The job script on two fake nodes (fake srun, a real torchrun agent per node, rendezvous on
    the first node) trains; then USR1 to the batch shell (what --signal=B:USR1@LEAD does) ->
    SIGTERM through srun and both torchrun agents to the ranks -> both checkpoint the same step
    and exit -> requeue. (The planner's job.sbatch runs to its end the same way:
    tests/test_plan_scripts.py.)"""
    train = tmp_path / "train"
    cluster = Cluster(nodes=2, nproc_per_node=1, cpus_per_task=1, rdzv_id="unused")
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(CONFIG, ["train.strategy=ddp", "train.max_steps=1000", "schedule.warmup_steps=1",
                                             "train.metrics_flush_s=0"], cluster, str(train)))
    log = tmp_path / "job.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=fake_slurm_env(tmp_path),
                                stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                rows = train / "metrics.jsonl"
                if rows.exists() and len(rows.read_text().splitlines()) >= 3:
                    break
                time.sleep(0.05)
            proc.send_signal(signal.SIGUSR1)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert "requeueing job 4242" in text and text.count("SIGTERM received") == 2, text[-3000:]
    steps = [int(p.name.split("_")[-1]) for p in (train / "checkpoints").glob("step_*")]
    assert len(steps) == 1 and 3 <= steps[0] < 1000, steps      # save_every = 0: only the signal saved
    assert "stopped by SIGTERM after step" in text
    assert "rendezvous 127.0.0.1:" in text  # both agents met on the first node
    logged = [r["step"] for r in metrics_rows(train)]
    assert logged == list(range(1, len(logged) + 1)) and steps[0] in logged, logged  # every step once


def test_jobs_restart_by_default_and_several_nodes_get_a_fresh_store_per_attempt(tmp_path, capsys):
    # Restarted gloo groups hung here until the trainer joined each attempt through its own store
    # keys (tests/test_torchrun_restart.py): CPU jobs restart like GPU jobs now.
    assert Cluster().max_restarts == 3 and Cluster(gpus_per_node=8).max_restarts == 3
    assert Cluster(max_restarts=0).max_restarts == 0  # asked for: kept
    args = parse(["--config", CONFIG, "--nproc-per-node", "2", "--out", str(tmp_path / "l"), "--dry-run"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    script = text.split("===== launch_torchrun.sh =====")[1].split("=====")[0]
    cmd = next(ln for ln in script.splitlines() if ln.startswith("torchrun"))
    assert cmd.split()[cmd.split().index("--max-restarts") + 1] == "3"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in script  # one node: the trainer's own prefix suffices
    for cluster in (Cluster(nodes=2), Cluster(nodes=2, gpus_per_node=4)):
        sbatch = sbatch_script(CONFIG, [], cluster)
        assert "--max-restarts 3" in sbatch and "hung in 2 of 5" not in sbatch
        export = sbatch.index("export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
        assert export < sbatch.index('"$TORCHRUN"') if '"$TORCHRUN"' in sbatch else export >= 0
    assert "TORCH_DISABLE_SHARE" not in sbatch_script(CONFIG, [], Cluster(nodes=2, max_restarts=0))


def test_torchrun_scripts_give_each_rank_its_cores_so_torchrun_prints_no_banner(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 and prints a banner about it whenever it is unset: the
    generated script sets each rank's share of the node's cores first (an existing value wins),
    and so does the torchrun ``course launch`` runs here."""
    from course_lib.launchers.cli import omp_threads_env, omp_threads_export

    line = omp_threads_export(4).splitlines()[-1]
    for env, want in (({}, None), ({"OMP_NUM_THREADS": "3"}, "3")):
        out = subprocess.run(["bash", "-c", f"{line}; echo $OMP_NUM_THREADS; nproc"], capture_output=True,
                             text=True, check=True, env={"PATH": "/usr/bin:/bin", **env}).stdout.split()
        assert out[0] == (want or str(max(1, int(out[1]) // 4)))
    assert omp_threads_env(2, {"OMP_NUM_THREADS": "5"})["OMP_NUM_THREADS"] == "5"
    assert int(omp_threads_env(64, {})["OMP_NUM_THREADS"]) == 1
    with pytest.raises(ValueError, match="nproc_per_node"):
        omp_threads_export(0)
    parser = argparse.ArgumentParser()
    add_launch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["launch", "--config", str(ROOT / "labs" / "configs" / "tiny-cpu.toml"),
                              "--nproc-per-node", "2", "--out", str(tmp_path / "l")])
    from course_lib.launchers.cli import build_files

    assert line.replace("4", "2") in build_files(args)["launch_torchrun.sh"]
