# %% [markdown]
# # Lab 15 — Context parallelism: ring attention for long sequences
#
# Take this lab right after lab 11 (it comes last in numbering only because it was added last).
# Data, tensor and pipeline parallelism all leave one thing whole on some rank: **the sequence**.
# At 8K tokens and beyond, the activations of a single sequence may not fit one GPU. Context
# parallelism (CP) splits the sequence itself over N ranks: each rank holds S/N tokens of every
# layer. Attention is the only place where tokens meet, and **ring attention** (Liu et al. 2023)
# handles it by passing key/value blocks around the ranks. This lab measures each step:
#
# 1. **why long sequences break the other forms**: one sequence's activation bytes against its
#    length, measured, and what data, tensor and context parallelism leave on each rank;
# 2. **ring attention step by step**: the online-softmax update in the library's code, a ring of 4
#    ranks played in this process, then the library's ring on 2 gloo ranks, all against
#    `scaled_dot_product_attention`;
# 3. **zig-zag chunks** (the sequence cut into 2N pieces, rank r taking piece r and piece 2N-1-r:
#    one early, one late): under the causal mask contiguous chunks give the last rank all the work;
#    the work per rank counted and timed for both layouts;
# 4. **CP in the trainer** (`parallel.cp`): the same losses as one process, and every byte on the
#    wire against the closed form;
# 5. **a 7B model at 8K context**: the estimators' numbers, and when the ring's transfers hide
#    behind the attention.
#
# Ranks are processes on this machine talking over loopback with **gloo** (on GPUs the same code
# uses NCCL). The rank functions live in `course_lib.labs.lab15_context_parallel` (spawned ranks
# can only run importable code); the ring itself in `course_lib.parallel.context_parallel`.

# %% tags=["parameters"]
SMOKE = False  # True: small sizes, so the automated tests finish quickly
SEQ_LENS = (256, 512, 1024, 2048)  # section 1: lengths of the sequence whose activations are measured
SIM_N = 4  # sections 2-3: ranks played in this process
SIM_SEQ = 2048  # sections 2-3: tokens of the played ring (4 heads of 16)
TIME_REPEATS = 3  # section 3: timed passes per rank; the least disturbed one is kept
CP = 2  # sections 1, 2 and 4: gloo ranks
CP_SEQ = 1024  # section 2: tokens of the ring-attention test on the gloo ranks
TRAIN_STEPS = 20  # section 4: trainer steps, with CP and in one process

# %%
import dataclasses
import inspect
import json
import math
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import course_lib
from course_lib.kit.checks import check
from course_lib.kit.scratch import fresh
from course_lib.kit.predict import show_prediction
from course_lib.estimate import (ModelShape, accelerator, activation_bytes_per_layer, cp_comm_bytes_per_layer,
                                 first_stage_activation_breakdown)
from course_lib.labs import lab15_context_parallel as lab_runs
from course_lib.measure import saved_activation_bytes, tinygpt_activation_kwargs
from course_lib.model import TinyGPT
from course_lib.parallel import run_ranks
from course_lib.parallel.context_parallel import (causal_score_elements, chunk_segments, merge_sequence,
                                                  online_softmax_update, peak_score_elements,
                                                  ring_attention_bytes_per_rank, split_sequence)
from course_lib.train import train
from course_lib.trainer import config as train_config

SMOKE = course_lib.smoke(SMOKE)
if SMOKE:
    SEQ_LENS, SIM_SEQ, CP_SEQ, TRAIN_STEPS = (256, 512, 1024), 1024, 128, 2
torch.set_num_threads(1)  # the single-process parts run in this kernel: one thread, like each rank
TRAIN_CFG = Path(course_lib.__file__).resolve().parent.parent / "labs" / "configs" / "tiny-cpu.toml"
RUNS = Path(tempfile.mkdtemp(prefix="lab15-"))  # scratch: every file this lab writes


def trainer_cfg(*sets):
    """The tiny config (2 blocks, d_model 64, 4 heads, 64-token sequences), 2 micro-batches of 8 per step."""
    base = ["train.progress=false", "train.peak_flops=1e12", "train.metrics_flush_s=0", "train.grad_accum=2",
            "train.micro_batch=8", f"train.max_steps={TRAIN_STEPS}",
            f"schedule.warmup_steps={max(1, TRAIN_STEPS // 10)}", "checkpoint.async_save=false"]
    return train_config.load(TRAIN_CFG, base + list(sets))


MODEL = train_config.build_model_config(trainer_cfg())
print(f"TinyGPT: {MODEL.n_layers} blocks, d_model {MODEL.d_model}, {MODEL.n_heads} heads of {MODEL.head_dim}; "
      f"sequences of {SEQ_LENS} tokens in section 1")

# %% [markdown]
# ## 1. Why long sequences break the other forms
#
# What a layer saves for backward grows with the sequence: every token keeps its inputs to each
# matmul, norm and activation. Attention adds a term in S²: an attention that materialises its
# softmax keeps S x S probabilities per head. Fused kernels (FlashAttention; `scaled_dot_product_attention`
# on this CPU) keep only a log-sum-exp per query, `lse = log(sum over the keys j of exp(score_j))`
# (one number per query row: with the scores recomputed, it gives back every softmax
# probability, `exp(score_j - lse)`), and recompute the rest in backward.
#
# The measurement: one sequence through the tiny model, and the bytes autograd saves for its
# backward (`measure.saved_activation_bytes`: a saved-tensors hook, each storage once, parameters
# excluded), with the model's fused attention and with an **eager** attention swapped in (it
# computes `softmax(q k^T / sqrt(d)) v` itself, as attention was written before fused kernels).
# Next to them, the estimator (`estimate.first_stage_activation_breakdown`, Korthikanti et al.
# 2022, described for TinyGPT by `measure.tinygpt_activation_kwargs`; the token ids are added:
# 8 B each for the inputs, targets and positions).

