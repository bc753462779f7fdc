"""Measured counterparts of `course_lib.estimate`: what a step really allocates, and how fast it runs.

| measured here | function | checks the estimator |
| --- | --- | --- |
| bytes autograd saves for backward | `saved_activation_bytes` | `estimate.activation_bytes_per_layer` |
| parameter / gradient / optimizer-state bytes | `model_state_bytes_allocated` | `estimate.model_state_bytes` |
| CUDA peak memory of a step (GPU only) | `cuda_peak_memory` | state + activations |
| the CPU's own matmul peak, FLOP/s | `cpu_matmul_peak_flops` | `estimate.ACCELERATORS` (datasheets) |
| seconds per step, tokens per second | `StepTimer`, `time_steps` | `estimate.mfu` |
| TinyGPT: estimate vs measure, per component | `compare_tinygpt_activations` | all of the above |

Why saved-tensor hooks and not the allocator: on a CPU there is no peak-memory counter, and the
profiler's memory events do not add up (shared/CPU-DISTRIBUTED.md). A pack hook sees every tensor
autograd keeps for backward; counting each *storage* once (views share one) and skipping the
model's own parameters and buffers (they exist whether or not autograd saves them) gives exactly
the bytes the activation estimator predicts - the same on every repeat, on any device.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from course_lib.validate import check_int, check_number


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


# ------------------------------------------------------------------------------ saved activations
@dataclass(frozen=True)
class SavedActivations:
    """Bytes of tensors autograd saved for backward during one forward (each storage once).

    `by_module`: bytes per module name, attributed to the innermost module running when the
    storage was *first* saved ("" = the top level; with non-reentrant checkpointing a checkpointed
    block's input is saved by the checkpoint call, i.e. by the caller). `by_dtype`: bytes per dtype.
    """

    total_bytes: int
    n_storages: int
    n_saved_tensors: int
    by_module: dict = field(default_factory=dict)
    by_dtype: dict = field(default_factory=dict)
    unit: str = "bytes"

    def module_bytes(self, prefix: str) -> int:
        """Bytes attributed to module `prefix` and its submodules (`"blocks.1"`, `"blocks.1.attn"`;
        `""` is the whole forward)."""
        if prefix == "":
            return self.total_bytes
        return sum(v for k, v in self.by_module.items() if k == prefix or k.startswith(prefix + "."))


def saved_activation_bytes(fn: Callable, *args, skip: tuple = (), **kwargs) -> SavedActivations:
    """Run `fn(*args, **kwargs)` once and count the bytes autograd saves for its backward.

    `fn` is a module or any callable (`lambda: model(x, y)[1]`). Each saved storage counts once at
    its full `nbytes()` (a view saves its whole storage alive). Storages of `fn`'s parameters and
    buffers (when `fn` is an `nn.Module`) and of the tensors in `skip` are not counted: they are
    model state, not activations (pass `skip=tuple(model.parameters()) + tuple(model.buffers())`
    when `fn` is a lambda). The forward's output is dropped, so its graph is freed on return.
    Grad mode must be on; the caller's own saved-tensor hooks are overridden for the call.
    Returns SavedActivations (bytes).
    """
    if not callable(fn):
        raise TypeError(f"fn must be an nn.Module or a callable, got {type(fn).__name__}")
    if not torch.is_grad_enabled():
        raise RuntimeError("saved_activation_bytes needs grad mode: under torch.no_grad() autograd "
                           "saves nothing, so there would be nothing to count")
    state = list(skip)
    if isinstance(fn, nn.Module):
        state += list(fn.parameters()) + list(fn.buffers())
    for t in state:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"skip must hold tensors, got {type(t).__name__}")
    skipped = {_storage_key(t) for t in state}

    stack, handles = [""], []
    if isinstance(fn, nn.Module):
        names = {m: n for n, m in fn.named_modules()}

        def push(module, _args):
            stack.append(names[module])

        def pop(module, _args, _out):
            stack.pop()

        for module in names:
            handles.append(module.register_forward_pre_hook(push))
            handles.append(module.register_forward_hook(pop, always_call=True))

    seen: dict = {}  # storage key -> the storage itself (kept alive: no address reuse mid-forward)
    by_module, by_dtype, n_saved = Counter(), Counter(), [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        n_saved[0] += 1
        key = _storage_key(t)
        if key not in skipped and key not in seen:
            seen[key] = t.untyped_storage()
            by_module[stack[-1]] += key[2]
            by_dtype[str(t.dtype).removeprefix("torch.")] += key[2]
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*args, **kwargs)
        del out
    finally:
        for h in handles:
            h.remove()
    return SavedActivations(sum(k[2] for k in seen), len(seen), n_saved[0], dict(by_module), dict(by_dtype))


# ------------------------------------------------------------------------------ model state
@dataclass(frozen=True)
class AllocatedState:
    """Bytes of model state actually allocated, each storage counted once (a tied matrix once).

    `optimizer` is every tensor in the optimizer's state; `optimizer_scalars` the part held in
    one-element tensors (AdamW's per-parameter `step` counters: 4 B per parameter *tensor*), which
    the closed forms leave out; `optimizer_moments` is the rest.
    """

    params: int
    grads: int
    optimizer: int
    optimizer_scalars: int
    num_params: int
    unit: str = "bytes"

    @property
    def optimizer_moments(self) -> int:
        """Optimizer state without one-element tensors, bytes (AdamW: exp_avg + exp_avg_sq)."""
        return self.optimizer - self.optimizer_scalars

    @property
    def total(self) -> int:
        """params + grads + optimizer, bytes."""
        return self.params + self.grads + self.optimizer


def model_state_bytes_allocated(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> AllocatedState:
    """Walk `model`'s parameters, their `.grad`s and `optimizer.state`; count each storage once.

    Gradients count only where allocated (`None` after `zero_grad(set_to_none=True)` costs 0);
    optimizer state exists only after the first `optimizer.step()` (lazy init). Storage bytes, so a
    parameter that is a view into a flat buffer counts the buffer once. Returns AllocatedState.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    seen: set = set()

    def add(t: torch.Tensor) -> int:
        key = _storage_key(t)
        if key in seen:
            return 0
        seen.add(key)
        return key[2]

    params = list(model.parameters())  # parameters() already yields a tied parameter once
    p_bytes = sum(add(p) for p in params)
    g_bytes = sum(add(p.grad) for p in params if p.grad is not None)
    o_bytes = o_scalar = 0
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    n = add(value)
                    o_bytes += n
                    o_scalar += n if value.numel() == 1 else 0
    return AllocatedState(p_bytes, g_bytes, o_bytes, o_scalar, sum(p.numel() for p in params))


# ------------------------------------------------------------------------------ CUDA peak
class CudaUnavailableError(RuntimeError):
    """CUDA memory statistics were asked for on a machine without a usable CUDA device."""


@dataclass(frozen=True)
class CudaPeak:
    """`torch.cuda.max_memory_allocated` around one call: bytes on that device.

    `before`: allocated when the call started (weights, optimizer state, ...); `peak`: the
    highest allocated during the call; `step_peak = peak - before`: what the call itself added.
    """

    before: int
    peak: int
    after: int
    device: str
    unit: str = "bytes"

    @property
    def step_peak(self) -> int:
        """Peak bytes the call added on top of what was already allocated."""
        return self.peak - self.before


def cuda_peak_memory(step_fn: Callable[[], object], device=None) -> CudaPeak:
    """Run `step_fn()` once and report CUDA allocated bytes before, at the peak and after.

    Resets the peak counter first and synchronizes before reading. Raises CudaUnavailableError,
    saying what to use instead, when torch has no CUDA device (CPU-only build or no GPU).
    """
    if not torch.cuda.is_available():
        raise CudaUnavailableError(
            "CUDA peak memory needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). On a CPU count what a step keeps instead: "
            "saved_activation_bytes() for activations and model_state_bytes_allocated() for "
            "parameters, gradients and optimizer state.")
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    step_fn()
    torch.cuda.synchronize(dev)
    return CudaPeak(before, torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev), str(dev))


# ------------------------------------------------------------------------------ FLOP/s and time
@dataclass(frozen=True)
class MatmulPeak:
    """Best measured dense matmul throughput: `flops_per_second` (FLOP/s) for n x n x n in `dtype`."""

    flops_per_second: float
    n: int
    dtype: str
    threads: int
    best_seconds: float
    unit: str = "FLOP/s"


def cpu_matmul_peak_flops(n: int = 1024, *, dtype: torch.dtype = torch.float32, repeats: int = 5,
                          min_seconds: float = 0.05) -> MatmulPeak:
    """The CPU's own matmul peak: the fastest of `repeats` timings of n x n @ n x n (2 n^3 FLOPs).

    Each timing loops the matmul until at least `min_seconds` have passed and divides. The best
    timing, not the mean: other processes only ever slow a run down. Uses torch's current thread
    count (`torch.get_num_threads()`). This is the denominator for MFU *on this CPU*; a datasheet
    peak (estimate.ACCELERATORS) is the denominator on a GPU. Returns MatmulPeak (FLOP/s).
    """
    check_int("n", n, 16)  # smaller matmuls time thread start-up, not arithmetic
    check_int("repeats", repeats, 1)
    check_number("min_seconds", min_seconds, 0, lo_open=True)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: first call pays for thread-pool start and packing buffers
    best = float("inf")
    for _ in range(repeats):
        calls, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / calls)
    return MatmulPeak(2 * n**3 / best, n, str(dtype).removeprefix("torch."), torch.get_num_threads(), best)


