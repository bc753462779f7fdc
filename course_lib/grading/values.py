"""Read a run's records as plain data and compare them with the references (grader side).

Records come from an untrusted kernel: they are parsed as JSON and safetensors only (no pickle,
no code), with size limits, and anything malformed is simply a value that matches nothing.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from course_lib.grading.record import RECORDS_FILE

MAX_RECORDS_BYTES = 64 * 2**20  # a records.jsonl larger than this is truncated (bytes)
MAX_TENSOR_FILE_BYTES = 256 * 2**20  # larger tensor files are ignored (bytes)


class Malformed:
    """Stands for a record value that could not be decoded; equal to nothing."""

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"<malformed: {self.why}>"


@dataclass
class Record:
    """One decoded record: its value and the tolerances written with it."""

    value: Any
    rtol: float
    atol: float
    judge: str = ""  # "course_lib.module:function" or ""; only the reference's is ever used


def load_records(folder: Path) -> dict[str, Record]:
    """Every record in ``folder`` by name; a name recorded twice keeps its *first* value (a later
    write cannot overwrite what a test cell recorded). Missing folder: no records."""
    path = Path(folder) / RECORDS_FILE
    if not path.is_file():
        return {}
    out: dict[str, Record] = {}
    with open(path, "rb") as f:
        raw = f.read(MAX_RECORDS_BYTES)
    for line in raw.split(b"\n"):
        try:
            item = json.loads(line)
            name = item["name"]
            if not isinstance(name, str) or name in out:
                continue
            tensors = _load_tensors(Path(folder), item.get("tensors"))
            rtol, atol = float(item.get("rtol", 1e-9)), float(item.get("atol", 0.0))
            judge = item.get("judge") or ""
            out[name] = Record(_decode(item["value"], tensors), rtol, atol, judge if isinstance(judge, str) else "")
        except Exception:  # noqa: BLE001 - garbage lines are ignored, never trusted
            continue
    return out


def _load_tensors(folder: Path, name) -> dict:
    if not name:
        return {}
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise ValueError("bad tensor file name")
    path = folder / name
    if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_TENSOR_FILE_BYTES:
        raise ValueError("tensor file missing or too large")
    from safetensors.torch import load_file

    return load_file(str(path))


def _decode(node: Any, tensors: dict) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, body), = node.items()
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$list" and isinstance(body, list):
            return [_decode(v, tensors) for v in body]
        if tag == "$dict" and isinstance(body, list):
            return {_freeze(_decode(k, tensors)): _decode(v, tensors) for k, v in body}
        if tag == "$tensor" and isinstance(body, str) and body in tensors:
            return tensors[body]
        if tag == "$unsupported":
            return Malformed(f"an object of type {str(body)[:40]}")
    return Malformed("unknown encoding")


def _freeze(key: Any) -> Any:
    """Dict keys must be hashable: lists become tuples."""
    return tuple(_freeze(k) for k in key) if isinstance(key, list) else key


def describe(value: Any, limit: int = 80) -> str:
    """A short, safe text for a value in feedback (never more than ``limit`` characters)."""
    if _is_tensor(value):
        text = f"tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_tensor(value: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def judged(judge: str, value: Any) -> Any:
    """``judge``'s verdict on ``value`` (grader side). ``judge`` comes from the *reference* run and
    must name a function in ``course_lib`` (``"course_lib.module:function"``); a student's value
    it cannot judge (any exception) becomes a :class:`Malformed` that equals nothing."""
    import importlib

    from course_lib.grading.record import JUDGE

    if not JUDGE.fullmatch(judge):
        raise ValueError(f"judge {judge!r} is not a course_lib function")
    module, _, name = judge.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if isinstance(value, Malformed):
        return value
    try:
        return fn(value)
    except Exception as exc:  # noqa: BLE001 - whatever the student's data makes the judge raise
        return Malformed(f"the judge refused it: {type(exc).__name__}: {str(exc)[:120]}")


def mismatch(got: Any, want: Any, rtol: float, atol: float, where: str = "") -> str | None:
    """None when ``got`` equals the reference ``want`` within ``rtol``/``atol``; else a sentence
    saying where they differ (``where`` is the path inside nested containers)."""
    at = f" at {where}" if where else ""
    if isinstance(got, Malformed):
        return f"the value{at} could not be read ({got.why})"
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return None if type(got) is type(want) and got == want else f"wrong value{at}"
    if _is_number(want):
        if not _is_number(got):
            return f"expected a number{at}, got {type(got).__name__}"
        if math.isnan(want) or math.isnan(got):
            return None if math.isnan(want) and math.isnan(got) else f"wrong value{at}"
        if isinstance(want, int) and isinstance(got, int) and rtol == 0 and atol == 0:
            return None if got == want else f"wrong value{at}"
        ok = got == want or math.isclose(got, want, rel_tol=rtol, abs_tol=atol)
        return None if ok else f"wrong value{at}"
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"expected a sequence of {len(want)} items{at}"
        for i, (g, w) in enumerate(zip(got, want)):
            reason = mismatch(g, w, rtol, atol, f"{where}[{i}]")
            if reason:
                return reason
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"expected keys {sorted(map(repr, want))[:8]}{at}"
        for key in want:
            reason = mismatch(got[key], want[key], rtol, atol, f"{where}[{key!r}]")
            if reason:
                return reason
        return None
    if _is_tensor(want):
        return _tensor_mismatch(got, want, rtol, atol, at)
    return f"the reference{at} is not comparable"


def _tensor_mismatch(got: Any, want, rtol: float, atol: float, at: str) -> str | None:
    import torch

    if not _is_tensor(got):
        return f"expected a tensor{at}, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}{at}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}{at}, expected {want.dtype}"
    if want.dtype == torch.bool or not (want.is_floating_point() or want.is_complex()):
        return None if torch.equal(got, want) else f"wrong values{at}"
    g, w = got.double(), want.double()
    same_nan = torch.equal(torch.isnan(g), torch.isnan(w))
    close = torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True).all().item()
    return None if same_nan and close else f"wrong values{at}"
