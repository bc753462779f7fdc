"""Training data: synthetic tasks with known structure, byte-level text, a token file
(course_lib.data.tokens), and a resumable sampler.

Every dataset here maps an example index i to one (input, target) pair of int64 [seq_len] tensors,
deterministically from (seed, i). The sampler decides *which* indices a rank reads at each step:

    data = MarkovTask(vocab_size=64, seq_len=64, seed=0)
    batches = BatchStream(data, batch_size=16, rank=0, world_size=1, seed=0)
    x, y = next(batches)                       # int64 [16, 64] each
    state = batches.state_dict()               # put this in the checkpoint
    batches.load_state_dict(state)             # resumes with exactly the batches that would follow

Sharding rule (what makes data parallel comparable to one process): the global stream of example
indices is cut into global batches of batch_size * world_size; rank r gets rows
[r*batch_size, (r+1)*batch_size) of each. So W ranks with batch B see, together, exactly the batches
one process with batch W*B sees. The position saved is a global sample count, so a run may resume
under a different world size as long as it divides the count (elastic resume).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from course_lib.validate import check_choice as _check_choice
from course_lib.validate import check_int as _check_int
from course_lib.validate import check_number as _check_number

IGNORE_INDEX = -100  # targets with this value are not scored (matches TinyGPT's loss)
DEFAULT_TEXT = Path(__file__).parent / "files" / "training_notes.txt"
_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """Hash integers into one 63-bit seed (splitmix64 steps), so (seed, i) pairs never collide
    the way seed * K + i would. Pure Python: identical on every platform and torch version."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*parts))


