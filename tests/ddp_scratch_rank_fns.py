"""Rank functions (and the single-process reference) for tests/test_ddp_scratch.py.

One launch per world size runs every scenario, because starting ranks is the slow part."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH, SEQ, VOCAB, DIM = 8, 5, 16, 8
STEPS = 3
TINY_MB = 1e-4  # MiB = 104 bytes: about one parameter per bucket


class TinyTied(nn.Module):
    """Tied embedding/head, a frozen layer, a parameter forward never uses and a buffer."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.unused = nn.Parameter(torch.randn(3))  # registered first: lands in the last bucket
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # one Parameter, two names
        self.register_buffer("scale", torch.full((DIM,), 1.0 + 0.5 * seed))

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc2(torch.tanh(self.fc1(self.frozen(h))))
        return self.head(self.norm(h) * self.scale)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def batches(steps=STEPS, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(steps)]


def make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def snapshot(model, grads=False):
    """name -> tensor copy (tied weight once, under its first name); grads: None kept as None."""
    if grads:
        return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.clone() for n, b in model.named_buffers()})
    return out


def reference(opt_name, steps=STEPS):
    """One process, the whole global batch: what every DDP form must reproduce."""
    model = TinyTied(seed=0)
    opt = make_opt(opt_name, model.parameters())
    first = None
    for x, y in batches(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        first = first or snapshot(model, grads=True)
        opt.step()
    return {"grads": first, "params": snapshot(model)}


def _wrap(kind, model, bucket_mb):
    from course_lib.parallel import BucketedDDP, NaiveDDP

    return NaiveDDP(model) if kind == "naive" else BucketedDDP(model, bucket_mb=bucket_mb)


def run_scenario(rank, world_size, kind, bucket_mb, opt_name, micro=1):
    model = TinyTied(seed=rank)  # a different start on every rank: the broadcast must fix it
    ddp = _wrap(kind, model, bucket_mb)
    opt = make_opt(opt_name, ddp.parameters())
    per = GLOBAL_BATCH // world_size
    first, launched = None, []
    for x, y in batches():
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        xm, ym = xs.chunk(micro), ys.chunk(micro)
        if micro > 1:
            with ddp.no_sync():
                for i in range(micro - 1):
                    (loss_fn(ddp, xm[i], ym[i]) / micro).backward()
        (loss_fn(ddp, xm[-1], ym[-1]) / micro).backward()
        ddp.finish_gradient_synchronization()
        launched.append(getattr(ddp, "launched_in_backward", None))
        first = first or snapshot(model, grads=True)
        opt.step()
    return {"grads": first, "params": snapshot(model), "launched": launched,
            "buckets": getattr(ddp, "bucket_count", None),
            "tied": ddp.module.head.weight is ddp.module.emb.weight}


SCENARIOS = [  # (wrapper, bucket_mb, optimizer, micro-batches)
    ("naive", None, "sgd", 1), ("naive", None, "adamw", 1),
    ("bucketed", None, "sgd", 1), ("bucketed", None, "adamw", 1),
    ("bucketed", TINY_MB, "sgd", 1), ("bucketed", TINY_MB, "adamw", 1),
    ("bucketed", 25.0, "sgd", 1), ("bucketed", 25.0, "adamw", 1),
    ("bucketed", TINY_MB, "adamw", 2), ("bucketed", None, "sgd", 2),
]


class PartlyUsed(nn.Module):
    """``a`` used on every rank, ``b`` only on rank 0, ``c`` nowhere."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.ones(n)) for n in (3, 2, 4))

    def forward(self, rank):
        loss = (self.a * (rank + 1)).sum()
        return loss + (self.b * (rank + 1)).sum() if rank == 0 else loss


def partly_used(rank, world_size, kind, bucket_mb):
    ddp = _wrap(kind, PartlyUsed(), bucket_mb)
    out = []
    for _ in range(2):  # twice: state must reset between syncs
        for p in ddp.parameters():
            p.grad = None
        ddp(rank).backward()
        ddp.finish_gradient_synchronization()
        out.append({n: (None if p.grad is None else p.grad.clone()) for n, p in ddp.module.named_parameters()})
    return out


def everything(rank, world_size):
    results = {s: run_scenario(rank, world_size, *s) for s in SCENARIOS}
    for kind, mb in (("naive", None), ("bucketed", None), ("bucketed", 1e-6)):
        results[("partly", kind, mb)] = partly_used(rank, world_size, kind, mb)
    dist.barrier()
    return results
