"""Training FLOPs, model FLOPs utilization (MFU) and time to train.

Sources:
- "6n": C = 6N FLOPs per token for forward + backward (Kaplan et al. 2020, Sec. 2.1).
- "palm": 6N + 12 L H Q T per token, the attention term added (Chowdhery et al. 2022, PaLM,
  Appendix B); nanoGPT's `estimate_mfu` uses it with N excluding the position table.
- Per iteration: 72 B s l h^2 (1 + s/6h + V/12lh) model FLOPs and, with full activation
  recomputation, 96 B s l h^2 (1 + s/6h + V/16lh) (Narayanan et al. 2021, Sec. 5.1 / Appendix;
  Korthikanti et al. 2022, Sec. 6 distinguishes model FLOPs from hardware FLOPs).
- MFU = achieved model FLOP/s / peak FLOP/s (PaLM Sec. 4.1 / Appendix B).
- Training time = k N T / (n X) with k = 6 (model FLOPs) or 8 (full recompute; Narayanan Sec. 5.1).

All FLOP counts are floating-point operations (a multiply-add is 2), not FLOP/s, unless named.
"""

from __future__ import annotations

from course_lib.validate import check_choice, check_count, check_int, check_number
from .shapes import ModelShape

FORMULAS = ("6n", "palm", "narayanan")
PARAM_COUNTS = ("all", "no-position", "non-embedding")
SECONDS_PER_DAY = 86_400


def _check_shape(shape) -> ModelShape:
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape, got {type(shape).__name__}")
    return shape


