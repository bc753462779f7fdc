"""Weights files from outside the run, damaged: a truncated ``model.safetensors`` as
``model.init_from`` (a Hugging Face folder) or a truncated consolidated file given to ``course
ckpt export-hf`` / ``consolidate`` is exit 2 with a sentence naming the file, and nothing is
written (issue 44, item 10: it was a safetensors traceback, exit 1).

The check is the torch-free header read (:func:`course_lib.model.hf_map.safetensors_header`): every
tensor's byte range must be its shape times its dtype's size, the ranges must follow one another,
and the last must end where the file does. Tiny models only (TinyGPT ``tiny``, vocab 64): well under
a second of work beyond the imports.
"""
from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from course_lib import cli
from course_lib.model import ModelConfig, TinyGPT
from course_lib.model.hf_map import safetensors_header
from course_lib.model.init_source import CONFIG_KEY
from course_lib.train import main as train_main

TINY = ModelConfig.preset("tiny", vocab_size=64, block_size=32)
TOML = "labs/configs/tiny-cpu.toml"


def consolidated(path, cfg=TINY):
    """A consolidated file as ``course ckpt consolidate`` writes it (tied head stored once)."""
    sd = {k: v for k, v in TinyGPT(cfg).state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(path), metadata={CONFIG_KEY: json.dumps(cfg.to_dict())})
    return path


def cut(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def test_the_header_read_refuses_every_truncation_and_passes_the_whole_file(tmp_path):
    f = consolidated(tmp_path / "w.safetensors")
    whole = f.read_bytes()
    shapes, meta = safetensors_header(f)
    assert shapes["tok_emb.weight"] == (64, 64) and CONFIG_KEY in meta
    (n,) = __import__("struct").unpack("<Q", whole[:8])
    for keep in (4, 8 + n // 2, 8 + n, 8 + n + 100, len(whole) - 1):  # in the length, header, data, last byte
        cut(f, keep)
        with pytest.raises(ValueError, match="truncated|not a safetensors file"):
            safetensors_header(f)
        f.write_bytes(whole)
    f.write_bytes(whole + b"\0" * 8)  # bytes after the last tensor: not what safetensors wrote either
    with pytest.raises(ValueError, match="the file holds"):
        safetensors_header(f)


def test_a_truncated_init_from_is_a_config_error_and_no_run_folder(tmp_path, capsys):
    """An HF folder (config.json + model.safetensors, HF's names) whose weights file lost its tail:
    `course train` exits 2 naming the file, and the run folder is never made."""
    from course_lib.model.hf_map import hf_config_kwargs
    from course_lib.model.hf_weights import to_hf

    folder = tmp_path / "hf"
    folder.mkdir()
    llama = ModelConfig.preset("llama-tiny", vocab_size=64, block_size=32)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **hf_config_kwargs(llama)[1]}))
    weights = folder / "model.safetensors"
    save_file(to_hf(TinyGPT(llama).state_dict(), llama), str(weights), metadata={"format": "pt"})
    overrides = ["--set", "model.preset='llama-tiny'", "--set", f"model.init_from='{folder}'",
                 "--set", "model.vocab_size=64", "--set", "data.seq_len=32", "--set", "model.block_size=32"]
    assert train_main(["--config", TOML, "--out", str(tmp_path / "ok"), *overrides, "--check-config"]) == 0
    cut(weights, weights.stat().st_size - 1000)
    capsys.readouterr()
    out = tmp_path / "run"
    assert train_main(["--config", TOML, "--out", str(out), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model.init_from") and str(weights) in err and "truncated" in err, err
    assert not out.exists()


def test_a_truncated_consolidated_file_is_refused_by_export_and_consolidate(tmp_path, capsys):
    pytest.importorskip("transformers")
    f = consolidated(tmp_path / "w.safetensors")
    cut(f, f.stat().st_size - 100)
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (["export-hf", str(f), "--out", str(tmp_path / "hf")],
                 ["consolidate", str(f), "--out", str(tmp_path / "again.safetensors")]):
        assert cli.main(["ckpt", *args]) == 2, args
        err = capsys.readouterr().err
        assert str(f) in err and "truncated" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no .tmp-* left
