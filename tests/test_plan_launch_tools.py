"""A plan's launch files read by the tools' own code, and the cluster behaviour the fakes of
tests/test_plan_scripts.py cannot show (issue 33, "What to build" 2-4).

* Every torchrun line (``launch_torchrun.sh``, ``job.sbatch``) parses with torch's own torchrun
  parser (``torch.distributed.run.get_args_parser``); ``accelerate_config.yaml`` loads with
  accelerate's config loader and ``launch_accelerate.sh``'s command parses with ``accelerate
  launch``'s own parser; ``ds_config.json`` passes DeepSpeed's ``DeepSpeedConfig`` with the world
  size DeepSpeed will see (its ``deepspeed.comm`` answering for the plan's ranks).
* ``job.sbatch`` runs as the batch step with a torchrun that has no ``--shutdown-timeout`` (an
  older torch): the step still starts, without the flag; with a torchrun that has it, the flag is
  there. The srun step's CPU binding is checked by tests/test_plan_scripts.py (fake srun as
  Slurm >= 22.05: no --cpus-per-task inherited).
* plan.md's submit command, run with an ``sbatch`` that, like SLURM, needs the folder of
  ``#SBATCH --output`` to exist, leaves that folder in place before sbatch is called.
* ``launch_deepspeed.sh`` on two nodes runs DeepSpeed's own multi-node launcher (its runner, with
  ``pdsh`` and ``ssh`` stood in by scripts that record their command): every variable the script
  exports is in the command pdsh would run on the other nodes.

Work: 3 planner searches, DeepSpeed's runner once (~3 s: it imports torch), 16 fake torchrun
calls (torch-free), torch's and accelerate's parsers in this process.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from plan_cases import write_plans
from course_lib.planner.exercise import SCENARIOS
from fake_cluster import VENV_BIN
from test_plan_scripts import check_env, run_script, slurm


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """name -> (Plan, folder): the 7B one-node and 70B 8-node scenarios and GPT-2 XL on 2 nodes (a
    multi-node DeepSpeed plan), written as `course plan --out` writes them."""
    root = tmp_path_factory.mktemp("plans")
    kws = {"7b-one-node": SCENARIOS["7b-one-node"], "70b-8-nodes": SCENARIOS["70b-8-nodes"],
           "gpt2-xl-2-nodes": dict(model="gpt2-xl", gpu="a100-80gb", gpus=16, gpus_per_node=8, tokens="30B")}
    return write_plans(root, kws)


def torchrun_words(script: str) -> list[str]:
    """The torchrun command of a launch script, as words (a shell line joined over ``\\``, with
    the sbatch script's optional-flag array expanded as a torchrun that has the flag sees it)."""
    text = script.replace("\\\n", " ").replace('${GRACE[@]+"${GRACE[@]}"}', "--shutdown-timeout 105")
    [line] = [ln for ln in text.splitlines() if re.search(r"(^|\s)\"?(\$TORCHRUN|torchrun)\"?\s+--", ln)
              and not ln.lstrip().startswith(("#", "if "))]
    words = shlex.split(line.split("&")[0])
    return words[[i for i, w in enumerate(words) if w in ("torchrun", "$TORCHRUN")][0] + 1:]


def test_launch_files_parse_in_their_tools(plans, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.run import get_args_parser

    for name, (p, folder) in plans.items():
        spec = p.spec
        for script in ("launch_torchrun.sh", "job.sbatch"):
            run = get_args_parser().parse_args(torchrun_words((folder / script).read_text()))
            assert int(run.nnodes) == spec.nodes and int(run.nproc_per_node) == spec.gpus_per_node, (name, script)
            assert run.module and run.training_script == "course_lib.train", (name, script)
        acc = load_config_from_file(str(folder / "accelerate_config.yaml"))
        assert (acc.num_machines, acc.num_processes) == (spec.nodes, spec.gpus), name
        line = [ln for ln in (folder / "launch_accelerate.sh").read_text().splitlines() if ln.startswith("accelerate ")]
        # the values the shell gives the script's variables on node 0
        words = shlex.split(line[0].replace("$NODE_RANK", "0").replace("$MASTER_ADDR", "node0"))
        launch = launch_command_parser().parse_args(words[2:])
        assert launch.config_file == str(folder / "accelerate_config.yaml") and launch.module, name
        if (folder / "ds_config.json").exists():
            import deepspeed.comm
            from deepspeed.runtime.config import DeepSpeedConfig

            # DeepSpeed reads the world from its process group: the one the launcher will start.
            monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
            monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda *a, **k: spec.gpus)
            ds = DeepSpeedConfig(json.loads((folder / "ds_config.json").read_text()))
            assert ds.world_size == spec.gpus and ds.train_batch_size == spec.global_batch, name
    assert {n for n, (_, f) in plans.items() if (f / "ds_config.json").exists()} == {"7b-one-node", "gpt2-xl-2-nodes"}


def test_sbatch_runs_with_and_without_torchruns_shutdown_timeout(plans, tmp_path):
    p, folder = plans["70b-8-nodes"]
    for old in (False, True):
        env = check_env(tmp_path, **slurm(8), **({"FAKE_TORCHRUN_OLD": "1"} if old else {}))
        calls = run_script(folder / "job.sbatch", tmp_path, env)
        assert len(calls) == 8 and all(c["script_rc"] == 0 and c["rc"] == 0 for c in calls), calls[0]
        assert {c["shutdown_timeout"] for c in calls} == ({None} if old else {105}), old
        if old:
            assert "this torchrun has no --shutdown-timeout" in calls[0]["script_err"]


def test_the_submit_command_makes_the_log_folder_first(plans, tmp_path):
    p, folder = plans["70b-8-nodes"]
    fake = tmp_path / "bin"
    fake.mkdir()
    # sbatch as SLURM behaves: the job's log opens in the --output folder, which must exist
    (fake / "sbatch").write_text('#!/bin/bash\nout="$(sed -n "s/^#SBATCH --output=\\([^ ]*\\).*/\\1/p" "$1")"\n'
                                 '[ -d "$(dirname "$out")" ] || { echo "no folder for $out" >&2; exit 1; }\n'
                                 'echo "Submitted batch job 1"\n')
    (fake / "sbatch").chmod(0o755)
    md = (folder / "plan.md").read_text()
    [submit] = re.findall(r"`(mkdir -p \S+ && sbatch \S+/job\.sbatch)`", md)
    work = tmp_path / "kit"
    work.mkdir()
    res = subprocess.run(["bash", "-c", submit], cwd=work, capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"))
    assert res.returncode == 0, res.stderr
    assert "Submitted batch job" in res.stdout
    assert f"#   {submit}\n" in (folder / "job.sbatch").read_text()  # the script's header says the same
    assert (work / "runs" / f"{p.spec.model_name}-{p.spec.gpus}gpu").is_dir()


def test_deepspeed_passes_every_variable_to_the_other_nodes(plans, tmp_path):
    p, folder = plans["gpt2-xl-2-nodes"]
    script = (folder / "launch_deepspeed.sh").read_text()
    exported = set(re.findall(r"^export ([A-Z_][A-Z0-9_]*)=", script, flags=re.M)) - {"DS_ENV_FILE"}
    assert {"OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG"} <= exported
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "pdsh").write_text('#!/bin/bash\nprintf "%s\\n" "$@" >"$PDSH_LOG"\n')  # what would run on each node
    (fake / "ssh").write_text('#!/bin/bash\ncase "$*" in *"hostname -I"*) echo 10.0.0.1 ;; esac\n')
    for tool in ("pdsh", "ssh"):
        (fake / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "TORCH_NCCL", "NCCL", "DS_"))}
    env.update(PATH=os.pathsep.join([str(fake), VENV_BIN, env["PATH"]]), PDSH_LOG=str(tmp_path / "pdsh.log"))
    res = subprocess.run(["bash", str(folder / "launch_deepspeed.sh")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    remote = (tmp_path / "pdsh.log").read_text()
    assert "node0,node1" in remote and "deepspeed.launcher.launch" in remote
    reached = set(re.findall(r"export ([A-Z_][A-Z0-9_]*)=", remote))
    assert exported <= reached, f"never reach the other nodes: {sorted(exported - reached)}"
    assert Path(folder / ".deepspeed_env").read_text().count("\n") == len(exported)
    # nothing to pass (a CPU cluster's `course launch`): no file, whose one empty line DeepSpeed could not read
    from course_lib.launchers.commands import deepspeed_env_block

    assert deepspeed_env_block("", "x") == "" and "x/.deepspeed_env" in deepspeed_env_block('export A="1"\n', "x")
