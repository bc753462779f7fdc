"""The grading kernel: one fresh Python process per notebook run, fed one cell at a time.

Started by :mod:`course_lib.grading.sandbox` as ``python -m course_lib.grading.runner``. It reads
JSON lines ``{"id": ..., "source": ...}`` from stdin, runs each in an IPython shell (magics like
``%%writefile`` work, ``sys.exit`` in a cell fails that cell only) and reports ``start``/``end``
events as JSON lines on the status descriptor. The parent sends a cell only after the previous one
ended, so the process never holds test cells it has not reached yet.

The student's code runs in this process, so nothing it reports is trusted: a forged ``end`` event
can make a cell look finished, never make its recorded values right.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

MAX_FILE_BYTES = 2**30  # per file the kernel writes (bytes)


def _hide_paths(work: str, hide: list[str], mount_point: str) -> str:
    """Inside a private mount namespace: show ``work`` at ``mount_point`` and cover every path of
    ``hide`` (solutions, tests, other runs, the grader's output...) with an empty tmpfs."""
    def mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    mount("-t", "tmpfs", "-o", "size=1m", "course-grading", mount_point)
    visible = os.path.join(mount_point, "work")
    os.mkdir(visible)
    mount("--bind", work, visible)
    for path in hide:
        if os.path.isdir(path):
            mount("-t", "tmpfs", "-o", "size=1m,mode=000", "hidden", path)
    return visible


def _loopback_up() -> None:
    """A new network namespace starts with its loopback down; gloo ranks need 127.0.0.1."""
    import fcntl
    import socket
    import struct

    with socket.socket() as s:
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH", b"lo", 0x1 | 0x40))  # SIOCSIFFLAGS UP|RUNNING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course_lib.grading.runner")
    parser.add_argument("--work", required=True)
    parser.add_argument("--status-fd", type=int, required=True)
    parser.add_argument("--memory-bytes", type=int, default=0)
    parser.add_argument("--sandboxed", action="store_true")
    parser.add_argument("--mount-point", default="/mnt")
    parser.add_argument("--hide", action="append", default=[])
    args = parser.parse_args(argv)

    work = args.work
    if args.sandboxed:
        work = _hide_paths(args.work, args.hide, args.mount_point)
        _loopback_up()
    os.chdir(work)
    os.environ["HOME"] = work
    os.environ["COURSE_GRADING_RECORDS"] = os.path.join(work, "records")
    sys.path.insert(0, work)  # like a kernel started in the notebook's folder
    if args.memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (args.memory_bytes, args.memory_bytes))
    # no file the kernel writes (its own log included) may grow past 1 GiB: a print loop cannot fill the disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    status = os.fdopen(args.status_fd, "w", buffering=1)

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    for line in sys.stdin:
        cell = json.loads(line)
        status.write(json.dumps({"event": "start", "id": cell["id"]}) + "\n")
        result = shell.run_cell(cell["source"], store_history=True)
        error = result.error_before_exec or result.error_in_exec
        event = {"event": "end", "id": cell["id"], "ok": error is None}
        if error is not None:
            event["error_name"] = type(error).__name__
            event["error"] = str(error)[:2000]
        status.write(json.dumps(event) + "\n")
    status.flush()
    # leave without interpreter exit: no atexit hook of the student's runs after the last cell
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
