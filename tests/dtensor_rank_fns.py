"""Rank functions for tests/test_dtensor_tp.py: the DTensor TinyGPT next to the scratch one.

One launch per world size runs every case (starting ranks is the slow part). The dense model and
batch come from ``tp_rank_fns.dense_model`` (fixed seeds), so the test process rebuilds the dense
reference itself. Ranks hand back plain tensors: DTensor gradients and weights are assembled with
``full_tensor()`` on the ranks (the whole tensor, the same on every rank), scratch ones as this
rank's shard plus ``tp_partition_dim`` for the test to concatenate."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import RowwiseParallel, loss_parallel

import tp_rank_fns as tpf
from course_lib.parallel.wire import count_collectives

STEPS, LR = 3, 1e-3  # AdamW steps compared, learning rate


def mesh_of(world):
    """The explicit 1-D tensor-parallel mesh over every rank (no global mesh is set)."""
    return DeviceMesh("cpu", list(range(world)))


def _full(t):
    """A plain tensor of the whole value: DTensors assembled (collective), others cloned."""
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _dtensor_grads(model):
    """{name: (full grad, placements of the grad as text)}, ties under both names."""
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        place = str(p.grad.placements) if isinstance(p.grad, DTensor) else "plain"
        out[n] = (_full(p.grad), place)
    return out


def _scratch_grads(model):
    return {n: (None if p.grad is None else p.grad.detach().clone(), getattr(p, "tp_partition_dim", None))
            for n, p in model.named_parameters(remove_duplicate=False)}


# c10d_functional op names (what DTensor issues) -> the kit's wire-counter kinds (what scratch issues)
_KIND = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
         "reduce_scatter_tensor": "reduce-scatter"}


def _kinds(mode):
    """{kind: count} of the collectives a CommDebugMode saw (DTensor's functional collectives)."""
    return {_KIND.get(str(op).split(".")[-1], str(op)): n for op, n in mode.get_comm_counts().items()}


def _wire_kinds(wire):
    return {k: v["count"] for k, v in wire.to_dict()["by_kind"].items()}


def dtensor_forward_backward(model, idx, targets):
    """Forward + backward of a parallelized TinyGPT with the loss vocab-parallel."""
    with loss_parallel():
        logits, loss = model(idx, targets)
        loss.backward()
    return logits, loss


def model_cases(world, kinds=("gpt", "llama"), sps=(False, True)):
    """Loss, full logits and every gradient of the DTensor model and of ``tp_tinygpt``."""
    from course_lib.parallel.tensor_parallel import parallelize_tinygpt, tp_tinygpt

    mesh, out = mesh_of(world), {}
    for kind in kinds:
        for sp in sps:
            dense, idx, targets = tpf.dense_model(kind)
            dt = parallelize_tinygpt(copy.deepcopy(dense), mesh, sequence_parallel=sp)
            with loss_parallel():
                with CommDebugMode() as fwd:
                    logits, loss = dt(idx, targets)
                with CommDebugMode() as bwd:
                    loss.backward()
            scratch = tp_tinygpt(dense, sequence_parallel=sp)
            with count_collectives() as s_fwd:
                s_logits, s_loss = scratch(idx, targets)
            with count_collectives() as s_bwd:
                s_loss.backward()
                scratch.finish_gradient_synchronization()
            out[(kind, sp)] = {
                "loss": _full(loss), "logits": _full(logits), "logits_placements": str(logits.placements),
                "comm": {"fwd": _kinds(fwd), "bwd": _kinds(bwd), "scratch_fwd": _wire_kinds(s_fwd),
                         "scratch_bwd": _wire_kinds(s_bwd)},
                "grad_unlike_param": {n: (str(p.placements), str(getattr(p.grad, "placements", "plain")))
                                      for n, p in dt.named_parameters() if isinstance(p, DTensor)
                                      and str(getattr(p.grad, "placements", None)) != str(p.placements)},
                "grads": _dtensor_grads(dt), "tied": dt.lm_head.weight is dt.tok_emb.weight,
                "local_heads": (dt.blocks[0].attn.n_heads, dt.blocks[0].attn.n_kv_heads),
                "q_local_shape": tuple(dt.blocks[0].attn.q_proj.weight.to_local().shape),
                "scratch": {"loss": s_loss.detach(), "logits": s_logits.detach(), "grads": _scratch_grads(scratch)}}
    return out


def adamw_cases(world, kind="llama", sp=True):
    """STEPS AdamW steps (same batch) of the DTensor model and the scratch one: losses and weights."""
    from course_lib.parallel.tensor_parallel import parallelize_tinygpt, tp_tinygpt

    dense, idx, targets = tpf.dense_model(kind)
    dt = parallelize_tinygpt(copy.deepcopy(dense), mesh_of(world), sequence_parallel=sp)
    scratch = tp_tinygpt(dense, sequence_parallel=sp)
    opt_dt = torch.optim.AdamW(dt.parameters(), lr=LR)
    opt_s = torch.optim.AdamW(scratch.parameters(), lr=LR)
    losses, opt_comm = [], {}
    for _ in range(STEPS):
        _, loss = dtensor_forward_backward(dt, idx, targets)
        with CommDebugMode() as opt_mode:
            opt_dt.step()
        opt_comm = _kinds(opt_mode)
        opt_dt.zero_grad(set_to_none=True)
        _, s_loss = scratch(idx, targets)
        s_loss.backward()
        scratch.finish_gradient_synchronization()
        opt_s.step()
        opt_s.zero_grad(set_to_none=True)
        losses.append((_full(loss).item(), s_loss.item()))
    return {"losses": losses, "opt_comm": opt_comm,
            "weights": {n: _full(p) for n, p in dt.named_parameters()},
            "scratch_weights": {n: (p.detach().clone(), getattr(p, "tp_partition_dim", None))
                                for n, p in scratch.named_parameters()}}


def sabotage_cases(world):
    """A layout mistake the comparison must catch: every row-parallel layer declares its output
    ``Partial()`` and hands it on as a local tensor, so the reduction (Megatron's g) never happens
    and each rank carries its own partial sum."""
    from course_lib.parallel.tensor_parallel import parallelize_tinygpt, tinygpt_tp_plan

    dense, idx, targets = tpf.dense_model("gpt")
    model = copy.deepcopy(dense)
    plan = tinygpt_tp_plan(model)
    for key in ("blocks.*.attn.out_proj", "blocks.*.mlp.down"):
        plan[key] = RowwiseParallel(output_layouts=Partial())
    model = parallelize_tinygpt(model, mesh_of(world), plan=plan)
    logits, loss = dtensor_forward_backward(model, idx, targets)
    return {"loss": _full(loss), "logits": _full(logits), "grads": _dtensor_grads(model)}


def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def error_cases(world):
    """Bad input, each refused before any collective (so no rank waits on another)."""
    from course_lib.model import ModelConfig, TinyGPT
    from course_lib.parallel.tensor_parallel import parallelize_tinygpt

    mesh = mesh_of(world)
    mesh2d = DeviceMesh("cpu", torch.arange(world).reshape(1, world))
    gpt = tpf.block_cfg("gpt")
    sp_model = parallelize_tinygpt(TinyGPT(gpt), mesh, sequence_parallel=True)
    return {
        "n_heads": _message(lambda: parallelize_tinygpt(
            TinyGPT(ModelConfig(n_heads=world + 1, d_model=8 * (world + 1))), mesh)),
        "n_kv_heads": _message(lambda: parallelize_tinygpt(TinyGPT(ModelConfig(n_heads=4, n_kv_heads=1, d_model=16)),
                                                           mesh)),
        "mesh_2d": _message(lambda: parallelize_tinygpt(TinyGPT(gpt), mesh2d)),
        "mesh_type": _message(lambda: parallelize_tinygpt(TinyGPT(gpt), dist.group.WORLD)),
        "model_type": _message(lambda: parallelize_tinygpt(torch.nn.Linear(2, 2), mesh)),
        "dropout": _message(lambda: parallelize_tinygpt(TinyGPT(ModelConfig(n_heads=4, d_model=16, dropout=0.1)),
                                                        mesh)),
        "ffn": _message(lambda: parallelize_tinygpt(TinyGPT(ModelConfig(n_heads=4, d_model=16, d_ff=5)), mesh)),
        "vocab": _message(lambda: parallelize_tinygpt(TinyGPT(ModelConfig(n_heads=4, d_model=16, vocab_size=33)),
                                                      mesh)),
        "checkpointing": _message(lambda: parallelize_tinygpt(
            TinyGPT(ModelConfig(n_heads=4, d_model=16, checkpointing="full")), mesh)),
        "twice": _message(lambda: parallelize_tinygpt(sp_model, mesh)),
        "sp_seq_len": _message(lambda: sp_model(torch.zeros(1, world + 1, dtype=torch.long))),
        "sp_seq_len_kwarg": _message(lambda: sp_model(idx=torch.zeros(1, world + 1, dtype=torch.long))),
        "plan_type": _message(lambda: parallelize_tinygpt(TinyGPT(gpt), mesh, plan=["lm_head"])),
    }


def everything(rank, world_size, adamw=True, sabotage=True, errors=True):
    out = {"models": model_cases(world_size)}
    if adamw:
        # llama + SP (GQA, norms' Partial gradients) and gpt without SP (the tied embedding/head)
        out["adamw"] = {case: adamw_cases(world_size, *case) for case in (("llama", True), ("gpt", False))}
    if sabotage:
        out["sabotage"] = sabotage_cases(world_size)
    if errors:
        out["errors"] = error_cases(world_size)
    dist.barrier()
    return out


def models_only(rank, world_size):
    """The 4-rank case: model comparisons only (the rest is the same code as on 2 ranks)."""
    out = {"models": model_cases(world_size)}
    dist.barrier()
    return out
