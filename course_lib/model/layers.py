"""Building blocks of TinyGPT: norms, rotary positions, attention, MLPs and the transformer block.

Read `course_lib/model/tinygpt.py` first; it says which switch picks which block. Everything here is plain
PyTorch so a learner can read the math directly. Shapes use B = batch, T = sequence length,
H = query heads, Hkv = key/value heads, D = head dimension, C = model width (H * D).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from course_lib.model.moe import MoE


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): x / rms(x) * weight, no mean subtraction and no bias.

    The statistics are computed in float32 even when the input is bf16/fp16, because a mean of
    squares over thousands of channels loses most of its digits in 8 mantissa bits.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def make_norm(kind: str, dim: int, *, bias: bool, eps: float) -> nn.Module:
    """`layernorm` (GPT-2; bias optional) or `rmsnorm` (Llama). `dim` is the channel count."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_len, head_dim], for rotary position embeddings.

    Channel pair (i, i + D/2) rotates at frequency theta^(-2i/D) ("rotate-half" layout, as in
    GPT-NeoX and Hugging Face Llama; Meta's reference interleaves pairs instead - same math, the
    channels are only permuted).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] by position: x*cos + rotate_half(x)*sin, tables [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def sliding_window_mask(seq_len: int, window: int, device: torch.device | str) -> torch.Tensor:
    """Boolean [T, T] mask, True where query i may attend key j: i - window < j <= i.

    A window of w lets every token see itself and the w - 1 tokens before it (the Mistral /
    Hugging Face convention). With w >= T it is exactly the full causal mask.
    """
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    return (j <= i) & (j > i - window)


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query heads, RoPE and a sliding window.

    q has H heads, k and v have Hkv heads each. With Hkv < H each k/v head is shared by H / Hkv
    query heads (grouped-query attention); Hkv == H is ordinary multi-head attention and Hkv == 1
    is multi-query attention. q, k, v are separate projections (not one fused qkv matrix) so that
    tensor parallelism can shard each column-wise by heads; head counts are read from the tensor
    shapes in forward, so a sharded module with fewer local heads works unchanged.
    """

    #: None: the dense ``core`` below. Context parallelism sets a callable with the same signature
    #: (ring attention over the cp group; course_lib.parallel.context_parallel.in_trainer).
    cp_core = None

    def __init__(self, cfg) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim  # d_model // n_heads unless attn_head_dim is set
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=cfg.bias)
        self.out_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.out_proj.is_residual_projection = True  # read by the init schemes
        self.dropout = cfg.dropout
        self.window = cfg.attention_window
        self.use_rope = cfg.position == "rope"
        # Set by TinyGPT.set_memory_strategy: recompute the attention core in backward.
        self.recompute_core = False
        self._mask_cache: dict[tuple[int, str], torch.Tensor] = {}

    def _mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, str(device))
        if key not in self._mask_cache:  # the mask depends only on T: build it once per length
            self._mask_cache[key] = sliding_window_mask(seq_len, self.window, device)
        return self._mask_cache[key]

    def core(self, q, k, v, cos, sin):
        """softmax(q k^T / sqrt(D) + mask) v for q [B,H,T,D], k/v [B,Hkv,T,D]; returns [B,H,T,D].

        Kept separate so that selective checkpointing can recompute exactly this part: its saved
        tensors (rotated q/k, the expanded k/v, the attention statistics) are the ones that grow
        with heads and sequence length, while the inputs q, k, v are all it needs to keep.
        """
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)  # query head h reads k/v head h // group
            v = v.repeat_interleave(group, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        if self.window is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        mask = self._mask(q.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        core = self.core if self.cp_core is None else self.cp_core
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(core, q, k, v, cos, sin, use_reentrant=False)
        else:
            y = core(q, k, v, cos, sin)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return F.dropout(self.out_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """GPT-2 MLP: Linear(C, F) -> GELU (tanh approximation, as GPT-2 used) -> Linear(F, C)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.down.is_residual_projection = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.down(F.gelu(self.up(x), approximate="tanh")), self.dropout, self.training)


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)); three matrices, so F is ~2/3 of the GELU width."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.down.is_residual_projection = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.down(F.silu(self.gate(x)) * self.up(x)), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)). ``layer`` (0-based)
    picks a mixture-of-experts MLP where ``cfg.is_moe_layer(layer)`` (course_lib/model/moe.py)."""

    def __init__(self, cfg, layer: int = 0) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, eps=cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg)
        else:
            self.mlp = SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def init_linear_(module: nn.Linear, scheme: str, std: float, residual_std: float, d_model: int) -> None:
    """Initialise one Linear in place according to `scheme` (see TinyGPT's docstring)."""
    w = module.weight
    residual = getattr(module, "is_residual_projection", False)
    if scheme == "kaiming":
        # The usual tutorial snippet: He-normal with fan_in and the ReLU gain, i.e. std = sqrt(2 / fan_in).
        nn.init.kaiming_normal_(w, mode="fan_in", nonlinearity="relu")
    elif scheme == "xavier":
        nn.init.xavier_uniform_(w)  # U(-a, a), a = sqrt(6 / (fan_in + fan_out))
    elif scheme == "small":
        nn.init.normal_(w, 0.0, math.sqrt(2.0 / (5.0 * d_model)))  # "small init", std = sqrt(2/(5C))
    elif residual and scheme == "zero_out_proj":
        nn.init.zeros_(w)  # every block starts as the identity map
    elif residual and scheme == "scaled_residual":
        nn.init.normal_(w, 0.0, residual_std)
    else:  # "normal", and the non-residual matrices of the residual-aware schemes
        nn.init.normal_(w, 0.0, std)
    if module.bias is not None:
        nn.init.zeros_(module.bias)
