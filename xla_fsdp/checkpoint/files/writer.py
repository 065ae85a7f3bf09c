"""Writers that take one tensor at a time, so an output never has to fit in memory.

``TorchFileWriter`` produces what ``torch.save`` would (a zip with one record per tensor and
a pickle of the structure, loadable with ``torch.load(weights_only=True)`` and
``mmap=True``). It writes each tensor's record as it arrives and the pickle last.
``SafetensorsWriter`` needs every name, dtype and shape up front for its header, then takes
the tensors in that order.
"""
from __future__ import annotations

import collections
import io
import json
import math
import pickle
import struct
from typing import Any, Dict, List, Tuple

import torch

from ..._sharding.tensor_tree import map_tensors
from ..._xla.private_api import file_writer, rebuild_tensor, storage_type_names
from .reader import contiguous_strides

_STORAGE_TYPES = storage_type_names()


class _StorageStub:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class TensorStub:
    """Stands in for a tensor already written; pickles as that tensor."""

    def __init__(self, key: str, dtype: torch.dtype, shape: Tuple[int, ...]) -> None:
        self.storage = _StorageStub(key, dtype, math.prod(shape))
        self.shape = tuple(shape)

    def __reduce_ex__(self, protocol: int) -> Any:
        return (rebuild_tensor(),
                (self.storage, 0, torch.Size(self.shape), contiguous_strides(self.shape), False,
                 collections.OrderedDict()))


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageStub):
            storage_type = getattr(torch, _STORAGE_TYPES[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class TorchFileWriter:
    def __init__(self, path: str) -> None:
        self._writer = file_writer(path)
        self._count = 0

    def add(self, tensor: torch.Tensor) -> TensorStub:
        """Writes ``tensor`` now; put the returned stub where the tensor goes in the tree.
        The same stub may appear under several keys (tied weights stay tied on load)."""
        tensor = tensor.detach().contiguous().cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.storage_offset() or tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone()  # a view: the record holds the whole storage, from its start
        key = str(self._count)
        self._count += 1
        self._writer.write_record(f"data/{key}", tensor.untyped_storage(), nbytes)
        return TensorStub(key, tensor.dtype, tuple(tensor.shape))

    def finish(self, tree: Any) -> None:
        """Writes the structure; tensors still in ``tree`` are written first."""
        buffer = io.BytesIO()
        _StubPickler(buffer, protocol=2).dump(map_tensors(self.add, tree))
        data = buffer.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        self._writer.write_record("byteorder", b"little", len("little"))
        self._writer.write_end_of_file()
        del self._writer


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                       torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsWriter:
    def __init__(self, path: str, specs: List[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Dict[str, str]) -> None:
        header: Dict[str, Any] = {"__metadata__": metadata}
        at = 0
        self._order = []
        for name, dtype, shape in specs:
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"safetensors cannot hold {name} of dtype {dtype}")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [at, at + size]}
            self._order.append((name, dtype, tuple(shape)))
            at += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != expected:
            raise ValueError(f"safetensors writer expected {expected}, got "
                             f"{(name, tensor.dtype, tuple(tensor.shape))}")
        self._next += 1
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))

    def finish(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"safetensors writer got {self._next} of {len(self._order)} tensors")
        self._file.close()