# %%
def eager_core(q, k, v, cos, sin):
    """Attention that keeps its S x S softmax for backward (the causal mask is added, not stored)."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    t = s.shape[-1]
    s = s + torch.full((t, t), float("-inf")).triu(1)
    return torch.softmax(s, dim=-1) @ v


def one_sequence(seq_len, core=None):
    """Saved bytes of one forward (loss included) of one seq_len-token sequence."""
    torch.manual_seed(0)
    model = TinyGPT(dataclasses.replace(MODEL, block_size=seq_len)).train()
    if core is not None:
        for attn in (m for m in model.modules() if hasattr(type(m), "cp_core") and hasattr(m, "core")):
            attn.cp_core = core  # the hook context parallelism uses too
    g = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, MODEL.vocab_size, (1, seq_len), generator=g) for _ in range(2))
    return saved_activation_bytes(model, idx, targets).total_bytes


def estimate(seq_len, **kw):
    """The estimator's bytes for the same forward, token ids included."""
    args = {**tinygpt_activation_kwargs(MODEL, seq_len=seq_len, micro_batch=1), **kw}
    return first_stage_activation_breakdown(n_layers=MODEL.n_layers, vocab_size=MODEL.vocab_size, **args).total \
        + 3 * 8 * seq_len


act = {s: {"fused": one_sequence(s), "eager": one_sequence(s, eager_core)} for s in SEQ_LENS}
MIB = 2**20
print(f"{'tokens':>7} {'fused MiB':>10} {'estimate':>10} {'eager MiB':>10} {'estimate':>10} {'eager / fused':>14}")
for s, a in act.items():
    print(f"{s:>7} {a['fused'] / MIB:>10.3f} {estimate(s) / MIB:>10.3f} {a['eager'] / MIB:>10.3f} "
          f"{estimate(s, attention='eager') / MIB:>10.3f} {a['eager'] / a['fused']:>14.2f}")
print("measured - estimate (bytes):", {s: (a["fused"] - estimate(s), a["eager"] - estimate(s, attention="eager"))
                                       for s, a in act.items()})

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.loglog(SEQ_LENS, [act[s]["fused"] / MIB for s in SEQ_LENS], "o-", label="fused attention (measured)")
ax.loglog(SEQ_LENS, [act[s]["eager"] / MIB for s in SEQ_LENS], "s-", label="eager attention (measured)")
ax.loglog(SEQ_LENS, [estimate(s) / MIB for s in SEQ_LENS], "k+", ms=12, label="estimate")
ax.loglog(SEQ_LENS, [estimate(s, attention="eager") / MIB for s in SEQ_LENS], "k+", ms=12)
ax.set(xlabel="tokens in the sequence", ylabel="saved for backward (MiB)",
       title="one sequence's activations: linear when fused, quadratic when eager")
ax.set_xticks(SEQ_LENS, [str(s) for s in SEQ_LENS])
ax.xaxis.set_minor_locator(plt.NullLocator())
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %%
lo, hi = SEQ_LENS[-2], SEQ_LENS[-1]
for s, a in act.items():
    check(a["fused"] - estimate(s) == 4, f"{s} tokens: the fused model saved {a['fused']:,} B, the estimate plus the "
          f"loss's 4-byte scalar is {estimate(s) + 4:,.0f} B: the model saves something the accounting does not know")
    check(a["eager"] - estimate(s, attention="eager") == 4, f"{s} tokens: the eager model saved {a['eager']:,} B, "
          f"the eager estimate plus 4 B is {estimate(s, attention='eager') + 4:,.0f} B")
check(abs((act[hi]["fused"] - 4) / (act[lo]["fused"] - 4) - 2) < 1e-9,
      "fused attention: twice the tokens should save exactly twice the bytes (nothing grows faster than S)")
check(act[hi]["eager"] / act[lo]["eager"] > 3, "eager attention: doubling the longest sequence should more than "
      "triple the bytes (the S x S softmax dominates)")

# %% [markdown]
# **What you should see:** the measurement equal to the estimate to the byte in both cases (plus
# a 4-byte scalar the loss keeps). With fused attention twice the tokens save exactly twice the
# bytes; with eager attention, doubling the longest sequence here more than triples them: the
# S x S softmax takes over. Fused kernels remove the square, not the line: one 8K-token sequence
# of a 7B model keeps about 40 GB even so (section 5).
#
# What do the other forms do about it, per rank?
#
# * **Data parallelism, FSDP, ZeRO** shard weights, gradients and optimizer state. Each rank still
#   runs whole sequences, and one sequence is the least it can take: its activations stay as they are.
# * **Tensor parallelism** (tp 2 here) splits heads and MLP columns, so the inside of attention and
#   the MLP halves; the norms' inputs and the residual stream stay whole on every rank unless
#   sequence parallelism splits them too (and the kit's layers keep the gathered inputs of their
#   matmuls). TP also stops at the heads and at the node.
# * **Context parallelism** (cp 2) gives each rank half the tokens of *everything*.
#
# One launch of `CP` gloo ranks runs everything this lab measures on ranks (starting ranks is the
# slow part): the model made context parallel (`apply_context_parallel`, measured here), the ring
# of section 2 and the trainer of section 4.

# %%
ring_cases = [(1, 4, CP_SEQ, 16, layout) for layout in ("contiguous", "zigzag")]
launch = run_ranks(lab_runs.cp_launch, CP, ring_cases, MODEL, list(SEQ_LENS),
                   trainer_cfg("parallel.cp=2", "train.strategy=ddp"), str(fresh(RUNS / "cp")),
                   threads_per_rank=1, show_output=False, timeout=600)
d = MODEL.d_model
rows = {}
print(f"{'tokens':>7} {'1 process = a DP/FSDP rank':>27} {'TP 2 (estimate)':>16} {'TP 2 + SP (estimate)':>21} "
      f"{'CP 2, per rank':>15}   (MiB, and share of one process)")
for i, s in enumerate(SEQ_LENS):
    one = act[s]["fused"]
    tp = estimate(s, tp=2) + 4
    sp = estimate(s, tp=2, sequence_parallel=True, sp_gathered_inputs="keep") + 4
    cp = [launch[r]["saved"][i] for r in range(CP)]
    rows[s] = (one, tp, sp, cp)
    print(f"{s:>7} {one / MIB:>20.3f} (1.0) {tp / MIB:>9.3f} ({tp / one:.2f}) {sp / MIB:>14.3f} ({sp / one:.2f}) "
          f"{max(cp) / MIB:>8.3f} ({max(cp) / one:.2f})")
