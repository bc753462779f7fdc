"""Lab 16 (experts): a tiny MoE TinyGPT trained three ways (no balancing, the balancing loss, the
expert bias) with its router's load recorded every step; capacity and dropped tokens; and the
library's expert parallelism (:mod:`course_lib.parallel.expert_parallel`) on gloo ranks, its
all-to-alls counted byte by byte at ``torch.distributed.all_to_all_single`` and held against one
process.

Everything a rank returns is plain numbers and tensors; :func:`ep_rank` compares, in the same
process, the expert-parallel forward and backward with one process running the whole model on every
rank's batch (no exchange), and counts the bytes each all-to-all sends to other ranks.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.data.tasks import DEFAULT_TEXT
from course_lib.model import ModelConfig, TinyGPT
from course_lib.model.moe import capacity, keep_mask, moe_layers, update_expert_bias
from course_lib.parallel.expert_parallel import make_ep_group, shard_experts



# ============================================================= prediction cells
from course_lib.kit.predict import show_prediction  # noqa: E402,F401 - the notebook calls lab_runs.show_prediction


# ============================================================= data and the model
def text_tokens(path: Path | None = None) -> torch.Tensor:
    """The bytes of the kit's training text (``course_lib/data/files/training_notes.txt``, the trainer's
    byte-level data) as int64 token ids 0..255: real text, so the router has something to specialise
    on. moe-tiny's vocabulary is the 256 byte values."""
    path = DEFAULT_TEXT if path is None else Path(path)
    data = path.read_bytes()
    if len(data) < 1_000:
        raise ValueError(f"the lab's text {path} holds only {len(data)} bytes; it needs 1,000 or more")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 [batch_size, seq_len]: random windows of ``tokens`` (seeded), y shifted by one."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len)
    return tokens[idx], tokens[idx + 1]


def moe_config(**overrides) -> ModelConfig:
    """The ``moe-tiny`` preset (8 experts, top 2, 2 blocks, width 64) with ``overrides``; no balancing
    unless asked (the preset's balancing loss is set to 0 here)."""
    return ModelConfig.preset("moe-tiny", **{"moe_aux_loss_coef": 0.0, **overrides})