def palm_flops_per_token(num_params, *, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """PaLM Appendix B: 6N + 12 L H Q T training FLOPs per token (forward + backward, no recompute).

    N = parameters, L = layers, H = heads, Q = head dimension, T = sequence length. The second
    term is the attention score work (QK^T and attention x V), which 6N leaves out. FLOPs.
    """
    check_count("num_params", num_params)
    for name, value in (("n_layers", n_layers), ("n_heads", n_heads), ("head_dim", head_dim),
                        ("seq_len", seq_len)):
        check_int(name, value, 1)
    return 6 * num_params + 12 * n_layers * n_heads * head_dim * seq_len


def _counted_params(shape: ModelShape, params: str) -> int:
    check_choice("params", params, PARAM_COUNTS)
    n = shape.num_params()
    if params == "no-position":  # nanoGPT: the tied token table is also the output matmul
        return n - shape.position_params()
    if params == "non-embedding":  # Kaplan et al.: no token or position tables
        return n - shape.embedding_params()
    return n


def flops_per_token(shape: ModelShape, *, formula: str = "6n", params: str = "all") -> float:
    """Training FLOPs per token (forward + backward) for `shape` at its `seq_len`.

    `formula`: "6n" (Kaplan), "palm" (6N + 12LHQT, PaLM App. B) or "narayanan" (the matmul count
    of `model_flops_per_iteration` divided by the tokens of one sequence). `params` picks N for
    6n/palm: "all" (every parameter), "no-position" (nanoGPT: without the learned position table),
    "non-embedding" (Kaplan: without token and position tables). FLOPs (not FLOP/s).
    """
    _check_shape(shape)
    check_choice("formula", formula, FORMULAS)
    n = _counted_params(shape, params)
    if formula == "6n":
        return 6.0 * n
    if formula == "palm":
        return float(palm_flops_per_token(n, n_layers=shape.n_layers, n_heads=shape.n_heads,
                                          head_dim=shape.head_dim, seq_len=shape.seq_len))
    return model_flops_per_iteration(shape, batch=1) / shape.seq_len


def _layer_forward_flops(shape: ModelShape, batch: int, seq_len: int) -> tuple[float, float]:
    """(matmul FLOPs of one layer's forward except attention scores, score FLOPs)."""
    b, s, h, f = batch, seq_len, shape.d_model, shape.ffn_dim
    kv_dim = shape.kv_heads * shape.head_dim
    mlp_mats = 2 if shape.mlp == "gelu" else 3
    projections = 2 * b * s * (h * (h + 2 * kv_dim) + h * h + mlp_mats * h * f)  # qkv, o, MLP
    scores = 4 * b * s * s * h  # QK^T and attention x V, 2 b s^2 h each
    return projections, scores


def model_flops_per_iteration(shape: ModelShape, *, batch: int, recompute=False,
                              seq_len: int | None = None) -> float:
    """FLOPs of one training iteration over `batch` sequences (matmuls only, as Narayanan et al.).

    Forward of a layer: 2bs(h(h + 2 kv_dim) + h^2 + k h d_ff) + 4bs^2h (k = 2 matrices for GELU,
    3 for SwiGLU); logits 2bshV; backward = 2 x forward. For a GPT shape (d_ff = 4h, MHA) this is
    exactly 72 B s l h^2 (1 + s/6h + V/12lh) - the *model* FLOPs MFU uses. `recompute` gives the
    *hardware* FLOPs: True / "full" adds one more forward of every layer (Narayanan eq. 3:
    96 B s l h^2 (1 + s/6h + V/16lh)); "selective" adds one forward of the attention-score matmuls
    (4bs^2h per layer; our derivation - Korthikanti et al. account it their own way).
    False / "none" = model FLOPs. Norms, softmax, biases and the optimizer step are not counted.
    """
    _check_shape(shape)
    check_int("batch", batch, 1)
    s = shape.seq_len if seq_len is None else check_int("seq_len", seq_len, 1)
    # Booleans are the contract's form (True = full recomputation); strings name the mode.
    mode = {True: "full", False: "none"}[recompute] if isinstance(recompute, bool) else recompute
    check_choice("recompute", mode, ("none", "selective", "full"))
    projections, scores = _layer_forward_flops(shape, batch, s)
    layer_fwd = projections + scores
    logits = 2 * batch * s * shape.d_model * shape.vocab_size
    total = 3 * (shape.n_layers * layer_fwd + logits)
    if mode == "full":
        total += shape.n_layers * layer_fwd
    elif mode == "selective":
        total += shape.n_layers * scores
    return float(total)


def mfu(tokens_per_second: float, flops_per_token: float, *, n_devices: int,
        peak_flops_per_device: float) -> float:
    """Model FLOPs utilization, a fraction in [0, 1] for a feasible run (PaLM Sec. 4.1, App. B).

    = tokens_per_second x flops_per_token / (n_devices x peak_flops_per_device). Use *model*
    FLOPs per token (no recomputation) for MFU; passing hardware FLOPs gives HFU instead.
    `peak_flops_per_device` is dense FLOP/s of the precision used (see hardware.ACCELERATORS).
    """
    check_number("tokens_per_second", tokens_per_second, 0)
    check_number("flops_per_token", flops_per_token, 0)
    check_int("n_devices", n_devices, 1)
    check_number("peak_flops_per_device", peak_flops_per_device, 0, lo_open=True)
    return tokens_per_second * flops_per_token / (n_devices * peak_flops_per_device)


def training_days(tokens, num_params, *, n_devices: int, achieved_flops_per_device: float,
                  flops_per_param_per_token: float = 6.0) -> float:
    """Days of wall-clock time to train `num_params` parameters on `tokens` tokens.

    = flops_per_param_per_token x N x T / (n_devices x achieved FLOP/s) / 86400. The default 6 is
    the model-FLOPs count (Kaplan); 8 adds full activation recomputation, as Narayanan et al. 2021
    (Sec. 5.1) do for their 34-day GPT-3 and 84-day 1T estimates. `achieved_flops_per_device` is
    the sustained FLOP/s per device (peak x MFU), not the peak. Returns days (float).
    """
    check_number("tokens", tokens, 0)
    check_count("num_params", num_params)
    check_int("n_devices", n_devices, 1)
    check_number("achieved_flops_per_device", achieved_flops_per_device, 0, lo_open=True)
    check_number("flops_per_param_per_token", flops_per_param_per_token, 0, lo_open=True)
    seconds = flops_per_param_per_token * num_params * tokens / (n_devices * achieved_flops_per_device)
    return seconds / SECONDS_PER_DAY
