"""data.task = "tokens": a flat file of token ids through a memory map; every bad input refused at
config time; global batches independent of the world size; a resumed run on another world size
gives the losses of an uninterrupted one."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import token_rank_fns
from course_lib.trainer import config as train_config
from course_lib.data import DEFAULT_TEXT, BatchStream
from course_lib.trainer.metrics import read_rows
from course_lib.parallel import run_ranks
from course_lib.data.tokens import LLMC_MAGIC, TokenFile
from course_lib.train import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"


def notes_as_tokens(path: Path, dtype: str = "<u2") -> np.ndarray:
    """The kit's training notes, one token per byte: text, so different batches give different losses."""
    ids = np.frombuffer(DEFAULT_TEXT.read_bytes(), dtype=np.uint8).astype(dtype)
    ids.tofile(path)
    return ids


def cfg(path, *sets):
    return train_config.load(TINY, ["train.progress=false", "train.metrics_flush_s=0", "data.task='tokens'",
                                    f"data.path='{path}'", "data.vocab_size=256", *sets])


# ----------------------------------------------------------------------------- the file
def test_examples_are_the_files_windows_and_llmc_headers_are_skipped(tmp_path):
    ids = np.arange(1000, dtype="<u4") * 7 % 70_001  # ids above 65,535: uint32
    ids.tofile(tmp_path / "a.bin")
    data = TokenFile(tmp_path / "a.bin", dtype="uint32", seq_len=10)
    assert data.num_examples == 99  # (1000 - 1) // 10: windows of 11 tokens, one shared
    x, y = data.get_batch([0, 98, 5])
    assert x.dtype == torch.int64 and x.shape == (3, 10)
    for row, i in enumerate([0, 98, 5]):
        assert x[row].tolist() == ids[i * 10:i * 10 + 10].tolist()
        assert y[row].tolist() == ids[i * 10 + 1:i * 10 + 11].tolist()
    header = np.zeros(256, dtype="<i4")
    header[:3] = (LLMC_MAGIC, 1, 500)
    with open(tmp_path / "llmc.bin", "wb") as f:  # llm.c's layout: 1,024-byte header, uint16 ids
        f.write(header.tobytes() + (np.arange(500) % 300).astype("<u2").tobytes())
    llmc = TokenFile(tmp_path / "llmc.bin", dtype="uint16", seq_len=10)
    assert llmc.num_tokens == 500 and llmc.get_batch([0])[0][0].tolist() == list(range(10))


@pytest.mark.parametrize("case, words", [
    ("missing", ["data.path", "no such file"]),
    ("odd_size", ["data.path", "not a whole number of uint16", "uint16, uint32"]),
    ("too_short", ["data.path", "holds 40 tokens", "data.seq_len = 64 needs at least 65"]),
    ("id_too_big", ["data.path", "token id 300", ">= model.vocab_size = 256", "accepted ids: 0..255"]),
    ("val_id_too_big", ["data.val_path", "token id 300"]),
    ("no_path", ["data.task = 'tokens' needs data.path"]),
    ("val_without_tokens", ["data.val_path is only read by the tokens task"]),
    ("val_sharded", ["data.val_path is evaluated after the last step by rank 0", "'fsdp'"]),
])
def test_bad_token_files_are_config_errors_naming_the_key(tmp_path, case, words):
    good = tmp_path / "good.bin"
    notes_as_tokens(good)
    bad = tmp_path / "bad.bin"
    sets = {"missing": [f"data.path='{tmp_path / 'none.bin'}'"],
            "odd_size": [f"data.path='{bad}'"], "too_short": [f"data.path='{bad}'"],
            "id_too_big": [f"data.path='{bad}'"], "val_id_too_big": [f"data.val_path='{bad}'"],
            "no_path": ["data.path=''"], "val_without_tokens": ["data.task='markov'", "data.path=''",
                                                                  f"data.val_path='{good}'"],
            "val_sharded": ["train.strategy='fsdp'", f"data.val_path='{good}'"]}[case]
    if case == "odd_size":
        bad.write_bytes(good.read_bytes()[:-1])
    elif case == "too_short":
        np.arange(40, dtype="<u2").tofile(bad)
    elif case in ("id_too_big", "val_id_too_big"):
        ids = np.arange(1000, dtype="<u2") % 256
        ids[700] = 300
        ids.tofile(bad)
    with pytest.raises(train_config.ConfigError) as err:
        cfg(good, *sets)
    for word in words:
        assert word in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- sampling