@dataclass(frozen=True)
class Throughput:
    """Step timings: `seconds` per timed step; medians are robust to one slow step."""

    seconds: tuple
    tokens_per_step: int | None = None

    @property
    def seconds_per_step(self) -> float:
        """Median seconds per step."""
        if not self.seconds:
            raise ValueError("no timed steps: run at least one step after the warm-up")
        return statistics.median(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        """tokens_per_step / median seconds per step (tokens/s)."""
        if self.tokens_per_step is None:
            raise ValueError("tokens_per_step was not given, so tokens/s is unknown")
        return self.tokens_per_step / self.seconds_per_step


class StepTimer:
    """Times each `with timer:` block (synchronizing CUDA first when `device` is a GPU).

        timer = StepTimer(tokens_per_step=batch * seq, warmup=1)
        for _ in range(10):
            with timer:
                train_step()
        timer.result().tokens_per_second

    The first `warmup` blocks are timed but left out of `result()` (allocator and thread-pool
    warm-up, lazy optimizer state).
    """

    def __init__(self, *, tokens_per_step: int | None = None, warmup: int = 1, device=None):
        check_int("warmup", warmup, 0)
        if tokens_per_step is not None:
            check_int("tokens_per_step", tokens_per_step, 1)
        self.tokens_per_step, self.warmup = tokens_per_step, warmup
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.all_seconds: list[float] = []
        self._t0 = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self) -> "StepTimer":
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.all_seconds.append(time.perf_counter() - self._t0)

    def result(self) -> Throughput:
        """Throughput over the steps after the warm-up."""
        return Throughput(tuple(self.all_seconds[self.warmup:]), self.tokens_per_step)


