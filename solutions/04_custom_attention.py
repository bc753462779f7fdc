# %% [markdown]
# # Exercise 04 — A custom attention pattern, checkpointed and benchmarked
#
# The exercise: write a training step with a **custom attention pattern** and
# **activation checkpointing**, prove it computes the same thing, and benchmark the strategies.
# (Lab 04 measures TinyGPT's built-in strategies; here you build your own.)
#
# The pattern: a causal **sliding window** plus **global tokens**. Query `i` may attend key `j`
# when `j <= i` (causal) and either `i - j < window` (a recent token) or `j < n_global` (one of
# the first `n_global` tokens, which every query can always see, as in Longformer's global
# attention or the "attention sinks" of streaming LLMs).
#
# You will write:
#
# 1. the mask builder;
# 2. a forward pass that checkpoints every k-th block, and a forward + backward that returns the
#    gradients: the same gradients as without checkpointing, for less memory;
# 3. a training loop and a benchmark table of the strategies.

# %% tags=["parameters"]
SMOKE = False  # True: the tests run this notebook at small sizes
SEED = 0
SEQ_LEN = 128  # tokens per sequence
BATCH = 8
D_MODEL = 64
N_LAYERS = 4
WINDOW = 16
N_GLOBAL = 4
TRAIN_STEPS = 60
TIMED_ROUNDS = 5

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import course_lib
from course_lib import measure
from course_lib.kit.checks import check, check_close
from course_lib.grading import record  # hands checked values to the grader (no-op otherwise)
from course_lib.data import BatchStream, MarkovTask
from course_lib.model.layers import sliding_window_mask

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    SEQ_LEN, BATCH, TRAIN_STEPS, TIMED_ROUNDS = 64, 4, 30, 2
VOCAB = 32
torch.set_num_threads(1)  # small model: one thread is as fast, and timings repeat

# %% [markdown]
# ## Part 1: the mask
#
# Return a boolean tensor of shape `[seq_len, seq_len]`, True where query `i` (row) may attend
# key `j` (column). No Python loops needed: compare a column of query positions with a row of key
# positions (`torch.arange`) and let broadcasting build the square.

# %%
def custom_attention_mask(seq_len: int, window: int, n_global: int) -> torch.Tensor:
    """Causal sliding window of `window` tokens (itself + window - 1 before) plus the first
    `n_global` tokens, visible to every later query. Bool [seq_len, seq_len], True = may attend."""
    ### BEGIN SOLUTION a column of query positions i and a row of key positions j (torch.arange); combine the causal, window and global conditions with & and |
    i = torch.arange(seq_len).unsqueeze(1)
    j = torch.arange(seq_len).unsqueeze(0)
    return (j <= i) & ((i - j < window) | (j < n_global))
    ### END SOLUTION


# %% tags=["points:2"]
def show(mask):
    return "\n".join(" ".join("x" if v else "." for v in row) for row in mask.tolist())


# Window 2, one global token, 6 positions, written out by hand: row i = query i.
EXPECTED = torch.tensor([[c == "x" for c in row] for row in
                         ["x.....", "xx....", "xxx...", "x.xx..", "x..xx.", "x...xx"]])
got = custom_attention_mask(6, 2, 1)
record("masks", [got, custom_attention_mask(16, 4, 3), custom_attention_mask(16, 4, 0), custom_attention_mask(16, 16, 2)])
check(isinstance(got, torch.Tensor) and got.dtype == torch.bool,
      f"return a torch.bool tensor (True = may attend), got {type(got).__name__} "
      f"{getattr(got, 'dtype', '')}")
check(tuple(got.shape) == (6, 6), f"the mask for 6 tokens should be [6, 6], got {tuple(got.shape)}")
check(torch.equal(got, EXPECTED), "seq_len=6, window=2, n_global=1: expected\n" + show(EXPECTED)
      + "\ngot\n" + show(got) + "\nRow i is query i: it sees itself, the token before it, and token 0.")
check(not custom_attention_mask(16, 4, 3).triu(1).any(), "a query must never attend a later key (causal)")
check(torch.equal(custom_attention_mask(16, 4, 0), sliding_window_mask(16, 4, "cpu")),
      "with n_global=0 the pattern should be exactly TinyGPT's sliding window")
check(torch.equal(custom_attention_mask(16, 16, 2), torch.ones(16, 16, dtype=torch.bool).tril()),
      "with a window as long as the sequence every query sees every earlier token (full causal)")
print(show(custom_attention_mask(12, 3, 2)))

# %% [markdown]
# **What you should see:** a band along the diagonal (the window) and full columns on the left
# (the global tokens). Every row keeps its diagonal: a token always sees itself.

