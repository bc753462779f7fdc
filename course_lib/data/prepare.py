"""``course data prepare``: a text file -> a token file the trainer reads (``data.task = "tokens"``).

    course data prepare corpus.txt --out data/corpus --vocab-size 8000      # train a byte-level BPE here
    course data prepare corpus.txt --out data/corpus --tokenizer tok.json   # or use a local tokenizer.json

writes, each atomically (a temporary file in the same folder, fsynced, then renamed):

* ``data/corpus.bin``: the ids back to back, little-endian uint16 when the vocabulary fits
  (<= 65,536 ids), else uint32 - the layout nanoGPT, llm.c and Megatron users know;
* ``data/corpus.json``: a sidecar with the vocabulary size, dtype, token count, the tokenizer's
  path and sha256 and the source's, and the ``[data]`` keys to train on it;
* ``data/corpus.tokenizer.json`` when a tokenizer was trained (HuggingFace ``tokenizers`` format).

The whole ``--out`` name is the prefix: ``--out data/wiki.train`` writes ``data/wiki.train.bin``,
``data/wiki.train.json`` (never ``data/wiki.bin``: a second call with ``--out data/wiki.val`` must
not replace the training corpus). An existing output is never overwritten unless ``--force`` is
given: the command refuses, naming the file, before writing anything. No output may be the input
text or the ``--tokenizer`` file, ``--force`` or not (``prepare corpus.json --out corpus`` is refused,
not the text replaced by the sidecar), and ``--out`` may not be a folder (``--out data/`` is refused:
give the prefix inside it, ``data/corpus``).

Tokenizers come from the HuggingFace ``tokenizers`` library, trained or loaded from a local file:
nothing is downloaded (``Tokenizer.from_pretrained`` is never called). The text is read as UTF-8
with line endings kept as they are and encoded one line at a time (lines batched for speed), so
the output does not depend on the batch size, and for a byte-level BPE decoding the ids gives the
text back exactly. A tokenizer that normalises (lower-casing, NFKC, ...) cannot give it back; the
summary says whether the first lines round-trip.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

PROGRESS_MIN_BYTES = 8 << 20  # a progress bar for inputs of 8 MiB and more
BATCH_BYTES = 4 << 20  # text per encode_batch call: ~4 MiB of lines
MIN_VOCAB = 256  # a byte-level BPE starts from the 256 byte symbols


class PrepareError(ValueError):
    """The input, the tokenizer or the output cannot be used; the message says which and why."""


def dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits 16 bits, else ``"uint32"``."""
    if vocab_size > 2**32:
        raise PrepareError(f"vocabulary of {vocab_size:,} ids does not fit uint32")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _lines(path: Path, bar=None) -> Iterator[str]:
    """The file's lines with their endings as written (newline=""), UTF-8, strictly decoded."""
    with open(path, encoding="utf-8", newline="") as f:
        for line in f:
            if bar is not None:
                bar.update(len(line.encode("utf-8")))
            yield line