def time_steps(step_fn: Callable[[], object], n_steps: int, *, warmup: int = 1,
               tokens_per_step: int | None = None, device=None) -> Throughput:
    """Call `step_fn()` `warmup + n_steps` times; time the last `n_steps`. Returns Throughput."""
    check_int("n_steps", n_steps, 1)
    timer = StepTimer(tokens_per_step=tokens_per_step, warmup=warmup, device=device)
    for _ in range(warmup + n_steps):
        with timer:
            step_fn()
    return timer.result()


# ------------------------------------------------------------------------------ TinyGPT vs estimate
def tinygpt_activation_kwargs(cfg, *, seq_len: int, micro_batch: int) -> dict:
    """`estimate.activation_bytes_per_layer` keywords that describe TinyGPT `cfg` in fp32.

    Every way TinyGPT differs from Korthikanti et al.'s assumptions is spelled out: no dropout,
    fused "flash" attention (CPU SDPA keeps an fp32 log-sum-exp, no s x s scores), K/V repeated to
    every query head before attention (grouped-query), SwiGLU width, fp32 activations (4 B), and
    what its norms keep (fused LayerNorm: input + fp32 mean/rstd; Llama RMSNorm: unfused ops).
    Raises ValueError for settings whose bytes this accounting does not cover.
    """
    problems = [msg for bad, msg in [
        (cfg.dropout > 0, f"dropout={cfg.dropout} (masks are not modelled for TinyGPT; use 0)"),
        (cfg.attention_window is not None, "attention_window (a mask makes SDPA leave the flash path)"),
        (cfg.checkpoint_every is not None, "checkpoint_every (checkpoints some blocks, not all)"),
        (cfg.offload_activations, "offload_activations (saved tensors move to CPU)"),
    ] if bad]
    if problems:
        raise ValueError("the exact TinyGPT accounting does not cover: " + "; ".join(problems))
    return dict(seq_len=seq_len, micro_batch=micro_batch, d_model=cfg.d_model, n_heads=cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads, mlp=cfg.mlp, d_ff=cfg.ffn_dim, recompute=cfg.checkpointing,
                dropout=False, attention="flash", kv_repeat=True, bytes_per_element=4,
                norm_saves="unfused-rmsnorm" if cfg.norm == "rmsnorm" else "input+stats")


