"""The kill harness (course_lib.labs.lab07_checkpoints): a torn in-place save is seen torn, an atomic one
intact, and a writer that fails is reported with its traceback. Small states, a few kills each."""
import textwrap

import pytest
import torch

from course_lib.labs.lab07_checkpoints import (WriterFailed, kill_while_saving, loaded_step, make_state,
                                        state_step)

NUMEL = 500_000  # 2 MB: a save takes milliseconds, long enough to be killed inside

# Written to a file, as a notebook's %%writefile would: the harness imports writers by name.
WRITERS = textwrap.dedent('''
    import os
    from pathlib import Path

    import torch


    def atomic(state, folder, step, keep_last):
        path = Path(folder) / f"step_{step:06d}.pt"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for old in sorted(Path(folder).glob("step_*.pt"))[:-keep_last]:
            old.unlink()


    def broken(state, folder, step):
        raise OSError("No space left on device (simulated)")
''')


@pytest.fixture
def writers(tmp_path):
    (tmp_path / "kill_writers.py").write_text(WRITERS)
    return tmp_path


def test_state_round_trip_and_a_mixed_state_is_refused(tmp_path):
    torch.save(make_state(7, 10), tmp_path / "a.pt")
    assert loaded_step(tmp_path / "a.pt") == 7
    mixed = make_state(7, 10)
    mixed["w"][3] = 6.0  # half of one save, half of another
    assert state_step(mixed) is None and state_step({"step": 1}) is None
    (tmp_path / "torn.pt").write_bytes((tmp_path / "a.pt").read_bytes()[:100])
    assert loaded_step(tmp_path / "torn.pt") is None and loaded_step(tmp_path / "missing.pt") is None


def test_naive_save_killed_mid_write_is_torn(tmp_path):
    reports = kill_while_saving("course_lib.labs.lab07_checkpoints:torch_save_in_place", tmp_path / "naive",
                                cycles=4, numel=NUMEL, final="latest.pt")
    assert [r.cycle for r in reports] == [0, 1, 2, 3] and [r.targeted for r in reports] == [False, True] * 2
    for r in reports:
        assert r.saves >= 2 and r.period_s > 0 and r.final == ("latest.pt",) and r.leftovers == ()
    targeted = [r for r in reports if r.targeted]
    assert all(r.in_write for r in targeted), "the harness should see the in-place rewrite (a short file)"
    assert all(loaded_step(r.folder / "latest.pt") is None for r in targeted), "a kill mid-write tears the file"


def test_atomic_save_survives_every_kill(writers, tmp_path):
    reports = kill_while_saving("kill_writers:atomic", tmp_path / "atomic", cycles=4, numel=NUMEL,
                                kwargs={"keep_last": 2}, path=[writers], final="step_*.pt")
    for r in reports:
        assert r.final, f"cycle {r.cycle}: no checkpoint left"
        newest = r.final[-1]
        assert loaded_step(r.folder / newest) == int(newest[5:11]), f"cycle {r.cycle}: {newest} is not intact"
    targeted = [r for r in reports if r.targeted]
    assert all(r.in_write and r.leftovers for r in targeted), "targeted kills should land while a temp file exists"


def test_a_failing_writer_is_reported_with_its_error(writers, tmp_path):
    with pytest.raises(WriterFailed, match="No space left on device"):
        kill_while_saving("kill_writers:broken", tmp_path / "broken", cycles=1, numel=10, path=[writers])
    with pytest.raises(WriterFailed, match="ModuleNotFoundError"):
        kill_while_saving("no_such_module:save", tmp_path / "missing", cycles=1, numel=10)
    with pytest.raises(ValueError, match="module:function"):
        kill_while_saving("kill_writers.atomic", tmp_path / "x", cycles=1)
    with pytest.raises(ValueError, match="cycles"):
        kill_while_saving("kill_writers:atomic", tmp_path / "x", cycles=0)
