"""``python -m slow_mirror_train ARGS``: the trainer's command line (``python -m course_lib.train``)
with every file a checkpoint mirror uploads delayed by ``SLOW_MIRROR_S`` seconds (a slow link), so
that a test can kill a job while an upload is half done (tests/test_sharded_kill_storm.py; the
harness puts tests/ on the path of a job started with ``module="slow_mirror_train"``)."""
from __future__ import annotations

import os
import sys
import time


def slow_uploads(seconds: float) -> None:
    """Delay every file :class:`~course_lib.checkpoint.mirror.CheckpointMirror` puts on the mirror
    (also used in-process by sharded_mirror_rank_fns.slow_mirror, which restores the original)."""
    from course_lib.checkpoint.mirror import CheckpointMirror

    upload = CheckpointMirror._upload_once

    def slow(self, local_dir):
        put = self.fs.put_file

        def slow_put(*args, **kwargs):
            time.sleep(seconds)
            return put(*args, **kwargs)

        self.fs.put_file = slow_put
        try:
            return upload(self, local_dir)
        finally:
            self.fs.put_file = put

    CheckpointMirror._upload_once = slow


if __name__ == "__main__":
    slow_uploads(float(os.environ.get("SLOW_MIRROR_S", "0.5")))
    from course_lib.train import main

    code = main(sys.argv[1:])
    if "RANK" in os.environ:  # under torchrun: leave without gloo's exit-time crash, as the trainer does
        from course_lib.parallel.ranks.launch import teardown

        teardown(code)
    sys.exit(code)