def _batches(lines: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for line in lines:
        batch.append(line)
        size += len(line)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def train_byte_bpe(text_path: Path, vocab_size: int, *, min_frequency: int = 2, progress: bool = False):
    """A byte-level BPE (GPT-2's pre-tokenization, no normaliser, no prefix space) trained on
    ``text_path`` with at most ``vocab_size`` ids (the 256 byte symbols included). Local only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_lines(text_path), trainer=trainer)
    return tok


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _replace_atomically(tmp: Path, final: Path) -> None:
    """fsync ``tmp``, rename it over ``final`` and fsync the folder: a reader sees the old file or
    the whole new one, never a part."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def output_paths(out: str | Path, *, trains_tokenizer: bool) -> dict[str, Path]:
    """The files ``--out OUT`` names: ``{"bin": OUT.bin, "json": OUT.json}`` plus ``"tokenizer":
    OUT.tokenizer.json`` when a tokenizer is trained. The whole name is the prefix, dots and all
    (``wiki.train`` -> ``wiki.train.bin``); a trailing ``.bin`` is accepted and dropped."""
    out = Path(out)
    if out.name.endswith(".bin"):
        out = out.with_name(out.name[: -len(".bin")])
    paths = {"bin": out.with_name(f"{out.name}.bin"), "json": out.with_name(f"{out.name}.json")}
    if trains_tokenizer:
        paths["tokenizer"] = out.with_name(f"{out.name}.tokenizer.json")
    return paths


def prepare(text_path: str | Path, out: str | Path, *, vocab_size: int | None = None,
            tokenizer_path: str | Path | None = None, min_frequency: int = 2,
            progress: bool | None = None, force: bool = False) -> dict:
    """Tokenize ``text_path`` into ``<out>.bin`` + ``<out>.json`` (see the module docstring); train a
    byte-level BPE of ``vocab_size`` ids or load ``tokenizer_path`` (exactly one). ``progress``:
    a tqdm bar on stderr (None: only for inputs of PROGRESS_MIN_BYTES and more). ``force``:
    replace outputs that already exist (otherwise refused). Returns the sidecar dict. Raises
    PrepareError before writing anything when an input is unusable or an output exists."""
    text_path = Path(text_path)
    raw_out = str(out)
    out = Path(out)
    # "outdir/" and an existing folder name a folder: Path() drops the slash, and OUT.bin would land
    # beside the folder instead of in it.
    if (out.name in ("", ".", "..") or out.name == ".bin" or raw_out.endswith(("/", os.sep)) or out.is_dir()):
        raise PrepareError(f"--out: {raw_out!r} is a folder, not an output prefix like "
                           f"{str(out / 'corpus') if out.name not in ('', '.bin') else 'data/corpus'} "
                           f"(the whole name is the prefix of OUT.bin and OUT.json)")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or not 0 <= min_frequency < 2**63:
        raise PrepareError(f"--min-frequency must be an integer in [0, {2**63 - 1}] (the least count of a pair the "
                           f"BPE merges), got {min_frequency!r}")
    if (vocab_size is None) == (tokenizer_path is None):
        raise PrepareError("give exactly one of --vocab-size N (train a byte-level BPE) and --tokenizer PATH")
    if not text_path.is_file():
        raise PrepareError(f"input: no such file {str(text_path)!r} (a UTF-8 text file)")
    if vocab_size is not None and not MIN_VOCAB <= vocab_size <= 2**32:
        raise PrepareError(f"--vocab-size must be in [{MIN_VOCAB}, {2**32}] (a byte-level BPE holds the 256 byte "
                           f"symbols, then merges), got {vocab_size}")
    paths = output_paths(out, trains_tokenizer=tokenizer_path is None)
    if not paths["bin"].parent.is_dir():
        raise PrepareError(f"--out: folder {str(paths['bin'].parent)!r} does not exist")
    for key, p in paths.items():
        if p.is_dir():
            raise PrepareError(f"--out: {str(p)!r} is a folder; the {key} output cannot be written there. Choose "
                               f"another --out")
    # No output may be an input, --force or not: `prepare corpus.json --out corpus` would replace
    # its own text with the sidecar (resolve() sees through "./" and symlinks, samefile() through hard links).
    for what, given in (("input", text_path), ("--tokenizer", tokenizer_path)):
        if given is None:
            continue
        hit = [p for p in paths.values() if Path(given).resolve() == p.resolve()
               or (p.exists() and Path(given).exists() and os.path.samefile(given, p))]
        if hit:
            raise PrepareError(f"{what} {str(given)!r} is {str(hit[0])!r}, one of the outputs of --out {raw_out!r}; "
                               f"nothing was written. Choose another --out")
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        # Two corpora under one prefix (train and val) would silently replace each other.
        raise PrepareError(f"--out: {', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
                           f"nothing was written. Pass --force to replace, or choose another --out")
    try:
        return _prepare(text_path, paths, vocab_size, tokenizer_path, min_frequency, progress)
    except UnicodeDecodeError as exc:
        raise PrepareError(f"input: {text_path} is not UTF-8 text ({exc.reason} at byte {exc.start} of a "
                           f"line); nothing was written") from None


def _prepare(text_path: Path, paths: dict[str, Path], vocab_size: int | None, tokenizer_path, min_frequency: int,
             progress: bool | None) -> dict:
    source_bytes = text_path.stat().st_size
    show = source_bytes >= PROGRESS_MIN_BYTES if progress is None else progress
    t0 = time.perf_counter()
    if tokenizer_path is not None:
        from tokenizers import Tokenizer

        tokenizer_path = Path(tokenizer_path)
        if not tokenizer_path.is_file():
            raise PrepareError(f"--tokenizer: no such file {str(tokenizer_path)!r} (a tokenizer.json saved by the "
                               f"HuggingFace tokenizers library; nothing is downloaded)")
        try:
            tok = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise PrepareError(f"--tokenizer: {tokenizer_path} is not a tokenizers JSON file: {exc}") from None
        kind = "loaded"
    else:
        tok = train_byte_bpe(text_path, vocab_size, min_frequency=min_frequency, progress=show)
        kind = "trained byte-level BPE"
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = dtype_for_vocab(vocab)
    item = np.dtype(dtype).itemsize

    bin_path = paths["bin"]
    tmp_bin = bin_path.with_name(f"{bin_path.name}.tmp-{os.getpid()}")
    written, top, round_trip = 0, -1, None
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=source_bytes, unit="B", unit_scale=True, desc="tokenize", file=sys.stderr)
    try:
        with open(tmp_bin, "wb") as f:
            for lines in _batches(_lines(text_path, bar)):
                encodings = tok.encode_batch(lines, add_special_tokens=False)
                ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64)
                if round_trip is None:  # the first batch: does decoding give the text back?
                    round_trip = tok.decode([int(i) for i in ids], skip_special_tokens=False) == "".join(lines)
                if len(ids):
                    top = max(top, int(ids.max()))
                f.write(ids.astype(f"<u{item}").tobytes())
                written += len(ids)
        if written == 0:
            raise PrepareError(f"input: {text_path} gave no tokens (an empty file?)")
        if top >= vocab:
            raise PrepareError(f"the tokenizer produced id {top} but reports {vocab} ids")
        tok_file = tokenizer_path
        if tokenizer_path is None:  # save the trained tokenizer next to the data, atomically too
            tok_file = paths["tokenizer"]
            tmp_tok = tok_file.with_name(f"{tok_file.name}.tmp-{os.getpid()}")
            tok.save(str(tmp_tok))
            _replace_atomically(tmp_tok, tok_file)
        _replace_atomically(tmp_bin, bin_path)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    import tokenizers

    sidecar = {
        "format": "course-tokens/1",
        "bin": bin_path.name, "dtype": dtype, "byte_order": "little", "tokens": written,
        "bytes": written * item, "vocab_size": vocab, "max_token_id": top, "vocab_size_asked": vocab_size,
        "tokenizer": {"path": str(Path(tok_file).resolve()), "sha256": _sha256(Path(tok_file)), "kind": kind,
                      "library": f"tokenizers {tokenizers.__version__}"},
        "source": {"path": str(text_path.resolve()), "bytes": source_bytes, "sha256": _sha256(text_path)},
        "round_trip_first_batch": round_trip,
        "seconds": round(time.perf_counter() - t0, 3),
        "train_config": {"task": "tokens", "path": str(bin_path), "dtype": dtype, "vocab_size": vocab},
    }
    tmp_json = paths["json"].with_name(f"{paths['json'].name}.tmp-{os.getpid()}")
    tmp_json.write_text(json.dumps(sidecar, indent=2) + "\n")
    _replace_atomically(tmp_json, paths["json"])
    return sidecar


