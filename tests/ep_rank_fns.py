"""Rank functions and one-process references for tests/test_expert_parallel.py.

One 4-rank launch runs every check: EP 4 (one group of 4) and EP 2 (two groups of 2, each expert
slice held twice: expert-data-parallel 2). Every rank builds the same weights and the same global
data from seeds and uses its own share; the references run the whole thing on one process."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from course_lib.model import ModelConfig, TinyGPT
from course_lib.model import moe as moe_lib
from course_lib.parallel import expert_parallel as ep_lib
from course_lib.parallel.wire import count_collectives

WORLD, TOKENS, STEPS = 4, 12, 3
# expert 0 preferred, experts 5 and 6 never chosen (empty on every rank): uneven routing
SKEW = torch.tensor([1.0, 0.3, 0.0, 0.0, 0.0, -10.0, -10.0, 0.0])
LAYER_CASES = {
    "dropless": dict(),
    "dropped": dict(moe_capacity_factor=0.75),  # dropped tokens on top of the skew
    "shared-sigmoid": dict(moe_score="sigmoid", moe_shared_experts=1, moe_route_scale=2.5),
}


def layer_cfg(case: str) -> ModelConfig:
    return ModelConfig.preset("moe-tiny", d_model=16, n_heads=2, moe_experts=8, moe_top_k=2, moe_ffn_dim=8,
                              moe_bias_update_rate=0.01, **LAYER_CASES[case])


def layer_and_data(case: str):
    """The MoE layer (skewed by its selection bias), every rank's tokens and output gradients."""
    cfg = layer_cfg(case)
    torch.manual_seed(0)
    m = moe_lib.MoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    m.router.expert_bias.copy_(SKEW)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD, TOKENS, cfg.d_model, generator=g)
    dy = torch.randn(WORLD, TOKENS, cfg.d_model, generator=g)
    return m, x, dy


def layer_reference(case: str) -> dict:
    """Every rank's tokens through the whole layer on one process: outputs, summed gradients."""
    m, x, dy = layer_and_data(case)
    x.requires_grad_()
    outs = [m(x[r]) for r in range(WORLD)]
    sum((o * dy[r]).sum() for r, o in enumerate(outs)).backward()
    return {"out": torch.stack([o.detach() for o in outs]), "dx": x.grad,
            **{n: p.grad.clone() for n, p in m.named_parameters()}}


def model_cfg() -> ModelConfig:
    return ModelConfig.preset("moe-tiny", vocab_size=64, block_size=16, d_model=16, n_heads=2, n_kv_heads=1,
                              moe_experts=8, moe_ffn_dim=8, moe_capacity_factor=1.0, moe_aux_loss_coef=0.01,
                              moe_bias_update_rate=0.01)


def batches():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (STEPS, WORLD, 2, 16), generator=g)
    return x, torch.roll(x, -1, dims=-1)


def train_reference() -> dict:
    """STEPS AdamW steps on one process, the mean loss over the WORLD batches each step."""
    torch.manual_seed(0)
    model = TinyGPT(model_cfg()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batches()
    losses = []
    for s in range(STEPS):
        loss = sum(model(x[s, r], y[s, r])[1] for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
        moe_lib.update_expert_bias(model)  # the step's loads: every batch's, summed
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _layer_check(rank: int, ep: ep_lib.EPGroup, case: str) -> dict:
    m, x, dy = layer_and_data(case)
    disp = ep_lib.shard_experts(m, ep)[0]
    h = x[rank].clone().requires_grad_()  # as in a model: the layer's input has a gradient
    with torch.no_grad():  # the routing, redone here to predict the traffic
        r = m.router(h)
        cap = None if m.capacity_factor is None else moe_lib.capacity(TOKENS, 2, 8, m.capacity_factor)
        keep = moe_lib.keep_mask(r.experts, r.weights, 8, cap, m.drop_policy)
        counts = torch.bincount(r.experts[keep], minlength=8)
    send = counts.view(ep.size, -1).sum(1).tolist()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, send)
    group_start = rank - ep.rank
    recv = [everyone[group_start + q][ep.rank] for q in range(ep.size)]
    with count_collectives() as wire:
        out = m(h)
        (out * dy[rank]).sum().backward()
    # expert gradients: summed over the EP group by the combine's backward, then over expert-DP;
    # the router (and shared experts): over every rank, as data parallelism would
    for p in m.parameters():
        if ep_lib.is_expert(p):
            if ep.edp_group is not None:
                dist.all_reduce(p.grad, group=ep.edp_group)
        else:
            dist.all_reduce(p.grad)
    a2a = wire.by_kind().get("all-to-all", {})
    return {"out": out.detach(), "dx": h.grad, "dropped": m.last_dropped, "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
            "local": list(ep.local_experts(8)), "send": send, "recv": recv,
            "measured": ep_lib.measured_bytes(disp.log, ep.rank),
            "expected": ep_lib.expected_bytes(send, recv, ep.rank, 8 // ep.size, 16, 4),
            "wire_payload": a2a.get("payload_bytes"), "wire_count": a2a.get("count"),
            "counts_sent": counts.tolist()}


def _train_check(rank: int, ep: ep_lib.EPGroup) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(model_cfg()).train()
    ep_lib.shard_experts(model, ep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batches()
    losses = []
    for s in range(STEPS):
        loss = model(x[s, rank], y[s, rank])[1]
        loss.backward()
        ep_lib.sync_gradients(model, ep)
        opt.step()
        opt.zero_grad()
        moe_lib.update_expert_bias(model, ep_lib.all_reduce_load)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return {"losses": losses, "state": ep_lib.gather_experts(model, ep)}


def _trainer_run(cfg: dict, out_dir) -> dict:
    """The trainer on these ranks (FSDP2 over 4: no buffer broadcast, so the expert biases stay
    equal only if every rank sums the same loads): each rank's biases after the run."""
    from course_lib.train import train

    result = train(cfg, out_dir)
    return {"steps": result.steps, "loss": result.final_loss,
            "bias": [m.router.expert_bias.detach().clone() for m in moe_lib.moe_layers(result.model)]}


def ep_everything(rank: int, world_size: int, trainer_cfg: dict | None = None, out_dir=None) -> dict:
    """Every EP check of the test file, for EP 4 and EP 2, on this rank; then the trainer run."""
    torch.set_num_threads(1)
    out = {}
    if trainer_cfg is not None:
        out["trainer"] = _trainer_run(trainer_cfg, out_dir)
    for size in (4, 2):
        ep = ep_lib.make_ep_group(size)
        for case in LAYER_CASES:
            out[(size, case)] = _layer_check(rank, ep, case)
        out[(size, "train")] = _train_check(rank, ep)
    return out
