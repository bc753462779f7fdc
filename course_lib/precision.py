"""Mixed precision: dtype policies for training, and helpers that make the number formats visible.

Training side:

    policy = make_policy("bf16", device)     # "fp32" | "bf16" | "fp16"
    with policy.autocast():
        _, loss = model(x, y)
    policy.backward(loss / accum_steps)      # scales the loss first when fp16
    policy.unscale_(optimizer)               # before clipping: clip true gradients, not scaled ones
    clip_grad_norm_(...)
    applied = policy.step(optimizer)         # False when fp16 found inf/nan and skipped the step

The weights stay float32 in every policy (autocast computes matmuls in the low dtype and keeps the
master weights and the optimizer in fp32). fp16 needs dynamic loss scaling because its exponent
range is small (below ~6e-8 a value is zero); bf16 has fp32's exponent range and needs none.

Decision for fp16 on a CPU: it runs, for demonstration, with autocast("cpu", float16) and
torch.amp.GradScaler("cpu") - both work in torch 2.13, the scaler skips inf steps and halves its
scale exactly as on a GPU - but it is about 8x slower than bf16, so by default it warns once
(`cpu_fp16="warn"`); `"error"` refuses with a message and `"allow"` is silent.

Teaching side: `dtype_ranges` / `format_dtype_table` (max, smallest normal, smallest subnormal,
machine epsilon), `cast_report` (what a cast to fp16/bf16 does to a set of values: how many vanish,
overflow, go subnormal), `loss_scaling_report` (the same with and without a loss scale), `ulp`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch

from course_lib.validate import check_choice, check_int, check_number

POLICIES = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


# --------------------------------------------------------------------------------- policies
@dataclass
class PrecisionPolicy:
    """How one training run computes: `name` in POLICIES on `device_type` ("cpu" or "cuda").

    `compute_dtype` is the autocast dtype (None for fp32); `scaler` is a GradScaler for fp16, else None.
    """

    name: str
    device_type: str
    compute_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None = None
    _last_scale: float | None = field(default=0.0, repr=False)

    def autocast(self):
        """Context manager for the forward pass (and loss); a no-op for fp32."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), multiplying the loss by the current loss scale first when fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale in place (fp16 only). Call once per step, before
        clipping or reading gradient norms, so they see true gradients."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, found_inf: bool | None = None) -> bool:
        """optimizer.step(), or for fp16 scaler.step + scaler.update. Returns whether the step was
        applied (False: fp16 found inf/nan gradients, skipped the step and halved the scale).

        ``found_inf``: whether the (unscaled) gradients hold inf/nan, when the caller already read
        that on the host (the trainer's stabilizer does, in its one transfer per step). With it,
        fp16 makes no host read at all: the optimizer step is applied or not on that knowledge and
        ``update()`` adjusts the scale on the device from what ``unscale_`` recorded. Without it,
        ``GradScaler.step`` reads its inf flag and this method reads the new scale: two syncs.
        fp32/bf16: no host-device synchronization either way."""
        if self.scaler is None:
            optimizer.step()
            return True
        if found_inf is not None:
            if not found_inf:
                optimizer.step()
            # The scale follows the caller's (global) verdict, not what unscale_ saw here: with
            # sharded gradients (ZeRO-2/3) the inf may sit in another rank's shard, and ranks whose
            # scales drift apart would scale their shares of one gradient differently. Writing the
            # flag into the recorded tensors is a device op, no host read.
            for state in self.scaler._per_optimizer_states.values():
                for flag in state.get("found_inf_per_device", {}).values():
                    flag.fill_(float(found_inf))
            self.scaler.update()
            self._last_scale = None
            return not found_inf
        if self._last_scale is None:  # unknown after skip(): read it once, before the step
            self._last_scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        new_scale = self.scaler.get_scale()
        applied = new_scale >= self._last_scale  # update() lowers the scale only after an inf/nan step
        self._last_scale = new_scale
        return applied

    def scale_tensor(self) -> torch.Tensor | None:
        """The current loss scale as a one-element device tensor (None without a scaler): pass it
        to a read the step makes anyway, instead of :attr:`loss_scale`, which syncs on CUDA."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        if self.scaler._scale is None:  # lazily created by the first scale() call
            return torch.full((), self.scaler.get_scale())
        return self.scaler._scale

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Leave this step out after :meth:`unscale_` was called (a spike or a non-finite loss
        the stabilizer caught). fp16: closes the scaler's step with ``update()`` so the next
        ``unscale_`` is allowed; the scale itself only changes if the gradients held inf/nan."""
        if self.scaler is not None:
            self.scaler.update()  # no host read: the scale stays on the device
            self._last_scale = None  # step() without found_inf reads it again when it needs it

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 when there is no scaler). Reads a device value: syncs on CUDA."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def state_dict(self) -> dict:
        """Scaler state for checkpoints (empty dict when there is no scaler)."""
        return {"name": self.name, "scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore the loss scale and its growth tracker; the policy name must match."""
        if state.get("name") != self.name:
            raise ValueError(f"precision state is for {state.get('name')!r}, this policy is {self.name!r}")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._last_scale = self.scaler.get_scale()


def make_policy(name: str, device: torch.device | str = "cpu", *, init_scale: float = 2.0**16,
                growth_interval: int = 2000, cpu_fp16: str = "warn") -> PrecisionPolicy:
    """Build a PrecisionPolicy: `fp32`, `bf16` (autocast on CPU or CUDA) or `fp16` (autocast +
    dynamic loss scaling starting at `init_scale`, doubled after `growth_interval` clean steps).

    On CPU, `cpu_fp16` decides what fp16 does: "warn" (default; runs with GradScaler("cpu")),
    "allow" (runs silently) or "error" (ValueError). bf16 on a CUDA device without bf16 support is
    a ValueError. Arguments are checked before anything is built.
    """
    check_choice("precision", name, POLICIES)
    device = torch.device(device)
    check_choice("device", device.type, ("cpu", "cuda"))
    check_number("init_scale", init_scale, 0, lo_open=True)
    check_int("growth_interval", growth_interval, 1)
    check_choice("cpu_fp16", cpu_fp16, ("warn", "allow", "error"))

    if name == "fp32":
        return PrecisionPolicy("fp32", device.type, None)
    if name == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("bf16 needs a GPU with bfloat16 support (Ampere or newer); use fp16 or fp32")
        return PrecisionPolicy("bf16", device.type, torch.bfloat16)
    if device.type == "cpu":
        msg = ("fp16 on CPU runs autocast('cpu', float16) with GradScaler('cpu') for demonstration only: "
               "about 8x slower than bf16 on a CPU. Use bf16 on CPU; fp16 + loss scaling is the GPU path.")
        if cpu_fp16 == "error":
            raise ValueError(msg + " (cpu_fp16='error')")
        if cpu_fp16 == "warn":
            warnings.warn(msg, UserWarning, stacklevel=2)
    scaler = torch.amp.GradScaler(device.type, init_scale=float(init_scale), growth_interval=growth_interval)
    return PrecisionPolicy("fp16", device.type, torch.float16, scaler, _last_scale=float(init_scale))


# --------------------------------------------------------------------------------- number formats
def dtype_ranges(dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list[dict]:
    """One row per floating dtype: bits, exponent/mantissa bits, max, smallest normal, smallest
    subnormal, eps (spacing just above 1.0) and ~decimal digits. Values are plain Python floats,
    read from torch.finfo; the smallest subnormal is smallest_normal * eps (2^(emin - mantissa bits))."""
    rows = []
    for dt in dtypes:
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise TypeError(f"dtypes must be floating torch dtypes, got {dt!r}")
        fi = torch.finfo(dt)
        mantissa = -int(round(math.log2(fi.eps)))
        rows.append({
            "dtype": _NAMES.get(dt, str(dt).replace("torch.", "")),
            "bits": fi.bits,
            "exponent_bits": fi.bits - 1 - mantissa,
            "mantissa_bits": mantissa,
            "max": float(fi.max),
            "min_normal": float(fi.smallest_normal),
            "min_subnormal": float(fi.smallest_normal) * float(fi.eps),
            "eps": float(fi.eps),
            "decimal_digits": round(math.log10(2.0) * (mantissa + 1), 1),
        })
    return rows


def format_dtype_table(rows: list[dict] | None = None) -> str:
    """dtype_ranges() as a fixed-width text table (for notebooks and `course` output)."""
    rows = dtype_ranges() if rows is None else rows
    head = f"{'dtype':<6}{'bits':>5}{'exp':>5}{'mant':>6}{'max':>12}{'min normal':>12}{'min subnormal':>15}{'eps':>11}{'digits':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['dtype']:<6}{r['bits']:>5}{r['exponent_bits']:>5}{r['mantissa_bits']:>6}{r['max']:>12.4g}"
            f"{r['min_normal']:>12.4g}{r['min_subnormal']:>15.4g}{r['eps']:>11.4g}{r['decimal_digits']:>8}"
        )
    return "\n".join(lines)


def round_to(value: float, dtype: torch.dtype) -> float:
    """The value a float becomes when stored in `dtype` (round-to-nearest-even), as a Python float."""
    return float(torch.tensor(float(value), dtype=torch.float64).to(dtype).double())


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing between `value` and the next larger-magnitude number representable in `dtype`.

    This is the resolution of the format at that magnitude: adding less than half of it to
    `value` changes nothing (e.g. ulp(1.0, bf16) = 2^-7, so 1 + 1/256 rounds back to 1 in bf16).
    """
    fi = torch.finfo(dtype)
    mag = abs(float(value))
    if mag < fi.smallest_normal:  # subnormals are evenly spaced
        return float(fi.smallest_normal) * float(fi.eps)
    return 2.0 ** math.floor(math.log2(mag)) * float(fi.eps)


def log_uniform_values(n: int, low: float = 1e-12, high: float = 1e-1, seed: int = 0) -> torch.Tensor:
    """n float32 values with magnitudes log-uniform in [low, high] and random signs: a stand-in
    for a gradient tensor whose entries span many orders of magnitude."""
    check_int("n", n, 1)
    if not (0 < low < high):
        raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
    g = torch.Generator().manual_seed(seed)
    exps = torch.empty(n, dtype=torch.float64).uniform_(math.log10(low), math.log10(high), generator=g)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return (signs * 10.0**exps).float()


def cast_report(values: torch.Tensor, dtype: torch.dtype = torch.float16, scale: float = 1.0) -> dict:
    """What storing `values * scale` in `dtype`, then dividing by `scale` in float32, does to them.

    Counts (ints) over the nonzero finite inputs: `underflow` (became 0), `overflow` (became inf),
    `subnormal` (stored with reduced precision); `kept_fraction` = share that survived as nonzero
    finite numbers; `max_rel_error` / `median_rel_error` among the survivors. This is exactly what
    happens to fp16 gradients with and without a loss scale.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError("values must be a floating-point tensor")
    check_number("scale", scale, 0, lo_open=True)
    ref = values.detach().double().flatten()
    ref = ref[(ref != 0) & torch.isfinite(ref)]
    stored = (ref * scale).to(dtype)
    back = stored.double() / scale
    fi = torch.finfo(dtype)
    finite = torch.isfinite(back)
    underflow = finite & (back == 0)
    alive = finite & (back != 0)
    rel = ((back[alive] - ref[alive]).abs() / ref[alive].abs()).float()
    return {
        "dtype": _NAMES.get(dtype, str(dtype)),
        "scale": float(scale),
        "count": int(ref.numel()),
        "underflow": int(underflow.sum()),
        "overflow": int((~finite).sum()),
        "subnormal": int((alive & (stored.double().abs() < fi.smallest_normal)).sum()),
        "kept_fraction": float(alive.double().mean()) if ref.numel() else 1.0,
        "max_rel_error": float(rel.max()) if rel.numel() else 0.0,
        "median_rel_error": float(rel.median()) if rel.numel() else 0.0,
    }


def loss_scaling_report(grads: torch.Tensor, scales=(1.0, 2.0**8, 2.0**16, 2.0**24),
                        dtype: torch.dtype = torch.float16) -> list[dict]:
    """cast_report for each loss scale: too small a scale loses tiny gradients to underflow, too
    large a scale overflows the big ones; dynamic scaling searches between the two."""
    return [cast_report(grads, dtype, s) for s in scales]


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients of `model` concatenated into one float32 vector (a copy)."""
    grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
    if not grads:
        raise ValueError("model has no gradients: run a backward pass first")
    return torch.cat(grads)
