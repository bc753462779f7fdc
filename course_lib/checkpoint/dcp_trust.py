"""What a sharded (DCP) checkpoint is read with, so that loading one never runs code.

``torch.distributed.checkpoint`` reads its ``.metadata`` with plain ``pickle.load`` and the
non-tensor entries of its ``.distcp`` shards with ``torch.load(weights_only=False)``: a forged file
runs whatever its ``__reduce__`` names, and the sha256 manifest cannot stop that (whoever can write
the file can rewrite the manifest). Here:

* :class:`RestrictedUnpickler` admits only the globals DCP metadata really contains;
* :class:`RestrictedFileSystemReader` is DCP's reader with ``read_metadata`` through it;
* :class:`SafeLoadPlanner` is DCP's default planner with non-tensor entries read through
  ``torch.load(weights_only=True)``.

See ``docs/CHECKPOINTS.md`` ("What is trusted") for what this does and does not protect.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .io import CheckpointCorruptError

# Every global a DCP ``.metadata`` pickle names, found by saving FSDP2 + AdamW, plain modules with
# SGD momentum and bf16 parameters with DCP and unpickling the file with a logging unpickler
# (torch 2.13). Anything else is refused.
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # rebuilds a torch.layout from its name
    "torch": {"Size"},  # and the dtypes, checked below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "dict", "list", "tuple"},
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: ``find_class`` admits only the classes listed in
    ``_DCP_METADATA_CLASSES`` and torch dtypes. A pickle naming anything else (``os.system`` in a
    ``__reduce__`` payload, ``builtins.eval``, any torch module) is refused before it is looked
    up, so nothing it names is ever called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to unpickle global {module}.{name}: DCP metadata never "
                                     f"contains it")


def read_metadata_file(path: str | Path) -> Any:
    """Read a DCP ``.metadata`` file through :class:`RestrictedUnpickler`. Raises
    CheckpointCorruptError naming the file (and the refused global) when it is not genuine DCP
    metadata; OSError when it cannot be read."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    with open(path, "rb") as f:
        try:
            metadata = RestrictedUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise CheckpointCorruptError(f"{path}: {e}") from None
        except Exception as e:  # truncated, garbled, wrong arguments to an allowed class
            raise CheckpointCorruptError(f"{path}: not a DCP metadata pickle ({e!r})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class RestrictedFileSystemReader(FileSystemReader):
    """DCP's :class:`FileSystemReader` whose :meth:`read_metadata` unpickles through
    :class:`RestrictedUnpickler` (the stock reader calls plain ``pickle.load``). Tensor data is
    read by the stock ``read_data``, which uses ``torch.load(weights_only=True)``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_metadata_file(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries (optimizer hyper-parameters,
    step counters stored as bytes) are read with ``torch.load(weights_only=True)``; the stock
    planner uses ``weights_only=False``, i.e. unpickles whatever the shard holds."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
