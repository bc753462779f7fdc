"""The trainer on a CUDA machine: the device follows train.device and the local rank, under
torchrun too. Skipped without CUDA (marker 'gpu'); the CPU-side logic is in test_train_recovery."""
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import train_config
from course_lib.train import train

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"


def test_auto_trains_on_the_gpu_and_cpu_stays_on_the_cpu(tmp_path):
    base = ["train.progress=false", "train.max_steps=12", "schedule.warmup_steps=3"]
    gpu = train(train_config.load(TINY, base), tmp_path / "gpu")
    assert gpu.device == "cuda:0" and next(gpu.model.parameters()).is_cuda
    cpu = train(train_config.load(TINY, base + ["train.device='cpu'"]), tmp_path / "cpu")
    assert cpu.device == "cpu" and not next(cpu.model.parameters()).is_cuda
    assert abs(gpu.final_loss - cpu.final_loss) < 0.05  # same run, two devices


@pytest.mark.parametrize("device, words", [("auto", "on cuda:0 (nccl)"), ("cpu", "on cpu (gloo)")])
def test_torchrun_rank_uses_the_configured_device_and_backend(tmp_path, device, words):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "course_lib.train", "--config", str(TINY), "--out", str(tmp_path), "--no-progress",
           "--max-steps", "10", "--set", "schedule.warmup_steps=3", "--set", "train.strategy='ddp'",
           "--set", f"train.device='{device}'"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert words in done.stdout, done.stdout
