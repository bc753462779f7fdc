"""Lab 16 (experts): a tiny MoE TinyGPT trained three ways (no balancing, the balancing loss, the
expert bias) with its router's load recorded every step; capacity and dropped tokens; and expert
parallelism on gloo ranks, its two all-to-alls counted byte by byte and held against one process.

Expert parallelism here is this module's own: :func:`ep_dispatcher` builds the callable the model's
:class:`~course_lib.model.moe.MoE` calls in place of its local experts (``MoE.dispatcher``): the
rows the MoE layer already sorted by expert go to the rank holding their expert (the counts first,
then the rows, both with ``all_to_all_single``), the local experts run, and the outputs come back
along the same splits. :class:`AllToAll` makes the exchange differentiable: its backward is the same
exchange with the splits swapped. The lab shows this code on screen.

Everything a rank returns is plain numbers and tensors; :func:`ep_rank` compares, in the same
process, the expert-parallel forward and backward with one process running the whole model on every
rank's batch (no exchange), and counts the bytes each all-to-all sends to other ranks.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.model import ModelConfig, TinyGPT
from course_lib.model.moe import Experts, capacity, keep_mask, moe_layers, update_expert_bias

TEXT_FILES = ("README.md", "docs/ARCHITECTURE.md", "docs/TESTING.md", "docs/NOTEBOOKS.md", "docs/PLANNING.md")


# ============================================================= prediction cells
def show_prediction(what: str, mine, measured, *, unit: str = "", why: str = "") -> float | None:
    """Print the learner's prediction ``mine`` beside the ``measured`` value (in ``unit``) and the
    relative gap; never fails. Left None it says so and shows the measurement anyway. Returns the
    relative gap (mine - measured) / |measured|, or None."""
    u = f" {unit}" if unit else ""
    if mine is None:
        print(f"{what}: fill in your prediction above, then run this cell again. Measured: {measured:,}{u}")
        gap = None
    else:
        gap = (float(mine) - float(measured)) / abs(float(measured)) if measured else None
        verdict = ("spot on" if gap is not None and abs(gap) < 0.02 else
                   f"{gap:+.0%} from the measurement" if gap is not None else "measured 0")
        print(f"{what}: your prediction {mine:,}{u}, measured {measured:,}{u} ({verdict})")
    if why:
        print(f"  {why}")
    return gap


# ============================================================= data and the model
def text_tokens(root: Path | None = None) -> torch.Tensor:
    """The bytes of the kit's own prose (README and docs), as int64 token ids 0..255: real text, so the
    router has something to specialise on. moe-tiny's vocabulary is the 256 byte values."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    data = b"\n".join((root / f).read_bytes() for f in TEXT_FILES if (root / f).exists())
    if len(data) < 10_000:
        raise FileNotFoundError(f"the lab's text ({', '.join(TEXT_FILES)} under {root}) holds only {len(data)} bytes")
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
class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x`` with the given split sizes, differentiable: the
    gradient of what a rank received travels back to the ranks that sent it, along the same splits."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        back = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return back, None, None, None


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group=None):
    """Send rows sorted by global expert (``counts`` [E]: rows per expert) to the ranks holding their
    experts (rank r: experts r*E/N ... (r+1)*E/N - 1). Returns (rows here, grouped by local expert;
    rows per local expert [E/N]; what :func:`combine` needs)."""
    n = dist.get_world_size(group)
    e_local = counts.numel() // n
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)  # 1. the counts: got[s, j] rows from rank s for my expert j
    got = got.view(n, e_local)
    send, recv = counts.view(n, e_local).sum(1).tolist(), got.sum(1).tolist()
    arrived = AllToAll.apply(rows, send, recv, group)  # 2. the rows: rank 0's block first, then rank 1's ...
    blocks = torch.arange(arrived.shape[0]).split(got.flatten().tolist())
    perm = torch.cat([blocks[s * e_local + j] for j in range(e_local) for s in range(n)])
    return arrived[perm], got.sum(0), (perm, send, recv)  # 3. one block per local expert


def combine(out: torch.Tensor, state, group=None) -> torch.Tensor:
    """The experts' outputs (in :func:`dispatch`'s order) back to the ranks their rows came from, in
    the order those ranks sent them."""
    perm, send, recv = state
    arrived = torch.empty_like(out).index_copy(0, perm, out)  # undo the grouping by local expert
    return AllToAll.apply(arrived, recv, send, group)  # the same exchange, splits swapped


def ep_dispatcher(local: Experts, group=None):
    """The ``MoE.dispatcher`` of expert parallelism: ``(rows, counts, experts) -> outputs`` that runs
    ``local`` (this rank's E/N experts) on the rows every rank sends here."""
    def run(rows, counts, _all_experts):
        mine, per_expert, state = dispatch(rows, counts, group)
        return combine(local(mine, per_expert), state, group)
    return run


def _local_experts(full: Experts, rank: int, n: int) -> Experts:
    """A copy of rank ``rank``'s slice (experts rank*E/N ...) of ``full``, as its own parameters."""
    e_local = full.n_local // n
    local = Experts(e_local, full.gate.shape[2], full.gate.shape[1])
    with torch.no_grad():
        for name in ("gate", "up", "down"):
            getattr(local, name).copy_(getattr(full, name)[rank * e_local:(rank + 1) * e_local])
    return local


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
    # expert parallelism: the same weights; every MoE layer's experts replaced by this rank's slice
    ep = model(cfg)
    locals_ = []
    for m in moe_layers(ep):
        local = _local_experts(m.experts, rank, world_size)
        locals_.append(local)
        m.dispatcher = ep_dispatcher(local)
    x, y = batches[rank]
    wire.phase = "forward"
    logits, loss = ep(x, y)
    loads = [m.last_load.tolist() for m in moe_layers(ep)]
    wire.phase = "backward"
    loss.backward()
    e_local = cfg.moe_experts // world_size
    grad_err = 0.0
    for local, m in zip(locals_, moe_layers(ref)):
        for name in ("gate", "up", "down"):
            want = getattr(m.experts, name).grad[rank * e_local:(rank + 1) * e_local]
            grad_err = max(grad_err, (getattr(local, name).grad - want).abs().max().item())
    fwd = [c for c in wire.calls if c[0] == "forward"]
    # forward, per MoE layer: the counts, the dispatch's rows, the combine's rows (3 calls)
    per_layer = [{"received counts": torch.tensor(fwd[3 * i][4]).view(world_size, e_local).tolist(),
                  "dispatch splits": fwd[3 * i + 1][2], "combine splits": fwd[3 * i + 2][2],
                  "counts bytes": fwd[3 * i][3], "dispatch bytes": fwd[3 * i + 1][3],
                  "combine bytes": fwd[3 * i + 2][3]}
                 for i in range(len(locals_))]
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
