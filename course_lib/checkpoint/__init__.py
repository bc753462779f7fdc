"""Checkpoints that survive crashes, corruption and restarts.

One module per job:

* :mod:`.manager` - :class:`CheckpointManager`: atomic, async, verified saves; retention; loading
  with fallback past corrupt checkpoints (and a loud refusal when none can be loaded);
* :mod:`.io` - the on-disk format and the one atomic commit (temp dir, fsync, rename);
* :mod:`.state` - what a checkpoint holds besides weights (optimizer, scheduler, RNG, data position,
  per-rank states) and how it goes back into live objects (checked first, then loaded);
* :mod:`.mirror` - a second storage tier (any fsspec URL);
* :mod:`.dcp` - sharded checkpoints through ``torch.distributed.checkpoint`` (every rank writes its
  shards);
* :mod:`.dcp_async` - the same, async: a staged copy, then the write and the commit in the background;
* :mod:`.collective` - the multi-rank save protocol both share with DeepSpeed's checkpoints;
* :mod:`.dcp_trust` - what DCP files are read with (a restricted unpickler, a weights-only planner).

Users import from here: ``from course_lib.checkpoint import CheckpointManager``. Errors:
:class:`CheckpointError` (base), :class:`CheckpointLoadError` (a resume that must stop: never a
silent fresh start), :class:`CheckpointCorruptError` (verification failed). See
``docs/CHECKPOINTS.md``.
"""
from .io import CheckpointCorruptError, CheckpointError, CheckpointLoadError
from .manager import CheckpointManager
from .state import LoadResult

__all__ = ["CheckpointManager", "CheckpointError", "CheckpointLoadError", "CheckpointCorruptError", "LoadResult"]
