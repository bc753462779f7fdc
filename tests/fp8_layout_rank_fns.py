"""Rank functions for tests/test_train_fp8_layouts.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_fp8_layouts(rank, world_size, runs, cases, tp_layer_cases=None, tp_model_cases=None):
    """One launch: each ``(cfg, out_dir)`` of ``runs`` trained in turn, then
    :func:`fp8_linear_under_cp` on ``cases``, :func:`fp8_mlp_under_tp` on ``tp_layer_cases`` and
    :func:`fp8_tinygpt_under_tp` on ``tp_model_cases``. Returns ``{"steps": [optimizer steps per
    run], "grouped": [per run, how many of this rank's FP8 layers were told a token group],
    "tp_fp8": [per run, how many tensor-parallel layers ran FP8], "layers": ..., "tp_layers": ...,
    "tp_model": ...}``."""
    from course_lib.precision.fp8_linear import is_fp8_layer
    from course_lib.train import train

    steps, grouped, tp_fp8 = [], [], []
    for cfg, out_dir in runs:
        result = train(cfg, out_dir)
        steps.append(result.steps)
        layers = [m for m in result.model.modules() if is_fp8_layer(m)]
        grouped.append(sum(m.token_group is not None for m in layers))
        tp_fp8.append(sum(getattr(m, "fp8_recipe", None) is not None for m in layers))
    return {"steps": steps, "grouped": grouped, "tp_fp8": tp_fp8,
            "layers": fp8_linear_under_cp(rank, world_size, cases),
            "tp_layers": fp8_mlp_under_tp(rank, world_size, tp_layer_cases or {}),
            "tp_model": fp8_tinygpt_under_tp(rank, world_size, tp_model_cases or {})}


def fp8_linear_under_cp(rank, world_size, cases):
    """One Fp8Linear on zig-zag chunks of a batch, every rank of the world one cp rank, against the
    same layer on the whole batch in this process. ``cases``: ``{name: (recipe, seq_len, reduce)}``;
    ``reduce``: whether the layer is told the cp group (set_token_group). Three steps each (delayed
    scaling's history fills), new inputs and output gradients every step. Returns, per case, the
    largest relative differences ``{"y", "dx", "dw"}`` of the last step (dW summed over the ranks,
    as the data-parallel mode of the trainer sums it over dp x cp)."""
    import torch
    import torch.distributed as dist

    from course_lib.parallel.context_parallel.in_trainer import zigzag_positions
    from course_lib.precision.fp8_linear import Fp8Linear, set_token_group

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    out = {}
    for name, (recipe, seq_len, reduce) in cases.items():
        torch.manual_seed(0)
        whole, part = (Fp8Linear(64, 96, recipe=recipe) for _ in range(2))
        part.load_state_dict(whole.state_dict())
        if reduce:
            set_token_group(part, dist.group.WORLD)
        pos = zigzag_positions(seq_len, world_size, rank)
        for _ in range(3):
            x = (torch.randn(2, seq_len, 64) * torch.rand(2, seq_len, 1) * 4).requires_grad_()
            g = torch.randn(2, seq_len, 96)
            whole.zero_grad()
            part.zero_grad()
            y_whole = whole(x)
            y_whole.backward(g)
            x_part = x.detach()[:, pos].clone().requires_grad_()
            y_part = part(x_part)
            y_part.backward(g[:, pos])
        dw = part.weight.grad.clone()
        dist.all_reduce(dw)
        out[name] = {"y": rel(y_part.detach(), y_whole.detach()[:, pos]), "dx": rel(x_part.grad, x.grad[:, pos]),
                     "dw": rel(dw, whole.weight.grad)}
    return out


def fp8_mlp_under_tp(rank, world_size, cases):
    """A column-parallel then a row-parallel FP8 layer (an MLP, 64 -> 96 -> 64, GELU between), every
    rank of the world one tp rank, against the same two dense Fp8Linear layers in this process.
    Each rank holds 48 of the 96 hidden features, so 1 x 32 and 128-wide tiles of the hidden axis
    straddle the shards. ``cases``: ``{name: (recipe, reduce)}``; ``reduce=False`` hides the split
    from the quantizer (``split_axis = None``: each rank scales with its own shard's amax and tiles,
    the layout without the tp reduction). Three steps each (delayed scaling's history fills), new
    inputs and output gradients every step. Returns, per case, the largest relative differences of
    the last step: ``h`` (the column layer's output shard), ``y`` (the MLP's output, summed over
    tp), ``dx`` (the input gradient, summed over tp by ``f``), ``dw1``/``dw2`` (this rank's shard
    of each weight gradient)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_lib.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from course_lib.precision.fp8_linear import Fp8Linear

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    group, out = dist.group.WORLD, {}
    for name, (recipe, reduce) in cases.items():
        torch.manual_seed(0)
        up, down = Fp8Linear(64, 96, recipe=recipe), Fp8Linear(96, 64, recipe=recipe)
        col = ColumnParallelLinear.from_linear(up, group, gather_output=False)
        row = RowParallelLinear.from_linear(down, group, input_is_parallel=True)
        if not reduce:
            col.split_axis = row.split_axis = None
        for _ in range(3):
            x = (torch.randn(4, 16, 64) * torch.rand(4, 16, 1) * 4).requires_grad_()
            g = torch.randn(4, 16, 64)
            for layer in (up, down, col, row):
                layer.zero_grad()
            h_dense = up(x)
            y_dense = down(F.gelu(h_dense))
            y_dense.backward(g)
            x_tp = x.detach().clone().requires_grad_()
            h_tp = col(x_tp)  # f inside: the input gradient is summed over tp
            y_tp = row(F.gelu(h_tp))
            y_tp.backward(g)
        cols = slice(rank * 48, (rank + 1) * 48)
        out[name] = {"h": rel(h_tp.detach(), h_dense.detach()[..., cols]), "y": rel(y_tp.detach(), y_dense.detach()),
                     "dx": rel(x_tp.grad, x.grad), "dw1": rel(col.weight.grad, up.weight.grad[cols]),
                     "dw2": rel(row.weight.grad, down.weight.grad[:, cols])}
    return out


def fp8_tinygpt_under_tp(rank, world_size, cases):
    """The trainer's FP8 tensor-parallel model without autocast: the tiny TinyGPT (vocabulary 64,
    sequences of 64), its Linear layers converted by the kit (lm_head kept, fp32 everywhere else),
    cut by ``tp_tinygpt`` over the world, one forward and backward of a batch of 4, against the
    dense FP8 model in this process. ``cases``: ``{name: (recipe, sequence_parallel, reduce)}``;
    ``reduce=False``: every TP layer's ``split_axis = None`` (each rank's own amaxes and tiles).
    Returns, per case, the loss's relative difference, the largest relative difference of a weight
    gradient (this rank's shard of every FP8 layer's; the vocab-parallel loss hands the blocks a
    gradient that differs from the dense one by fp32 rounding, which FP8 rounding of the gradients
    can amplify), and how many of this rank's layers ran FP8."""
    import torch

    from course_lib.model import ModelConfig, TinyGPT
    from course_lib.parallel.tensor_parallel.gpt import tp_tinygpt
    from course_lib.precision.fp8_linear import is_fp8_layer
    from course_lib.precision.fp8_model import convert_for_training

    out = {}
    for name, (recipe, sp, reduce) in cases.items():
        torch.manual_seed(0)
        dense = TinyGPT(ModelConfig.preset("tiny", vocab_size=64, block_size=64))
        convert_for_training(dense, recipe=recipe, backend="kit")
        tp = tp_tinygpt(dense, None, sequence_parallel=sp)
        layers = {n: m for n, m in tp.named_modules() if is_fp8_layer(m)}
        if not reduce:
            for m in layers.values():
                m.split_axis = None
        idx = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
        targets = torch.roll(idx, -1, 1)
        _, loss_dense = dense(idx, targets)
        loss_dense.backward()
        _, loss_tp = tp(idx, targets)
        loss_tp.backward()
        tp.finish_gradient_synchronization()
        grads = []
        for n, m in layers.items():
            full = dense.get_submodule(n).weight.grad
            part = m.weight.tp_partition_dim
            want = full.chunk(world_size, dim=part)[rank]
            grads.append(((m.weight.grad - want).abs().max() / want.abs().max()).item())
        out[name] = {"loss": abs(loss_tp.item() - loss_dense.item()) / loss_dense.item(), "dw": max(grads),
                     "fp8_layers": len(layers)}
    return out
