"""Rank functions (and the single-process reference) for tests/test_fsdp_scratch.py.

One launch per world size runs every scenario, because starting ranks is the slow part. Sizes are
chosen so that no sharded tensor splits evenly over 4 ranks: the padding is exercised."""

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH, SEQ, VOCAB, DIM, HIDDEN = 8, 5, 13, 6, 10
STEPS = 3


class TinyTiedLM(nn.Module):
    """Embedding tied to the output Linear, a frozen Linear, a frozen loose parameter, a Linear
    with bias and a LayerNorm (replicated by SimpleFSDP)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.offset = nn.Parameter(torch.randn(DIM), requires_grad=False)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # one Parameter, two names

    def forward(self, x):
        h = self.frozen(self.emb(x)) + self.offset
        h = h + self.proj(torch.tanh(self.fc(h)))
        return self.head(self.norm(h))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))


def batches(steps=STEPS, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(steps)]


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference():
    """One process, the whole global batch: what SimpleFSDP must reproduce."""
    model = TinyTiedLM(seed=0)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    grads, losses = None, []
    for x, y in batches():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        losses.append(loss.item())
        grads = grads or {n: (None if p.grad is None else p.grad.clone())
                          for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    layer_params = {id(p): p for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))
                    for p in m.parameters()}  # the tied weight once
    sharded_bytes = sum(p.numel() * p.element_size() for p in layer_params.values())
    return {"grads": grads, "params": params, "losses": losses,
            "state_names": list(model.state_dict()), "sharded_bytes": sharded_bytes}


def train(rank, world_size, compute_dtype, prefetch=True):
    from course_lib.parallel import SimpleFSDP

    fsdp = SimpleFSDP(TinyTiedLM(seed=rank), compute_dtype=compute_dtype,  # broadcast fixes seeds
                      prefetch=prefetch)
    opt = make_opt([p for p in fsdp.parameters() if p.requires_grad])
    per = GLOBAL_BATCH // world_size
    grads, losses = None, []
    for x, y in batches():
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(fsdp, xs, ys)
        loss.backward()
        fsdp.finish_gradient_synchronization()
        losses.append(loss.detach().float().clone())
        grads = grads or fsdp.gather_full_params(grads=True)
        opt.step()
    losses = torch.stack(losses)
    torch.distributed.all_reduce(losses)  # mean of per-rank means = the global-batch loss
    m = fsdp.module
    return {"grads": grads, "params": fsdp.gather_full_params(), "losses": (losses / world_size).tolist(),
            "sharded_bytes": fsdp.sharded_bytes(),
            "dtypes": {n: (p.dtype, None if p.grad is None else p.grad.dtype)
                       for n, p in fsdp.named_parameters()},
            "opt_dtypes": {t.dtype for s in opt.state.values() for t in s.values() if t.dim()},
            "prefetch_hits": fsdp.prefetch_hits, "tied": m.head.weight is m.emb.weight,
            "shard_shapes": {n: tuple(p.shape) for n, p in m.named_parameters()},
            "full_attrs_left": [n for n, mod in m.named_modules() if "weight" in mod.__dict__]}


def nothing_to_shard(rank, world_size):
    from course_lib.parallel import SimpleFSDP

    try:
        SimpleFSDP(nn.Sequential(nn.LayerNorm(4)))
    except ValueError as exc:
        return str(exc)
    return None


def everything(rank, world_size):
    out = {"fp32": train(rank, world_size, None), "bf16": train(rank, world_size, torch.bfloat16),
           "no_prefetch": train(rank, world_size, None, prefetch=False),
           "nothing": nothing_to_shard(rank, world_size)}
    torch.distributed.barrier()
    return out
