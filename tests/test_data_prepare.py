"""`course data prepare`: text -> token file + sidecar, locally (no network), atomically; the ids
decode back to the text; the file is what data.task = "tokens" accepts."""
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from course_lib.trainer import config as train_config
from course_lib.cli import main
from course_lib.data import DEFAULT_TEXT
from course_lib.data.prepare import dtype_for_vocab, prepare

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test: the command must work offline."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def write_text(path: Path) -> str:
    """The kit's notes plus what breaks naive tokenizers: non-ASCII, CRLF, tabs, blank lines, no final newline."""
    text = (DEFAULT_TEXT.read_text(encoding="utf-8") + "Ünïcödé — ∑ 日本語 🙂\r\nwindows line\r\n\n\ttabs  and   "
            "spaces \n  leading spaces, and no newline at the end")
    path.write_bytes(text.encode("utf-8"))
    return text


def decode(tokenizer_json: str, ids: np.ndarray) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_json).decode(ids.tolist(), skip_special_tokens=False)


def test_prepare_trains_a_bpe_and_the_ids_decode_to_the_text(tmp_path, capsys, no_network):
    text = write_text(tmp_path / "in.txt")
    assert main(["data", "prepare", str(tmp_path / "in.txt"), "--out", str(tmp_path / "corpus"),
                 "--vocab-size", "300"]) == 0
    printed = capsys.readouterr().out
    side = json.loads((tmp_path / "corpus.json").read_text())
    ids = np.fromfile(tmp_path / "corpus.bin", dtype="<u2")
    assert side["dtype"] == "uint16" and side["tokens"] == len(ids) and side["vocab_size"] == 300
    assert side["bytes"] == (tmp_path / "corpus.bin").stat().st_size == 2 * len(ids)
    assert len(ids) < 0.8 * len(text.encode())  # merges happened: fewer tokens than bytes
    assert int(ids.max()) == side["max_token_id"] < 300
    assert decode(side["tokenizer"]["path"], ids) == text  # exact, CRLF and all
    assert side["tokenizer"]["path"] == str((tmp_path / "corpus.tokenizer.json").resolve())
    assert 'task = "tokens"' in printed and "vocab_size = 300" in printed
    assert not list(tmp_path.glob("*.tmp-*"))  # temporaries renamed or removed
    # a loaded tokenizer gives the same ids; its hash is recorded
    again = prepare(tmp_path / "in.txt", tmp_path / "again.bin", tokenizer_path=tmp_path / "corpus.tokenizer.json")
    assert np.array_equal(np.fromfile(tmp_path / "again.bin", dtype="<u2"), ids)
    assert again["tokenizer"]["sha256"] == side["tokenizer"]["sha256"] and again["tokenizer"]["kind"] == "loaded"
    # the trainer takes the file with the printed keys
    cfg = train_config.load(TINY, [f"data.{k}={json.dumps(v)}" for k, v in side["train_config"].items()])
    assert cfg["data"]["vocab_size"] == 300


