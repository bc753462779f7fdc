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


def rope_tables(head_dim: int, max_len: int, theta: float,
                linear_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_len, head_dim], for rotary position embeddings.

    Channel pair (i, i + D/2) rotates at frequency theta^(-2i/D) ("rotate-half" layout, as in
    GPT-NeoX and Hugging Face Llama; Meta's reference interleaves pairs instead - same math, the
    channels are only permuted). ``linear_factor`` > 1 divides every frequency by it (linear
    scaling / position interpolation: position p turns as p / factor would).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
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
        # QK-norm (ModelConfig.qk_norm): one RMSNorm over the head dimension, shared by the heads
        # (Qwen3's q_norm / k_norm), applied before RoPE. None: off.
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.softcap = cfg.attn_logit_softcap
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
        if self.softcap is not None:
            return self._capped_core(q, k, v, dropout_p)
        if self.window is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        mask = self._mask(q.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    def _capped_core(self, q, k, v, dropout_p: float) -> torch.Tensor:
        """Attention with soft-capped scores (Gemma 2): s = cap * tanh(q k^T / sqrt(D) / cap), then
        the causal (or window) mask and softmax. Written out: SDPA has no hook between the scores
        and the softmax. The [B, H, T, T] scores are materialised, so this path is for small T."""
        T = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = self.softcap * torch.tanh(scores / self.softcap)
        allowed = (self._mask(T, q.device) if self.window is not None
                   else torch.ones(T, T, dtype=torch.bool, device=q.device).tril())
        att = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), dim=-1).to(q.dtype)
        return F.dropout(att, dropout_p, self.training) @ v

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        if self.q_norm is not None:  # per head, over D: |q| and |k| are pinned to ~sqrt(D) * weight
            q, k = self.q_norm(q), self.k_norm(k)
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
    """Llama MLP: down(silu(gate(x)) * up(x)); three matrices, so F is ~2/3 of the GELU width.

    ``smooth=True`` is Smooth-SwiGLU (Fishman et al. 2024, "Scaling FP8 training to trillion-token
    LLMs"). Late in long runs the gate and up weights of a channel can align, and silu(g) * u then
    grows like a square: a few channels of the down projection's input carry outliers hundreds of
    times the rest, and one per-tensor FP8 scale sized for them flushes every other channel to
    zero. Smooth-SwiGLU divides each channel h_i by s_i = max over the batch's tokens of |h_i| (a
    constant, no gradient) and multiplies column i of the down weight by s_i:
    down(h) = (W diag(s)) (h / s) + b. The function and its gradients are unchanged (up to
    rounding); what changes is that the down GEMM's input lies in [-1, 1] in every channel, so an
    FP8 cast of it loses nothing to one outlier channel.
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.down.is_residual_projection = True
        self.dropout = cfg.dropout
        self.smooth = cfg.smooth_swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.up(x)
        if self.smooth:
            s = smooth_scale(h)
            y = F.linear(h / s, self.down.weight * s, self.down.bias)
        else:
            y = self.down(h)
        return F.dropout(y, self.dropout, self.training)


def smooth_scale(h: torch.Tensor) -> torch.Tensor:
    """Smooth-SwiGLU's per-channel scale of ``h`` [..., F]: max |h| over every token, shape [F],
    detached (a constant, as an FP8 scale is), a channel that is all zero given 1 (nothing to scale)."""
    s = h.detach().abs().amax(dim=tuple(range(h.dim() - 1)))
    return torch.where(s > 0, s, torch.ones_like(s))


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
