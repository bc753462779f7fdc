"""Every launch script `course plan` writes runs here with the cluster tools faked and reaches the
trainer with a config that validates for the world size it starts; for a tiny model the plan's
torchrun and SLURM scripts really train on 2 CPU ranks (issue 21, "What to build" 3).

* The three jobs of lab 13 (course_lib.planner.exercise.SCENARIOS: 7B on one node, 70B on 8 nodes,
  7B at 8K context) are planned and written with ``write_plan``. Every script in the folder
  (``*.sh``, ``*.sbatch``) runs under bash with tests/fake_cluster_tools first on PATH: the fake
  torchrun / deepspeed / accelerate parse their command lines as the real tools do, work out the
  world they would start and hand ``-m course_lib.train ...`` to the trainer's ``--check-config``
  (course_lib.trainer.check_config: the TOML and overrides validated, dp x tp x pp x cp = ranks, strategy
  composition; torch-free). ``job.sbatch`` runs as SLURM's batch step on the first node of a fake
  allocation (SLURM_* set, scontrol naming node0..node{N-1}); its srun starts the torchrun line once
  per node. Scripts that say "run on every node" run on the first and the last node. Each call must
  exit 0 with the trainer's layout for the launcher's world = the plan's GPUs, tp / pp as planned,
  the planned global batch, the first node as rendezvous / main address, distinct node ranks.
* A plan broken on purpose is refused (so the checks can fail): ranks changed under a tp/cp
  layout -> the trainer's check exits 2 and the script fails; ranks changed under plain data
  parallelism -> the trainer accepts it but the batch check here does not; accelerate on several
  nodes with neither SLURM nor MASTER_ADDR -> the script stops before launching.
* The fakes accept only option names the installed torchrun and DeepSpeed launcher have.
* A tiny model (2 blocks, d 64, bytes) planned for 2 CPU "GPUs": the plan for one node runs its
  ``launch_torchrun.sh`` (the venv's real torchrun, --standalone), the plan for 2 nodes x 1 runs its
  ``job.sbatch`` (srun and scontrol of tests/fake_cluster; two real torchrun agents meet at a c10d
  rendezvous): each trains the plan's 3 steps on 2 gloo ranks, both at once.

Work: 5 planner searches (in this process); 22 fake-launcher processes (torch-free, ~0.2 CPU-s
each: 19 for the scenarios, 3 for the broken plans); 2 trainings of 3 steps on 2 ranks, at once
(1 + 2 torchrun agents and 4 ranks: 7 processes that import torch); ``--check-config`` in-process.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.planner import plan, write_plan
from course_lib.planner.configs import deepspeed_supports
from course_lib.planner.exercise import SCENARIOS
from plan_cases import write_plans
from fake_cluster import FAKE_TOOLS, ROOT, VENV_BIN, fake_slurm_env, metrics_rows, run_env

sys.path.insert(0, str(FAKE_TOOLS))
import fake_launchers  # noqa: E402  (its parsers, for the option-name check)

SCRIPTS = ("launch_torchrun.sh", "launch_deepspeed.sh", "launch_accelerate.sh", "job.sbatch")
TINY = dict(gpu="custom", gpu_memory_gib=1, gpu_tflops=0.05, gpus=2, seq=64, global_batch_tokens=8 * 64,
            tokens=3 * 8 * 64, shape_overrides=dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256))


def with_kit(env: dict) -> dict:
    """``env`` with this tree's course_lib importable from any working directory."""
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH", "")] if p])
    return env


def check_env(work: Path, **extra: str) -> dict:
    """The fakes first on PATH (then the venv), a call log, no test hooks of the scripts."""
    env = with_kit(dict(os.environ))
    for name in [k for k in env if k.startswith(("SLURM_", "COURSE_", "MASTER_", "NODE_RANK", "RDZV_", "WORLD_SIZE",
                                                  "RANK", "LOCAL_RANK"))]:
        del env[name]
    env.update(PATH=os.pathsep.join([str(FAKE_TOOLS), VENV_BIN, os.environ.get("PATH", "")]),
               FAKE_LAUNCH_LOG=str(work / "calls.jsonl"), OMP_NUM_THREADS="1", **extra)
    return env


def slurm(nodes: int, node: int = 0) -> dict:
    """What SLURM sets for a batch step (or a task) on node ``node`` of ``nodes``."""
    return dict(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"node[0-{nodes - 1}]", SLURM_NNODES=str(nodes),
                SLURM_NODEID=str(node), FAKE_HOSTNAMES=" ".join(f"node{i}" for i in range(nodes)))


