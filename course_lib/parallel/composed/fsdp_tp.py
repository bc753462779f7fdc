"""FSDP2 as the data-parallel dimension under DTensor tensor parallelism (``train.strategy = "fsdp"``
with ``parallel.tp > 1``), composed the way torchtitan composes them.

One torch ``DeviceMesh`` over every rank, its dimensions in the order of
:mod:`course_lib.parallel.mesh` (pp outermost, dp, cp, tp innermost: ``rank = (dp_i * cp + cp_i) *
tp + tp_i``), so global rank r has the same (dp, cp, tp) coordinates here as in the kit's
:class:`~course_lib.parallel.mesh.MeshLayout`. Then, on each rank:

1. **TP** - :func:`~course_lib.parallel.tensor_parallel.parallelize_tinygpt` on the ``"tp"``
   sub-mesh (``parallel.sequence_parallel`` honoured): heads, MLP columns and vocabulary rows
   become DTensors sharded over the tp ranks; norms (and, without SP, the position table) stay
   replicated over tp;
2. **FSDP2** - ``fully_shard`` per block, then the root, over the data-parallel sub-mesh: ``"dp"``,
   or, when ``parallel.cp > 1``, the flattened ``"dp_cp"`` dimension (the ranks that hold the same
   weights and read different tokens: torchtitan's ``dp_shard_cp``). Each TP shard is cut once
   more along dim 0 over those ranks: parameters become 2-D DTensors (FSDP shard x TP shard),
   gathered per block before it runs, gradients reduce-scattered after its backward.
   ``parallel.reshard_after_forward`` and bf16/fp16 (FSDP2's ``MixedPrecisionPolicy``, as in
   :mod:`.data_parallel.fsdp2`) work as for plain FSDP2.

TP peers read the same batch: :attr:`dp_rank` / :attr:`dp_size` are the data-parallel coordinates
only. The loss is computed vocab-parallel (``loss_parallel``: the logits are never gathered).

Gradient norms (:meth:`reduce_grad_sq`): the stabilizer hands over the squared norms of this rank's
local gradient shards, and ONE all-reduce over the world completes them all: a tensor sharded
along a mesh dimension contributes from every rank of it, one replicated along a dimension (a norm
weight over tp) only from coordinate 0 there, so every logical parameter counts once. (Left to
DTensor, ``full_tensor()`` on each norm would cost one to two all-reduces per tensor.) One host read
per step, as ever.

Checkpoints are sharded (DCP): the state dict has the dense model's names (neither
``parallelize_module`` nor ``fully_shard`` renames anything), and DCP reshards DTensors on load, so
a checkpoint of this layout loads into plain FSDP2 on another world size, or into one process.

**Context parallelism** (``parallel.cp > 1``, with or without tp):
:func:`~course_lib.parallel.context_parallel.in_trainer.apply_context_parallel` swaps ring attention
(zig-zag chunks) into every attention module and wraps the model so each rank computes its share of
the micro-batch's loss; cp peers hold the same weights, so FSDP2's reduce-scatter over the flattened
dp x cp dimension averages their gradients like more data-parallel replicas (the loss share makes
that mean the micro-batch mean), and the world mean of the loss is the global loss.

``parallel.pp > 1`` with fsdp is refused by ``trainer.config`` (FSDP2 on our pipeline stages is not
built); the world size must be dp x cp x tp, checked when the ranks start (``course_lib.train``).
"""
from __future__ import annotations

import torch
from torch import nn

from course_lib.parallel.data_parallel.fsdp2 import FSDP2


def _config_error(message: str):
    from course_lib.validate import ConfigError

    return ConfigError(message)


