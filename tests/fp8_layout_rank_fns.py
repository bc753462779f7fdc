"""Rank functions for tests/test_train_fp8_layouts.py (importable: run_ranks spawns fresh processes)."""
from __future__ import annotations


def train_fp8_layouts(rank, world_size, runs, cases):
    """One launch: each ``(cfg, out_dir)`` of ``runs`` trained in turn, then
    :func:`fp8_linear_under_cp` on ``cases``. Returns ``{"steps": [optimizer steps per run],
    "grouped": [per run, how many of this rank's FP8 layers were told a token group], "layers": ...}``."""
    from course_lib.precision.fp8_linear import Fp8Linear
    from course_lib.train import train

    steps, grouped = [], []
    for cfg, out_dir in runs:
        result = train(cfg, out_dir)
        steps.append(result.steps)
        grouped.append(sum(m.token_group is not None for m in result.model.modules() if isinstance(m, Fp8Linear)))
    return {"steps": steps, "grouped": grouped, "layers": fp8_linear_under_cp(rank, world_size, cases)}


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
