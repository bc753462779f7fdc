"""A tokenized corpus on disk: a flat file of token ids read through a memory map.

The convention nanoGPT, llm.c and Megatron users know: ``train.bin`` holds the token ids of the
whole corpus back to back, little-endian ``uint16`` (vocabularies up to 65,536) or ``uint32``, no
header (llm.c's 1,024-byte header, magic 20240520, is recognised and skipped). ``course data
prepare`` writes such a file from text (:mod:`course_lib.data.prepare`).

    data = TokenFile("corpus.bin", dtype="uint16", seq_len=256)
    batches = BatchStream(data, batch_size=8, rank=r, world_size=W, seed=0)   # course_lib.data

Example i is the window of seq_len + 1 tokens starting at token i * seq_len (consecutive windows
share one token: the last target of one is the first input of the next), so a file of n tokens
holds (n - 1) // seq_len examples and an epoch reads every token once. Which examples a rank reads
at each step is :class:`course_lib.data.ShardedSampler`'s business: a seeded permutation per epoch,
cut into global batches, each rank taking its rows. The position it saves is a global sample
count, so a resumed run - on the same or another number of data-parallel ranks, with the same
global batch - reads exactly the batches an uninterrupted run would have read.

Nothing is read into memory up front: a batch reads its windows' pages of the map.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from course_lib.validate import check_choice, check_int

# Little-endian whatever the host: the files are written on (little-endian) x86 and ARM machines.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
LLMC_MAGIC, LLMC_HEADER_BYTES = 20240520, 1024  # llm.c's train.bin: 256 int32, then uint16 tokens
SCAN_CHUNK = 1 << 24  # tokens per read when scanning for the largest id (32-64 MiB)


def _llmc_header_tokens(path: Path, size: int) -> int | None:
    """Token count from an llm.c header ([magic, version 1, n_tokens, 0...], 1,024 bytes), or None
    when the file does not start with one that matches its size."""
    if size < LLMC_HEADER_BYTES:
        return None
    head = np.fromfile(path, dtype="<i4", count=3)
    if len(head) == 3 and head[0] == LLMC_MAGIC and head[1] == 1 and \
            LLMC_HEADER_BYTES + 2 * int(head[2]) == size:
        return int(head[2])
    return None


def open_tokens(path: str | Path, dtype: str = "uint16", *, key: str = "path") -> np.memmap:
    """The token ids of ``path`` as a read-only 1-D memory map (no copy). ``key`` names the setting
    in error messages (e.g. ``data.path``). Raises ValueError for a missing file, a size that is
    not a whole number of ``dtype`` items (bytes), or an empty file."""
    check_choice("dtype", dtype, tuple(DTYPES))
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{key}: no such file {str(path)!r} (a flat file of {dtype} token ids; "
                         f"`course data prepare` writes one from text)")
    size = path.stat().st_size  # bytes
    item = DTYPES[dtype].itemsize
    offset = 0
    if _llmc_header_tokens(path, size) is not None:
        if dtype != "uint16":
            raise ValueError(f"{key}: {path} has llm.c's header, whose tokens are uint16; set data.dtype = 'uint16'")
        offset = LLMC_HEADER_BYTES
    if (size - offset) % item:
        raise ValueError(f"{key}: {path} is {size:,} bytes, not a whole number of {dtype} token ids "
                         f"({item} bytes each): a wrong data.dtype (accepted: {', '.join(DTYPES)}) or a "
                         f"truncated file")
    if size == offset:
        raise ValueError(f"{key}: {path} holds no tokens")
    return np.memmap(path, dtype=DTYPES[dtype], mode="r", offset=offset)


def max_token_id(tokens: np.ndarray) -> tuple[int, int]:
    """(largest id, its first position) over the whole array, read in chunks of SCAN_CHUNK tokens
    so a large file never needs its size in memory (0.15-0.26 s per GiB from the page cache, measured
    on the 2-core test machine under load)."""
    best, where = -1, -1
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[start:start + SCAN_CHUNK])
        m = int(chunk.max())
        if m > best:
            best, where = m, start + int(chunk.argmax())
    return best, where


def check_token_file(path: str | Path, dtype: str, *, seq_len: int, vocab_size: int,
                     key: str = "data.path") -> int:
    """Everything that can be wrong with a token file, before any work: missing, a size that is not
    a multiple of ``dtype``, fewer than ``seq_len + 1`` tokens (one training sequence and its
    targets), an id >= ``vocab_size`` (the model's embedding rows). Returns the token count;
    ValueError naming ``key`` and the accepted range otherwise. Reads the whole file once."""
    tokens = open_tokens(path, dtype, key=key)
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(f"{key}: {path} holds {n:,} tokens; data.seq_len = {seq_len} needs at least "
                         f"{seq_len + 1} (one sequence and its shifted targets)")
    top, where = max_token_id(tokens)
    if top >= vocab_size:
        raise ValueError(f"{key}: token id {top:,} (at token {where:,} of {path}) is >= model.vocab_size = "
                         f"{vocab_size:,}; accepted ids: 0..{vocab_size - 1:,}. Set data.vocab_size to the "
                         f"tokenizer's vocabulary size (at least {top + 1:,}; `course data prepare` writes it "
                         f"into the .json next to the .bin)")
    return n


class TokenFile:
    """Language modelling on a token file: example i is tokens [i*seq_len, i*seq_len + seq_len + 1)
    (inputs and targets shifted by one). ``vocab_size`` is what the ids are checked against by
    :func:`check_token_file` (the trainer checks at config time; here only the layout is read).

    Provides ``get_batch(indices)`` and ``num_examples`` for :class:`course_lib.data.BatchStream`."""

    def __init__(self, path: str | Path, dtype: str = "uint16", seq_len: int = 64, vocab_size: int | None = None):
        check_int("seq_len", seq_len, 1)
        self.path, self.dtype, self.seq_len = Path(path), dtype, seq_len
        self.tokens = open_tokens(self.path, dtype)
        self.num_tokens = len(self.tokens)
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"{self.path} holds {self.num_tokens:,} tokens; seq_len={seq_len} needs at least "
                             f"{seq_len + 1}")
        self.vocab_size = vocab_size
        self.num_examples = (self.num_tokens - 1) // seq_len

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [len(indices), seq_len]: windows of the file and the same shifted by one."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        window = torch.from_numpy(self.tokens[starts + np.arange(self.seq_len + 1)].astype(np.int64))
        return window[:, :-1].clone(), window[:, 1:].clone()


# ----------------------------------------------------------------------------- validation file
MAX_VAL_SEQUENCES = 512  # windows the end-of-run validation reads: the file's first ones, in order
# Strategies whose rank 0 holds the whole model (replicated weights): it can evaluate alone.
WHOLE_MODEL_STRATEGIES = ("single", "ddp", "ddp-scratch", "zero1", "zero2")


@torch.no_grad()
def validation_loss(model: torch.nn.Module, dataset, *, batch_size: int, device: torch.device | str = "cpu",
                    max_sequences: int = MAX_VAL_SEQUENCES) -> tuple[float, int]:
    """(mean next-token loss in nats/token, sequences read) of ``model`` (returning ``(logits,
    loss)`` like TinyGPT) over the first min(num_examples, max_sequences) windows of ``dataset``,
    in eval mode (no dropout), ``batch_size`` sequences per forward. Every window has seq_len
    scored tokens, so weighting batch means by their sequences gives the mean over tokens."""
    check_int("batch_size", batch_size, 1)
    n = min(dataset.num_examples, check_int("max_sequences", max_sequences, 1))
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for start in range(0, n, batch_size):
            idx = list(range(start, min(n, start + batch_size)))
            x, y = dataset.get_batch(idx)
            total += float(model(x.to(device), y.to(device))[1]) * len(idx)  # after training: reads are free
    finally:
        model.train(was_training)
    return total / n, n


def end_of_run_validation(cfg: dict, strategy, device: torch.device, out_dir: str | Path, step: int) -> float | None:
    """``data.val_path`` set: rank 0 evaluates its (whole) model on the validation file after the
    last step, writes ``OUT/val.json`` and returns the loss (nats/token); None elsewhere. The
    config check keeps this to :data:`WHOLE_MODEL_STRATEGIES` (rank 0 then holds every weight)."""
    d = cfg["data"]
    if d["task"] != "tokens" or not d["val_path"] or not strategy.is_writer:
        return None
    import json

    loss, n = validation_loss(strategy.model, TokenFile(d["val_path"], d["dtype"], d["seq_len"]),
                              batch_size=cfg["train"]["micro_batch"], device=device)
    Path(out_dir, "val.json").write_text(json.dumps({"step": step, "val_loss": loss, "sequences": n,
                                                      "tokens": n * d["seq_len"], "path": d["val_path"]}) + "\n")
    return loss
