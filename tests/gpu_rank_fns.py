"""Rank functions of tests/test_parallel_gpu.py: each parallel form on one GPU under NCCL (world
size 1), against the dense model on the same GPU. Returns plain numbers (max differences)."""
import torch
import torch.distributed as dist

from course_lib.model import ModelConfig, TinyGPT


def _dense(kind: str):
    torch.manual_seed(0)
    preset = "llama-tiny" if kind == "llama" else "tiny"
    return TinyGPT(ModelConfig.preset(preset, vocab_size=64, block_size=32)).cuda()


def _maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def tensor_parallel(rank, world, kind):
    """tp_tinygpt on a 1-rank NCCL group: logits, loss and every gradient equal the dense model."""
    from course_lib.parallel.tensor_parallel import tp_tinygpt

    assert dist.get_backend() == "nccl" and torch.cuda.is_available()
    dense = _dense(kind)
    idx = torch.randint(0, 64, (4, 32), device="cuda")
    logits, loss = dense(idx, idx)
    loss.backward()
    tp = tp_tinygpt(_dense(kind), group=dist.group.WORLD)
    tp_logits, tp_loss = tp(idx, idx)
    tp_loss.backward()
    tp.finish_gradient_synchronization()
    dense_grads = dict(dense.named_parameters())
    worst = max(_maxdiff(p.grad, dense_grads[n].grad) for n, p in tp.named_parameters() if n in dense_grads)
    return {"loss": _maxdiff(tp_loss, loss), "grads": worst, "device": str(tp_loss.device)}


def ring(rank, world):
    """Ring attention on one rank is plain causal attention (fp32 and bf16)."""
    import torch.nn.functional as F

    from course_lib.parallel.context_parallel import ring_attention

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 64, 16, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        got = ring_attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out[str(dtype)] = _maxdiff(got, ref)
    return out


def pipeline(rank, world, schedule):
    """A one-stage pipeline with 4 micro-batches equals the dense model on the whole batch."""
    from course_lib.parallel.pipeline import build_stage, pipeline_step

    dense = _dense("gpt2")
    idx = torch.randint(0, 64, (8, 32), device="cuda")
    _, loss = dense(idx, idx)
    loss.backward()
    stage = build_stage(_dense("gpt2"), 0, 1)
    result = pipeline_step(stage, idx, idx, schedule=schedule, micro_batches=4)
    dense_grads = dict(dense.named_parameters())
    worst = max(_maxdiff(p.grad, dense_grads[n].grad) for n, p in stage.named_parameters())
    return {"loss": abs(float(result["loss"]) - loss.item()), "grads": worst}


def dtensor(rank, world, sequence_parallel):
    """The DTensor plan on a 1-GPU mesh (NCCL): loss and every gradient equal the dense model."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from course_lib.parallel.tensor_parallel import parallelize_tinygpt

    dense = _dense("llama")
    idx = torch.randint(0, 64, (4, 32), device="cuda")
    _, loss = dense(idx, idx)
    loss.backward()
    model = parallelize_tinygpt(_dense("llama"), DeviceMesh("cuda", [0]), sequence_parallel=sequence_parallel)
    with loss_parallel():
        _, tp_loss = model(idx, idx)
        tp_loss.backward()
    dense_grads = dict(dense.named_parameters())

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    worst = max(_maxdiff(full(p.grad), dense_grads[n].grad) for n, p in model.named_parameters())
    return {"loss": _maxdiff(full(tp_loss), loss), "grads": worst}


def torch_pipelining(rank, world, schedule):
    """torch.distributed.pipelining with one stage per rank on one GPU equals the dense model."""
    from course_lib.parallel.pipeline.torch_pipelining import build_torch_stages, torch_pipeline_step

    dense = _dense("gpt2")
    idx = torch.randint(0, 64, (8, 32), device="cuda")
    _, loss = dense(idx, idx)
    loss.backward()
    stages = build_torch_stages(_dense("gpt2"), 0, 1, device=torch.device("cuda"))
    result = torch_pipeline_step(stages, idx, idx, schedule=schedule, micro_batches=4)
    dense_grads = dict(dense.named_parameters())
    worst = max(_maxdiff(p.grad, dense_grads[n].grad) for st in stages for n, p in st.submod.named_parameters())
    return {"loss": abs(float(result["loss"]) - loss.item()), "grads": worst}
