"""What exercises 08-11 share: how the learner's code reaches the ranks, and how a check reports.

How the learner's class reaches the ranks: the exercise cell that holds it is written to a module
next to the notebook (``%%writefile ex08_bucketed_ddp.py``); the notebook imports the class and
hands it to a ``check_*`` function of the exercise's module (``exercise08_bucketed_ddp``, ...).
Spawned ranks cannot unpickle a class defined in a notebook, so the check sends only a reference,
``"module:Class"`` plus the module's folder, and every rank imports that module fresh
(:func:`load_impl`): it always runs the file as last written.

Each rank compares the learner's code with a reference computed in the same process and returns
plain dicts: numbers plus ``problems``, sentences that say what was expected, what came out and the
likely bug. The checks raise :class:`course_lib.kit.checks.CheckFailed` with the first problem
(:func:`_first_problem`), or ``NotImplementedError`` while the learner's code still raises it
(:func:`_guard`), and otherwise return table rows for the notebook; :func:`_launch` turns a hung
or crashed launch into a sentence.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from course_lib.kit.checks import CheckFailed
from course_lib.parallel.ranks.launch import COLLECTIVES_PRELOAD, RankFailedError, run_ranks



# ----------------------------------------------------------------------------- shared plumbing
def impl_ref(obj) -> tuple[str, str]:
    """``("module:Name", folder)`` for a class or function defined in a written ``.py`` module;
    TypeError (with what to do) for one defined in the notebook itself."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if file is None or obj.__module__ == "__main__":
        raise TypeError(f"{getattr(obj, '__name__', obj)!r} is defined in the notebook itself, which "
                        "spawned ranks cannot import: run the cell that starts with %%writefile, "
                        "then import the class from the module it wrote")
    return f"{obj.__module__}:{obj.__qualname__}", str(Path(file).resolve().parent)


def load_impl(ref: str, folder: str):
    """In a rank: import ``module`` from ``folder`` and return ``module.Name`` (``ref`` is
    ``"module:Name"``)."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _guard(name: str, fn, *args):
    """Run one scenario; name it in any error except NotImplementedError (kept as is)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as exc:
        raise RuntimeError(f"in scenario {name!r}: {type(exc).__name__}: {exc}") from exc


DDP_DEADLOCK_HINT = ("Every rank must issue the same collectives in the same order (launch buckets in a "
                     "fixed order, launch one even when a gradient in it is missing) and wait for every "
                     "handle it started")


def _launch(fn, world_size: int, what: str, timeout: float, *args,
            deadlock_hint: str = DDP_DEADLOCK_HINT) -> list:
    """Run the learner's code on ``world_size`` ranks; a NotImplementedError, an exception or a
    hang (``timeout`` seconds) becomes a message that says what to do (``deadlock_hint``: the
    likely cause of a hang in this exercise)."""
    try:
        # the checks' ranks use torch.distributed's collectives only: a lighter fork server
        return run_ranks(fn, world_size, *args, timeout=timeout, show_output=False, preload=COLLECTIVES_PRELOAD)
    except RankFailedError as exc:
        if exc.exc_type == "NotImplementedError":
            raise NotImplementedError(
                f"{what}: a 'YOUR CODE HERE' still raises NotImplementedError (rank {exc.rank}): "
                "fill in every one, run those cells, then this check") from None
        tail = "\n".join(exc.remote_traceback.strip().splitlines()[-6:])
        raise CheckFailed(f"{what} raised an exception on {world_size} ranks (rank {exc.rank}); "
                          f"the end of its traceback:\n{tail}") from None
    except TimeoutError:
        raise CheckFailed(f"{what} did not finish within {timeout:g} s on {world_size} ranks: a "
                          f"deadlock. {deadlock_hint}") from None


def _first_problem(per_rank: list[dict], world_size: int) -> None:
    """Raise the earliest problem (scenarios in order; within one, the earliest stage on any rank:
    a wrong broadcast on rank 1 explains wrong gradients on rank 0)."""
    for name in per_rank[0]:
        found = [(stage, rank, text) for rank, result in enumerate(per_rank)
                 for stage, text in result[name]["problems"]]
        if found:
            stage, rank, text = min(found)
            raise CheckFailed(f"{world_size} ranks, scenario {name!r}, rank {rank}: {text}")