print(f"\nCP per rank minus (one process + {MODEL.n_layers} x S x d_model x 4 B) / 2, bytes:",
      {s: [c - (one + MODEL.n_layers * s * d * 4) / 2 for c in cp] for s, (one, _, _, cp) in rows.items()})

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.6))
for k, (label, style) in enumerate([("1 process / DP / FSDP rank", "o-"), ("TP 2 (estimate)", "^--"),
                                    ("TP 2 + SP (estimate)", "v--"), ("CP 2, per rank", "s-")]):
    ys = [(max(rows[s][k]) if k == 3 else rows[s][k]) / MIB for s in SEQ_LENS]
    ax.loglog(SEQ_LENS, ys, style, label=label)
ax.set(xlabel="tokens in the sequence", ylabel="activations per rank (MiB)",
       title="what each form leaves on a rank (fused attention)")
ax.set_xticks(SEQ_LENS, [str(s) for s in SEQ_LENS])
ax.xaxis.set_minor_locator(plt.NullLocator())
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %%
for s, (one, tp, sp, cp) in rows.items():
    check(tp / one > 0.6 and sp / one > 0.55, f"{s} tokens: TP 2 should leave more than 60% of the bytes on each "
          f"rank ({tp / one:.2f}), more than 55% with sequence parallelism ({sp / one:.2f})")
    for r, c in enumerate(cp):
        extra = c - (one + MODEL.n_layers * s * d * 4) / 2
        check(0 <= extra <= 16, f"{s} tokens, cp rank {r}: {c:,} B saved; half of one process plus one "
              f"[S/2, d_model] fp32 copy per layer is {c - extra:,.0f} B ({extra:+,.0f} B): a rank should hold its "
              "half of every activation and no more")
        check(round(c / one, 2) == 0.53, f"{s} tokens, cp rank {r}: CP 2 should leave 53% on each rank, got "
              f"{c / one:.2f}")
    check((round(tp / one, 2), round(sp / one, 2)) == (0.64, 0.57), f"{s} tokens: TP 2 should leave 64% on each rank "
          f"and 57% with sequence parallelism (the estimator for this model), got {tp / one:.2f} and {sp / one:.2f}")

# %% [markdown]
# **What you should see:** TP 2 leaves 64% of one process's activations on each rank, 57% with
# sequence parallelism; CP 2 leaves 53%, at every length: half of everything, plus one more copy
# of the attention output per layer (the ring returns it heads-first, and the output projection
# keeps its own token-major copy; the fused kernel's output needs none). Within 16 bytes: a few
# scalars of the loss. And unlike tp, cp can keep growing with the sequence.
#
# ## 2. Ring attention, step by step
#
# Each rank keeps the queries of its tokens; the key/value blocks travel. At step s rank r holds
# the K/V block of rank (r - s) mod N; after N steps every query has met every key, and nobody has
# held more than one block of scores. The results of the blocks are merged with the **online
# softmax** (Milakov & Gimelshein 2018, FlashAttention): per query row a running max m, a running
# sum l of exp(score - m), and an unnormalised output acc. The library's update, for one block of
# scores s and values v:

# %% tags=["nbval-check-output"]
print(inspect.getsource(online_softmax_update))

# %% [markdown]
# When a block raises the row's max, everything accumulated so far was computed against the old
# max: `alpha = exp(m - m_new)` rescales it, so no exp ever sees a large positive number. Before
# the first block m is -inf; `safe` keeps a row that has seen no key yet at zero instead of NaN.
# At the end `out = acc / l`, and `lse = m + log l` is kept for the backward.
#
# Now a ring of `SIM_N` ranks, played one rank after the other in this process, with that update:
# rank r's queries, the blocks in ring order, the causal mask at the tokens' true positions. A
# key segment entirely in the future of a query segment is skipped; one on the diagonal is
# computed in full and masked. `play_ring` also records the block held, the score elements
# computed and the CPU time of each (rank, step) (`time.thread_time`: this thread's CPU time, so
# other programs on the machine do not count).

# %% tags=["timing"]
TRIANGLES = {}  # the diagonal's causal mask, built once per size (not part of the timed work)


def play_ring(q, k, v, n, layout):
    """One process plays n ranks of causal ring attention. Returns the output (whole sequence),
    and per rank and step: the block held, score elements computed, CPU seconds."""
    b, h, seq, dh = q.shape
    c, scale = seq // n, 1 / math.sqrt(dh)
    outs, held, work, secs = [], [], [], []
    for r in range(n):
        qr, mine = split_sequence(q, n, r, layout=layout), chunk_segments(c, n, r, layout)
        m = torch.full((b, h, c), float("-inf"))
        l, acc = torch.zeros(b, h, c), torch.zeros(b, h, c, v.shape[-1])
        held.append([])
        work.append([])
        secs.append([])
        for step in range(n):
            src = (r - step) % n  # the block that has travelled step hops to reach rank r
            kb, vb = split_sequence(k, n, src, layout=layout), split_sequence(v, n, src, layout=layout)
            t0, elements, q_off = time.thread_time(), 0, 0
            for qs, ql in mine:
                k_off = 0
                for ks, kl in chunk_segments(c, n, src, layout):
                    if ks < qs + ql:  # not entirely in the future of these queries
                        rows_, cols = slice(q_off, q_off + ql), slice(k_off, k_off + kl)
                        s = (qr[:, :, rows_] @ kb[:, :, cols].transpose(-1, -2)) * scale
                        if ks == qs:  # the diagonal: key j is in the future of query i when j > i
                            if ql not in TRIANGLES:
                                TRIANGLES[ql] = torch.ones(ql, kl, dtype=torch.bool).triu(1)
                            s.masked_fill_(TRIANGLES[ql], float("-inf"))
                        online_softmax_update(m[:, :, rows_], l[:, :, rows_], acc[:, :, rows_], s, vb[:, :, cols])
                        elements += s.numel()
                    k_off += kl
                q_off += ql
            secs[r].append(time.thread_time() - t0)
            held[r].append(src)
            work[r].append(elements)
        outs.append(acc / l.unsqueeze(-1))
    return merge_sequence(outs, layout=layout), held, work, secs


