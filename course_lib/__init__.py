"""course_lib: the LLM training-infrastructure course kit (library behind the labs).

Importing this package is cheap (no torch import); each module pulls in what it needs.
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# DeepSpeed JIT-compiles its C++ ops on first use (about a minute each on 2 cores). Keep that
# cache inside the project's virtual environment, so it is paid once per environment and goes
# away with it, whichever entry point (CLI, notebook, test) triggers the build first.
if _sys.prefix != _sys.base_prefix:
    _os.environ.setdefault("TORCH_EXTENSIONS_DIR", _os.path.join(_sys.prefix, "torch_extensions"))


def smoke(requested: bool) -> bool:
    """True when a notebook should run at smoke-test size.

    ``requested`` is the notebook's ``SMOKE`` parameter (papermill injects ``True``); the
    environment variable ``COURSE_SMOKE=1`` forces it on, which is how the nbval run, which cannot
    inject parameters, gets small sizes too."""
    return bool(requested) or _os.environ.get("COURSE_SMOKE") == "1"
