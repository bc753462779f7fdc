"""Data: determinism, task structure, rank-disjoint sharding, exact resume."""

import json
import math

import pytest
import torch

from course_lib.data import (DEFAULT_TEXT, IGNORE_INDEX, BatchStream, ByteText, MarkovTask, SequenceTask,
                             ShardedSampler, make_dataset, mix_seed)
from course_lib.model import ModelConfig, TinyGPT


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def take(stream, n):
    return [next(stream) for _ in range(n)]


def same_batches(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


DATASETS = {
    "markov": lambda seed: MarkovTask(vocab_size=16, seq_len=12, seed=seed),
    "markov2": lambda seed: MarkovTask(vocab_size=8, seq_len=12, seed=seed, order=2),
    "sort": lambda seed: SequenceTask("sort", n_items=6, vocab_size=10, seed=seed),
    "text": lambda seed: ByteText(seq_len=12),
}


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", DATASETS)
def test_same_seed_same_batches_and_examples_independent_of_batch(name):
    a = take(BatchStream(DATASETS[name](3), 4, seed=3), 3)
    b = take(BatchStream(DATASETS[name](3), 4, seed=3), 3)
    assert same_batches(a, b)
    c = take(BatchStream(DATASETS[name](4), 4, seed=4), 3)
    assert not same_batches(a, c)
    ds = DATASETS[name](3)
    x_alone, _ = ds.get_batch([7])
    x_in_batch, _ = ds.get_batch([2, 7, 9])
    assert torch.equal(x_alone[0], x_in_batch[1])


def test_mix_seed_separates_pairs_that_a_linear_mix_would_merge():
    assert mix_seed(0, 1_000_003) != mix_seed(1, 0)
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert 0 <= mix_seed(2**70, -5) < 2**63


# ----------------------------------------------------------------------------- tasks
def test_markov_samples_follow_the_chain_and_its_entropy_is_exact():
    task = MarkovTask(vocab_size=16, seq_len=64, seed=1, branching=3)
    x, y = task.get_batch(list(range(400)))
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) < 16
    # The true model's loss on samples estimates the entropy rate; the context-free one the unigram.
    nll = -task.transition[x.flatten(), y.flatten()].log().mean().item()
    assert nll == pytest.approx(task.entropy_rate(), abs=0.03)
    freq = torch.bincount(y.flatten(), minlength=16).double() / y.numel()
    assert (-(freq.log() * freq).sum()).item() == pytest.approx(task.unigram_entropy(), abs=0.03)
    assert task.entropy_rate() < task.unigram_entropy() - 1.0 < math.log(16)


def test_markov_order_two_uses_two_tokens_of_context():
    task = MarkovTask(vocab_size=8, seq_len=48, seed=0, order=2, branching=2)
    x, y = task.get_batch(list(range(300)))
    ctx = x[:, :-1] * 8 + x[:, 1:]  # positions 1.. have two tokens of context
    nll = -task.transition[ctx.flatten(), y[:, 1:].flatten()].log().mean().item()
    assert nll == pytest.approx(task.entropy_rate(), abs=0.04)
    assert task.entropy_rate() < task.unigram_entropy() - 1.0


