"""Keep the maintainer's machine out of committed lab outputs.

A lab that prints where it wrote a file shows the path of the machine it ran on
(``/tmp/lab07-x1y2/victim/metrics.jsonl``, ``/home/alice/kit/.venv/bin/python``). The learner's
own run shows their paths, which is useful; the committed copy should show neither ours nor
anybody's. ``scrub_paths`` rewrites known prefixes to placeholders when an executed lab is
recorded, and ``machine_paths`` finds any absolute path left in outputs for ``course notebooks
check``.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

# What an absolute path of some machine looks like in printed text (POSIX homes, temp dirs,
# CI workspaces, macOS users, Windows drives).
_ABSOLUTE = re.compile(r"(?<![\w<>~.])(/(?:tmp|home|Users|root|work|var/folders|private/var)/[^\s'\"\\)\]]+"
                       r"|[A-Z]:\\\\Users\\\\[^\s'\"]+)")
_TEXT_KEYS = ("text", "text/plain", "text/html", "text/markdown", "evalue", "traceback")


def _prefixes(root: Path) -> list[tuple[str, str]]:
    """(prefix, placeholder) pairs, longest first, for this machine."""
    pairs = {str(Path(root).resolve()): "<repo>", str(Path(sys.prefix).resolve()): "<venv>",
             str(Path(tempfile.gettempdir()).resolve()): "<tmp>", str(Path.home()): "~"}
    if os.environ.get("TMPDIR"):
        pairs.setdefault(str(Path(os.environ["TMPDIR"]).resolve()), "<tmp>")
    pairs = {k: v for k, v in pairs.items() if k not in ("/", "")}
    return sorted(pairs.items(), key=lambda kv: -len(kv[0]))


def _map_text(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_text(v, fn) for v in value]
    return value


def scrub_paths(nb, root: Path) -> int:
    """Replace this machine's repository, venv, temp and home prefixes in every output of ``nb``
    (in place) by ``<repo>``, ``<venv>``, ``<tmp>``, ``~``. Returns the number of replacements."""
    pairs = _prefixes(root)
    count = 0

    def fix(text: str) -> str:
        nonlocal count
        for prefix, placeholder in pairs:
            n = text.count(prefix)
            if n:
                count += n
                text = text.replace(prefix, placeholder)
        return text

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for key in ("text", "evalue", "traceback"):
                if key in out:
                    out[key] = _map_text(out[key], fix)
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/"):
                    out["data"][mime] = _map_text(value, fix)
    return count


def machine_paths(nb) -> list[tuple[str, str]]:
    """(cell id, path) for every absolute machine path still visible in a text output of ``nb``."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            blobs = [out.get(k) for k in ("text", "evalue", "traceback")]
            blobs += [v for m, v in out.get("data", {}).items() if m.startswith("text/")]
            text = json.dumps([b for b in blobs if b])
            found += [(cell.get("id", "?"), m.group(0)) for m in _ABSOLUTE.finditer(text)]
    return list(dict.fromkeys(found))  # once each, in order
