"""Sharded checkpoints through torch.distributed.checkpoint, on gloo ranks with FSDP2.

Two launches in all (starting ranks is the slow part): every 2-rank check in one, then a 1-rank
load of a checkpoint the 2 ranks saved (DCP reshards)."""
import pickle

import pytest
import torch

import checkpoint_rank_fns  # tests/ is on sys.path under pytest; spawned ranks import it too
from course_lib.checkpoint import CheckpointError
from course_lib.parallel.ranks.launch import run_ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    results = run_ranks(checkpoint_rank_fns.sharded_all, 2, str(root), timeout=180, show_output=False)
    return root, results


def test_sharded_save_load_is_exact_and_reshards_to_one_rank(two_ranks):
    root, results = two_ranks
    for rank, r in enumerate(results):
        rt = r["roundtrip"]
        assert rt["loaded_step"] == 3 and rt["name"] == "step_000000003" and rt["metrics"] == {"loss": 1.5}
        assert rt["pos"] == 100 + rank  # each rank got its own data position back
        assert rt["losses"] == rt["ref_losses"] and rt["weights_equal"]
        assert rt["lr"] == rt["ref_lr"]  # the scheduler (shared state) came back too
        assert rt["loaded_equal_saved"]  # 2 -> 2 ranks: full weights and optimizer state identical
        rep = r["replicated"]
        assert (rep["step"], rep["equal"], rep["lr"]) == (2, True, True)  # a plain replicated module
        wrong = rep["wrong_shape"]  # another model shape: refused by name, nothing touched
        assert wrong["type"] == "CheckpointLoadError" and wrong["untouched"]
        assert "step_000000002" in wrong["msg"] and "2.weight: checkpoint (32, 32) vs model (16, 32)" in wrong["msg"]
    kept = sorted(p.name for p in (root / "a").iterdir() if not p.name.startswith("."))
    assert kept == ["step_000000003"]  # step 6 was hidden by the test; nothing else left behind
    assert not any(p.name.startswith(".tmp-step") for p in (root / "a").iterdir())
    # 2 -> 1 rank: DCP reshards; the same full weights and the same optimizer state
    one = run_ranks(checkpoint_rank_fns.sharded_load_one_rank, 1, str(root / "a"), timeout=120,
                    show_output=False)[0]
    saved = results[0]["roundtrip"]
    assert one["step"] == 3
    assert checkpoint_rank_fns.same(one["weights"], saved["saved_weights"])
    assert checkpoint_rank_fns.same(one["optim"], saved["saved_optim"])
    assert set(one["optim"]) == set(one["weights"])  # every parameter has its Adam state


def test_corrupt_sharded_checkpoint_falls_back_and_all_corrupt_refuses(two_ranks):
    _, results = two_ranks
    for r in results:
        c = r["corrupt"]
        assert c["step"] == 1  # the flipped byte in step 2 was caught by its checksum
        assert c["all_corrupt"]["type"] == "CheckpointLoadError"  # not None: no silent fresh start
        # the corrupt step 2 was moved aside by the fall-back (rank 0, the writer), so it neither
        # loads nor counts toward keep_last; the refusal lists step 1 and names the quarantined one
        assert c["after_fallback"] == [".corrupt-step_000000002", "step_000000001"], c["after_fallback"]
        assert c["all_corrupt"]["failures"] == ["step_000000001"]
        assert "checksum" in c["all_corrupt"]["msg"] and ".corrupt-step_000000002" in c["all_corrupt"]["msg"]
    assert results[0]["corrupt"]["warned"]  # rank 0 checks the checksums and says why it fell back


