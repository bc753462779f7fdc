"""Rank function and warning filter for tests/test_no_deprecations.py (importable: run_ranks
starts fresh processes)."""
from __future__ import annotations

import sys
import warnings

# Decorators that sit between a deprecated torch function and its caller: the warning that
# ``typing_extensions.deprecated`` issues with stacklevel=2 points into them (torch wraps its
# collectives in ``c10d_logger._exception_logger``), so a plain ``-W error::FutureWarning:course_lib``
# module filter never matches. The caller is the first frame above them.
WRAPPER_FILES = ("c10d_logger.py", "typing_extensions.py", "functools.py", "contextlib.py")
CATEGORIES = (FutureWarning, DeprecationWarning)


class KitDeprecation(Exception):
    """A FutureWarning/DeprecationWarning whose caller is a ``course_lib`` module."""


def _caller_module(filename: str, lineno: int) -> str:
    """The module of the code that made the warned call: the frame the warning points at, or the
    first frame above it that is not a decorator's wrapper."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_filename == filename and frame.f_lineno == lineno):
        frame = frame.f_back
    while frame is not None and frame.f_code.co_filename.endswith(WRAPPER_FILES):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def kit_warnings_are_errors(found: list | None = None) -> list:
    """From now on in this process (or until the caller's ``warnings.catch_warnings`` ends), a
    FutureWarning or DeprecationWarning raised on behalf of a ``course_lib`` module is an error,
    as under ``-W error``; it is also appended to ``found`` (returned) as ``"module: message"``
    in case something on the way swallows the exception. Other code's warnings print as usual."""
    found = [] if found is None else found
    shown = warnings.showwarning
    for category in CATEGORIES:
        warnings.filterwarnings("always", category=category)

    def show(message, category, filename, lineno, file=None, line=None):
        module = _caller_module(filename, lineno) if issubclass(category, CATEGORIES) else ""
        if module == "course_lib" or module.startswith("course_lib."):
            found.append(f"{module}: {category.__name__}: {message}")
            raise KitDeprecation(f"{module} calls something deprecated: {category.__name__}: {message}")
        return shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return found


def train_each(rank, world_size, runs):
    """Run every ``(cfg, out_dir)`` through the in-process trainer with the kit's deprecations as
    errors; returns (the steps each ran, the kit deprecations seen, wall seconds per run)."""
    from course_lib.train import train

    import time

    found = kit_warnings_are_errors()
    steps, seconds = [], []
    for cfg, out in runs:
        t0 = time.perf_counter()
        steps.append(train(cfg, out).steps)
        seconds.append(round(time.perf_counter() - t0, 1))
    return steps, found, seconds
