"""Build DeepSpeed's JIT ops once, into the venv's cache, before anything needs them.

DeepSpeed compiles C++ ops the first time they are used and caches them in
``TORCH_EXTENSIONS_DIR`` (the kit points it inside the venv, see ``course_lib/__init__.py``). On a
CPU, ``deepspeed_shm_comm`` is loaded at every ``deepspeed.init_distributed`` and ``cpu_adam`` by
ZeRO-Offload: left to first use, each rank of the first run races to compile them (about 40 s and
60 s on a quiet 2-core machine, minutes under load) inside its collective timeouts. ``./kit setup``
calls :func:`build` once; tests call it again as a cheap check (about 3 s when cached).

    python -m course_lib.parallel.deepspeed.ops      # prints what was built or loaded, and how long
"""
from __future__ import annotations

import os
import time

#: The builders the kit uses; ones this machine's accelerator does not offer are skipped.
OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")


def build(names: tuple[str, ...] = OPS) -> dict[str, str]:
    """Load (building on first use) each op in ``names``; returns ``{name: what happened}``:
    "loaded in S s", "not offered by this accelerator", or "incompatible here". Build errors
    propagate: a broken toolchain should stop the set-up, not the first training run."""
    import contextlib
    import io
    import warnings

    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        import course_lib  # noqa: F401 - sets TORCH_EXTENSIONS_DIR inside the venv
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
    from course_lib.parallel.deepspeed.op_locks import guard

    done = {}
    with guard():  # a lock left by a killed build: an OpLockError naming it, not a silent wait
        for name in names:
            builder = accelerator.create_op_builder(name)
            if builder is None:
                done[name] = "not offered by this accelerator"
            elif not builder.is_compatible(verbose=False):
                done[name] = "incompatible here"
            else:
                t0 = time.perf_counter()
                builder.load(verbose=False)
                done[name] = f"loaded in {time.perf_counter() - t0:.1f} s"
    return done


if __name__ == "__main__":
    print(f"DeepSpeed ops cache: {os.environ.get('TORCH_EXTENSIONS_DIR') or '(set by course_lib)'}")
    for op, what in build().items():
        print(f"  {op}: {what}")
