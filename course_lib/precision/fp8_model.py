"""FP8 for a training run: swap a model's Linear layers for FP8 ones, by torchao or by the kit.

    report = convert_for_training(model, recipe="tensorwise", backend="auto", keep=["lm_head", "router"],
                                  device=torch.device("cuda"))

Two implementations of the same idea:

* **torchao** (``torchao.float8.convert_to_float8_training``, the production path torchtitan uses):
  its Float8Linear runs real FP8 GEMMs on an H100/H200 (``torch._scaled_mm``), supports FSDP2's FP8
  all-gather (``enable_fsdp_float8_all_gather``: weights travel as FP8, half of bf16's bytes), and
  on a CPU runs the same code with torch's CPU kernels. Recipes: ``tensorwise``, ``rowwise``.
* **kit** (:mod:`course_lib.precision.fp8_linear`): the readable one, every recipe
  (``tensorwise``, ``delayed``, ``rowwise``, ``blockwise``, ``mxfp8``), blockwise and MX by
  quantize-dequantize emulation.

On a CPU there are no FP8 tensor cores: whichever path runs, the FP8 arithmetic is **emulated**
(the rounding is FP8's, the speed is not), and :func:`describe` says so.

Layers left in high precision: everything that is not an ``nn.Linear`` (embeddings, norms; an MoE
layer's experts, whose stacked [E, F, C] weights run batched GEMMs - the report lists them as
``kept_batched``), and the Linear layers named in ``keep`` (by default the output head and an MoE
router, whose small errors move the loss or the routing most). Keeping the experts in high
precision is also what lets expert parallelism equal one FP8 process: an expert's GEMM there reads
the rows the all-to-all brought from every EP rank, so a scale spanning its tokens (tensorwise,
and rowwise in the weight-gradient GEMM) would see other micro-batches than one process's.
torchao also needs both of a layer's dimensions to be multiples of 16 (its GEMM's tiles); narrower
layers stay in high precision and are listed as such.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch
from torch import nn

from course_lib.precision.fp8_linear import convert_to_fp8, matches
from course_lib.precision.recipes import RECIPES
from course_lib.validate import check_choice

BACKENDS = ("auto", "torchao", "kit")
TORCHAO_RECIPES = ("tensorwise", "rowwise")
TORCHAO_PIN = "torchao==0.18.0"
DEFAULT_KEEP = ("lm_head", "router")


def torchao_available() -> bool:
    """Whether the torchao package is installed (nothing is imported)."""
    return importlib.util.find_spec("torchao") is not None


def missing_torchao_message(why: str = "fp8.backend = 'torchao'") -> str:
    """What to do when torchao is asked for and absent (names the package and the version)."""
    return (f"{why} needs the torchao package, which is not installed: pip install {TORCHAO_PIN} "
            f"(or set fp8.backend = 'kit' for the kit's own FP8 Linear)")


def resolve_backend(backend: str, recipe: str) -> str:
    """"torchao" or "kit" for ``backend`` in BACKENDS: "auto" is torchao where it is installed and
    has the recipe (tensorwise, rowwise), else the kit. ValueError for a combination that cannot run."""
    check_choice("fp8.backend", backend, BACKENDS)
    check_choice("fp8.recipe", recipe, tuple(RECIPES))
    if backend == "auto":
        return "torchao" if recipe in TORCHAO_RECIPES and torchao_available() else "kit"
    if backend == "torchao":
        if recipe not in TORCHAO_RECIPES:
            raise ValueError(f"fp8.recipe = {recipe!r} is the kit's own (fp8.backend = 'kit'); torchao's "
                             f"Float8Linear is built here for {', '.join(TORCHAO_RECIPES)}")
        if not torchao_available():
            raise ValueError(missing_torchao_message())
    return backend


@contextlib.contextmanager
def _quiet_torchao_import(device_type: str):
    # On a CPU build torchao logs one warning per CUDA kernel library it cannot load (its MX and
    # CUTLASS kernels); nothing on a CPU would use them, so the warnings only say the obvious.
    log = logging.getLogger("torchao")
    level = log.level
    if device_type != "cuda":
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _torchao_convert(model: nn.Module, recipe: str, keep, fsdp_all_gather: bool, device_type: str) -> dict:
    with _quiet_torchao_import(device_type):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    if fsdp_all_gather and recipe != "tensorwise":
        raise ValueError("fp8.fsdp_all_gather needs fp8.recipe = 'tensorwise' (torchao all-gathers FP8 "
                         "weights with one scale per tensor)")
    config = (Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather) if recipe == "tensorwise"
              else Float8LinearConfig.from_recipe_name(recipe))
    converted, kept = [], []

    def take(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # a container: let torchao look inside
        ok = not matches(fqn, keep) and module.in_features % 16 == 0 and module.out_features % 16 == 0
        (converted if ok else kept).append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=take)
    return {"converted": converted, "kept": kept}


def convert_for_training(model: nn.Module, *, recipe: str = "tensorwise", backend: str = "auto",
                         keep=DEFAULT_KEEP, fsdp_all_gather: bool = False,
                         device: torch.device | str = "cpu") -> dict:
    """Swap ``model``'s Linear layers for FP8 ones in place, before the optimizer or any parallel
    wrapper is built (torchtitan's order: FP8 first, then TP, activation checkpointing, compile,
    FSDP2). Returns a report: recipe, backend used, device type, ``emulated`` (True off CUDA),
    ``converted`` and ``kept`` (Linear layer names)."""
    device = torch.device(device)
    used = resolve_backend(backend, recipe)
    if isinstance(keep, str):
        raise TypeError("keep must be a list of layer names or patterns, e.g. ['lm_head', 'router']")
    if used == "torchao":
        layers = _torchao_convert(model, recipe, tuple(keep), fsdp_all_gather, device.type)
    else:
        if fsdp_all_gather:
            raise ValueError("fp8.fsdp_all_gather is torchao's (fp8.backend = 'torchao' or 'auto' with torchao installed)")
        layers = convert_to_fp8(model, recipe, skip=tuple(keep))
    return {"recipe": recipe, "backend": used, "device": device.type, "emulated": device.type != "cuda",
            "fsdp_all_gather": fsdp_all_gather, **layers, "kept_batched": batched_weight_modules(model)}


def batched_weight_modules(model: nn.Module) -> list[str]:
    """Names of the modules holding stacked matmul weights (a 3-D Parameter: an MoE layer's experts,
    [E, F, C]). Their batched GEMMs are not ``nn.Linear`` layers, so neither backend converts them:
    they run in high precision (bf16 under autocast)."""
    return [name for name, m in model.named_modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]


def describe(report: dict) -> str:
    """One line for a run's log: recipe, backend, how many layers went FP8, which stayed high
    precision, and "emulated" wherever the FP8 arithmetic is not on FP8 hardware."""
    where = ("emulated on CPU: FP8 rounding, not FP8 speed" if report["emulated"]
             else f"FP8 GEMMs on {report['device']}")
    kept = ", ".join(report["kept"]) or "none"
    batched = report.get("kept_batched") or []
    if batched:  # MoE experts: stacked weights, batched GEMMs in high precision
        kept += f", the MoE experts' batched GEMMs ({', '.join(batched)})"
    gather = ", FP8 all-gather" if report["fsdp_all_gather"] else ""
    return (f"fp8: {report['recipe']} recipe via {report['backend']}{gather} ({where}); {len(report['converted'])} "
            f"Linear layers in FP8, kept in high precision: {kept}, embeddings and norms")
