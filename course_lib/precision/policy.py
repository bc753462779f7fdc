"""Mixed precision: the dtype policy a training run computes under (autocast, loss scaling).

Training side:

    policy = make_policy("bf16", device)     # "fp32" | "bf16" | "fp16" | "fp8"
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

fp8 (:mod:`course_lib.precision.fp8_model`, set up by the trainer before the strategy wraps the model):
the policy is bf16 autocast, so every layer that stays in high precision (embedding, norms, the
head, the router) computes in bf16 as under `bf16`, while the converted Linear layers quantize
their GEMM operands to FP8 themselves.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

from course_lib.validate import check_choice, check_int, check_number

POLICIES = ("fp32", "bf16", "fp16", "fp8")


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
    """Build a PrecisionPolicy: `fp32`, `bf16` (autocast on CPU or CUDA), `fp16` (autocast +
    dynamic loss scaling starting at `init_scale`, doubled after `growth_interval` clean steps) or
    `fp8` (bf16 autocast for the layers that stay in high precision; the FP8 Linear layers are
    swapped in separately, see :func:`course_lib.precision.fp8_model.convert_for_training`).

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
    if name in ("bf16", "fp8"):  # fp8: the layers left in high precision compute in bf16
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"{name} needs a GPU with bfloat16 support (Ampere or newer); use fp16 or fp32")
        return PrecisionPolicy(name, device.type, torch.bfloat16)
    if device.type == "cpu":
        msg = ("fp16 on CPU runs autocast('cpu', float16) with GradScaler('cpu') for demonstration only: "
               "about 8x slower than bf16 on a CPU. Use bf16 on CPU; fp16 + loss scaling is the GPU path.")
        if cpu_fp16 == "error":
            raise ValueError(msg + " (cpu_fp16='error')")
        if cpu_fp16 == "warn":
            warnings.warn(msg, UserWarning, stacklevel=2)
    scaler = torch.amp.GradScaler(device.type, init_scale=float(init_scale), growth_interval=growth_interval)
    return PrecisionPolicy("fp16", device.type, torch.float16, scaler, _last_scale=float(init_scale))
