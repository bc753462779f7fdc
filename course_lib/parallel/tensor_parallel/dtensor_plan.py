"""The production tensor-parallel path: TinyGPT sharded by DTensor's ``parallelize_module``.

The from-scratch Megatron layers (:mod:`.layers`, :mod:`.blocks`, :func:`.gpt.tp_tinygpt`) write
every collective by hand. Here the *same* layout is only **declared** - which weights are split
along which dim, and which layout each activation has where it enters and leaves a module - and
``torch.distributed.tensor`` (DTensor) inserts the collectives. Tested equal to the dense model and
to ``tp_tinygpt`` (loss, logits, every gradient, AdamW steps) in ``tests/test_dtensor_tp.py``::

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = DeviceMesh("cpu", list(range(world_size)))        # 1-D: the tensor-parallel ranks
    model = parallelize_tinygpt(TinyGPT(cfg), mesh, sequence_parallel=True)   # in place
    with loss_parallel():             # cross-entropy on vocab-sharded logits; backward inside too
        logits, loss = model(idx, targets)   # logits: DTensor [B, T, vocab], Shard(2)
        loss.backward()
    opt.step()                        # any torch optimizer; DTensor parameters are ordinary leaves

Layout (the Megatron one of :func:`.gpt.tp_tinygpt`; N = ``mesh.size()``; SP = sequence parallel):

==============================  ============================  ==========================================
module                          style                         activation in -> out
==============================  ============================  ==========================================
``tok_emb``                     RowwiseParallel (vocab rows)  ids Replicate -> Replicate (SP: Shard(1))
``pos_emb`` (SP only)           PrepareModuleOutput           [T, C] Replicate -> this rank's T/N rows
``blocks.*.norm1``, ``norm2``   SequenceParallel (SP only)    Shard(1) -> Shard(1)
``blocks.*.attn``               PrepareModuleInput            Replicate (SP: Shard(1)) -> Replicate
``attn.q_proj, k_proj, v_proj`` ColwiseParallel (by heads)    Replicate -> local heads [B, T, H/N * D]
``attn.out_proj``               RowwiseParallel               local heads -> Replicate (SP: Shard(1))
``blocks.*.mlp``                PrepareModuleInput            as ``attn``
``mlp.up`` (and ``mlp.gate``)   ColwiseParallel               Replicate -> local [B, T, F/N]
``mlp.down``                    RowwiseParallel               local -> Replicate (SP: Shard(1))
``norm_f``                      SequenceParallel (SP only)    Shard(1) -> Shard(1)
``lm_head``                     ColwiseParallel (vocab rows)  Replicate (SP: Shard(1)) -> Shard(-1)
==============================  ============================  ==========================================

Without sequence parallelism the norms and the position table stay plain replicated modules: their
inputs and output gradients are already whole on every rank, so their gradients are too. After
backward every DTensor gradient has its parameter's layout (a hook all-reduces the ``Partial``
gradients of SP norms once, see :func:`_grad_like_param`), so the optimizer step sends nothing.
Dropout must be 0 (a dropout mask on a replicated activation would differ per rank) and
checkpointing/offloading off: the same limits as ``tp_tinygpt``.

Measured (2 gloo ranks, tests/test_dtensor_tp.py): logits and loss bitwise equal to ``tp_tinygpt``'s,
gradients within 3e-7; the same collectives in backward (one all-reduce or reduce-scatter per
sub-layer); the loss takes 3 small all-reduces where the scratch one packs 2 into 1. The price is
step time: on 2 busy CPU ranks (3.3 M parameters) ~1.5x the scratch model's, ~1.7x with SP -
DTensor's per-op dispatch, most of all in the optimizer step (benchmarks/bench_tensor_parallel.py).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from course_lib.model import TinyGPT
from course_lib.model.layers import SwiGLU
from course_lib.validate import check_bool

__all__ = ["tinygpt_tp_plan", "parallelize_tinygpt"]


def _check_model(model) -> None:
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a course_lib.model.TinyGPT, got {type(model).__name__}")


def tinygpt_tp_plan(model, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of a TinyGPT: ``{module path: ParallelStyle}``.

    Paths use ``blocks.*`` (``parallelize_module`` matches each path token with fnmatch), so one
    entry covers every block. Entries depend on the model only through its switches: a ``gate``
    entry for SwiGLU, a ``pos_emb`` entry for learned positions under sequence parallelism.
    ``sequence_parallel=True`` keeps the residual stream split along the sequence between the
    sub-layers (``[B, T/N, C]`` per rank). The plan holds no sizes: any mesh size that divides the
    head counts, the MLP width and the vocabulary fits (checked by :func:`parallelize_tinygpt`).
    """
    _check_model(model)
    check_bool("sequence_parallel", sequence_parallel)
    sp = sequence_parallel
    # The layout of the residual stream between sub-layers: whole on every rank, or split by tokens.
    stream = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        # Vocab-parallel embedding (Megatron's VocabParallelEmbedding): "Rowwise" on an Embedding
        # means the table's rows (token ids) are split, Shard(0). Each rank looks up the ids it
        # owns, zeros elsewhere (a Partial sum); the output layout turns that into the all-reduce
        # (g) or, under SP, a reduce-scatter straight into this rank's tokens. Splitting the table
        # by rows, not by columns, is what lets a tied lm_head share the very same shard.
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
    }
    if sp and model.pos_emb is not None:
        # The learned position table stays a plain replicated module; TinyGPT looks up all T rows
        # and adds them to x, which under SP holds only this rank's T/N tokens. Declaring the
        # [T, C] output Replicate and asking for Shard(0) keeps this rank's rows (a local slice,
        # no traffic); backward all-gathers the row gradients, so every rank gets the whole
        # gradient of the table (no separate sync, unlike sync_sequence_parallel_grads).
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0),
                                              use_local_output=True)
    for name in ("attn", "mlp"):
        norm = "norm1" if name == "attn" else "norm2"
        if sp:
            # The norm runs on this rank's tokens; its weights become Replicate DTensors. Their
            # gradients come back Partial (each rank saw its own tokens): _grad_like_param
            # all-reduces each once after backward.
            plan[f"blocks.*.{norm}"] = SequenceParallel()
        # Enter the tensor-parallel region once per sub-layer (Megatron's f, or SP's all-gather):
        # the input becomes one Replicate DTensor (use_local_output=False) that q, k, v (or up and
        # gate) all read. Their input gradients then come back as Partial DTensors that autograd
        # adds locally, and cross the wire in ONE all-reduce (SP: reduce-scatter) instead of one
        # per projection - what the scratch TPAttention does with skip_input_comm.
        extra = (None, None) if name == "attn" else ()  # attn(x, cos, sin): the RoPE tables pass as-is
        plan[f"blocks.*.{name}"] = PrepareModuleInput(input_layouts=(stream, *extra),
                                                      desired_input_layouts=(Replicate(), *extra),
                                                      use_local_output=False)
    # Column-parallel by heads: q/k/v weight rows (output channels) split in N contiguous blocks,
    # i.e. query heads [r*H/N, (r+1)*H/N) and k/v heads [r*Hkv/N, ...): with N dividing both, each
    # query head's k/v head lives on the same rank. The outputs come back as plain local tensors
    # [B, T, H/N * D], which Attention.forward reshapes with view(B, T, -1, D): it reads the head
    # count from the shape, so the local head count needs no patching for the math.
    for proj in ("q_proj", "k_proj", "v_proj"):
        plan[f"blocks.*.attn.{proj}"] = ColwiseParallel()
    # Row-parallel: reads the local heads (Shard(-1)), produces a Partial sum; the output layout
    # is the all-reduce (g) or, under SP, the reduce-scatter to this rank's tokens. The bias is a
    # Replicate DTensor; DTensor folds it into the partial sums (bias / N on each rank) so that the
    # reduced output counts it once, and its gradient comes out whole on every rank (measured: no
    # extra sync, unlike the scratch RowParallelLinear's under SP). use_local_output=True (default): the residual add
    # x + attn(...) stays between plain tensors of the same local shape.
    plan["blocks.*.attn.out_proj"] = RowwiseParallel(output_layouts=stream)
    plan["blocks.*.mlp.up"] = ColwiseParallel()
    if isinstance(model.blocks[0].mlp, SwiGLU):
        plan["blocks.*.mlp.gate"] = ColwiseParallel()
    plan["blocks.*.mlp.down"] = RowwiseParallel(output_layouts=stream)
    if sp:
        plan["norm_f"] = SequenceParallel()
    # Vocab-parallel head: weight rows (vocab) split like tok_emb's; the logits stay a DTensor
    # sharded on the vocabulary (use_local_output=False), so that F.cross_entropy inside TinyGPT
    # runs as DTensor's loss_parallel (three numbers per token on the wire, never [B, T, V]) when
    # forward and backward run under torch.distributed.tensor.parallel.loss_parallel(). Outside
    # that context DTensor gathers the logits first: slower, same numbers.
    plan["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    return plan


def _check_tp_divides(tp: int, name: str, value: int) -> None:
    """ValueError naming the mesh size and ``name`` unless tp divides ``value``; lists the accepted tp."""
    if value % tp:
        accepted = ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)
        raise ValueError(f"tp ({tp}) must divide {name} ({value}) (tp = mesh.size(), the tensor-parallel ranks); "
                         f"accepted tp values: {accepted}")


