"""Refresh tests/file_seconds.json, the per-file seconds that order the files for two workers
(see the root conftest.py), from a one-process run's JUnit report:

    ./kit test -p no:xdist --junitxml=/tmp/suite.xml && .venv/bin/python tests/refresh_file_seconds.py /tmp/suite.xml

Only the order of the files depends on these numbers, never a result: a stale or missing entry
costs minutes of wall time at worst."""
from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).with_name("file_seconds.json")


def file_of(testcase) -> str:
    """`tests.test_x` -> `tests/test_x.py`; nbval's `labs.NN_name.ipynb` -> `labs/NN_name.ipynb`."""
    name = testcase.get("classname").split("::")[0]
    if name.endswith(".ipynb"):
        folder, stem = name.split(".", 1)
        return f"{folder}/{stem}"
    return name.replace(".", "/") + ".py"


def main(report: str) -> None:
    seconds = collections.Counter()
    for case in ET.parse(report).iter("testcase"):
        seconds[file_of(case)] += float(case.get("time") or 0)
    ranked = {f: round(s, 1) for f, s in seconds.most_common() if s >= 1.0}
    OUT.write_text(json.dumps(ranked, indent=1) + "\n")
    print(f"{OUT}: {len(ranked)} files, {sum(ranked.values()):.0f} s in all")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
