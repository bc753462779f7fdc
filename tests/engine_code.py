"""The engines' own code for the plan-file tests, imported the way they can be on a CPU machine.

torchtitan 0.2.0 (a dev dependency, pyproject.toml) imports triton when its package is imported:
``torchtitan/__init__.py`` imports ``torchtitan.components.quantization`` (to register its float8
and MX converters), whose float8 module reaches ``torchtitan.models.moe.kernels`` and triton, a GPU
compiler of several hundred MB that torch's CPU wheel does not bring. The clean way chosen here:
create the ``torchtitan`` package from its installed spec **without running its ``__init__``**
(:func:`torchtitan_package`). Its submodules then import normally from the installed files -
config (ConfigManager, JobConfig), distributed.parallel_dims (ParallelDims), protocols.train_spec,
models.llama3 (model args, Transformer, pipeline helpers) - and only the quantization converters,
which the plan never names (``[model] converters`` is empty), are left unregistered.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys


def torchtitan_package():
    """The ``torchtitan`` package object, created from its spec without its ``__init__`` (see the
    module's docstring); skips the test when torchtitan 0.2.0 is not installed."""
    import pytest

    if "torchtitan" in sys.modules:
        return sys.modules["torchtitan"]
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed (./kit setup installs torchtitan==0.2.0)")
    from importlib.metadata import version

    if version("torchtitan") != "0.2.0":
        pytest.skip(f"torchtitan {version('torchtitan')} is installed; the plan files are for 0.2.0")
    package = importlib.util.module_from_spec(spec)  # __path__ set: submodules import from the wheel
    sys.modules["torchtitan"] = package
    return package


def torchtitan(module: str):
    """A torchtitan submodule, e.g. ``torchtitan("config.manager")``, imported from the wheel."""
    torchtitan_package()
    return importlib.import_module(f"torchtitan.{module}")


def without_triton():
    """Let torchtitan's MoE models import on a CPU machine: ``torchtitan.models.moe.kernels`` imports
    triton (a GPU compiler torch's CPU wheel does not bring) to define the GPU kernel behind
    ``generate_permute_indices``, which nothing on the meta device calls. When triton is not
    installed, that one module is registered as a stand-in whose ``generate_permute_indices``
    raises if called (triton itself is not faked: torch would take a fake for the real one);
    with triton present, nothing."""
    import importlib.util
    import types

    torchtitan_package()
    name = "torchtitan.models.moe.kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    kernels = types.ModuleType(name)

    def generate_permute_indices(*args, **kwargs):
        raise RuntimeError("torchtitan's MoE permutation kernel needs triton (a GPU); this CPU test only builds "
                           "the model on the meta device")
    kernels.generate_permute_indices = generate_permute_indices
    sys.modules[name] = kernels