# %% tags=["points:2"]
### BEGIN HIDDEN TESTS
def reference_mask(t, w, g):
    return torch.tensor([[j <= i and (i - j < w or j < g) for j in range(t)] for i in range(t)])


for t, w, g in [(1, 1, 0), (1, 3, 5), (7, 1, 0), (7, 1, 3), (33, 5, 2), (40, 8, 50), (64, 100, 0), (50, 3, 1)]:
    out = custom_attention_mask(t, w, g)
    record(f"hidden.mask.{t}-{w}-{g}", out)
    check(out.dtype == torch.bool and tuple(out.shape) == (t, t), f"seq_len={t}: bool [{t}, {t}] expected")
    check(torch.equal(out, reference_mask(t, w, g)), f"seq_len={t}, window={w}, n_global={g}: wrong mask")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 2: checkpointing a model that uses it
#
# A small language model with the pattern is given: pre-norm blocks whose attention passes the
# mask to `F.scaled_dot_product_attention(q, k, v, attn_mask=...)` (True = may attend). Read it;
# the parts you need are `model.embed(idx)`, `model.blocks` and `model.head_loss(h, targets)`.

# %%
class MaskedSelfAttention(nn.Module):
    """Multi-head self-attention restricted to a boolean [T, T] mask (True = may attend)."""

    def __init__(self, d_model, n_heads, mask):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.register_buffer("mask", mask, persistent=False)  # derived from the config: not saved

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:T, :T])
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model, n_heads, mask):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = MaskedSelfAttention(d_model, n_heads, mask)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatternLM(nn.Module):
    """Token + position embedding, `n_layers` masked blocks, final norm, output layer."""

    def __init__(self, vocab, seq_len, d_model, n_layers, n_heads, mask):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mask) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def embed(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))

    def head_loss(self, h, targets):
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(n_layers=N_LAYERS, seq_len=SEQ_LEN, window=WINDOW, n_global=N_GLOBAL, seed=SEED):
    torch.manual_seed(seed)
    return PatternLM(VOCAB, seq_len, D_MODEL, n_layers, 4, custom_attention_mask(seq_len, window, n_global))


task = MarkovTask(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=SEED)
x, y = task.get_batch(list(range(BATCH)))

# %% [markdown]
# Write `forward_loss`: embed, run the blocks, return the loss. With `checkpoint_every=k`, run
# blocks 0, k, 2k, ... through `torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)`:
# autograd then keeps only that block's input and runs the block again during backward. With
# `checkpoint_every=None`, no block is checkpointed.
#
# Then `forward_backward`: clear the gradients, compute the loss, backward, and return the loss
# **as a Python float** (`loss.item()`: a tensor would keep its graph alive, lab 04 section 6) and a
# dict of **copies** of every parameter's gradient, by parameter name.

# %%
def forward_loss(model, idx, targets, *, checkpoint_every=None):
    """The loss of `model` on (idx, targets), checkpointing blocks 0, k, 2k, ... when checkpoint_every=k."""
    ### BEGIN SOLUTION PatternLM above has the pieces (embed, blocks, head_loss): which block indices does checkpoint_every=k select? Lab 04, section 1 names the kind of checkpoint this kit uses
    h = model.embed(idx)
    for i, block in enumerate(model.blocks):
        if checkpoint_every is not None and i % checkpoint_every == 0:
            h = checkpoint(block, h, use_reentrant=False)
        else:
            h = block(h)
    return model.head_loss(h, targets)
    ### END SOLUTION


def forward_backward(model, idx, targets, *, checkpoint_every=None):
    """(loss as a float, {parameter name: copy of its gradient}) after one forward + backward."""
    ### BEGIN SOLUTION What is in p.grad before this backward if the model was used before? And what happens to a dict of p.grad tensors you returned when the next call writes p.grad again?
    model.zero_grad(set_to_none=True)
    loss = forward_loss(model, idx, targets, checkpoint_every=checkpoint_every)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}
    ### END SOLUTION


# %% tags=["points:3"]
def check_same_gradients(model, idx, targets, every, label=""):
    """Your checkpointed forward + backward must reproduce the plain one exactly (fp32)."""
    loss0, grads0 = forward_backward(model, idx, targets)
    loss1, grads1 = forward_backward(model, idx, targets, checkpoint_every=every)
    record(f"{label}grads.{every}", [loss0, loss1, grads0, grads1], rtol=1e-5, atol=1e-7)
    check(isinstance(loss0, float), f"return the loss as a Python float (loss.item()), got {type(loss0).__name__}: "
          "a tensor keeps its autograd graph alive for as long as you hold it")
    names = [n for n, _ in model.named_parameters()]
    check(isinstance(grads0, dict) and sorted(grads0) == sorted(names),
          "return a dict with one gradient per parameter, keyed by the names of model.named_parameters()")
    missing = [n for n in names if grads1.get(n) is None]
    check(not missing, f"{label}checkpoint_every={every}: no gradient for {missing[:3]}...: a checkpointed block "
          "lost its gradients. Which kind of checkpoint does the text above ask for?")
    check(loss1 == loss0, f"{label}checkpoint_every={every}: loss {loss1} but {loss0} without checkpointing; "
          "checkpointing must not change the forward")
    for n in names:
        check_close(grads1[n], grads0[n], rtol=0, atol=1e-7, what=f"{label}checkpoint_every={every}: gradient of {n}",
                    hint="the recomputed block should reproduce the forward exactly")
    return grads0


