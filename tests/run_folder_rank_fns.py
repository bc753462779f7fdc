"""Rank functions for tests/test_run_folder_rules.py (spawned ranks import them from here)."""
from __future__ import annotations


def refusals_on_two_ranks(rank, world_size, cfg, out_dir, mirror_cases, seq_root):
    """fsdp with sharded checkpoints on every rank of one launch: ``cfg`` trained into ``out_dir``
    (its checkpoints fill the folder), then the same run again without ``--resume``, then one
    fresh run per ``(name, cfg, out_dir)`` of ``mirror_cases`` (a ``checkpoint.mirror`` that
    overlaps its own checkpoint folder). Returns ``{case: the ConfigError's text, or None when the
    run went ahead}`` and a snapshot of ``out_dir`` (its entries, metrics.jsonl, each checkpoint's
    manifest) before and after the second run, taken by rank 0 after a barrier. Last, under
    ``seq_root`` beside a full-format checkpoint of save sequence 7, a sharded save of a plain
    module: its sequence (rank 0; the folder's one order says 8)."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from course_lib.checkpoint import io as cio
    from course_lib.checkpoint.dcp import save_sharded
    from course_lib.train import train
    from course_lib.trainer.config import ConfigError

    out_dir = Path(out_dir)

    def snapshot():
        ckpts = sorted((out_dir / "checkpoints").iterdir())
        return (sorted(p.name for p in out_dir.iterdir()), [p.name for p in ckpts],
                (out_dir / "metrics.jsonl").read_bytes(), [(p / "manifest.json").read_bytes() for p in ckpts])

    def refused(c, out):
        try:
            train(c, out)
        except ConfigError as exc:
            return str(exc)
        return None

    train(cfg, out_dir)
    dist.barrier()
    before = snapshot() if rank == 0 else None
    found = {"again": refused(cfg, out_dir)}
    dist.barrier()
    after = snapshot() if rank == 0 else None
    for name, c, out in mirror_cases:
        found[name] = refused(c, out)
        dist.barrier()
    if rank == 0:
        Path(seq_root).mkdir()
        cio.write_checkpoint_dir(Path(seq_root), "step_000000009", {"weights": b"x"}, {"step": 9, "seq": 7})
    dist.barrier()
    path = save_sharded(seq_root, 10, torch.nn.Linear(2, 2))
    seq = cio.read_manifest(path, expected_format=None)["seq"] if rank == 0 else None
    return found, before, after, seq