q, k, v = lab_runs.attention_inputs(1, 4, SIM_SEQ, 16)[:3]  # batch 1, 4 heads of 16
full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
played = {}
for rep in range(TIME_REPEATS + 1):  # the first pass warms up; each (rank, step) keeps its fastest time
    for layout in ("contiguous", "zigzag"):
        out, held, work, secs = play_ring(q, k, v, SIM_N, layout)
        if rep == 0:
            played[layout] = {"out": out, "held": held, "work": work, "secs": secs}
        else:
            played[layout]["secs"] = [[min(a, b) for a, b in zip(x, y)] for x, y in zip(played[layout]["secs"], secs)]
for layout, p in played.items():
    p["err"] = (p["out"] - full).abs().max().item()
    print(f"{layout:<11} max |ring - scaled_dot_product_attention| = {p['err']:.1e}; blocks computed per rank: "
          f"{[sum(1 for w in ws if w) for ws in p['work']]}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for ax, (layout, p) in zip(axes, played.items()):
    grid = torch.tensor(p["held"], dtype=torch.float64)
    skipped = torch.tensor(p["work"]) == 0
    ax.imshow(grid.masked_fill(skipped, float("nan")), cmap="tab10", vmin=0, vmax=9)  # NaN: white
    for r in range(SIM_N):
        for s in range(SIM_N):
            w = p["work"][r][s]
            ax.text(s, r, f"K/V {p['held'][r][s]}\n" + (f"{w / 1e6:.2f} M" if w else "skipped"), ha="center",
                    va="center", fontsize=8)
    ax.set(xlabel="step", ylabel="rank", xticks=range(SIM_N), yticks=range(SIM_N),
           title=f"{layout}: block held, score elements computed")
fig.suptitle("K/V blocks travel one rank per step (colour: whose block it is; white: all in the future)", fontsize=9)
fig.tight_layout()
plt.show()

# %%
for layout, p in played.items():
    check(p["err"] < 1e-5, f"{layout}: the played ring should equal scaled_dot_product_attention to fp32 rounding, "
          f"got {p['err']:.1e}; an update that forgets to rescale the running sum does this")
    check(all(p["held"][r][s] == (r - s) % SIM_N for r in range(SIM_N) for s in range(SIM_N)),
          "at step s rank r should hold the block of rank (r - s) mod N")
check([sum(1 for w in ws if w) for ws in played["contiguous"]["work"]] == list(range(1, SIM_N + 1)),
      "contiguous: rank r should compute r + 1 blocks (its own and those of the ranks before it)")
check(all(w > 0 for ws in played["zigzag"]["work"] for w in ws), "zig-zag: every rank should compute something at "
      "every step (each block holds an early and a late piece)")

# %% [markdown]
# **What you should see:** both layouts equal to `scaled_dot_product_attention` to fp32 rounding.
# The blocks move down the grid one rank per step. With contiguous chunks rank 0 skips every
# block but its own (they are all in its future) and rank r computes r + 1: the last rank works
# at every step while the first idles. With zig-zag chunks (section 3) every rank computes at every
# step.
#
# On real ranks the library's `ring_attention` does the same with `isend`/`irecv`: it posts the
# hand-over of its block to rank r + 1, computes on the block it holds while the transfer runs,
# then waits. Backward runs the ring again (FlashAttention-2's recomputation from q, k, v, out and
# lse), and the gradients of each K/V block travel with it back to their owner. The launch above
# ran it on `CP` ranks, `CP_SEQ` tokens (4 heads of 16, fp32, causal), forward and backward;
# `cost.ring_attention_bytes_per_rank` predicts what each rank sends: (N-1)(K+V) forward and
# (N-1)(K+V)(1 + 4/4) backward, K and V being one rank's key and value bytes.
#
# The forward of the library's ring, whole (`_Ring.send` / `recv` post one `dist.isend` /
# `dist.irecv` per tensor; `wait` waits for them):

# %%
import importlib  # noqa: E402

ring_module = importlib.import_module("course_lib.parallel.context_parallel.ring_attention")  # the module, not the function

print(inspect.getsource(ring_module._forward))
check("ring.send(kv" in inspect.getsource(ring_module._forward) and "dist.isend" in inspect.getsource(ring_module._Ring),
      "the ring's forward should post its block's hand-over with isend before computing")

# %% [markdown]
# The hand-over of step s is posted *before* the block of step s is computed and waited for only
# after: on a GPU, the transfer runs while the block's attention does (on gloo it is a thread
# moving bytes while this one computes). The last step sends nothing: its block goes nowhere.
# %%
qf, kf, vf, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(lab_runs.attention_inputs(1, 4, CP_SEQ, 16)))
o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
o.backward(dout)
ref = {"out": o.detach(), "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}
pred = ring_attention_bytes_per_rank(1, 4, CP_SEQ // CP, 16, CP)
ring_rows = {}
print(f"{'layout':<11} {'max |out - full|':>16} {'max |grad - full|':>17} {'sent fwd B':>11} {'sent bwd B':>11} "
      f"{'on the wire B':>14} {'predicted B':>12} {'score block':>12} {'full S x S':>11}")
for j, (_, _, _, _, layout) in enumerate(ring_cases):
    per_rank = [launch[r]["ring"][j] for r in range(CP)]
    merged = {key: merge_sequence([x[key] for x in per_rank], layout=layout) for key in ref}
    err_out = (merged["out"] - ref["out"]).abs().max().item()
    err_grad = max((merged[key] - ref[key]).abs().max().item() for key in ("dq", "dk", "dv"))
    st = per_rank[0]["stats"]
    ring_rows[layout] = (err_out, err_grad, per_rank)
    print(f"{layout:<11} {err_out:>16.1e} {err_grad:>17.1e} {st['bytes_sent_forward']:>11,} "
          f"{st['bytes_sent_backward']:>11,} {per_rank[0]['wire']['send']:>14,.0f} {pred['total']:>12,} "
          f"{st['peak_score_elements']:>12,} {peak_score_elements(1, 4, CP_SEQ):>11,}")

# %%
for layout, (err_out, err_grad, per_rank) in ring_rows.items():
    check(err_out < 1e-5 and err_grad < 1e-4, f"{layout}: ring attention on {CP} ranks should equal full attention "
          f"(fp32 rounding only), got {err_out:.1e} in the output and {err_grad:.1e} in the gradients")
    for r, x in enumerate(per_rank):
        st = x["stats"]
        check(st["bytes_sent_forward"] == pred["forward"] and st["bytes_sent_backward"] == pred["backward"],
              f"{layout}, rank {r}: sent {st['bytes_sent_forward']:,} B forward and {st['bytes_sent_backward']:,} B "
              f"backward; cost.py predicts {pred['forward']:,} and {pred['backward']:,}")
        check(x["wire"]["send"] == pred["total"] and x["wire"].get("all-reduce", 0) == 0,
              f"{layout}, rank {r}: the wire counter should see exactly the predicted {pred['total']:,} B of sends and "
              f"no collective, got {x['wire']}")
        check(st["peak_score_elements"] == peak_score_elements(1, 4, CP_SEQ // CP, layout=layout),
              f"{layout}: the largest score block should be (S/N)^2 per head (zig-zag: (S/2N)^2)")
    share = peak_score_elements(1, 4, CP_SEQ) / per_rank[0]["stats"]["peak_score_elements"]
    check(share == {"contiguous": 4, "zigzag": 16}[layout], f"{layout}: the full S x S scores should be "
          f"{ {'contiguous': 4, 'zigzag': 16}[layout]} times the largest block on {CP} ranks, got {share:g}")

# %% [markdown]
# **What you should see:** output and gradients equal to full attention to fp32 rounding in both
# layouts; every rank sends exactly the predicted bytes (counted by the ring and, independently,
# by the wire counter: point-to-point sends only, no collective), and its largest score block is
# a quarter (contiguous) or a sixteenth (zig-zag) of the S x S scores an eager attention would
# hold on one process.
#
# ## 3. Zig-zag: evening out the causal work
#
# Under the causal mask query i only needs keys 0..i. With **contiguous** chunks rank r's queries
# need the blocks of ranks 0..r: the last rank does N blocks of work, the first one (of which half
# is masked). **Zig-zag** cuts the sequence into 2N pieces and gives rank r pieces r and 2N-1-r, one
# early and one late: every rank then scores 2N+1 pairs of pieces. Below, the pieces each rank
# owns, and the causal work as a grid of (query piece, key piece) pairs, coloured by the rank that
# computes it.

# %%
def owner_of_pieces(n, layout):
    """Owner rank of each of the 2n equal pieces of the sequence."""
    owners = [0] * (2 * n)
    for r in range(n):
        for start, length in chunk_segments(2, n, r, layout):  # a chunk of 2 tokens = 2 pieces of 1
            for piece in range(start, start + length):
                owners[piece] = r
    return owners


fig, axes = plt.subplots(2, 2, figsize=(10, 6.2), gridspec_kw={"height_ratios": [1, 5]})
pairs = {}
for col, layout in enumerate(("contiguous", "zigzag")):
    owners = owner_of_pieces(SIM_N, layout)
    axes[0, col].imshow([owners], cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for piece, r in enumerate(owners):
        axes[0, col].text(piece, 0, f"r{r}", ha="center", va="center", fontsize=8)
    axes[0, col].set(xticks=range(2 * SIM_N), yticks=[], title=f"{layout}: the {2 * SIM_N} pieces and their ranks")
    grid = torch.full((2 * SIM_N, 2 * SIM_N), float("nan"))
    for r in range(SIM_N):
        for qs, ql in chunk_segments(2, SIM_N, r, layout):
            for src in range(SIM_N):
                for ks, kl in chunk_segments(2, SIM_N, src, layout):
                    if ks < qs + ql:  # computed (the diagonal segment in full)
                        grid[qs:qs + ql, ks:ks + kl] = r
    pairs[layout] = [int((grid == r).sum()) for r in range(SIM_N)]
    axes[1, col].imshow(grid, cmap="tab10", vmin=0, vmax=9)
    axes[1, col].plot([-0.5, 2 * SIM_N - 0.5], [-0.5, 2 * SIM_N - 0.5], "k-", lw=1)
    axes[1, col].set(xlabel="key piece", ylabel="query piece", xticks=range(2 * SIM_N), yticks=range(2 * SIM_N),
                     title=f"piece pairs computed per rank: {pairs[layout]}")
fig.tight_layout()
plt.show()

# %%
check(pairs["contiguous"] == [4 * (r + 1) for r in range(SIM_N)], "contiguous: rank r computes r + 1 blocks of "
      "2 x 2 pieces (the diagonal block in full, half of it masked)")
check(pairs["zigzag"] == [2 * SIM_N + 1] * SIM_N, "zig-zag: every rank should compute 2N + 1 piece pairs")

# %% [markdown]
# **What you should see:** contiguous ranks compute 4, 8, 12 and 16 piece pairs (the square above
# the diagonal on each diagonal block is computed and thrown away by the mask); zig-zag ranks
# compute 9 each, and above the diagonal only masked halves of the diagonal pieces. Now the work
# measured in section 2's played ring: score elements per rank against
# `causal_score_elements` (the closed form), and CPU time per rank. A ring moves in lock-step (a
# rank cannot pass a block on before it has it), so each step lasts as long as its slowest rank:
# the ring's time is the sum over steps of the slowest rank's time.

# %%
work_rows = {}
print(f"{'layout':<11}" + "".join(f"{'rank ' + str(r) + ' M el, ms':>19}" for r in range(SIM_N))
      + f"{'ring ms':>9} {'slowest / fastest rank':>23}")
for layout, p in played.items():
    elements = [sum(ws) for ws in p["work"]]
    ms = [sum(ts) * 1e3 for ts in p["secs"]]
    ring_ms = sum(max(p["secs"][r][s] for r in range(SIM_N)) for s in range(SIM_N)) * 1e3
    closed = [4 * causal_score_elements(SIM_SEQ // SIM_N, SIM_N, r, layout) for r in range(SIM_N)]  # 4 heads
    work_rows[layout] = (elements, closed, ms, ring_ms)
    print(f"{layout:<11}" + "".join(f"{e / 1e6:>10.2f} {t:>7.1f}" for e, t in zip(elements, ms))
          + f"{ring_ms:>9.1f} {max(ms) / min(ms):>23.2f}")
ideal = max(work_rows["zigzag"][0]) / max(work_rows["contiguous"][0])
print(f"\nring time zig-zag / contiguous: measured {work_rows['zigzag'][3] / work_rows['contiguous'][3]:.2f}, "
      f"the slowest ranks' work predicts {ideal:.2f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
for off, (layout, (elements, closed, ms, _)) in zip((-0.2, 0.2), work_rows.items()):
    xs = [r + off for r in range(SIM_N)]
    ax1.bar(xs, [e / 1e6 for e in elements], width=0.38, label=f"{layout} (counted)")
    ax1.plot(xs, [c / 1e6 for c in closed], "k_", ms=18)
    ax2.bar(xs, ms, width=0.38, label=layout)
ax1.plot([], [], "k_", ms=12, label="causal_score_elements")
ax1.set(xticks=range(SIM_N), xlabel="rank", ylabel="score elements (millions)", title="causal work per rank")
ax2.set(xticks=range(SIM_N), xlabel="rank", ylabel="CPU ms", title="time per rank (fastest of the passes)")
for ax in (ax1, ax2):
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
fig.tight_layout()
plt.show()

# %%
for layout, (elements, closed, ms, ring_ms) in work_rows.items():
    check(elements == closed, f"{layout}: counted score elements {elements} should equal causal_score_elements "
          f"{closed}")
check(ideal == 9 / 16, f"the slowest zig-zag rank should do 2.25 blocks of work against contiguous's 4, got "
      f"{ideal:.3f} times as much")
total_ratio = sum(work_rows["zigzag"][0]) / sum(work_rows["contiguous"][0])
check(total_ratio == 0.9, f"all ranks together: zig-zag should score 0.9 times contiguous's elements, got "
      f"{total_ratio}")
c_ms, z_ms = work_rows["contiguous"][2], work_rows["zigzag"][2]
check(c_ms[-1] > 1.5 * c_ms[0], f"contiguous: the last rank ({c_ms[-1]:.1f} ms) should take clearly longer than the "
      f"first ({c_ms[0]:.1f} ms): it scores 4 times as much. A very busy machine can blur it: run section 2 again")
check(max(z_ms) / min(z_ms) < max(c_ms) / min(c_ms), "zig-zag's ranks should be closer to each other in time than "
      "contiguous ones")
check(work_rows["zigzag"][3] < work_rows["contiguous"][3], "the zig-zag ring should finish sooner: its slowest rank "
      "does less at every step")

# %% [markdown]
# **What you should see:** the counted elements equal the closed form exactly: contiguous grows
# 1:2:3:4 with the rank, zig-zag is flat. The times follow: the last contiguous rank takes clearly
# longer than the first (more than 1.5 times; the diagonal block every rank computes costs more per
# element than the others, and other programs on the machine share the caches), the zig-zag ranks
# are closer to each other, and the lock-step ring finishes sooner zig-zag. The work of the slowest
# rank predicts the ratio, 2.25 blocks against 4; the measured one moves around it with the block
# sizes (caches, per-block overhead): this machine's is printed above the plots. The total work is
# about the same (zig-zag scores 0.9 times as many elements: its diagonal pieces are smaller, so
# it computes fewer masked ones); zig-zag mainly spreads it. Megatron-LM's context parallelism and
# the trainer here use zig-zag.
#
# ## 4. CP in the trainer
#
# In the trainer, `parallel.cp = N` makes N ranks share each sequence (zig-zag chunks, ring
# attention in every attention layer: `course_lib/parallel/context_parallel/in_trainer.py`). The
# cp ranks hold the same weights, so `train.strategy` averages gradients over dp x cp (with ZeRO
# or FSDP, shards over them: lab 11 section 7). The sequence length must divide into 2N pieces;
# cp composes with tp and dp, not with pp. The run of the launch: `parallel.cp = 2`, 2 micro-batches
# of 8 sequences of 64 tokens per step; one process runs the same global batch here. Every
# collective was counted on the wire (`course_lib.parallel.wire.count_collectives`), the ring's
# bytes also by the attention cores.
#
# What the trainer does with `parallel.cp`, in the library's own code: each rank's model is called
# with the *whole* micro-batch and keeps its zig-zag share of the tokens (and their positions);
# every attention layer's core is swapped for one that runs the ring over the cp group:

# %%
from course_lib.parallel.context_parallel import in_trainer  # noqa: E402

print(inspect.getsource(in_trainer.ContextParallelModel.__call__))
print(inspect.getsource(in_trainer.ContextParallelCore.__call__))
print(inspect.getsource(in_trainer.apply_context_parallel))

# %%
cp_cfg = trainer_cfg("parallel.cp=2", "train.strategy=ddp")
print("[parallel]", {key: cp_cfg["parallel"][key] for key in ("dp", "tp", "pp", "cp")}, "  [data] seq_len",
      cp_cfg["data"]["seq_len"], "  [train] micro_batch", cp_cfg["train"]["micro_batch"], "grad_accum",
      cp_cfg["train"]["grad_accum"])
dp_left = CP // (cp_cfg["parallel"]["tp"] * cp_cfg["parallel"]["pp"] * cp_cfg["parallel"]["cp"])
print(f"dp = {cp_cfg['parallel']['dp']} in the config means 'the ranks that are left': {CP} ranks / (tp "
      f"{cp_cfg['parallel']['tp']} x pp {cp_cfg['parallel']['pp']} x cp {cp_cfg['parallel']['cp']}) = dp {dp_left}")
train(trainer_cfg(), fresh(RUNS / "single"))
single = [json.loads(line)["loss"] for line in (RUNS / "single" / "metrics.jsonl").read_text().splitlines()]
tr = [launch[r]["train"] for r in range(CP)]
rel_loss = max(abs(a - b) / b for a, b in zip(tr[0]["losses"], single))
print("coordinates (pp, dp, cp, tp) per rank:", [tuple(t["coords"][x] for x in ("pp", "dp", "cp", "tp")) for t in tr])
print(f"losses, 1 process: {[round(x, 6) for x in single[:4]]} ...; cp 2: {[round(x, 6) for x in tr[0]['losses'][:4]]} "
      f"...; largest relative difference over {TRAIN_STEPS} steps: {rel_loss:.1e}")

ring_call = ring_attention_bytes_per_rank(cp_cfg["train"]["micro_batch"], MODEL.n_heads,
                                          cp_cfg["data"]["seq_len"] // CP, MODEL.head_dim, CP)
calls = MODEL.n_layers * cp_cfg["train"]["grad_accum"]  # ring attentions per step
n_params = sum(p.numel() for p in TinyGPT(MODEL).parameters())
grad_bytes = 2 * (CP - 1) / CP * 4 * n_params  # one all-reduce of every fp32 gradient over the 2 ranks
print(f"\nbytes per step, rank by rank (predicted: the ring {calls} x {ring_call['total']:,} B; "
      f"the all-reduce 2(N-1)/N x 4 B x {n_params:,} parameters = {grad_bytes:,.0f} B)")
print(f"{'rank':>4} {'ring sends':>11} {'ring (attention cores)':>23} {'predicted':>10} {'all-reduce':>11} "
      f"{'gradients':>10} {'other, whole run':>17}")
wire_rows = []
for r, t in enumerate(tr):
    send = t["wire"]["send"]["bytes"] / TRAIN_STEPS
    cores = (t["ring"]["bytes_sent_forward"] + t["ring"]["bytes_sent_backward"]) / TRAIN_STEPS
    allreduce = t["wire"]["all-reduce"]["bytes"] / TRAIN_STEPS
    other = {kind: row["bytes"] for kind, row in t["wire"].items() if kind not in ("send", "recv", "all-reduce")}
    wire_rows.append((send, cores, allreduce))
    print(f"{r:>4} {send:>11,.0f} {cores:>23,.0f} {calls * ring_call['total']:>10,} {allreduce:>11,.0f} "
          f"{grad_bytes:>10,.0f} {str(other):>17}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
ax1.plot(range(1, len(single) + 1), single, "k-", lw=4, alpha=0.3, label="1 process")
ax1.plot(range(1, len(tr[0]["losses"]) + 1), tr[0]["losses"], "-", lw=1, label=f"cp {CP} (rank 0)")
ax1.set(xlabel="step", ylabel="loss (nats/token)", title="the same training run")
ax1.legend(fontsize=8)
kinds = ["ring sends", "all-reduce"]
measured = [wire_rows[0][0] / 1e3, wire_rows[0][2] / 1e3]
predicted = [calls * ring_call["total"] / 1e3, grad_bytes / 1e3]
ax2.bar([x - 0.2 for x in range(2)], measured, width=0.38, label="measured (wire counter)")
ax2.bar([x + 0.2 for x in range(2)], predicted, width=0.38, label="predicted")
ax2.set(xticks=range(2), xticklabels=kinds, ylabel="KB per step per rank", title="communication per step")
ax2.legend(fontsize=8)
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %%
check(rel_loss <= 1e-5, f"cp {CP}: the losses differ from one process by up to {rel_loss:.1e} (relative); the ring "
      "is exact, so only the order of the sums may differ")
check([t["coords"]["cp"] for t in tr] == list(range(CP)) and all(t["coords"]["dp"] == 0 for t in tr)
      and dp_left == 1, "with 2 ranks and cp = 2 both ranks should sit in one cp group: dp 1, both at dp index 0")
for r, (send, cores, allreduce) in enumerate(wire_rows):
    check(send == cores == calls * ring_call["total"], f"rank {r}: the ring should send exactly the predicted "
          f"{calls * ring_call['total']:,} B per step (wire {send:,.0f}, attention cores {cores:,.0f})")
    check(0 <= allreduce - grad_bytes <= 64, f"rank {r}: the all-reduce should carry every gradient once per step "
          f"({grad_bytes:,.0f} B) plus a few scalars, got {allreduce:,.0f} B")
    check(send > 3 * allreduce, f"rank {r}: the ring should move more than three times the all-reduce's bytes here")

# %% [markdown]
# **What you should see:** the cp run on the one-process curve (relative differences of 1e-5
# or less: the same sums in another order), both ranks in one cp group. Per step, each rank's ring sends
# exactly the closed form's bytes for 2 layers x 2 micro-batches, seen identically by the wire
# counter and by the attention cores, and the all-reduce carries each gradient once, plus a few
# bytes of scalars (the loss and the gradient norm). Here the ring moves more than three times the
# gradient bytes: the tiny model has few weights and a micro-batch of 8 x 64 tokens. Which side
# wins on a real model is section 5's question.
#
# ## 5. A 7B model at 8K context
#
# The estimators, for a Llama-2-7B shape (32 layers, d_model 4096, 32 heads of 128, SwiGLU 11008)
# on 8,192-token sequences, micro-batch 1, bf16, fused attention, no dropout. Per GPU, as the
# context-parallel size N grows: the activations of all 32 layers (without and with full
# recomputation), the scores an eager attention would keep per layer, and the ring's traffic.
#
# Predict the traffic first, from section 2's closed form: at N = 2, how many GB does one rank
# send per layer, forward and backward together? K and V of one rank hold S/N tokens x 32 heads x
# 128 channels each, bf16 (2 bytes); the backward sends (N-1)(K+V)(1 + 4/b) for b bytes per
# element (the K/V again, and their fp32 gradient accumulators).

# %%
my_ring_gb_per_layer = None  # your prediction: GB one rank sends per layer at N = 2 (forward + backward)

# %% tags=["nbval-check-output"]
S7, L7, H7, A7, DH7, FF7 = 8192, 32, 4096, 32, 128, 11008
GB = 1e9
print(f"7B, {S7:,}-token context, micro-batch 1, bf16; per GPU:")
print(f"{'CP N':>4} {'tokens':>7} {'activations':>12} {'full recompute':>15} {'eager scores/layer':>19} "
      f"{'ring sends/layer':>17} {'per step (32 layers)':>21}")
scenario = {}
for n in (1, 2, 4, 8):
    kw = dict(seq_len=S7 // n, micro_batch=1, d_model=H7, n_heads=A7, mlp="swiglu", d_ff=FF7, dropout=False,
              attention="flash", bytes_per_element=2)
    acts = L7 * activation_bytes_per_layer(**kw)
    recompute = L7 * activation_bytes_per_layer(**kw, recompute="full")
    comm = cp_comm_bytes_per_layer(seq_len=S7, micro_batch=1, n_kv_heads=A7, head_dim=DH7, cp=n, n_heads=A7)
    scores = comm.peak_score_elements * 2  # bf16 scores of one layer, if they were stored
    scenario[n] = (acts, recompute, scores, comm)
    print(f"{n:>4} {S7 // n:>7,} {acts / GB:>9.1f} GB {recompute / GB:>12.2f} GB {scores / GB:>16.2f} GB "
          f"{comm.bytes_per_rank / GB:>14.3f} GB {L7 * comm.bytes_per_rank / GB:>18.1f} GB")

# %%
acts1, _, scores1, _ = scenario[1]
check(35 * GB < acts1 < 45 * GB, f"one 8K sequence of a 7B model should need about 40 GB of activations, the "
      f"estimator says {acts1 / GB:.1f} GB")
check(all(abs(scenario[n][0] - acts1 / n) < 1e-6 * acts1 for n in scenario), "CP N should divide the activations by N")
check(4 * GB < scores1 < 5 * GB and all(abs(scenario[n][2] - scores1 / n**2) < 1e-6 * scores1 for n in scenario),
      "an eager attention's scores (about 4 GB per layer on one GPU) should shrink by N^2")
sends = [scenario[n][3].bytes_per_rank for n in (2, 4, 8)]
check(sends == sorted(sends), "the ring's bytes per rank per layer should not shrink as N grows")
show_prediction("ring sends per rank per layer at N = 2", my_ring_gb_per_layer, scenario[2][3].bytes_per_rank / GB,
                unit="GB", why=f"K + V = 2 x {S7 // 2:,} x {A7} x {DH7} x 2 B = {2 * S7 // 2 * A7 * DH7 * 2 / GB:.4f} GB; "
                               "forward (N-1)(K+V), backward 3 times that in bf16: 4 x (K+V) in all")
check(scenario[2][3].bytes_per_rank == 4 * (2 * S7 // 2 * A7 * DH7 * 2), "at N = 2 one rank should send 4 x (K + V) "
      "per layer")
adam_7b = 16 * ModelShape.preset("llama2-7b").num_params()
check(adam_7b > 100 * GB, f"mixed-precision Adam at 16 B per parameter should need over 100 GB for 7B, got "
      f"{adam_7b / GB:.0f} GB")

# %% [markdown]
# **What you should see:** on one GPU the activations of one 8K sequence are about 40 GB: half an
# 80 GB GPU before any weight or optimizer state (16 bytes per parameter for mixed-precision Adam:
# over 100 GB for a 7B model before ZeRO, lab 09). CP N divides them by N, and an eager
# attention's 4 GB of scores *per layer* by N². Full recomputation divides them too, at the price
# of another forward pass. The ring's traffic per rank per layer does not shrink with N: each rank
# forwards every other rank's K/V, and the blocks get smaller but more numerous.
#
# Whether that traffic is free depends on **overlap**: the ring posts each hop, then computes on
# the block it holds. A hop moves one K/V block (bytes ~ C = S/N), the block's attention costs ~C²
# FLOPs, so the ratio turns against CP as N grows. With the estimator's H100 peak (bf16) at 50%
# efficiency, and an NVLink-class 400 GB/s or an InfiniBand 50 GB/s link per direction
# (assumptions, not measurements):

# %% tags=["nbval-check-output"]
h100 = accelerator("h100-sxm5-80gb")
FLOP_S = 0.5 * h100.peak_flops("bf16")
hops = {}
print(f"{'CP N':>4} {'K/V block':>10} {'block attention fwd':>20} {'hop @ 400 GB/s':>15} {'hop @ 50 GB/s':>14}")
for n in (2, 4, 8, 16):
    c = S7 // n
    kv_bytes = 2 * A7 * c * DH7 * 2  # K and V of one block, bf16
    flops = 4 * A7 * c * c * DH7  # q k^T and p v of a full (off-diagonal) block
    t_comp, t_nv, t_ib = flops / FLOP_S, kv_bytes / 400e9, kv_bytes / 50e9
    hops[n] = (t_comp, t_nv, t_ib)
    print(f"{n:>4} {kv_bytes / 1e6:>7.1f} MB {t_comp * 1e6:>17.0f} us {t_nv * 1e6:>12.0f} us {t_ib * 1e6:>11.0f} us"
          f"   {'hidden' if t_nv <= t_comp else 'exposed'} / {'hidden' if t_ib <= t_comp else 'exposed'}")

# %%
check(all(hops[n][1] <= hops[n][0] for n in (2, 4)) and all(hops[n][1] > hops[n][0] for n in (8, 16)),
      "over NVLink a hop should hide behind the block's attention up to N = 4 and be exposed from N = 8")
check(0.7 < hops[8][0] / hops[8][1] < 1.3, "at N = 8 the NVLink hop and the block's attention should be about equal")
check(all(t_ib > t_comp for t_comp, _, t_ib in hops.values()), "over InfiniBand a hop should cost more than the "
      "block's attention at every N here")
fwd = cp_comm_bytes_per_layer(seq_len=S7, micro_batch=1, n_kv_heads=A7, head_dim=DH7, cp=8, n_heads=A7)
check(fwd.backward_bytes == 3 * fwd.forward_bytes, "in bf16 the backward should send 3 times the forward's bytes")

# %% [markdown]
# **What you should see:** inside a node (NVLink) a hop hides behind the block's attention up to
# N = 4; at N = 8 the two are about equal, beyond it the transfer is exposed. Across nodes
# (InfiniBand) a hop costs more than the block's attention at every N here. (The diagonal block of
# a causal mask is half the work; zig-zag keeps the work even, not smaller.) The backward sends 3
# times the forward's bytes in bf16 (K/V again, plus their fp32 gradient accumulators). That is why
# the kit's mesh puts cp right next to tp (ranks ordered `pp, dp, cp, tp` from the outside in, as
# section 4's coordinates read: `course_lib.parallel.mesh`), and why long-context runs use CP 2-8
# within a node and data parallelism across nodes.
#
# ## Where next
#
# * **Exercise 13** asks you to write the merge of two partial attention results (as
#   `(out, lse)` pairs), safe for huge scores and fully masked rows, then runs it inside a ring.
# * Lab 11, section 7: cp with tp and ZeRO-2 in the trainer, the Adam state sharded over the
#   `dp_cp` group.
# * Lab 13: `course plan` tries cp from 8K tokens (and when nothing else fits), and shows when it
#   wins.
# * `docs/TRAINING.md` lists the trainer's `parallel` keys; `tests/test_train_context_parallel.py`
#   runs cp with tp, sequence parallelism, RoPE and recomputation against one process.