def tinygpt_shape(cfg, *, seq_len: int | None = None):
    """The `estimate.ModelShape` of TinyGPT config `cfg` (same parameter count, tested), with
    `seq_len` (default `cfg.block_size`) as the context the FLOP estimates use."""
    from course_lib.estimate import ModelShape

    return ModelShape(cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size,
                      cfg.block_size if seq_len is None else seq_len, d_ff=cfg.ffn_dim,
                      n_kv_heads=cfg.n_kv_heads, tied_embeddings=cfg.tie_embeddings,
                      learned_pos_emb=cfg.position == "learned", bias=cfg.bias, mlp=cfg.mlp, norm=cfg.norm)


# Estimator components that belong to each module group of a TinyGPT block.
_BLOCK_GROUPS = {
    "norms": (("norm1", "norm2"), ("norm_inputs", "norm_extras")),
    "attention": (("attn",), ("qkv_input", "q_k_v", "attention_core", "out_proj_input")),
    "mlp": (("mlp",), ("mlp_input", "mlp_hidden", "dropout_masks")),
}


def compare_tinygpt_activations(cfg, *, seq_len: int, micro_batch: int, seed: int = 0) -> list[dict]:
    """Estimated vs measured saved-activation bytes of one TinyGPT forward, per component.

    Builds TinyGPT(cfg) and TinyGPT with one more block and measures both (the difference is one
    block, whatever the embedding and output layer keep). Rows (dicts with `component`,
    `estimated`, `measured` in bytes and `ratio` = measured / estimated, None when 0):
    per-block groups "norms" / "attention" / "mlp" (not for full recompute, where the checkpoint
    keeps only the block input), "one block", "all blocks", "embedding + output layer",
    "token ids (int64)" (inputs and targets of the lookup and the loss: not in Korthikanti's
    accounting, a closed form here) and "total".
    """
    from course_lib import estimate
    from course_lib.model import TinyGPT

    kwargs = tinygpt_activation_kwargs(cfg, seq_len=seq_len, micro_batch=micro_batch)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g)
    runs = []
    for n_layers in (cfg.n_layers, cfg.n_layers + 1):
        torch.manual_seed(seed)
        model = TinyGPT(dataclasses.replace(cfg, n_layers=n_layers)).train()
        runs.append(saved_activation_bytes(model, idx, targets))
    m, m_plus = runs
    per_layer = estimate.activation_breakdown_per_layer(**kwargs)
    stage = estimate.first_stage_activation_breakdown(n_layers=cfg.n_layers, vocab_size=cfg.vocab_size, **kwargs)
    s, b, L = seq_len, micro_batch, cfg.n_layers
    ids_est = 8 * s * b * 2 + (8 * s if cfg.position == "learned" else 0)  # idx, targets, positions
    ids_meas = m.by_dtype.get("int64", 0)
    layer_meas = m_plus.total_bytes - m.total_bytes
    rows = []
    if cfg.checkpointing != "full":
        last = f"blocks.{L - 1}"
        for group, (modules, parts) in _BLOCK_GROUPS.items():
            est = sum(per_layer.components.get(p, 0.0) for p in parts)
            meas = sum(m.module_bytes(f"{last}.{mod}") for mod in modules)
            rows.append((f"  {group} (one block)", est, meas))
    rows += [("one block", per_layer.total, layer_meas),
             ("all blocks", L * per_layer.total, L * layer_meas),
             ("embedding + output layer", stage.embedding + stage.output, m.total_bytes - L * layer_meas - ids_meas),
             ("token ids (int64)", ids_est, ids_meas),
             ("total", stage.total + ids_est, m.total_bytes)]
    return [{"component": c, "estimated": float(e), "measured": int(x), "ratio": (x / e if e else None)}
            for c, e, x in rows]