def test_tiny_model_beats_the_unigram_entropy_within_40_steps():
    torch.manual_seed(0)
    task = MarkovTask(vocab_size=32, seq_len=32, seed=0)
    model = TinyGPT(ModelConfig.preset("tiny", vocab_size=32, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = BatchStream(task, 16, seed=0)
    losses = []
    for _ in range(40):
        x, y = next(stream)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < task.unigram_entropy() - 1.0
    assert min(losses) > task.entropy_rate() - 0.1  # nothing beats the entropy rate (by more than noise)


@pytest.mark.parametrize("kind", SequenceTask.KINDS)
def test_sequence_tasks_layout_and_answers(kind):
    task = SequenceTask(kind, n_items=5, vocab_size=12, seed=0)
    x, y = task.get_batch([0, 1, 2])
    assert x.shape == y.shape == (3, 10)
    items = x[:, :5]
    assert (x[:, 5] == task.sep).all() and int(items.max()) < task.sep
    answer = {"copy": items, "reverse": items.flip(1), "sort": items.sort(1).values}[kind]
    assert torch.equal(y[:, 5:], answer)
    assert (y[:, :5] == IGNORE_INDEX).all()
    _, y_all = SequenceTask(kind, n_items=5, vocab_size=12, seed=0, score_prompt=True).get_batch([0, 1, 2])
    assert torch.equal(y_all[:, :4], items[:, 1:])


def test_byte_text_windows_match_the_file(tmp_path):
    ds = ByteText(seq_len=16)
    raw = DEFAULT_TEXT.read_bytes()
    assert len(raw) < 50_000 and ds.num_examples == len(raw) - 16
    x, y = ds.get_batch([0, 100, ds.num_examples - 1])
    assert bytes(x[1].tolist()) == raw[100:116] and bytes(y[1].tolist()) == raw[101:117]
    assert bytes(y[2].tolist()) == raw[-16:]
    assert 2.0 < ds.unigram_entropy() < math.log(256)
    own = tmp_path / "mine.txt"
    own.write_bytes(b"abcdefghij" * 3)
    assert ByteText(own, seq_len=8).num_examples == 22
    with pytest.raises(ValueError, match="seq_len"):
        ByteText(own, seq_len=30)
    with pytest.raises(FileNotFoundError):
        ByteText(tmp_path / "missing.txt")


def test_make_dataset_and_argument_errors():
    assert isinstance(make_dataset("markov", seq_len=8, vocab_size=8), MarkovTask)
    assert make_dataset("reverse", seq_len=8).n_items == 4
    assert make_dataset("text", seq_len=8).vocab_size == 256
    with pytest.raises(ValueError, match="even"):
        make_dataset("sort", seq_len=7)
    with pytest.raises(ValueError, match="unknown dataset"):
        make_dataset("wiki", seq_len=8)
    with pytest.raises(ValueError, match="branching"):
        MarkovTask(vocab_size=4, branching=5)
    with pytest.raises(TypeError, match="seq_len"):
        MarkovTask(seq_len=8.0)
    with pytest.raises(ValueError, match="rank"):
        ShardedSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        ShardedSampler(10, 0)


# ----------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("n", [None, 50, 7])
def test_ranks_are_disjoint_and_together_equal_one_process(n):
    B, W, steps = 3, 4, 6
    single = ShardedSampler(n, B * W, seed=5)
    ranks = [ShardedSampler(n, B, rank=r, world_size=W, seed=5) for r in range(W)]
    for _ in range(steps):
        expected = single.next_indices()
        got = [s.next_indices() for s in ranks]
        assert sum(got, []) == expected  # concatenated rank batches == the single-process batch
        if n is None or n >= B * W:
            flat = sum(got, [])
            stream_pos = single.samples_seen - B * W
            if n is None or stream_pos // n == (single.samples_seen - 1) // n:  # batch within one epoch
                assert len(set(flat)) == len(flat)


def test_each_epoch_visits_every_example_once_in_a_new_order():
    s = ShardedSampler(10, 5, seed=0)
    e0 = s.next_indices() + s.next_indices()
    e1 = s.next_indices() + s.next_indices()
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    plain = ShardedSampler(10, 4, shuffle=False)
    assert plain.next_indices() + plain.next_indices() + plain.next_indices() == list(range(10)) + [0, 1]


# ----------------------------------------------------------------------------- resume
@pytest.mark.parametrize("name", ["markov", "text"])
def test_resume_reproduces_the_uninterrupted_batches(name):
    ds = DATASETS[name](0)
    full = take(BatchStream(ds, 4, rank=1, world_size=2, seed=9), 12)
    first = BatchStream(ds, 4, rank=1, world_size=2, seed=9)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # the state is small and JSON-able
    resumed = BatchStream(ds, 4, rank=1, world_size=2, seed=9)
    resumed.load_state_dict(state)
    assert same_batches(head + take(resumed, 7), full)


def test_elastic_resume_with_another_world_size_keeps_the_global_stream():
    n, B = 23, 3
    two = [ShardedSampler(n, B, rank=r, world_size=2, seed=1) for r in range(2)]
    for _ in range(4):
        for s in two:
            s.next_indices()
    one = ShardedSampler(n, 2 * B, seed=1)
    one.load_state_dict(two[0].state_dict())
    reference = ShardedSampler(n, 2 * B, seed=1)
    for _ in range(4):
        reference.next_indices()
    assert [one.next_indices() for _ in range(5)] == [reference.next_indices() for _ in range(5)]


def test_resume_refuses_a_different_stream():
    s = ShardedSampler(20, 4, seed=1)
    s.next_indices()
    state = s.state_dict()
    with pytest.raises(ValueError, match="seed"):
        ShardedSampler(20, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_examples"):
        ShardedSampler(21, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="multiple"):
        ShardedSampler(20, 3, seed=1).load_state_dict(state)
