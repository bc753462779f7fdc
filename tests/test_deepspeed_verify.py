"""verify_deepspeed accepts the optimizer shards under both names DeepSpeed writes them: plain
``zero_pp_rank_R_...optim_states.pt`` and, when the engine runs bf16 (its BF16_Optimizer),
``bf16_zero_pp_rank_R_...``. Before, every bf16 ZeRO >= 1 checkpoint "lacked" its shards, so the
loader would have passed over (and quarantined) valid checkpoints. In-process: a folder with the
manifest, sizes and checksums of a real save, no DeepSpeed run."""
from __future__ import annotations

import hashlib
import io

import pytest
import torch

from course_lib.checkpoint.io import CheckpointCorruptError
from course_lib.parallel.deepspeed.checkpoints import verify_deepspeed


def _folder(tmp_path, optim_prefix: str, ranks=(0, 1)):
    files = {}

    def put(name: str, obj) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        blob = buf.getvalue()
        (tmp_path / name).write_bytes(blob)
        files[name] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}

    put("mp_rank_00_model_states.pt", {"module": {"w": torch.zeros(2)}})
    for r in ranks:
        put(f"rank{r}.pt", {"rng": {}, "per_rank": {}, "shared": {}})
        put(f"{optim_prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt", {"state": torch.zeros(1)})
    return {"files": files, "world_size": 2, "zero_stage": 2}


@pytest.mark.parametrize("prefix", ["", "bf16_"], ids=["fp32-names", "bf16-names"])
def test_optimizer_shards_verify_under_either_name(tmp_path, prefix):
    manifest = _folder(tmp_path, prefix)
    assert verify_deepspeed(tmp_path, manifest) is manifest


def test_a_missing_shard_is_still_named(tmp_path):
    manifest = _folder(tmp_path, "bf16_", ranks=(0,))
    with pytest.raises(CheckpointCorruptError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        verify_deepspeed(tmp_path, manifest)