def _check_plan(plan) -> None:
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, ParallelStyle)
                                             for k, v in plan.items()):
        raise TypeError("plan must be a dict {module path (str): torch.distributed.tensor.parallel "
                        f"ParallelStyle}}, e.g. tinygpt_tp_plan(model); got {type(plan).__name__}")


def parallelize_tinygpt(model, mesh, sequence_parallel: bool = False, *, plan=None) -> nn.Module:
    """Shard a dense ``TinyGPT`` over the 1-D ``mesh`` **in place** and return it.

    ``mesh``: a 1-D ``torch.distributed.device_mesh.DeviceMesh`` of the tensor-parallel ranks
    (N = ``mesh.size()`` ranks; slice a larger mesh first, e.g. ``mesh["tp"]``). It is passed to
    ``parallelize_module`` explicitly; no global mesh is set or read. Every rank must hold the same
    dense weights; DTensor distributes rank 0's copy (``src_data_rank=0``).
    ``sequence_parallel``: keep the residual stream ``[B, T/N, C]`` per rank between sub-layers
    (sequence lengths T must then be divisible by N; checked at every forward).
    ``plan``: a custom ``{path: ParallelStyle}`` instead of :func:`tinygpt_tp_plan` (for labs that
    show a broken layout); the checks below still apply.

    After the call, sharded parameters are DTensors (``Shard(0)``/``Shard(1)``; norms under SP
    ``Replicate``), with a tied ``lm_head``/``tok_emb`` still one Parameter; every attention has
    ``n_heads``/``n_kv_heads`` set to this rank's counts (H/N, Hkv/N). ``forward(idx, targets)``
    returns ``(logits, loss)`` with logits a DTensor ``[B, T, vocab]`` sharded on the vocabulary
    (``logits.full_tensor()`` assembles them) and the loss in nats per scored token; run forward
    and backward inside ``loss_parallel()`` so the loss never gathers the logits. Hooks added:
    a post-accumulate-grad hook on every DTensor parameter (gradients take their parameter's
    layout) and, with SP, a forward pre-hook checking the sequence length.

    Raises TypeError for a model that is not a TinyGPT or a mesh that is not a DeviceMesh;
    ValueError naming the argument for a mesh that is not 1-D, for N not dividing ``n_heads``,
    ``n_kv_heads``, the MLP width ``ffn_dim`` or ``vocab_size`` (the accepted N are their common
    divisors), for dropout > 0 and for activation checkpointing/offloading.
    """
    _check_model(model)
    check_bool("sequence_parallel", sequence_parallel)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"mesh must be 1-D (mesh.ndim == 1: the tensor-parallel ranks only), got a "
                         f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; pass its tensor-parallel "
                         "slice, e.g. mesh['tp']")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("model is already parallelized (it holds DTensor parameters); pass a dense TinyGPT "
                         "(parallelize_tinygpt works in place: parallelize a copy to keep the dense one)")
    cfg, tp = model.cfg, mesh.size()
    _check_tp_divides(tp, "n_heads", cfg.n_heads)
    _check_tp_divides(tp, "n_kv_heads", cfg.kv_heads)  # each rank needs the k/v heads of its q heads
    # Both are split into equal local pieces that are re-wrapped with DTensor.from_local, which
    # infers the global size as N x the local one: an uneven split would be silently wrong.
    _check_tp_divides(tp, "the MLP width ffn_dim", cfg.ffn_dim)
    _check_tp_divides(tp, "vocab_size", cfg.vocab_size)
    if cfg.dropout:
        raise ValueError(f"parallelize_tinygpt supports dropout=0 only, got dropout={cfg.dropout}: each rank "
                         "would draw its own mask for activations that must stay equal on every rank")
    if cfg.checkpointing != "none" or cfg.offload_activations:
        raise ValueError("parallelize_tinygpt supports checkpointing='none' and offload_activations=False only; "
                         f"got checkpointing={cfg.checkpointing!r}, offload_activations={cfg.offload_activations}")
    if plan is None:
        plan = tinygpt_tp_plan(model, sequence_parallel)
    _check_plan(plan)

    parallelize_module(model, mesh, plan)

    if cfg.tie_embeddings:
        # parallelize_module registers a new Parameter on each module it shards, so the tie (one
        # matrix, two uses) is broken: lm_head got its own copy. Both split the vocabulary rows the
        # same way (Shard(0)), so one shard can serve both again, and its gradient is the sum of
        # both uses, as in the dense model.
        emb, head = model.tok_emb.weight, model.lm_head.weight
        if not (isinstance(emb, DTensor) and isinstance(head, DTensor) and emb.placements == head.placements):
            raise ValueError("tie_embeddings=True needs tok_emb and lm_head sharded alike (both Shard(0) over "
                             "the vocabulary); the plan gave "
                             f"{getattr(emb, 'placements', 'a plain tensor')} and "
                             f"{getattr(head, 'placements', 'a plain tensor')}")
        model.lm_head.weight = emb
    for block in model.blocks:
        # Attention.forward reads head counts from the tensor shapes, so these attributes are not
        # used in the math; set them to what this rank runs so that nothing reading them (a
        # printout, an estimator) takes the dense counts for the local ones.
        block.attn.n_heads = cfg.n_heads // tp
        block.attn.n_kv_heads = cfg.kv_heads // tp
    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_grad_like_param)
    if sequence_parallel:
        model.register_forward_pre_hook(_sequence_length_check(tp), with_kwargs=True)
    return model


