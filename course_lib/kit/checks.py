"""Checks that notebooks and exercises use: they fail with a sentence, not a bare assert."""
from __future__ import annotations

from typing import Any


class CheckFailed(AssertionError):
    """A notebook check failed; the message says what was expected, what came out, and a hint."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message)


def check_close(actual: Any, expected: Any, *, what: str, rtol: float = 1e-5, atol: float = 1e-6,
                hint: str = "") -> None:
    """Compare two tensors / arrays / numbers and explain a mismatch in words.

    ``what`` names the quantity ("rank 1's tensor after all-reduce"); ``rtol``/``atol`` are the
    relative and absolute tolerances (same units as the values)."""
    import torch

    a = torch.as_tensor(actual).detach().cpu()
    e = torch.as_tensor(expected).detach().cpu()
    if a.shape != e.shape:
        raise CheckFailed(f"{what}: shape {tuple(a.shape)} but expected {tuple(e.shape)}. {hint}".strip())
    if a.dtype != e.dtype:
        raise CheckFailed(f"{what}: dtype {a.dtype} but expected {e.dtype}. {hint}".strip())
    if not torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol):
        diff = (a.double() - e.double()).abs()
        worst = int(diff.argmax()) if diff.numel() else 0
        raise CheckFailed(
            f"{what}: differs from the expected value (max abs error {diff.max().item():.3g} at "
            f"flat index {worst}: got {a.flatten()[worst].item():.6g}, expected "
            f"{e.flatten()[worst].item():.6g}). {hint}".strip())