model = make_model()
grads = check_same_gradients(model, x, y, every=1)
check_same_gradients(model, x, y, every=2)
again = forward_backward(model, x, y)[1]
check(all(torch.equal(grads[n], again[n]) for n in grads) and any(g.abs().sum() > 0 for g in grads.values()),
      "a second call should give the same gradients, and the first call's dict must still hold them: "
      "did the second call add onto the first call's gradients, or write into the tensors the first "
      "dict still holds?")
print(f"loss {forward_backward(model, x, y)[0]:.4f}: gradients identical with checkpoint_every = None, 1, 2")

# %% [markdown]
# Same gradients; now the point of it. `measure.saved_activation_bytes` counts the bytes autograd
# keeps for backward during one call (each storage once, the model's own weights and mask left out):

# %% tags=["points:2"]
def saved_bytes(model, every, idx=x, targets=y):
    return measure.saved_activation_bytes(lambda: forward_loss(model, idx, targets, checkpoint_every=every),
                                          skip=list(model.parameters()) + list(model.buffers())).total_bytes


saved = {every: saved_bytes(model, every) for every in (None, 2, 1)}
for every, nbytes in saved.items():
    print(f"checkpoint_every={str(every):<5} {nbytes / 2**20:8.2f} MiB kept for backward")
record("saved", [saved[None], saved[2], saved[1]], rtol=0)
check(saved[1] < 0.3 * saved[None], "checkpointing every block should keep far less than a third of what the "
      "plain forward keeps: did checkpoint() run every block?")
check(saved[1] < saved[2] < saved[None], "checkpointing every 2nd block should keep less than none and more "
      "than every block")

# %% [markdown]
# **What you should see:** every block checkpointed keeps only the blocks' inputs (plus the
# embedding and output layer); every 2nd block lands in between.

# %% tags=["points:3"]
### BEGIN HIDDEN TESTS
for layers, seq, w, g, every in [(3, 32, 4, 1, 3), (5, 48, 7, 0, 2), (2, 40, 100, 3, 1)]:
    m = make_model(n_layers=layers, seq_len=seq, window=w, n_global=g, seed=3)
    xs, ys = MarkovTask(vocab_size=VOCAB, seq_len=seq, seed=5).get_batch(list(range(3)))
    check_same_gradients(m, xs, ys, every=every, label=f"{layers} layers, seq {seq}: ")
    plain, ckpt = saved_bytes(m, None, xs, ys), saved_bytes(m, every, xs, ys)
    check(ckpt < plain, f"{layers} layers, checkpoint_every={every}: checkpointing should save memory")
    n_ckpt, every_block = len(range(0, layers, every)), saved_bytes(m, 1, xs, ys)
    record(f"hidden.saved.{layers}", [plain, ckpt, every_block], rtol=0)
    check((plain - ckpt) * layers == n_ckpt * (plain - every_block),
          f"{layers} layers, checkpoint_every={every}: each checkpointed block should save the same bytes")
### END HIDDEN TESTS

# %% [markdown]
# ## Part 3: a training loop, and the benchmark
#
# Write `train`: a fresh AdamW (`lr`), batches from `BatchStream(task, BATCH, seed=seed)`, and for
# each of `steps` steps: forward with your `forward_loss` (checkpointing as asked), backward,
# optimizer step. Return the list of the losses as Python floats.

# %%
def train(model, steps, *, checkpoint_every=None, lr=3e-3, seed=SEED):
    """Train `model` for `steps` AdamW steps; returns the loss of every step as a float."""
    ### BEGIN SOLUTION What does one training step need, in which order, and what must not carry over from the step before? Lab 04, section 6 shows why the loss you keep should be a float
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stream = BatchStream(task, BATCH, seed=seed)
    losses = []
    for _ in range(steps):
        xb, yb = next(stream)
        loss = forward_loss(model, xb, yb, checkpoint_every=checkpoint_every)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
    ### END SOLUTION