def test_a_vocabulary_beyond_16_bits_writes_uint32(tmp_path, no_network):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)} | {"[UNK]": 70_000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("w0 w69999 w65536\nw3 nothing\n")
    side = prepare(tmp_path / "in.txt", tmp_path / "out", tokenizer_path=tmp_path / "big.json")
    assert side["dtype"] == "uint32" and side["round_trip_first_batch"] is False  # word-level drops spaces
    assert np.fromfile(tmp_path / "out.bin", dtype="<u4").tolist() == [0, 69999, 65536, 3, 70_000]
    assert [dtype_for_vocab(v) for v in (256, 65536, 65537)] == ["uint16", "uint16", "uint32"]


@pytest.mark.parametrize("args, words", [
    (["missing.txt", "--vocab-size", "300"], "no such file"),
    (["in.txt", "--vocab-size", "100"], "--vocab-size must be in [256"),
    (["in.txt", "--tokenizer", "none.json"], "--tokenizer: no such file"),
    (["in.txt", "--tokenizer", "in.txt"], "not a tokenizers JSON file"),
    (["latin1.txt", "--vocab-size", "300"], "not UTF-8"),
    (["in.txt", "--vocab-size", "300", "--min-frequency", "-1"], "--min-frequency must be an integer in [0, "),
])
def test_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "in.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["data", "prepare", *args, "--out", "out"]) == 2
    assert words in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_dotted_out_names_keep_their_whole_name_and_never_overwrite_without_force(tmp_path, capsys, no_network):
    """``--out dp/wiki.train`` then ``--out dp/wiki.val``: two corpora side by side (``with_suffix``
    used to write both to dp/wiki.bin, the validation text replacing the training one); a third
    call onto an existing output is refused unless --force, naming the file and writing nothing."""
    (tmp_path / "train.txt").write_text("the training corpus, many words " * 40 + "\n")
    (tmp_path / "val.txt").write_text("held out text for validation\n" * 5)
    dp = tmp_path / "dp"
    dp.mkdir()
    assert main(["data", "prepare", str(tmp_path / "train.txt"), "--out", str(dp / "wiki.train"),
                 "--vocab-size", "300"]) == 0
    train_ids = np.fromfile(dp / "wiki.train.bin", dtype="<u2")
    assert main(["data", "prepare", str(tmp_path / "val.txt"), "--out", str(dp / "wiki.val"),
                 "--tokenizer", str(dp / "wiki.train.tokenizer.json")]) == 0
    assert sorted(p.name for p in dp.iterdir()) == ["wiki.train.bin", "wiki.train.json", "wiki.train.tokenizer.json",
                                                    "wiki.val.bin", "wiki.val.json"]
    assert np.array_equal(np.fromfile(dp / "wiki.train.bin", dtype="<u2"), train_ids)
    assert json.loads((dp / "wiki.val.json").read_text())["train_config"]["path"] == str(dp / "wiki.val.bin")
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in dp.iterdir()}
    assert main(["data", "prepare", str(tmp_path / "val.txt"), "--out", str(dp / "wiki.train"),
                 "--tokenizer", str(dp / "wiki.train.tokenizer.json")]) == 2
    err = capsys.readouterr().err
    assert str(dp / "wiki.train.bin") in err and "--force" in err and "nothing was written" in err
    assert {p.name: p.read_bytes() for p in dp.iterdir()} == before
    assert main(["data", "prepare", str(tmp_path / "val.txt"), "--out", str(dp / "wiki.train.bin"),
                 "--tokenizer", str(dp / "wiki.train.tokenizer.json"), "--force"]) == 0
    assert len(np.fromfile(dp / "wiki.train.bin", dtype="<u2")) < len(train_ids)  # replaced, as asked


def test_no_output_is_an_input_and_out_is_never_a_folder(tmp_path, capsys, monkeypatch, no_network):
    """``prepare corpus.json --out corpus --force`` used to replace its own text with the sidecar,
    and ``--out outdir/`` (an existing folder) wrote ``outdir.bin`` beside it: both are refused with
    exit 2, naming the argument, nothing written or changed."""
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "corpus.json")  # a text file that happens to be named like the sidecar
    (tmp_path / "outdir").mkdir()
    (tmp_path / "link.txt").symlink_to(tmp_path / "corpus.json")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    for args, words in [(["corpus.json", "--out", "corpus", "--force"], "input 'corpus.json' is 'corpus.json'"),
                        (["link.txt", "--out", "./corpus.bin", "--force"], "one of the outputs of --out"),
                        (["link.txt", "--out", "outdir/"], "--out: 'outdir/' is a folder"),
                        (["link.txt", "--out", "outdir"], "--out: 'outdir' is a folder"),
                        (["link.txt", "--out", "out", "--min-frequency", "-1"], "--min-frequency must be")]:
        assert main(["data", "prepare", *args, "--vocab-size", "300"]) == 2, args
        assert words in capsys.readouterr().err, args
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
        assert not any((tmp_path / "outdir").iterdir()) and not (tmp_path / "outdir.bin").exists()