def entropy_nats(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last dimension (0 * log 0 counted as 0)."""
    p = probs.double()
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


class MarkovTask:
    """Sequences from a random sparse order-k Markov chain over `vocab_size` tokens.

    Each context of k tokens has `branching` likely successors with random weights, plus
    `smoothing` probability spread over all tokens (which makes the chain ergodic, so the
    stationary distribution exists and every sequence is possible). Because the chain is known,
    the two reference losses are exact numbers, in nats per token:

    - `unigram_entropy()`: the best loss of a model that ignores context (token frequencies only).
    - `entropy_rate()`: the best loss any model can reach (the chain's conditional entropy).
    A model that has learnt something real falls clearly below the first; with the `tiny` preset
    and order 1 that happens within ~100 steps on a CPU. Sequences start from the stationary
    distribution; with order k > 1 the first k-1 predictions have less context than the rest.
    """

    def __init__(self, vocab_size: int = 64, seq_len: int = 64, seed: int = 0, *, order: int = 1,
                 branching: int = 4, smoothing: float = 0.02):
        _check_int("vocab_size", vocab_size, 2)
        _check_int("seq_len", seq_len, 1)
        _check_int("seed", seed, 0)
        _check_int("order", order, 1)
        _check_int("branching", branching, 1, vocab_size)
        if vocab_size ** (order + 1) > 2**24:
            raise ValueError(f"vocab_size ** (order + 1) must be <= 2**24 (dense table), got {vocab_size}**{order + 1}")
        _check_number("smoothing", smoothing, 0.0, 1.0, lo_open=True)
        self.vocab_size, self.seq_len, self.seed, self.order = vocab_size, seq_len, seed, order
        self.num_examples = None  # infinite: example i is generated from (seed, i)
        g = _generator(seed, 0x4D41524B)  # the chain itself depends only on the seed
        n_ctx = vocab_size**order
        succ = torch.rand(n_ctx, vocab_size, generator=g).argsort(dim=1)[:, :branching]
        # Normalised Exp(1) draws are Dirichlet(1, ..., 1) weights, drawn from our seeded generator.
        w = -torch.rand(n_ctx, branching, generator=g).clamp_min(1e-12).log()
        w = w / w.sum(1, keepdim=True)
        probs = torch.full((n_ctx, vocab_size), smoothing / vocab_size, dtype=torch.float64)
        probs.scatter_add_(1, succ, (1.0 - smoothing) * w.double())
        self.transition = probs  # [V**order, V], rows sum to 1
        self._cdf = probs.cumsum(1).float()
        self._cdf[:, -1] = 1.0  # guard against rounding: searchsorted must always land in range
        self.context_probs = self._stationary()  # [V**order]

    def _stationary(self, iters: int = 2000) -> torch.Tensor:
        """Stationary distribution over contexts by power iteration (float64)."""
        V, k = self.vocab_size, self.order
        n_ctx = V**k
        ctx = torch.arange(n_ctx)
        # context c = (t1..tk) as base-V number; next context after token t: (c * V + t) mod V**k
        nxt = (ctx.unsqueeze(1) * V + torch.arange(V).unsqueeze(0)) % n_ctx  # [n_ctx, V]
        pi = torch.full((n_ctx,), 1.0 / n_ctx, dtype=torch.float64)
        for _ in range(iters):
            new = torch.zeros_like(pi).scatter_add_(0, nxt.reshape(-1), (pi.unsqueeze(1) * self.transition).reshape(-1))
            if (new - pi).abs().max() < 1e-13:
                return new
            pi = new
        return pi

    def unigram_entropy(self) -> float:
        """Entropy (nats/token) of the stationary token distribution: the context-free loss floor."""
        last_token = self.context_probs.view(-1, self.vocab_size).sum(0) if self.order > 1 else self.context_probs
        return float(entropy_nats(last_token))

    def entropy_rate(self) -> float:
        """Conditional entropy (nats/token) of the chain: the loss no model can beat."""
        return float((self.context_probs * entropy_nats(self.transition)).sum())

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [len(indices), seq_len]; y is x shifted by one token."""
        V, k, n = self.vocab_size, self.order, len(indices)
        # Per-example uniforms from (seed, i): an example does not depend on the batch it is in.
        u = torch.stack([torch.rand(self.seq_len + k, generator=_generator(self.seed, i)) for i in indices])
        ctx_cdf = self.context_probs.cumsum(0).float()
        ctx_cdf[-1] = 1.0
        ctx = torch.searchsorted(ctx_cdf, u[:, :1].contiguous()).squeeze(1)  # start in the stationary law
        digits = [(ctx // V ** (k - 1 - j)) % V for j in range(k)]  # the k tokens of the first context
        tokens = torch.empty(n, self.seq_len + 1, dtype=torch.int64)
        for j in range(min(k, self.seq_len + 1)):
            tokens[:, j] = digits[j]
        for t in range(k, self.seq_len + 1):
            nxt = torch.searchsorted(self._cdf[ctx], u[:, t : t + 1].contiguous()).squeeze(1)
            tokens[:, t] = nxt
            ctx = (ctx * V + nxt) % V**k
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()


class SequenceTask:
    """Algorithmic tasks: `copy`, `reverse` or `sort` a random string of `n_items` symbols.

    Each example is `a1..an SEP f(a)1..f(a)n` (symbols 0..vocab_size-2, SEP = vocab_size-1), so
    seq_len = 2 * n_items. With `score_prompt=False` (default) only the answer tokens are scored:
    the prompt is random and cannot be predicted, while the answer is fully determined by it, so the
    loss can fall to zero - but only through attention to the prompt.
    """

    KINDS = ("copy", "reverse", "sort")

    def __init__(self, kind: str = "sort", n_items: int = 8, vocab_size: int = 16, seed: int = 0,
                 *, score_prompt: bool = False):
        _check_choice("kind", kind, self.KINDS)
        _check_int("n_items", n_items, 1)
        _check_int("vocab_size", vocab_size, 3)
        _check_int("seed", seed, 0)
        self.kind, self.n_items, self.vocab_size, self.seed = kind, n_items, vocab_size, seed
        self.sep = vocab_size - 1
        self.seq_len = 2 * n_items
        self.score_prompt = bool(score_prompt)
        self.num_examples = None

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [len(indices), 2 * n_items]; unscored targets are IGNORE_INDEX."""
        items = torch.stack(
            [torch.randint(0, self.sep, (self.n_items,), generator=_generator(self.seed, i)) for i in indices]
        )
        answer = {"copy": items, "reverse": items.flip(1), "sort": items.sort(dim=1).values}[self.kind]
        sep = torch.full((len(indices), 1), self.sep, dtype=torch.int64)
        seq = torch.cat([items, sep, answer], dim=1)  # [n, 2n+1]
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
        if not self.score_prompt:
            y[:, : self.n_items] = IGNORE_INDEX  # targets a2..an and SEP are not scored
        return x, y


class ByteText:
    """Byte-level language modelling on a local text file (vocab 256, no tokenizer, no download).

    Example i is the window of seq_len + 1 bytes starting at byte offset i, so there are
    file_size - seq_len examples. Without a path, the kit's own short text is used.
    """

    vocab_size = 256

    def __init__(self, path: str | Path | None = None, seq_len: int = 64):
        _check_int("seq_len", seq_len, 1)
        self.path = Path(path) if path is not None else DEFAULT_TEXT
        if not self.path.is_file():
            raise FileNotFoundError(f"text file not found: {self.path}")
        raw = self.path.read_bytes()
        if len(raw) < seq_len + 1:
            raise ValueError(f"{self.path} has {len(raw)} bytes; seq_len={seq_len} needs at least {seq_len + 1}")
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.num_examples = len(raw) - seq_len

    def unigram_entropy(self) -> float:
        """Entropy (nats/byte) of the file's byte frequencies: the loss of a context-free model."""
        counts = torch.bincount(self.data, minlength=256).double()
        return float(entropy_nats(counts / counts.sum()))

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [len(indices), seq_len]: windows of the file and the same shifted by one."""
        starts = torch.as_tensor(indices, dtype=torch.int64).unsqueeze(1)
        window = self.data[starts + torch.arange(self.seq_len + 1)]
        return window[:, :-1].clone(), window[:, 1:].clone()


class RandomTokens:
    """Uniform random tokens over `vocab_size`: nothing to learn (the loss floor is ln vocab_size),
    for measuring speed and memory at a real model's vocabulary without a data set. Example i is
    drawn from (seed, i), so it does not depend on the batch it is in."""

    def __init__(self, vocab_size: int = 50257, seq_len: int = 1024, seed: int = 0):
        _check_int("vocab_size", vocab_size, 2)
        _check_int("seq_len", seq_len, 1)
        _check_int("seed", seed, 0)
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_examples = None

    def unigram_entropy(self) -> float:
        """ln(vocab_size) nats/token: the best any model can do on uniform tokens."""
        return math.log(self.vocab_size)

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [len(indices), seq_len]; y is x shifted by one token."""
        seq = torch.stack([torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=_generator(self.seed, i))
                           for i in indices])
        return seq[:, :-1].clone(), seq[:, 1:].clone()


class ShardedSampler:
    """Yields this rank's list of example indices for each step; resumable and rank-aware.

    The global index stream is, for a finite dataset of n examples, a fresh permutation of range(n)
    per epoch (seeded by (seed, epoch); shuffle=False keeps the natural order), concatenated
    without dropping anything - a batch may straddle two epochs; for an infinite dataset it is
    0, 1, 2, ... Global batch g is stream[g*G, (g+1)*G) with G = batch_size * world_size; rank r takes
    rows [r*batch_size, (r+1)*batch_size). batch_size is per rank.
    """

    def __init__(self, num_examples: int | None, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        if num_examples is not None:
            _check_int("num_examples", num_examples, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0, world_size - 1)
        _check_int("seed", seed, 0)
        self.num_examples, self.batch_size, self.rank, self.world_size = num_examples, batch_size, rank, world_size
        self.seed, self.shuffle = seed, bool(shuffle)
        self.samples_seen = 0  # global count of stream positions consumed by all ranks together
        self._perm_epoch, self._perm = -1, None

    @property
    def global_batch_size(self) -> int:
        """Examples per step over all ranks (batch_size * world_size)."""
        return self.batch_size * self.world_size

    @property
    def step(self) -> int:
        """Number of global batches consumed so far."""
        return self.samples_seen // self.global_batch_size

    def _stream(self, start: int, count: int) -> list[int]:
        if self.num_examples is None:
            return list(range(start, start + count))
        out, n = [], self.num_examples
        pos = start
        while len(out) < count:
            epoch, offset = divmod(pos, n)
            if epoch != self._perm_epoch:  # cache one epoch's permutation
                self._perm = (torch.randperm(n, generator=_generator(self.seed, epoch)) if self.shuffle
                              else torch.arange(n))
                self._perm_epoch = epoch
            take = min(count - len(out), n - offset)
            out.extend(self._perm[offset : offset + take].tolist())
            pos += take
        return out

    def next_indices(self) -> list[int]:
        """This rank's indices for the next step (and advance the global position)."""
        start = self.samples_seen + self.rank * self.batch_size
        self.samples_seen += self.global_batch_size
        return self._stream(start, self.batch_size)

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        return self.next_indices()

    def state_dict(self) -> dict:
        """Position and identity of the stream (small, JSON-able); part of every checkpoint."""
        return {"samples_seen": self.samples_seen, "seed": self.seed, "shuffle": self.shuffle,
                "num_examples": self.num_examples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position. Seed, shuffle and dataset size must match (else the resumed
        stream would silently differ); the global batch size may change if it divides the position."""
        for key in ("seed", "shuffle", "num_examples"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state.get(key)!r}, this sampler has {getattr(self, key)!r}")
        seen = state["samples_seen"]
        _check_int("samples_seen", seen, 0)
        if seen % self.global_batch_size:
            raise ValueError(
                f"samples_seen={seen} is not a multiple of batch_size*world_size={self.global_batch_size}; "
                "resume with a global batch size that divides it"
            )
        self.samples_seen = seen


class BatchStream:
    """An endless iterator of (x, y) batches for one rank: a dataset plus a ShardedSampler.

    `batch_size` is per rank. Tensors are int64 [batch_size, seq_len], moved to `device`.
    """

    def __init__(self, dataset, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, device: torch.device | str = "cpu"):
        if not hasattr(dataset, "get_batch") or not hasattr(dataset, "num_examples"):
            raise TypeError(f"dataset must provide get_batch(indices) and num_examples, got {type(dataset).__name__}")
        self.dataset = dataset
        self.device = torch.device(device)
        self.sampler = ShardedSampler(dataset.num_examples, batch_size, rank=rank, world_size=world_size,
                                      seed=seed, shuffle=shuffle)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.dataset.get_batch(self.sampler.next_indices())
        if self.device.type == "cuda":  # pinned + non_blocking: the copy overlaps with compute
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict:
        """The sampler's position (see ShardedSampler.state_dict)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position (see ShardedSampler.load_state_dict)."""
        self.sampler.load_state_dict(state)


def make_dataset(name: str, *, seq_len: int, seed: int = 0, **options):
    """Build a dataset by name: `markov`, `copy`, `reverse`, `sort`, `text` (ByteText), `random`
    (RandomTokens: uniform tokens for speed and memory measurements) or `tokens` (a token file,
    course_lib.data.tokens.TokenFile).

    `options` go to the class (e.g. vocab_size, order, branching for markov; n_items, vocab_size for
    the sequence tasks; path for text). For the sequence tasks seq_len must be even (2 * n_items).
    """
    _check_int("seq_len", seq_len, 1)
    if name == "markov":
        return MarkovTask(seq_len=seq_len, seed=seed, **options)
    if name in SequenceTask.KINDS:
        if seq_len % 2:
            raise ValueError(f"seq_len must be even for the {name!r} task (2 * n_items), got {seq_len}")
        return SequenceTask(name, n_items=seq_len // 2, seed=seed, **options)
    if name == "text":
        return ByteText(options.pop("path", None), seq_len=seq_len, **options)
    if name == "random":
        return RandomTokens(seq_len=seq_len, seed=seed, **options)
    if name == "tokens":  # a tokenized corpus: options path, dtype, vocab_size (course_lib.data.tokens)
        from course_lib.data.tokens import TokenFile

        return TokenFile(options.pop("path"), seq_len=seq_len, **options)
    raise ValueError(f"unknown dataset {name!r}; choose from markov, copy, reverse, sort, text, random, tokens")


def dataset_from_config(cfg: dict):
    """The training dataset ``cfg["data"]`` describes (a validated trainer config,
    course_lib.trainer.config)."""
    d, seed = cfg["data"], cfg["train"]["seed"]
    if d["task"] == "tokens":
        options = {"path": d["path"], "dtype": d["dtype"], "vocab_size": d["vocab_size"]}
    elif d["task"] == "text":
        options = {"path": d["path"]} if d["path"] else {}
    else:
        options = {"vocab_size": d["vocab_size"]}
    return make_dataset(d["task"], seq_len=d["seq_len"], seed=seed, **options)


def stream_from_config(cfg: dict, *, dp_rank: int, dp_size: int, device: torch.device | str) -> BatchStream:
    """This rank's endless batch stream for the trainer: :func:`dataset_from_config`, micro-batches
    of ``train.micro_batch`` sequences, sharded over ``dp_size`` data-parallel ranks (tensor- and
    pipeline-parallel peers pass the same ``dp_rank`` and so read the same batches)."""
    t = cfg["train"]
    return BatchStream(dataset_from_config(cfg), t["micro_batch"], rank=dp_rank, world_size=dp_size,
                       seed=t["seed"], device=device)