def test_global_batches_do_not_depend_on_the_world_size_and_resume_anywhere(tmp_path):
    notes_as_tokens(tmp_path / "t.bin")
    data = TokenFile(tmp_path / "t.bin", seq_len=16)

    def global_batches(world, per_rank, steps, state=None):
        streams = [BatchStream(data, per_rank, rank=r, world_size=world, seed=5) for r in range(world)]
        if state is not None:
            for s in streams:
                s.load_state_dict(state)
        out = [torch.cat([next(s)[0] for s in streams]) for _ in range(steps)]
        return out, streams[0].state_dict()

    # 40 steps of 24 sequences cross two epochs of the 485 windows (a batch straddles them)
    one, _ = global_batches(1, 24, 40)
    for world, per_rank in ((2, 12), (4, 6)):
        assert all(torch.equal(a, b) for a, b in zip(one, global_batches(world, per_rank, 40)[0]))
    _, at_15 = global_batches(2, 12, 15)  # position saved by a 2-rank run after 15 steps...
    for world, per_rank in ((1, 24), (2, 12), (4, 6)):  # ...resumed on 1, 2 and 4 ranks
        rest, _ = global_batches(world, per_rank, 25, at_15)
        assert all(torch.equal(a, b) for a, b in zip(one[15:], rest))
    assert not torch.equal(one[15], one[0])  # a resume that replayed from 0 would be caught


# ----------------------------------------------------------------------------- training
def _losses(run):
    rows = read_rows(Path(run) / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in rows}


def test_tokens_run_resumed_on_another_world_size_matches_one_uninterrupted_process(tmp_path):
    ids = notes_as_tokens(tmp_path / "t.bin")
    ids[-1000:].tofile(tmp_path / "val.bin")  # 15 windows of 64 tokens
    steps, saved = 12, 6
    base = [f"train.max_steps={steps}", f"checkpoint.save_every={saved}", "schedule.warmup_steps=3"]
    val = f"data.val_path='{tmp_path / 'val.bin'}'"
    ref = train(cfg(tmp_path / "t.bin", *base, "train.micro_batch=8", val), tmp_path / "ref")
    assert ref.steps == steps
    want = _losses(tmp_path / "ref")
    # data.val_path: the loss of the final model on the validation file's windows, in one batch here
    x = torch.from_numpy(ids[-1000:].astype(np.int64))
    n = (len(x) - 1) // 64
    windows = torch.stack([x[i * 64:i * 64 + 65] for i in range(n)])
    with torch.no_grad():
        ref.model.eval()
        direct = float(ref.model(windows[:, :-1], windows[:, 1:])[1])
    assert ref.val_loss == pytest.approx(direct, rel=1e-5)
    assert json.loads((tmp_path / "ref" / "val.json").read_text())["sequences"] == n == 15
    token_rank_fns.copy_checkpoint(tmp_path / "ref", saved, tmp_path / "up")
    ddp = cfg(tmp_path / "t.bin", *base, "train.micro_batch=4", "train.strategy='ddp'")
    ddp_val = cfg(tmp_path / "t.bin", *base, "train.micro_batch=4", "train.strategy='ddp'", val)
    vals = run_ranks(token_rank_fns.tokens_runs, 2, ddp, ddp_val, str(tmp_path), saved)
    assert vals[1] is None and vals[0] == pytest.approx(ref.val_loss, rel=1e-4)  # rank 0 evaluates
    token_rank_fns.copy_checkpoint(tmp_path / "ddp", saved, tmp_path / "down")
    down = train(cfg(tmp_path / "t.bin", *base, "train.micro_batch=8"), tmp_path / "down", resume=True)
    assert down.resumed_from == saved
    for run, first in (("ddp", 1), ("up", saved + 1), ("same", saved + 1), ("down", saved + 1)):
        got = _losses(tmp_path / run)
        assert sorted(got) == list(range(first, steps + 1)), run
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=1e-4), (run, step)
        print(f"{run}: max relative loss difference to one process "
              f"{max(abs(got[s] / want[s] - 1) for s in got):.1e}")
    # The check can fail: the steps after the checkpoint read other batches than the first ones,
    # so a resume that replayed the data from position 0 would be off by far more than 1e-4.
    assert all(abs(want[saved + k] - want[k]) > 1e-2 * want[k] for k in range(1, 4)), want
