"""A checkpoint that is already in memory, read through the same ``TensorRef`` interface as
a file, so that consolidation has one reading path whether its shards come from disk or
from state dicts a caller holds (torch_xla's ``consolidate_sharded_state_dicts``)."""
from __future__ import annotations

from typing import Any, Dict

import torch

from .reader import TensorRef, contiguous_strides


class InMemoryCheckpoint:
    """``tree`` is ``obj`` with every tensor replaced by a ``TensorRef`` into this object.

    Each tensor is kept as a contiguous CPU tensor (not copied when it already is one);
    ``path`` names the checkpoint in error messages."""

    def __init__(self, obj: Any, path: str) -> None:
        self.path = path
        self._storages: Dict[str, torch.Tensor] = {}
        self.tree = self._refs(obj)

    def _refs(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            key = str(len(self._storages))
            self._storages[key] = tensor
            return TensorRef(self, key, tensor.dtype, 0, tuple(tensor.shape),
                             contiguous_strides(tuple(tensor.shape)))
        if isinstance(obj, dict):
            return type(obj)((k, self._refs(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._refs(v) for v in obj)
        return obj

    def record_size(self, key: str) -> int:
        tensor = self._storages[key]
        return tensor.numel() * tensor.element_size()

    def pread_into(self, key: str, byte_offset: int, out: Any) -> None:
        source = self._storages[key].reshape(-1).view(torch.uint8).numpy()
        view = memoryview(out).cast("B")
        view[:] = source[byte_offset:byte_offset + len(view)].tobytes()

    def verify(self) -> None:
        """Nothing to check: no bytes were stored."""

    def close(self) -> None:
        self._storages.clear()