def summary(sidecar: dict) -> str:
    """What ``course data prepare`` prints: counts, sizes, and the ``[data]`` keys to train on it."""
    s, d = sidecar, sidecar["train_config"]
    per_token = s["source"]["bytes"] / s["tokens"]
    trip = {True: "decoding the first lines gives them back exactly",
            False: "the tokenizer normalises: decoding does NOT give the text back", None: "n/a"}[
        s["round_trip_first_batch"]]
    asked = s.get("vocab_size_asked")
    if asked and asked != s["vocab_size"]:  # the text had fewer frequent pairs than merges asked for
        trip += f"; {asked:,} ids were asked for, the text gave {s['vocab_size']:,} (use the latter)"
    return (f"wrote {d['path']}: {s['tokens']:,} tokens ({s['dtype']}, {s['bytes'] / 2**20:.2f} MiB) from "
            f"{s['source']['bytes'] / 2**20:.2f} MiB of text, {per_token:.2f} bytes/token, in {s['seconds']:.1f} s\n"
            f"tokenizer: {s['tokenizer']['kind']}, {s['vocab_size']:,} ids, {s['tokenizer']['path']}; {trip}\n"
            f"sidecar: {output_paths(d['path'], trains_tokenizer=False)['json']}\n"
            f"train on it with:\n  [data]\n  task = \"tokens\"\n  path = \"{d['path']}\"\n  dtype = \"{d['dtype']}\"\n"
            f"  vocab_size = {d['vocab_size']}")


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------

def add_data_parser(sub) -> None:
    """``course data prepare`` under the ``course`` command's subparsers."""
    p = sub.add_parser("data", help="prepare training data (a token file from text)")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenize a text file into OUT.bin (+ OUT.json) for data.task = tokens")
    prep.add_argument("input", help="UTF-8 text file")
    prep.add_argument("--out", required=True, help="output prefix, the whole name: writes OUT.bin and OUT.json "
                                                   "(and OUT.tokenizer.json when training one; OUT.bin accepted too)")
    how = prep.add_mutually_exclusive_group(required=True)
    how.add_argument("--vocab-size", type=int, help=f"train a byte-level BPE of this many ids (>= {MIN_VOCAB}) here")
    how.add_argument("--tokenizer", help="a local tokenizer.json (HuggingFace tokenizers); nothing is downloaded")
    prep.add_argument("--min-frequency", type=int, default=2,
                      help="BPE training: least count of a merged pair (an integer >= 0; default 2)")
    prep.add_argument("--force", action="store_true",
                      help="replace OUT.bin / OUT.json / OUT.tokenizer.json if they exist (default: refuse)")
    prep.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help=f"progress bar (default: for inputs of {PROGRESS_MIN_BYTES >> 20} MiB and more)")
    prep.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """Exit 0 with a printed summary, or 2 with the reason on stderr (nothing written)."""
    try:
        sidecar = prepare(args.input, args.out, vocab_size=args.vocab_size, tokenizer_path=args.tokenizer,
                          min_frequency=args.min_frequency, progress=args.progress,
                          force=args.force)
    except PrepareError as exc:
        print(f"course data prepare: {exc}", file=sys.stderr)
        return 2
    print(summary(sidecar), flush=True)
    return 0
