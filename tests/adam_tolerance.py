"""How far two correct runs may drift apart in weights after AdamW steps, from the math.

Two runs that differ only in summation order (one process vs 2 ranks, 4 micro-batches vs one
big batch, a ZeRO partition vs whole tensors) produce gradients that differ by rounding, about
1e-7 relative in fp32. For a parameter with a real gradient, Adam's update m/sqrt(v) moves by
the same relative amount, and the weights stay within a tight ``rtol``/``atol``.

One kind of parameter has **no gradient in exact arithmetic**: the bias of the attention's key
projection, when positions are added to the input (learned or none, not RoPE). Adding ``b`` to
every key adds ``q . b`` to every score of a query's row; softmax ignores a constant added to a
row, so ``dL/db = 0``. What the computer produces is rounding noise around zero, and Adam divides
that noise by its own root-mean-square: each step moves such an element by up to about one
learning rate, in a direction set by the noise. Different summation orders give different noise,
so these elements wander apart by up to ``2 * lr * steps * c``, where ``c`` bounds
``|m_hat| / sqrt(v_hat)`` (Cauchy-Schwarz over the moments' geometric weights, below). A fixed
``atol`` there holds on the machine the test was written on and fails on the next (a 2-core
machine measured 1.02e-5 against atol=1e-5). Those elements do not change the model's function
(the loss, compared tightly elsewhere, is blind to them), so the bound is all a test can ask.
"""
from __future__ import annotations

import math

import torch

#: parameter-name suffixes whose exact gradient is zero when positions are added (see above)
ZERO_GRADIENT_SUFFIXES = ("attn.k_proj.bias",)


def adam_ratio_bound(beta1: float, beta2: float, steps: int) -> float:
    """Largest ``|m_hat_t| / sqrt(v_hat_t)`` over t = 1..steps for any gradient sequence
    (dimensionless). With r = beta1^2 / beta2 < 1, Cauchy-Schwarz gives
    (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt((1-r^t)/(1-r)); t = 1 gives exactly 1."""
    r = beta1 ** 2 / beta2
    if r >= 1:
        raise ValueError(f"the bound needs beta1^2 < beta2, got beta1={beta1}, beta2={beta2}")
    return max((1 - beta1) / (1 - beta1 ** t) * math.sqrt((1 - beta2 ** t) / (1 - beta2))
               * math.sqrt((1 - r ** t) / (1 - r)) for t in range(1, steps + 1))


def zero_gradient_names(names, position: str) -> set[str]:
    """The names among ``names`` whose exact gradient is zero for a model with ``position``
    ("learned" | "none"; with "rope" keys are rotated per position and the bias has a gradient)."""
    if position == "rope":
        return set()
    return {n for n in names if n.endswith(ZERO_GRADIENT_SUFFIXES)}


def assert_weights_match_after_adam(got: dict, want: dict, *, lr: float, steps: int, position: str = "learned",
                                    beta1: float = 0.9, beta2: float = 0.95, rtol: float = 1e-4,
                                    atol: float = 1e-5, msg: str = "") -> None:
    """``got`` equals ``want`` (name -> tensor) up to summation order after ``steps`` AdamW steps
    with peak learning rate ``lr``: ``rtol``/``atol`` for every parameter with a gradient, and
    ``2 * lr * steps * adam_ratio_bound`` (absolute, in the weight's units) for the parameters
    whose exact gradient is zero. Both dicts must have the same names."""
    assert set(got) == set(want), f"{msg} names differ: {sorted(set(got) ^ set(want))}"
    free = zero_gradient_names(want, position)
    wander = 2 * lr * steps * adam_ratio_bound(beta1, beta2, steps)
    for name, value in want.items():
        if name in free:
            diff = (got[name].float() - value.float()).abs().max().item()
            assert diff <= wander, (f"{msg} {name}: differs by {diff:.3g}, more than Adam can move a weight "
                                    f"with no gradient in {steps} steps at lr {lr} ({wander:.3g})")
        else:
            torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=f"{msg} {name}")