def test_planted_metadata_payload_runs_nothing(two_ranks):
    _, results = two_ranks
    for r in results:
        p = r["planted"]
        assert p["step"] == 1  # the forged newest was refused, the genuine older one loaded
        assert p["refused"]["type"] == "CheckpointLoadError"
        assert "posix.system" in p["refused"]["msg"] and ".metadata" in p["refused"]["msg"]
        assert "posix.system" in p["reader"]  # the DCP reader refuses on its own, too
        assert p["marker"] is False  # the payload never ran
        assert p["quarantined"] == ["step_000000001", "step_000000002"]  # both moved aside, kept for forensics
    warning = results[0]["planted"]["warnings"]
    assert warning and "posix.system" in warning[0]


def test_a_failing_rank_fails_the_sharded_save_everywhere_promptly(two_ranks):
    root, results = two_ranks
    for r in results:
        f = r["fail_fast"]
        for case, needle in (("write", "No space left"), ("get_state_dict", "state dict exploded")):
            assert f[case]["type"] == "CheckpointError", (case, f[case])
            assert "rank 1" in f[case]["msg"] and needle in f[case]["msg"]
            assert f[case]["seconds"] < 30  # not the process group's timeout
        assert f["good"] == "step_000000003"  # the group is still usable afterwards
    assert results[0]["fail_fast"]["left"] == []  # nothing under a final name, no temp dir left


def test_async_sharded_save_stages_then_commits_only_after_every_rank_wrote(two_ranks):
    """checkpoint.async_save for sharded checkpoints (AsyncShardedSaver): save() returns with the
    write still pending; the checkpoint holds the state of the save moment although training
    changed weights and Adam state in place before the background write ran (a staged copy);
    the final name appears only after rank 1's last file is on disk (the ranks agree before rank
    0 commits); the manifest lists every rank's files; a failing background write raises on
    every rank at the next wait and commits nothing, and the saver works again afterwards."""
    _, results = two_ranks
    for rank, r in enumerate(results):
        a = r["async"]
        assert a["in_flight_after_save"] and a["path"] == "step_000000002"
        assert a["loaded"] == {"step": 2, "pos": 7 + rank, "lr": True, "equal": True}, a["loaded"]
        f = a["failed"]
        assert f["type"] == "CheckpointError" and "rank 1" in f["msg"] and "No space left" in f["msg"], f
        assert f["seconds"] < 30
    zero, one = results[0]["async"], results[1]["async"]
    seen, written = zero["times"].get("seen"), one["times"].get("rank1_written")
    assert written is not None and seen is not None, (seen, written)
    assert seen >= written, f"step 2 was committed {written - seen:.3f} s before rank 1's file was written"
    assert {"rank0.pt", "rank1.pt", ".metadata"} <= set(zero["manifest_files"])
    assert sum(n.endswith(".distcp") for n in zero["manifest_files"]) == 2
    assert zero["after_failure"] == ["step_000000002"]  # step 6 not committed, its temp dir removed
    assert zero["kept"] == ["step_000000002", "step_000000007"]


def test_restricted_unpickler_refuses_foreign_globals(tmp_path):
    from course_lib.checkpoint.dcp_trust import read_metadata_file
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(checkpoint_rank_fns.Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata.*posix\.system"):
        read_metadata_file(tmp_path / ".metadata")
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": torch.nn.Linear}))
    with pytest.raises(CheckpointError, match="torch.nn.modules.linear.Linear"):
        read_metadata_file(tmp_path / ".metadata")
    assert not marker.exists()


def test_non_tensor_shard_entries_are_read_with_weights_only(tmp_path):
    """DCP's default planner reads non-tensor entries of .distcp shards with weights_only=False;
    ours must refuse a pickled payload there (and still read plain values)."""
    import io
    from types import SimpleNamespace

    from course_lib.checkpoint.dcp_trust import SafeLoadPlanner
    marker = tmp_path / "pwned"
    planner = SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    buf = io.BytesIO()
    torch.save(0.01, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
    assert planner.state_dict["optim.param_groups.0.lr"] == 0.01
    buf = io.BytesIO()
    torch.save(checkpoint_rank_fns.Payload(marker), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buf)
    assert not marker.exists()
