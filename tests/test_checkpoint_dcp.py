"""Sharded checkpoints through torch.distributed.checkpoint, on 2 gloo ranks with FSDP2."""

import checkpoint_rank_fns  # tests/ is on sys.path under pytest; spawned ranks import it too
from course_lib.parallel.launch import run_ranks


def test_sharded_save_load_is_exact_and_falls_back_on_corruption(tmp_path):
    results = run_ranks(checkpoint_rank_fns.sharded_all, 2, str(tmp_path), timeout=240, show_output=False)
    for rank, r in enumerate(results):
        rt = r["roundtrip"]
        assert rt["loaded_step"] == 3 and rt["metrics"] == {"loss": 1.5}
        assert rt["pos"] == 100 + rank  # each rank got its own data position back
        assert rt["losses"] == rt["ref_losses"] and rt["weights_equal"]
        assert rt["lr"] == rt["ref_lr"]  # the scheduler (shared state) came back too
        assert r["corrupt"]["step"] == 1
    assert results[0]["corrupt"]["warned"]  # rank 0 checks the checksums and says why it fell back
    kept = sorted(p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith("."))
    assert kept == ["step_000000003"]  # step 6 was hidden by the test; nothing else left behind
    assert not any(p.name.startswith(".tmp-step") for p in (tmp_path / "a").iterdir())