def run_script(script: Path, work: Path, env: dict) -> list[dict]:
    """Run ``script`` in ``work``; its fake launcher calls (each a dict), with the exit code under "script_rc"."""
    log = Path(env["FAKE_LAUNCH_LOG"])
    log.unlink(missing_ok=True)
    res = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for c in calls:
        c["script_rc"], c["script_err"] = res.returncode, res.stderr[-2000:]
    if not calls:
        calls = [{"tool": None, "script_rc": res.returncode, "script_err": res.stderr[-2000:]}]
    return calls


def run_every_script(folder: Path, work: Path, nodes: int) -> dict[str, list[dict]]:
    """script name -> the launcher calls it made: one run per script (job.sbatch as the batch step,
    scripts for "every node" on the first and the last node)."""
    out = {}
    every = sorted({0, nodes - 1})
    for name in SCRIPTS:
        script = folder / name
        if not script.exists():
            continue
        if name == "job.sbatch":
            out[name] = run_script(script, work, check_env(work, **slurm(nodes)))
        elif nodes == 1:
            out[name] = run_script(script, work, check_env(work))
        elif name == "launch_accelerate.sh":  # main address and machine rank from the job's environment
            out[name] = [c for n in every for c in run_script(script, work, check_env(work, **slurm(nodes, n)))]
        else:  # torchrun: the rendezvous host given by hand, the node's rank decided by the rendezvous
            out[name] = [c for n in every for c in run_script(script, work, check_env(
                work, RDZV_HOST="node0", FAKE_NODE_RANK=str(n)))]
    return out


