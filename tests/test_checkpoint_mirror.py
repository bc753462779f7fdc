"""Second checkpoint tier: a file:// directory and a real S3 server (moto, on loopback)."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import tiny_loop
from course_lib.checkpoint import io as cio
from course_lib.checkpoint import CheckpointError, CheckpointLoadError, CheckpointManager
from course_lib.checkpoint.mirror import CheckpointMirror

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server on 127.0.0.1 (moto's server mode), a bucket, and the fsspec
    storage options that reach it. Nothing leaves the machine."""
    pytest.importorskip("s3fs", reason="s3fs is needed for the S3 mirror tests (dev extras)")
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is needed for the S3 mirror tests")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = dict(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket=BUCKET)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    yield options
    server.stop()


def mirror_for(kind, tmp_path, s3_options=None, **kw):
    if kind == "file":
        (tmp_path / "remote").mkdir(exist_ok=True)  # a mirror's root exists (a missing one is an error)
        return CheckpointMirror(f"file://{tmp_path}/remote", backoff_s=0.01, **kw)
    return CheckpointMirror(f"s3://{BUCKET}/{tmp_path.name}", storage_options=s3_options, backoff_s=0.01, **kw)


def model_at(step):
    torch.manual_seed(step)
    return nn.Linear(16, 16)


@pytest.fixture(params=["file", "s3"])
def kind(request):
    return request.param


@pytest.fixture
def options(kind, request):
    return request.getfixturevalue("s3") if kind == "s3" else None


def test_verified_copies_land_on_the_mirror_and_follow_retention(tmp_path, kind, options):
    mirror = mirror_for(kind, tmp_path, options, skip_superseded=False)
    mgr = CheckpointManager(tmp_path / "local", keep_last=2, mirror=mirror)
    for step in range(1, 5):
        mgr.save(step, model=model_at(step))
    mgr.close()
    remote = mirror.list()
    assert sorted(remote) == ["step_000000003", "step_000000004"] == [n for n, _ in mgr.checkpoints()]
    for name, manifest in remote.items():
        for fname, meta in manifest["files"].items():
            blob = mirror.fs.cat_file(f"{mirror.root}/{name}/{fname}")
            assert cio.sha256_hex(blob) == meta["sha256"] == cio.sha256_hex((tmp_path / "local" / name / fname).read_bytes())
    assert mirror.failures == [] and mirror.uploaded == [f"step_00000000{i}" for i in range(1, 5)]


def test_after_a_recovery_from_the_mirror_it_still_keeps_keep_last(tmp_path):
    """The local disk is lost and the run resumes from the mirror, which downloads only the newest
    checkpoint: the next save must leave keep_last on the mirror, not prune it to the local set."""
    mirror = mirror_for("file", tmp_path, skip_superseded=False)
    mgr = CheckpointManager(tmp_path / "local", keep_last=3, mirror=mirror)
    for step in (1, 2, 3):
        mgr.save(step, model=model_at(step))
    mgr.close()
    shutil.rmtree(tmp_path / "local")
    mgr = CheckpointManager(tmp_path / "local", keep_last=3, mirror=mirror)
    assert mgr.load(nn.Linear(16, 16)).source == "mirror"
    mgr.save(4, model=model_at(4))
    mgr.close()
    assert sorted(mirror.list()) == ["step_000000002", "step_000000003", "step_000000004"]
    assert [n for n, _ in mgr.checkpoints()] == ["step_000000003", "step_000000004"]  # what the disk had


def test_the_mirror_prune_leaves_checkpoints_of_another_format(tmp_path):
    """A mirror that also holds a sharded (DCP) checkpoint (an earlier fsdp run's, beside which a
    resume only warns): the full tier's retention counts and deletes its own format only, as the
    local prune and the sharded tier's (``dcp_mirror.mirror_keep``) do; it used to delete it."""
    mirror = mirror_for("file", tmp_path, skip_superseded=False)
    foreign = tmp_path / "remote" / "step_000000001"
    foreign.mkdir()
    (foreign / ".metadata").write_bytes(b"x")
    (foreign / "manifest.json").write_text(json.dumps({
        "format": "course_lib.checkpoint.dcp/1", "step": 1, "seq": 1, "created_unix": 0.0,
        "files": {".metadata": {"bytes": 1, "sha256": cio.sha256_hex(b"x")}}}))
    mgr = CheckpointManager(tmp_path / "local", keep_last=1, mirror=mirror)
    for step in (2, 3):
        mgr.save(step, model=model_at(step))
    mgr.close()
    assert sorted(mirror.list()) == ["step_000000001", "step_000000003"]


