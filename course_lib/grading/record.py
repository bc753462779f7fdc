"""The record channel: test cells hand the values they check to the grader process.

Inside a grading run the environment variable ``COURSE_GRADING_RECORDS`` names a folder; each
:func:`record` call appends one JSON line to ``records.jsonl`` there (tensors go to a
``.safetensors`` file next to it). Outside grading :func:`record` does nothing, so a learner only
sees the notebook's usual in-kernel checks.

Nothing written here is trusted: the kernel runs the student's code, which can write any bytes to
the folder. The grader decodes records as plain data (JSON and safetensors, never pickle) and gives
credit only for values equal to the references it computed from the instructor's solution, so a
forged record earns a point only when it holds the right answer.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

RECORDS_ENV = "COURSE_GRADING_RECORDS"
RECORDS_FILE = "records.jsonl"
JUDGE = re.compile(r"course_lib(\.[A-Za-z_][A-Za-z0-9_]*)+:[A-Za-z_][A-Za-z0-9_]*")  # module:function


def grading_active() -> bool:
    """True inside a grading run (the grader set ``COURSE_GRADING_RECORDS``)."""
    return bool(os.environ.get(RECORDS_ENV))


def record(name: str, value: Any, *, rtol: float = 1e-9, atol: float = 0.0, judge: str | None = None) -> None:
    """Hand ``value`` to the grader under ``name`` (a no-op outside grading).

    ``value``: numbers, bools, strings, None, tensors / numpy arrays, and lists, tuples and dicts
    of those. ``rtol``/``atol`` (relative / absolute, in the value's units) say how close a
    student's value must be to the reference; the grader takes them from the *reference* run,
    never from the student's. Names must be unique within a notebook.

    ``judge`` (``"course_lib.module:function"``): when several answers are right (a schedule, an
    order), the grader applies this function, in its own process, to the student's value and to
    the reference's, and compares the two results instead. Only the reference run's judge counts."""
    folder = os.environ.get(RECORDS_ENV)
    if not folder:
        return
    if not isinstance(name, str) or not name:
        raise ValueError(f"record: name must be a non-empty string, got {name!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict = {}
    encoded = _encode(value, tensors)
    line = {"name": name, "value": encoded, "rtol": float(rtol), "atol": float(atol)}
    if judge is not None:
        if not isinstance(judge, str) or not JUDGE.fullmatch(judge):
            raise ValueError(f"record: judge must be 'course_lib.module:function', got {judge!r}")
        line["judge"] = judge
    if tensors:
        from safetensors.torch import save_file

        tensor_file = f"t-{os.getpid()}-{len(list(folder.glob('t-*.safetensors'))):06d}.safetensors"
        save_file(tensors, str(folder / tensor_file))
        line["tensors"] = tensor_file
    with open(folder / RECORDS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def _encode(value: Any, tensors: dict) -> Any:
    """Plain-JSON form of ``value``; tensors are stored in ``tensors`` and referenced by key."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, (list, tuple)):
        return {"$list": [_encode(v, tensors) for v in value]}
    if isinstance(value, dict):
        return {"$dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, Path):
        return str(value)
    tensor = _as_tensor(value)
    if tensor is not None:
        key = f"t{len(tensors)}"
        tensors[key] = tensor
        return {"$tensor": key}
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _encode(value.item(), tensors)  # numpy scalars
    return {"$unsupported": type(value).__name__}


def _as_tensor(value: Any):
    """A contiguous CPU torch tensor for torch tensors and numpy arrays, else None."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().clone()
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray) and value.dtype != object:
        import torch as _torch

        return _torch.from_numpy(numpy.ascontiguousarray(value)).clone()
    return None
