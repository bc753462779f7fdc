"""torch FSDP2 (``fully_shard``) behind the strategy interface (``train.strategy = "fsdp"``).

Each transformer block is one FSDP unit (its parameters become DTensors sharded on dim 0 across
the ranks), and the root (embeddings, final norm, head) another. Before a unit runs, its
parameters are all-gathered; after it ran they are freed again when ``reshard_after_forward`` is
True (ZeRO-3-like: backward gathers them a second time) or kept until backward when False
(ZeRO-2-like: more memory, one gather fewer). Gradients are reduce-scattered as each unit's
backward finishes. ``[parallel]`` keys: ``reshard_after_forward``, ``cpu_offload`` (parameters,
gradients and the optimizer step live on the CPU; on a CPU run this changes nothing but is
exercised). Mixed precision: ``bf16``/``fp16`` become FSDP2's ``MixedPrecisionPolicy`` (compute and
all-gather in that dtype, gradients reduced in fp32, fp32 master weights), so the trainer does no
autocast of its own; fp16 still scales the loss.

Gradient norms need no help: the stabilizer completes a DTensor's norm itself. Checkpoints are
sharded (DCP, every rank writes its shards) and load on another world size.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from course_lib.parallel.strategy import Distributed


class FSDP2(Distributed):
    """FSDP2 ``fully_shard`` per block + root (see the module docstring)."""

    name = "fsdp"
    checkpoint_formats = ("sharded",)  # DTensor shards go through DCP; consolidate_sharded makes a full file
    checkpoint_format = "sharded"

    def setup(self, model: nn.Module, make_optimizer) -> None:
        from course_lib.validate import ConfigError
        from torch.distributed.fsdp import fully_shard

        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ConfigError(f"train.strategy = 'fsdp' shards the model block by block, but "
                              f"{type(model).__name__} has no non-empty `blocks` ModuleList to shard")
        options = self._fsdp_options()
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        self.model = self.module = model
        self.optimizer = make_optimizer(model)  # over the DTensor shards: state sharded too

    def _fsdp_options(self) -> dict:
        """``fully_shard``'s keyword arguments from ``[parallel]`` and ``train.precision``: a mesh of
        every rank, reshard_after_forward, the mixed-precision and CPU-offload policies."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        par, precision = self.cfg["parallel"], self.cfg["train"]["precision"]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(precision)
        options = {"mesh": init_device_mesh(self.device.type, (self.info.world_size,)),
                   "reshard_after_forward": par["reshard_after_forward"]}
        if dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if par["cpu_offload"]:
            # Pinned host memory makes the GPU<->CPU copies asynchronous; without an accelerator
            # there is nothing to pin for (and torch refuses to try).
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return options

    def precision_policy(self, precision: str):
        """FSDP2's MixedPrecisionPolicy casts; the loop keeps fp16's loss scaling only."""
        from course_lib.precision import make_policy

        return make_policy("fp16" if precision == "fp16" else "fp32", self.device)

    def no_sync(self):
        # FSDP2: skip the reduce-scatter on accumulation micro-batches (gradients stay unsharded).
        @contextlib.contextmanager
        def ctx():
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
        return ctx()

    def full_weights(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