def model(cfg: ModelConfig, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(cfg)


# ============================================================= the router, watched while training
BALANCING = {  # name -> config overrides; larger than the published 0.01 / 0.001: 40 steps, not 100,000s
    "none": {},
    "balancing loss": {"moe_aux_loss_coef": 0.1},
    "expert bias": {"moe_bias_update_rate": 0.005},
}


def train_router(mode: str, steps: int, *, batch_size: int = 4, seq_len: int = 32, lr: float = 1e-3,
                 seed: int = 0) -> dict:
    """Train moe-tiny for ``steps`` AdamW steps with balancing ``mode`` (a key of :data:`BALANCING`)
    on the kit's text; return per step the language-model loss (nats per token, the balancing loss
    left out), and per MoE layer the tokens the router sent to each expert (``load``: [steps, E]
    int64, token copies, k per token) and the largest load over the mean (``max_over_mean``)."""
    if mode not in BALANCING:
        raise ValueError(f"mode must be one of {list(BALANCING)}, got {mode!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    tokens = text_tokens()
    net = model(moe_config(**BALANCING[mode]), seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    layers = moe_layers(net)
    loads, losses = [[] for _ in layers], []
    for step in range(steps):
        x, y = batch(tokens, batch_size, seq_len, seed=1000 + step)
        _, loss = net(x, y)
        aux = net.moe_aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for i, m in enumerate(layers):
            loads[i].append(m.last_load.clone())
        update_expert_bias(net)  # a no-op for layers without bias balancing (resets their step loads)
        losses.append(loss.item() - (aux.item() if aux is not None else 0.0))
    load = [torch.stack(layer) for layer in loads]
    return {"mode": mode, "loss": losses, "load": load,
            "max_over_mean": [(ld.max(1).values.float() / ld.float().mean(1)).tolist() for ld in load],
            "model": net}


# ============================================================= capacity
def capacity_rows(net: TinyGPT, factors: list, *, batch_size: int = 4, seq_len: int = 32,
                  seed: int = 99) -> tuple[list[dict], torch.Tensor, int]:
    """For the first MoE layer of ``net`` on one batch of text: per capacity factor (None: dropless),
    the slots per expert, the (token, expert) pairs dropped, the share of the batch's pairs that is,
    and the tokens that lost every expert; also the layer's load per expert [E] and the token count."""
    tokens = text_tokens()
    x, _ = batch(tokens, batch_size, seq_len, seed)
    layer = moe_layers(net)[0]
    captured = {}
    hook = layer.register_forward_pre_hook(lambda mod, args: captured.setdefault("h", args[0].detach()))
    with torch.no_grad():
        net.eval()
        net(x)
        net.train()
    hook.remove()
    h = captured["h"].reshape(-1, captured["h"].shape[-1])
    r = layer.router(h)
    n, k, e = h.shape[0], layer.top_k, layer.n_experts
    rows = []
    for f in factors:
        cap = None if f is None else capacity(n, k, e, f)
        keep = keep_mask(r.experts, r.weights, e, cap)
        dropped = int((~keep).sum())
        rows.append({"factor": f, "capacity": cap, "dropped": dropped, "pairs": n * k,
                     "dropped %": 100.0 * dropped / (n * k),
                     "tokens with no expert": int((~keep).all(1).sum())})
    load = torch.bincount(r.experts.reshape(-1), minlength=e)
    return rows, load, n


# ============================================================= expert parallelism
class _Wire:
    """Counts, per phase ("forward", "backward"), the bytes ``all_to_all_single`` sends to other
    ranks, split into the count exchange (int64 tensors) and the rows."""

    def __init__(self):
        self.phase, self.bytes, self.calls = "forward", {}, []
        real = dist.all_to_all_single

        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            n, me = dist.get_world_size(group), dist.get_rank(group)
            splits = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
            per_row = input[0].numel() * input.element_size() if input.shape[0] else 0
            sent = sum(int(s) for k, s in enumerate(splits) if k != me) * per_row
            kind = "counts" if input.dtype == torch.int64 else "rows"
            key = (self.phase, kind)
            self.bytes[key] = self.bytes.get(key, 0) + sent
            done = real(output, input, output_split_sizes, input_split_sizes, group=group, **kw)
            got = output.tolist() if kind == "counts" else None  # counts received: [source, local expert]
            self.calls.append((self.phase, kind, [int(s) for s in splits], sent, got))
            return done
        dist.all_to_all_single = counted


def ep_rank(rank: int, world_size: int, batch_size: int, seq_len: int) -> dict:
    """Rank function: moe-tiny with expert parallelism over all ranks (each holds E/N experts of every
    MoE layer), one forward and backward on this rank's own batch; the same model in one process on
    every rank's batch as the reference. Returns the losses, the largest differences of logits and of
    this rank's expert gradients, the rows this rank sent each rank per layer, and the bytes on the wire."""
    torch.set_num_threads(1)
    wire = _Wire()
    tokens = text_tokens()
    cfg = moe_config()
    batches = [batch(tokens, batch_size, seq_len, seed=500 + r) for r in range(world_size)]
    # the reference: one process, all experts, every rank's batch; gradients of the sum of the losses
    ref = model(cfg)
    ref_logits, ref_losses = [], []
    for x, y in batches:
        logits, loss = ref(x, y)
        ref_logits.append(logits.detach())
        ref_losses.append(loss)
    torch.stack(ref_losses).sum().backward()
    # expert parallelism (the library's): the same weights; every MoE layer keeps this rank's experts
    ep = model(cfg)
    group = make_ep_group(world_size)
    shard_experts(ep, group)
    x, y = batches[rank]
    wire.phase = "forward"
    logits, loss = ep(x, y)
    loads = [m.last_load.tolist() for m in moe_layers(ep)]
    wire.phase = "backward"
    loss.backward()
    e_local = cfg.moe_experts // world_size
    keep = group.local_experts(cfg.moe_experts)
    grad_err = 0.0
    for mine, m in zip(moe_layers(ep), moe_layers(ref)):
        for name in ("gate", "up", "down"):
            want = getattr(m.experts, name).grad[keep.start:keep.stop]
            grad_err = max(grad_err, (getattr(mine.experts, name).grad - want).abs().max().item())
    fwd = [c for c in wire.calls if c[0] == "forward"]
    # forward, per MoE layer: the counts, the dispatch's rows, the combine's rows (3 calls)
    per_layer = [{"received counts": torch.tensor(fwd[3 * i][4]).view(world_size, e_local).tolist(),
                  "dispatch splits": fwd[3 * i + 1][2], "combine splits": fwd[3 * i + 2][2],
                  "counts bytes": fwd[3 * i][3], "dispatch bytes": fwd[3 * i + 1][3],
                  "combine bytes": fwd[3 * i + 2][3]}
                 for i in range(len(moe_layers(ep)))]
    dist.barrier()
    return {"loss": loss.item(), "ref loss": ref_losses[rank].item(),
            "logit err": (logits.detach() - ref_logits[rank]).abs().max().item(),
            "expert grad err": grad_err, "layers": per_layer, "loads": loads,
            "bytes": {f"{p} {k}": v for (p, k), v in wire.bytes.items()},
            "calls": [(p, k, s) for p, k, s, *_ in wire.calls], "tokens": batch_size * seq_len,
            "e_local": e_local, "d_model": cfg.d_model, "experts": cfg.moe_experts, "top_k": cfg.moe_top_k}


def run_expert_parallel(world_size: int, *, batch_size: int = 4, seq_len: int = 64, timeout: float = 300.0) -> list[dict]:
    """:func:`ep_rank` on ``world_size`` gloo ranks; one dict per rank."""
    from course_lib.parallel.ranks.launch import run_ranks

    if world_size < 1 or 8 % world_size:
        raise ValueError(f"world_size must divide moe-tiny's 8 experts (1, 2, 4 or 8), got {world_size}")
    return run_ranks(ep_rank, world_size, batch_size, seq_len, timeout=timeout, show_output=False)


def rows_matrix(results: list[dict], layer: int) -> torch.Tensor:
    """[from rank][to rank]: the token copies each rank's dispatch sent each rank in MoE layer ``layer``."""
    return torch.tensor([r["layers"][layer]["dispatch splits"] for r in results])


def imbalance(load: torch.Tensor) -> float:
    """Largest expert load over the mean load (1.0: perfectly balanced)."""
    load = load.float()
    return (load.max() / load.mean()).item() if load.sum() else math.nan