def problems(p, calls: dict[str, list[dict]], folder: Path) -> list[str]:
    """Everything wrong with the launcher calls of ``p``'s scripts, one line each (empty: all right)."""
    spec, lay = p.spec, p.best.layout
    out = []
    nodes = spec.nodes
    cpus = json.loads((folder / "budget.json").read_text())["slurm"]["cpus_per_task"]
    for name, made in calls.items():
        want = nodes if name == "job.sbatch" else (1 if nodes == 1 else len({0, nodes - 1}))
        if len(made) != want or any(c["tool"] is None for c in made):
            out.append(f"{name}: {len(made)} launcher calls, expected {want}: "
                       f"{[c.get('script_err', '')[-300:] for c in made]}")
            continue
        for c in made:
            where = f"{name} (node {c.get('node_rank')})"
            if c["script_rc"] or c["rc"] or "layout" not in c:
                out.append(f"{where}: exit {c['script_rc']}/{c['rc']}: {c.get('error') or c['script_err'][-500:]}")
                continue
            lo = c["layout"]
            if c["torch_imported"]:
                out.append(f"{where}: the config check imported torch")
            if c["world_size"] != spec.gpus or lo["world_size"] != spec.gpus:
                out.append(f"{where}: {c['tool']} starts {c['world_size']} ranks (trainer saw {lo['world_size']}), "
                           f"the plan has {spec.gpus} GPUs")
            if (lo["tp"], lo["pp"]) != (lay.tp, lay.pp) or lo["dp"] * lo["tp"] * lo["pp"] * lo["cp"] != spec.gpus:
                out.append(f"{where}: trainer layout dp {lo['dp']} tp {lo['tp']} pp {lo['pp']} cp {lo['cp']}, "
                           f"plan {lay.label()}")
            if lo["global_batch"] != spec.global_batch:
                out.append(f"{where}: global batch {lo['global_batch']} sequences, the plan's is {spec.global_batch}")
            if c["nnodes"] != nodes or c["nproc_per_node"] != spec.gpus_per_node:
                out.append(f"{where}: {c['nnodes']} nodes x {c['nproc_per_node']}, plan {nodes} x {spec.gpus_per_node}")
            if nodes > 1 and c["master_addr"] != "node0":
                out.append(f"{where}: rendezvous / main address {c['master_addr']!r}, expected the first node")
            if c["tool"] == "torchrun" and nodes > 1 and c["max_restarts"] and \
                    c["node_env"].get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
                out.append(f"{where}: --max-restarts on {nodes} nodes without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
            if name == "job.sbatch" and c["node_env"].get("SLURM_CPUS_PER_TASK") != str(cpus):
                out.append(f"{where}: srun gave the torchrun agent {c['node_env'].get('SLURM_CPUS_PER_TASK', 'no')} "
                           f"CPUs, the plan's task has {cpus} (srun does not inherit sbatch's --cpus-per-task)")
        ranks = sorted(c.get("node_rank") for c in made)
        if name == "job.sbatch" and ranks != list(range(nodes)):
            out.append(f"{name}: node ranks {ranks}, expected 0..{nodes - 1} once each")
        if name == "launch_accelerate.sh" and nodes > 1 and ranks != sorted({0, nodes - 1}):
            out.append(f"{name}: machine ranks {ranks} (from SLURM_NODEID), expected {sorted({0, nodes - 1})}")
    if "launch_deepspeed.sh" in calls:  # the plan's DeepSpeed config holds for the ranks DeepSpeed starts
        ds = json.loads((folder / "ds_config.json").read_text())
        world = calls["launch_deepspeed.sh"][0].get("world_size")
        if ds["train_batch_size"] != ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world:
            out.append(f"ds_config.json: train_batch_size {ds['train_batch_size']} != micro x accum x {world} ranks")
        if calls["launch_deepspeed.sh"][0].get("layout", {}).get("strategy") != "deepspeed":
            out.append("launch_deepspeed.sh: the trainer did not run train.strategy = 'deepspeed'")
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """scenario -> (Plan, folder): each planned and written as `course plan --out` writes it
    (DeepSpeed's parser over ds_config.json: tests/test_planner.py)."""
    return write_plans(tmp_path_factory.mktemp("plans"), SCENARIOS)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_launch_script_reaches_the_trainer_with_a_valid_config(scenario, written, tmp_path):
    p, folder = written[scenario]
    written_scripts = sorted(f.name for f in folder.iterdir() if f.suffix in (".sh", ".sbatch"))
    assert set(written_scripts) <= set(SCRIPTS), f"a script this test does not run yet: {written_scripts}"
    expect = {"launch_torchrun.sh", "launch_accelerate.sh", "job.sbatch"} | (
        {"launch_deepspeed.sh"} if deepspeed_supports(p.best) else set())
    assert set(written_scripts) == expect
    calls = run_every_script(folder, tmp_path, p.spec.nodes)
    assert set(calls) == expect
    assert problems(p, calls, folder) == []
    if p.spec.nodes > 1:  # every agent of the job meets at one rendezvous, named after the job
        sb = calls["job.sbatch"]
        assert {c["rdzv_endpoint"] for c in sb} == {"node0:29500"} and {c["rdzv_id"] for c in sb} == {"4242"}


def test_broken_plans_are_refused(written, tmp_path):
    # tp/cp layout, ranks changed: the trainer's own check refuses the world size, the script fails.
    p, folder = written["7b-8k-context"]
    assert p.best.layout.cp * p.best.layout.tp * p.best.layout.pp > 1
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    text = (folder / "launch_torchrun.sh").read_text()
    assert "--nproc-per-node 8" in text
    (broken / "launch_torchrun.sh").write_text(text.replace("--nproc-per-node 8", "--nproc-per-node 4"))
    [call] = run_script(broken / "launch_torchrun.sh", tmp_path, check_env(tmp_path))
    assert call["world_size"] == 4 and call["rc"] == 2 and call["script_rc"] != 0
    assert "4 ranks started, but parallel.dp x tp x pp x cp" in call["error"]

    # plain data parallelism, ranks changed: the trainer would run it (any world divides), but with
    # another global batch than planned: the checks above catch it.
    p7, folder7 = written["7b-one-node"]
    (broken / "launch_torchrun.sh").write_text((folder7 / "launch_torchrun.sh").read_text()
                                               .replace("--nproc-per-node 8", "--nproc-per-node 4"))
    calls = {"launch_torchrun.sh": run_script(broken / "launch_torchrun.sh", tmp_path, check_env(tmp_path))}
    assert calls["launch_torchrun.sh"][0]["rc"] == 0
    found = problems(p7, calls, folder7)
    assert any("starts 4 ranks" in f for f in found) and any("global batch 512" in f for f in found), found

    # several machines, neither SLURM nor MASTER_ADDR / NODE_RANK: accelerate is never started.
    p70, folder70 = written["70b-8-nodes"]
    [call] = run_script(folder70 / "launch_accelerate.sh", tmp_path, check_env(tmp_path))
    assert call["tool"] is None and call["script_rc"] != 0 and "set MASTER_ADDR" in call["script_err"]
    # ... and with the YAML's placeholder address as the main process on 8 machines, the launch is refused.
    acc = (folder70 / "launch_accelerate.sh").read_text()
    (broken / "launch_accelerate.sh").write_text(acc.replace(' --main_process_ip "$MASTER_ADDR"', ""))
    [call] = run_script(broken / "launch_accelerate.sh", tmp_path, check_env(tmp_path, **slurm(8, 3)))
    assert call["rc"] == 1 and "cannot reach it" in call["error"]


def test_check_config_flag_checks_the_launched_world(monkeypatch, capsys, tmp_path):
    """`python -m course_lib.train --check-config` (in its --help): the layout and exit 0 for the
    WORLD_SIZE a launcher set, exit 2 naming what does not fit; nothing written, no model built."""
    from course_lib.train import build_parser, main

    assert "--check-config" in build_parser().format_help()
    out = tmp_path / "out"
    argv = ["--config", "labs/configs/tiny-cpu.toml", "--set", "train.strategy=ddp", "--set", "parallel.tp=2",
            "--set", "train.grad_accum=3", "--out", str(out), "--check-config"]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "config ok for 4 rank(s): dp 2 x tp 2 x pp 1 x cp 1" in text
    assert "global batch 96 sequences (micro_batch 16 x grad_accum 3 x dp 2)" in text
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(argv) == 2
    assert "3 ranks started, but parallel.dp x tp x pp x cp = 1 x 2 x 1 x 1 = 2" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")  # no launcher: one process, and ddp needs a process group
    assert main(argv) == 2 and "needs a process group" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(argv[:2] + ["--set", "train.strategy=ddp", "--set", "parallel.tp=3", "--check-config"]) == 2
    assert "parallel.tp = 3 must divide" in capsys.readouterr().err
    assert not out.exists()


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def _real_options(source: Path) -> set[str]:
    """Option strings of every add_argument call in ``source`` (read, not imported)."""
    text = source.read_text()
    calls = re.findall(r"add_argument\(\s*((?:\"[^\"]*\"\s*,\s*)+)", text)
    return {s for group in calls for s in re.findall(r"\"(-[^\"]*)\"", group)}


def test_fakes_know_only_the_real_tools_options():
    """What a fake accepts, the installed tool accepts too (torchrun and DeepSpeed: the option names
    of their sources; accelerate, a dev dependency: its own ``accelerate launch`` parser)."""
    torch_spec = importlib.util.find_spec("torch")  # the package's path, without importing it
    real = _real_options(Path(torch_spec.origin).parent / "distributed" / "run.py")
    assert "--nproc-per-node" in real and "--shutdown-timeout" in real
    assert _options(fake_launchers.torchrun_parser()) - real == set()
    ds_spec = importlib.util.find_spec("deepspeed")
    if ds_spec is None:
        pytest.skip("deepspeed is not installed; torchrun's options checked")
    real = _real_options(Path(ds_spec.origin).parent / "launcher" / "runner.py")
    assert "--num_gpus" in real and "--hostfile" in real
    assert _options(fake_launchers.deepspeed_parser()) - real == set()
    from accelerate.commands.launch import launch_command_parser

    real = _options(launch_command_parser())
    assert "--machine_rank" in real and "--config_file" in real
    assert _options(fake_launchers.accelerate_parser()) - real == set()


# --------------------------------------------------------------------------------------------
# a tiny plan, trained by its own scripts on 2 CPU ranks
# --------------------------------------------------------------------------------------------

def test_tiny_plans_torchrun_and_sbatch_scripts_train_on_two_cpu_ranks(tmp_path):
    runs = {}
    for name, gpus_per_node, script in (("one-node", 2, "launch_torchrun.sh"), ("two-nodes", 1, "job.sbatch")):
        p = plan(**TINY, gpus_per_node=gpus_per_node)
        lay = p.best.layout
        # the kit's own engines only: DeepSpeed's (ZeRO-1/2 without tp/pp) would build ops for minutes
        assert lay.tp * lay.pp * lay.cp == 1 and lay.zero_stage in (0, 3), lay.label()
        folder, work = tmp_path / f"plan-{name}", tmp_path / name
        write_plan(p, folder, validate_ds=False)
        work.mkdir()
        env = with_kit(fake_slurm_env(tmp_path / name, nodes=2) if script == "job.sbatch" else run_env())
        runs[name] = (p, work, subprocess.Popen(["bash", str(folder / script)], cwd=work, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for name, (p, work, proc) in runs.items():
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, f"{name}: {out[-2000:]}{err[-3000:]}"
        [train_out] = list((work / "runs").iterdir())
        rows = metrics_rows(train_out)
        steps = p.spec.tokens // p.spec.global_batch_tokens
        assert steps == 3 and [r["step"] for r in rows] == [1, 2, 3], (name, rows)
        assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows)
        assert "(gloo)" in out, out[-1000:]  # a process group: the ranks trained together