def build_device_mesh(device_type: str, layout):
    """The torch ``DeviceMesh`` of ``layout`` (a :class:`~course_lib.parallel.mesh.MeshLayout` with
    pp = 1) over every rank: dims ``("dp", "tp")``, or ``("dp", "cp", "tp")`` when cp > 1, plus a
    flattened ``"dp_cp"`` dim. Row-major like the kit's mesh, so the coordinates agree. Collective:
    every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.pp != 1:
        raise _config_error(f"FSDP2 x TP runs on one pipeline stage only (parallel.pp = 1), got pp = {layout.pp}")
    names = ("dp", "cp", "tp") if layout.cp > 1 else ("dp", "tp")
    shape = tuple(getattr(layout, n) for n in names)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if layout.cp > 1:
        mesh["dp", "cp"]._flatten("dp_cp")  # the ranks holding the same weights: FSDP shards over them
    return mesh


class FSDPTensorParallel(FSDP2):
    """FSDP2 over dp (x cp) on a DTensor-TP TinyGPT (see the module docstring). ``coords``: this
    rank's ``{"pp", "dp", "cp", "tp"}``; ``layout``: the :class:`~course_lib.parallel.mesh.MeshLayout`;
    ``device_mesh``: the torch DeviceMesh (``device_mesh["tp"]``, ``["dp"]``)."""

    name = "fsdp+tp"

    def __init__(self, info, device, cfg=None):
        super().__init__(info, device, cfg)
        from course_lib.parallel.mesh import mesh_layout

        par = self.cfg["parallel"]
        self.tp, self.cp, self.sequence_parallel = par["tp"], par["cp"], par["sequence_parallel"]
        if par["pp"] > 1:  # trainer.config refuses it first; a direct caller gets the same words
            raise _config_error(f"train.strategy = 'fsdp' with parallel.pp = {par['pp']} is not built (FSDP2 on "
                                f"pipeline stages); fsdp composes with parallel.tp; for pp > 1 use 'ddp'")
        try:
            self.layout = mesh_layout(info.world_size, tp=self.tp, pp=1, cp=self.cp, dp=par["dp"])
        except ValueError as exc:
            raise _config_error(f"parallel.dp/tp/cp do not fit the {info.world_size} ranks started: {exc} "
                                f"(parallel.dp = 0 takes what is left)") from None
        self.coords = self.layout.coords_of(info.rank)
        self.device_mesh = build_device_mesh(self.device.type, self.layout)  # collective
        self.shard_dim = "dp_cp" if self.cp > 1 else "dp"

    # ------------------------------------------------------------------ where this rank sits
    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    # ------------------------------------------------------------------ building
    def setup(self, model: nn.Module, make_optimizer) -> None:
        """TP first (on the dense model every rank built with the same seed), then FSDP2 over the
        data-parallel sub-mesh, then the trainer's optimizer over the 2-D DTensor shards."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from course_lib.model import TinyGPT
        from course_lib.parallel.tensor_parallel.dtensor_plan import parallelize_tinygpt

        if not isinstance(model, TinyGPT):
            raise TypeError(f"FSDP2 x TP parallelizes a course_lib.model.TinyGPT, got {type(model).__name__}")
        try:
            parallelize_tinygpt(model, self.device_mesh["tp"], self.sequence_parallel)
        except ValueError as exc:  # trainer.config checks these first; say which key anyway
            raise _config_error(f"parallel.tp = {self.tp}: {exc}") from None
        par, precision = self.cfg["parallel"], self.cfg["train"]["precision"]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        options = {"mesh": self.device_mesh[self.shard_dim], "reshard_after_forward": par["reshard_after_forward"]}
        if dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if par["cpu_offload"]:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        self.model = self.module = model
        if self.cp > 1:  # ring attention over the cp ranks; FSDP2 already averages over dp x cp
            from course_lib.parallel.context_parallel.in_trainer import apply_context_parallel

            self.module = apply_context_parallel(model, self.device_mesh["cp"].get_group(), self.cp,
                                                 self.coords["cp"])
        self.optimizer = make_optimizer(model)
        self._count = None
        self.reduce_grad_sq = self._reduce_grad_sq

    # ------------------------------------------------------------------ one step
    def _reduce_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """Per-tensor squared norms of this rank's local gradient shards -> whole-tensor squares
        (equal on every rank), one all-reduce over the world (the mesh spans it: pp = 1)."""
        import torch.distributed as dist

        if self._count is None or self._count.numel() != sq.numel():
            self._count = torch.tensor([_counts_here(p, self.coords) for p in self.model.parameters() if p.grad is not None],
                                       dtype=sq.dtype, device=sq.device)
        whole = sq * self._count
        dist.all_reduce(whole)
        return whole

    def forward_backward(self, batches, *, autocast, on_loss, backward) -> torch.Tensor:
        """The usual micro-batch loop, forward and backward inside ``loss_parallel`` (cross-entropy
        on the vocab-sharded logits). Returns this rank's mean loss as a plain tensor (TP peers
        hold the same number)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            local = super().forward_backward(batches, autocast=autocast, on_loss=on_loss, backward=backward)
        return local.to_local() if isinstance(local, DTensor) else local


def _counts_here(param, coords: dict[str, int]) -> float:
    """1.0 when this rank's shard of ``param`` is counted in the global norm. Along a mesh dimension
    where the parameter is replicated - a ``Replicate`` placement, or a dimension its DTensor mesh
    does not span (a norm weight TP left plain: FSDP2 made it a DTensor over dp only) - only
    coordinate 0 counts (the copies elsewhere are the same numbers); along sharded (or partial)
    dimensions every rank holds its own part. ``coords``: this rank's {"dp", "cp", "tp"}."""
    from torch.distributed.tensor import DTensor, Replicate

    spanned: set[str] = set()
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        for name, c, placement in zip(mesh.mesh_dim_names, mesh.get_coordinate(), param.placements):
            dims = ("dp", "cp") if name == "dp_cp" else (name,)
            if isinstance(placement, Replicate) and c != 0:
                return 0.0
            spanned.update(dims)
    return float(all(coords[d] == 0 for d in ("dp", "cp", "tp") if d not in spanned))