# %% tags=["points:2"]
plain = train(make_model(), TRAIN_STEPS)
ckpt = train(make_model(), TRAIN_STEPS, checkpoint_every=1)
record("losses", [plain, ckpt], rtol=1e-4)
check(isinstance(plain, list) and len(plain) == TRAIN_STEPS and all(isinstance(v, float) for v in plain),
      f"return a list of {TRAIN_STEPS} floats (loss.item() per step)")
check(ckpt == plain, "training with every block checkpointed should give exactly the same losses, step by step")
tail = sum(plain[-5:]) / 5
check(tail < plain[0] - 0.3, f"the loss should fall: first {plain[0]:.3f}, mean of the last 5 {tail:.3f}. "
      "Did you call opt.step() after backward, with the gradients cleared before each backward?")
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(plain, label="no checkpointing")
ax.plot(ckpt, "--", label="every block checkpointed")
ax.axhline(task.entropy_rate(), color="black", linestyle=":", label="best possible loss")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats/token)")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# **What you should see:** one curve: the two runs are identical to the last bit, falling from
# about `ln(VOCAB)` toward the best possible loss.
#
# Now the benchmark. For each strategy (a name and its `checkpoint_every`), measure the bytes
# kept for backward (`saved_bytes` above) and the median milliseconds of one forward + backward
# (`measure.time_steps(fn, rounds)` times `fn()` `rounds` times after a warm-up; its
# `.seconds_per_step` is the median). Return one dict per strategy, in the given order, with keys
# `"strategy"`, `"saved_bytes"`, `"ms_per_step"`.

# %%
STRATEGIES = {"none": None, "every 2nd block": 2, "every block": 1}


def benchmark(model, strategies, rounds):
    """One row per strategy: {"strategy": name, "saved_bytes": int, "ms_per_step": float}."""
    ### BEGIN SOLUTION The two measurements exist already (saved_bytes above, measure.time_steps as described): what function of no arguments would you time, and in which unit does .seconds_per_step come?
    rows = []
    for name, every in strategies.items():
        timing = measure.time_steps(lambda: forward_backward(model, x, y, checkpoint_every=every), rounds)
        rows.append({"strategy": name, "saved_bytes": saved_bytes(model, every),
                     "ms_per_step": timing.seconds_per_step * 1e3})
    return rows
    ### END SOLUTION


# %% tags=["points:2"]
rows = benchmark(make_model(), STRATEGIES, TIMED_ROUNDS)
record("benchmark", [[r.get("strategy"), r.get("saved_bytes")] for r in rows], rtol=0)
check([r.get("strategy") for r in rows] == list(STRATEGIES),
      f"one row per strategy, in order: {list(STRATEGIES)}; got {[r.get('strategy') for r in rows]}")
check(all(r["ms_per_step"] > 0 for r in rows), "every row needs a positive ms_per_step")
by_name = {r["strategy"]: r for r in rows}
check(by_name["every block"]["saved_bytes"] < by_name["none"]["saved_bytes"],
      "checkpointing every block should keep fewer bytes for backward than no checkpointing")
print(f"{'strategy':<18}{'kept for backward':>18}{'ms per step':>13}")
for r in rows:
    print(f"{r['strategy']:<18}{r['saved_bytes'] / 2**20:>14.2f} MiB{r['ms_per_step']:>13.1f}")
base = by_name["none"]
best = by_name["every block"]
print(f"every block: {best['saved_bytes'] / base['saved_bytes']:.0%} of the memory, "
      f"{best['ms_per_step'] / base['ms_per_step'] - 1:+.0%} time")

# %% [markdown]
# **What you should see:** memory falls from "none" to "every block" and time rises: every
# checkpointed block runs its forward twice. On a model this small, checkpoint's own bookkeeping
# adds visibly to that; on a large one the extra forward (about a third of a block's forward +
# backward FLOPs) is most of it. Try a longer `SEQ_LEN` or more layers: the memory gap grows with
# both. The mask itself saves nothing here: a dense mask computes every score and then discards
# the masked ones (lab 04, section 4).

# %% tags=["points:2"]
### BEGIN HIDDEN TESTS
hidden_rows = benchmark(make_model(n_layers=3), {"every 3rd": 3, "plain": None, "all": 1}, 1)
record("hidden.benchmark", [[r.get("strategy"), r.get("saved_bytes")] for r in hidden_rows], rtol=0)
check([r["strategy"] for r in hidden_rows] == ["every 3rd", "plain", "all"], "rows must follow the given order")
hb = {r["strategy"]: r["saved_bytes"] for r in hidden_rows}
check(hb["all"] < hb["every 3rd"] < hb["plain"], "3 layers: all < every 3rd < plain in saved bytes")
check(all(isinstance(r["saved_bytes"], int) and r["ms_per_step"] > 0 for r in hidden_rows),
      "saved_bytes should be an int and ms_per_step positive")
### END HIDDEN TESTS
