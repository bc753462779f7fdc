"""The from-scratch parallel forms on one GPU with NCCL (world size 1): NCCL refuses CPU tensors,
so every flag, buffer and message must live on the device. Skipped without CUDA (marker 'gpu');
the multi-rank equality proofs run on CPU with gloo (test_tensor_parallel, test_pipeline_parallel,
test_context_parallel)."""
import pytest

import gpu_rank_fns as fns
from course_lib.parallel import run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tensor_parallel_on_nccl_equals_dense(kind):
    (r,) = run_ranks(fns.tensor_parallel, 1, kind, backend="nccl", timeout=240, show_output=False)
    assert r["device"].startswith("cuda") and r["loss"] < 1e-5 and r["grads"] < 1e-4, r


def test_ring_attention_on_one_gpu_is_plain_attention():
    (r,) = run_ranks(fns.ring, 1, backend="nccl", timeout=240, show_output=False)
    assert r["torch.float32"] < 1e-5 and r["torch.bfloat16"] < 2e-2, r


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_pipeline_on_nccl_equals_dense(schedule):
    (r,) = run_ranks(fns.pipeline, 1, schedule, backend="nccl", timeout=240, show_output=False)
    assert r["loss"] < 1e-5 and r["grads"] < 1e-5, r


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dtensor_plan_on_nccl_equals_dense(sp):
    (r,) = run_ranks(fns.dtensor, 1, sp, backend="nccl", timeout=240, show_output=False)
    assert r["loss"] < 1e-5 and r["grads"] < 1e-4, r


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_one_stage_on_nccl_equals_dense(schedule):
    (r,) = run_ranks(fns.torch_pipelining, 1, schedule, backend="nccl", timeout=240, show_output=False)
    assert r["loss"] < 1e-5 and r["grads"] < 1e-5, r