def test_a_slow_mirror_skips_superseded_uploads_and_blocks_no_pruning(tmp_path):
    delays = []

    class SlowMirror(CheckpointMirror):  # a real file:// mirror behind a slow link
        def _upload_once(self, local_dir):
            delays.append(local_dir.name)
            time.sleep(0.3)
            super()._upload_once(local_dir)

    (tmp_path / "remote").mkdir()
    mirror = SlowMirror(f"file://{tmp_path}/remote", backoff_s=0.01)
    mgr = CheckpointManager(tmp_path / "local", keep_last=1, mirror=mirror)
    for step in range(1, 6):
        mgr.save(step, model=model_at(step))
        mgr.wait(mirror=False)
    mgr.close()
    assert mirror.failures == [] and mirror.uploaded[-1] == "step_000000005"
    assert set(mirror.skipped) | set(mirror.uploaded) == {f"step_00000000{i}" for i in range(1, 6)}
    assert mirror.skipped, "saves every few ms against a 0.3 s upload must coalesce"
    assert list(mirror.list()) == ["step_000000005"]
    mgr.save(6, model=model_at(6))  # the next save prunes what uploads were still reading
    mgr.close()
    assert [n for n, _ in mgr.checkpoints()] == ["step_000000006"]


def test_newest_valid_checkpoint_on_either_tier(tmp_path, kind, options):
    mirror = mirror_for(kind, tmp_path, options, skip_superseded=False)
    mgr = CheckpointManager(tmp_path / "local", keep_last=3, mirror=mirror)
    for step in range(1, 4):
        mgr.save(step, model=model_at(step))
    mgr.close()
    shutil.rmtree(tmp_path / "local" / "step_000000003")  # newest exists only on the mirror now
    m = nn.Linear(16, 16)
    res = CheckpointManager(tmp_path / "local", keep_last=3, mirror=mirror).load(m)
    assert (res.step, res.source) == (3, "mirror") and torch.equal(m.weight, model_at(3).weight)
    assert (tmp_path / "local" / "step_000000003" / "manifest.json").exists()  # downloaded atomically
    # corrupt the mirror's newest copy and lose the local disk: fall back to the previous one
    shutil.rmtree(tmp_path / "local")
    path = f"{mirror.root}/step_000000003/model.safetensors"
    blob = bytearray(mirror.fs.cat_file(path))
    blob[len(blob) // 2] ^= 0xFF
    mirror.fs.pipe_file(path, bytes(blob))
    with pytest.warns(RuntimeWarning, match=r"step_000000003 is unusable \(mirror copy\).*checksum"):
        res = CheckpointManager(tmp_path / "local", mirror=mirror).load(m)
    assert (res.step, res.source) == (2, "mirror") and torch.equal(m.weight, model_at(2).weight)


def test_corrupt_local_copy_uses_the_mirror_copy_and_a_reader_never_falls_back(tmp_path):
    mirror = mirror_for("file", tmp_path, skip_superseded=False)
    mgr = CheckpointManager(tmp_path / "local", keep_last=3, mirror=mirror)
    for step in (1, 2):
        mgr.save(step, model=model_at(step))
    mgr.close()
    newest = tmp_path / "local" / "step_000000002"
    blob = bytearray((newest / "model.safetensors").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(blob))
    m = nn.Linear(16, 16)
    with pytest.warns(RuntimeWarning, match=r"step_000000002 is unusable \(local copy\).*checksum"):
        res = CheckpointManager(tmp_path / "local", mirror=mirror).load(m)
    assert (res.step, res.source) == (2, "mirror") and torch.equal(m.weight, model_at(2).weight)
    assert (newest / "manifest.json").exists()  # the good copy is back in place
    # a reader (writer=False) does not download: a mirror-only newest stops it, no silent step 1
    shutil.rmtree(newest)
    with pytest.raises(CheckpointLoadError, match="step_000000002.*only the mirror"):
        CheckpointManager(tmp_path / "local", mirror=mirror, writer=False).load(nn.Linear(16, 16))


def test_unreachable_mirror_and_no_local_checkpoint_is_not_a_fresh_start(tmp_path):
    class Down(CheckpointMirror):
        def list(self):
            raise OSError("network is unreachable")

    with pytest.warns(RuntimeWarning, match="cannot list mirror"):
        mgr = CheckpointManager(tmp_path / "local", mirror=Down(f"file://{tmp_path}/remote"))
        with pytest.raises(CheckpointLoadError, match="cannot tell whether this is a fresh start"):
            mgr.load(nn.Linear(16, 16))


LOST_DISK_STEPS, LOST_DISK_WIDTH = 400, 256


@pytest.fixture(scope="module")
def lost_disk_reference(tmp_path_factory):
    """The uninterrupted run both mirror kinds' lost-disk resumes are compared with (trained once)."""
    ref = tmp_path_factory.mktemp("lost-disk-ref")
    tiny_loop.run(ref, LOST_DISK_STEPS, save_every=None, width=LOST_DISK_WIDTH)
    return ref


def test_lost_local_disk_resumes_from_the_mirror_bit_exact(tmp_path, kind, options, lost_disk_reference):
    steps, width, ref = LOST_DISK_STEPS, LOST_DISK_WIDTH, lost_disk_reference
    mirror = mirror_for(kind, tmp_path, options)
    run = tmp_path / "run"
    args = ["--dir", run, "--steps", steps, "--save-every", 10, "--width", width, "--mirror", mirror.url]
    if options:
        args += ["--storage-options", json.dumps(options)]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "tiny_loop.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not mirror.list():
        time.sleep(0.05)  # mid-run, as soon as the mirror holds a complete checkpoint...
    proc.send_signal(signal.SIGKILL)  # ...the node dies
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the mirror had a checkpoint: {err}"
    shutil.rmtree(run / "ckpt")  # and its disk is gone
    summary = tiny_loop.run(run, steps, save_every=10, width=width, mirror=mirror.url, storage_options=options)
    assert summary["resumed_from"]["source"] == "mirror" and summary["resumed_from"]["step"] >= 10
    got = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(steps)) and [r["loss"] for r in got] == [r["loss"] for r in want]
    a, b = load_file(run / "final.safetensors"), load_file(ref / "final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_upload_retries_until_the_target_recovers(tmp_path):
    blocker = tmp_path / "remote"
    blocker.write_text("a file where the mirror directory should be")  # every upload fails for now
    attempts = []

    def repair(attempt, exc):
        attempts.append((attempt, type(exc).__name__))
        if attempt == 1:  # the storage comes back (its folder is there again) before the third attempt
            blocker.unlink()
            blocker.mkdir()

    mirror = CheckpointMirror(f"file://{blocker}", retries=3, backoff_s=0.01, on_failure=repair)
    mgr = CheckpointManager(tmp_path / "local", mirror=mirror)
    mgr.save(1, model=model_at(1))
    mgr.close()
    assert [a for a, _ in attempts] == [0, 1] and mirror.failures == []
    assert list(mirror.list()) == ["step_000000001"]


def test_an_upload_never_creates_a_missing_file_mirror_root(tmp_path):
    """The share unmounted mid-run (the root renamed away): the next upload fails and warns, the
    local copy stays; it used to create the root afresh (makedirs), so a later resume with the
    local disk lost took that new, partial folder for the mirror. A resume meanwhile warns and
    takes the newest local checkpoint. The share back: uploads resume."""
    mirror = mirror_for("file", tmp_path, retries=0, skip_superseded=False)
    mgr = CheckpointManager(tmp_path / "local", keep_last=3, mirror=mirror)
    mgr.save(1, model=model_at(1))
    mgr.wait()
    (tmp_path / "remote").rename(tmp_path / "away")
    with pytest.warns(RuntimeWarning, match="mirror upload of step_000000002 .* failed.*does not exist"):
        mgr.save(2, model=model_at(2))
        mgr.wait()
    assert not (tmp_path / "remote").exists()
    with pytest.warns(RuntimeWarning, match="cannot list mirror"):  # a resume meanwhile: the local newest
        assert CheckpointManager(tmp_path / "local", mirror=mirror, writer=False).load(nn.Linear(16, 16)).step == 2
    (tmp_path / "away").rename(tmp_path / "remote")
    mgr.save(3, model=model_at(3))
    mgr.close()
    assert sorted(mirror.list()) == ["step_000000001", "step_000000003"]
    assert [n for n, _ in mgr.checkpoints()] == ["step_000000001", "step_000000002", "step_000000003"]


def test_upload_that_keeps_failing_warns_and_training_goes_on(tmp_path):
    blocker = tmp_path / "remote"
    blocker.write_text("not a directory")
    mirror = CheckpointMirror(f"file://{blocker}", retries=1, backoff_s=0.0)
    mgr = CheckpointManager(tmp_path / "local", mirror=mirror)
    with pytest.warns(RuntimeWarning, match="mirror upload of step_000000001 .* failed after 2 attempts"):
        mgr.save(1, model=model_at(1))
        mgr.close()
    assert [n for n, _ in mirror.failures] == ["step_000000001"]
    assert [n for n, _ in mgr.checkpoints()] == ["step_000000001"]  # the local tier is intact


def test_interrupted_upload_is_never_used_and_is_pruned(tmp_path):
    mirror = mirror_for("file", tmp_path)
    partial = tmp_path / "remote" / "step_000000099"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half")  # no manifest: the upload never committed
    assert mirror.list() == {}
    m = nn.Linear(16, 16)
    assert CheckpointManager(tmp_path / "local", mirror=mirror).load(m) is None
    mgr = CheckpointManager(tmp_path / "local", mirror=mirror)
    mgr.save(1, model=model_at(1))
    mgr.close()
    assert not partial.exists() and list(mirror.list()) == ["step_000000001"]


@pytest.mark.parametrize("kwargs, err, needle", [
    (dict(url=""), ValueError, "url"), (dict(url="file:///tmp/x", retries=-1), ValueError, "retries"),
    (dict(url="file:///tmp/x", backoff_s=-1), ValueError, "backoff_s")])
def test_mirror_validates_arguments(kwargs, err, needle):
    with pytest.raises(err, match=needle):
        CheckpointMirror(**kwargs)
    with pytest.raises(TypeError, match="mirror"):
        CheckpointManager("/tmp/unused-ckpt-root", mirror=42, writer=False)


def test_a_missing_file_mirror_root_is_an_error_not_an_empty_mirror(tmp_path):
    """An unmounted share: the file:// root is not there. Listing it raises; a resume with no
    local checkpoint refuses; a fresh run creates the root only when its parent exists, and
    refuses a mirror that already holds checkpoints (its uploads would replace them)."""
    from course_lib.checkpoint.mirror import MirrorRootMissing
    from course_lib.checkpoint.tiers import check_fresh_mirror

    gone = CheckpointMirror(f"file://{tmp_path}/share/run1")
    with pytest.raises(MirrorRootMissing, match="does not exist"):
        gone.list()
    with pytest.warns(RuntimeWarning, match="cannot list mirror"):
        mgr = CheckpointManager(tmp_path / "local", mirror=gone)
        with pytest.raises(CheckpointLoadError, match="does not exist.*cannot tell whether this is a fresh start"):
            mgr.load(nn.Linear(16, 16))
    with pytest.raises(MirrorRootMissing, match="parent folder does not exist"):
        check_fresh_mirror(gone)  # never builds /share/run1 inside a bare mount point
    assert not (tmp_path / "share").exists()
    (tmp_path / "share").mkdir()
    check_fresh_mirror(gone)  # a new run starts its mirror
    assert gone.list() == {}
    mgr = CheckpointManager(tmp_path / "local", mirror=gone)
    mgr.save(1, model=model_at(1))
    mgr.close()
    with pytest.raises(CheckpointError, match="already holds 1 checkpoint.*--resume auto"):
        check_fresh_mirror(gone)


def test_a_file_mirror_root_that_is_a_file_is_not_an_empty_mirror(tmp_path):
    """A file where the mirror's folder should be (a mount point gone wrong) lists as an error,
    not as an empty mirror (fsspec lists a file as itself: it used to read as "no checkpoints");
    a resume with nothing local refuses, a fresh run refuses to start on it."""
    from course_lib.checkpoint.mirror import MirrorRootMissing
    from course_lib.checkpoint.tiers import check_fresh_mirror

    (tmp_path / "share").write_text("not a folder")
    mirror = CheckpointMirror(f"file://{tmp_path}/share")
    with pytest.raises(MirrorRootMissing, match="not a folder"):
        mirror.list()
    with pytest.warns(RuntimeWarning, match="cannot list mirror"):
        with pytest.raises(CheckpointLoadError, match="cannot tell whether this is a fresh start"):
            CheckpointManager(tmp_path / "local", mirror=mirror).load(nn.Linear(16, 16))
    with pytest.raises(MirrorRootMissing, match="not a folder"):
        check_fresh_mirror(mirror)