def _grad_like_param(param) -> None:
    """Give every DTensor parameter a gradient of its own layout, once per backward.

    Two gradients come out of DTensor's backward in another layout than their parameter (measured,
    torch 2.13):

    * under sequence parallelism a norm's weight is ``Replicate`` but each rank saw only its own
      tokens, so its gradient is ``Partial`` (a per-rank share of the sum). The optimizer would
      still get it right - by all-reducing inside every op that reads the gradient (3 all-reduces
      per parameter per AdamW step, measured) - and anything reading ``p.grad`` locally (a
      gradient-norm monitor) would see a share. One all-reduce here, as soon as the gradient is
      complete, is the counterpart of the scratch ``sync_sequence_parallel_grads``;
    * an untied vocab-parallel ``tok_emb`` (``Shard(0)``) gets a ``Replicate`` gradient: DTensor's
      embedding backward builds the whole ``[vocab, C]`` table gradient on every rank (the scratch
      ``VocabParallelEmbedding`` builds only its rows). Keeping this rank's rows is a local slice,
      no traffic, and frees the rest; the transient full-table gradient is DTensor's cost.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _sequence_length_check(tp: int):
    def check(module, args, kwargs):
        idx = args[0] if args else kwargs.get("idx")
        if isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.shape[1] % tp:
            raise ValueError(f"sequence_parallel needs the sequence length ({idx.shape[1]}) divisible by "
                             f"tp ({tp}): every rank keeps T/tp tokens")
    return check
