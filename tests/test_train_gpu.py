"""The trainer on a CUDA machine: the device follows train.device and the local rank, under
torchrun too. Skipped without CUDA (marker 'gpu'); the CPU-side logic is in test_train_recovery."""
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.trainer import config as train_config
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


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp-scratch", "fsdp"])
def test_sharding_strategies_run_on_nccl(tmp_path, strategy):
    """Every sharding strategy on one GPU under torchrun (NCCL): flags and collectives live on the
    device (NCCL refuses CPU tensors), and the run ends with the loss falling."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "course_lib.train", "--config", str(TINY), "--out", str(tmp_path), "--no-progress",
           "--max-steps", "12", "--set", "schedule.warmup_steps=3", "--set", f"train.strategy='{strategy}'",
           "--set", "train.precision='bf16'"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on cuda:0 (nccl)" in done.stdout, done.stdout


def test_cuda_allocated_model_state_equals_the_census_and_the_estimate():
    """One GPU, fp32 + AdamW after a step: the census of parameters, gradients and Adam moments
    equals the estimator's 16 B/param exactly, and the CUDA caching allocator holds exactly those
    tensors rounded up to its 512-byte blocks (plus the input batch), nothing else."""
    import torch

    from course_lib.estimate.memory import model_state_bytes
    from course_lib.model import ModelConfig, TinyGPT
    from course_lib.parallel import model_state_bytes_on_rank

    def blocks(ts):
        return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in ts)

    # cuBLAS / cuBLASLt workspaces come from the same allocator, lazily, per kind of matmul
    # (a plain mm and a Linear with bias use different ones: 1 MiB was seen on an H100): run the
    # same step once on a throwaway model so every workspace exists before the count starts.
    warm = TinyGPT(ModelConfig.preset("tiny", vocab_size=64, block_size=64)).cuda()
    warm_opt = torch.optim.AdamW(warm.parameters(), lr=1e-3)
    xw = torch.randint(0, 64, (4, 64), device="cuda")
    warm(xw, xw)[1].backward()
    warm_opt.step()
    del warm, warm_opt, xw
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = TinyGPT(ModelConfig.preset("tiny", vocab_size=64, block_size=64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (4, 64), device="cuda")
    logits, loss = model(x, x)
    loss.backward()
    del logits, loss
    opt.step()
    torch.cuda.synchronize()
    census = model_state_bytes_on_rank(model, opt)
    est = model_state_bytes(model.num_params(), recipe="fp32-adam")
    assert census.total == est.total, (census, est.total)
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()] + \
        [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda]
    held = torch.cuda.memory_allocated() - base
    assert held == blocks(tensors) + blocks([x]), (held, blocks(tensors), census)


def _torchrun_train(tmp_path, *sets, steps=20):
    """One rank under torchrun (NCCL on cuda:0); returns the stdout and the logged rows."""
    import json

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "course_lib.train", "--config", str(TINY), "--out", str(tmp_path), "--no-progress",
           "--max-steps", str(steps), "--set", "schedule.warmup_steps=3"]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "on cuda:0 (nccl)" in done.stdout, done.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return done.stdout, rows


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_fp16_trains_on_nccl_with_its_loss_scaler(tmp_path, stage):
    """DeepSpeed's own fp16 optimizer and dynamic loss scale (they do not run on a CPU): the run
    ends with the loss below where it started and a loss scale logged."""
    _, rows = _torchrun_train(tmp_path, "train.strategy='deepspeed'", "train.precision='fp16'",
                              f"parallel.zero_stage={stage}", steps=30)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    assert losses[-1] < losses[0], losses


def test_compile_and_fused_adamw_train_like_the_plain_loop(tmp_path):
    """train.compile + optim.fused on CUDA (bf16): the same run as the plain loop, up to rounding
    of fused kernels; the MFU column is filled from the datasheet peak."""
    _, plain = _torchrun_train(tmp_path / "plain", "train.precision='bf16'", "train.strategy='ddp'")
    _, fast = _torchrun_train(tmp_path / "fast", "train.precision='bf16'", "train.strategy='ddp'",
                              "train.compile=true", "optim.fused=true")
    assert abs(plain[-1]["loss"] - fast[-1]["loss"]) < 0.05, (plain[-1], fast[-1])
    assert fast[-1]["mfu"] is not None and 0 < fast[-1]["mfu"] < 1
