"""Lab 14's helpers that run no job (the jobs themselves run when the notebook is executed)."""
from __future__ import annotations

import pytest

from course_lib.labs import lab14_capstone as capstone


def test_launch_commands_cover_one_gpu_eight_gpus_and_two_slurm_nodes():
    cmds = capstone.launch_commands()
    assert "--nproc-per-node 1" in cmds["1 GPU"] and "--nproc-per-node 8" in cmds["8 GPUs"]
    for text in cmds.values():
        assert "labs/configs/capstone-cpu.toml" in text and "train.device=cuda" in text and "--resume auto" in text
    sbatch = cmds["2 x 8 GPUs (SLURM)"]
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert "--signal=B:USR1@" in sbatch and "requeue" in sbatch


def test_checkpoint_steps_reads_only_committed_checkpoint_names(tmp_path):
    for name in ("step_000000004", "step_000000008.g1", ".tmp-step_000000012-1-ab", "notes"):
        (tmp_path / name).mkdir()
    assert capstone.checkpoint_steps(tmp_path) == [4, 8]
    assert capstone.checkpoint_steps(tmp_path / "missing") == []


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="nproc"):
        capstone.torchrun_command("x", nproc=0)
    with pytest.raises(ValueError, match="rank"):
        capstone.run_with_signal("x", 3, rank=2, nproc=2)
