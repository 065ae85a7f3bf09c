"""Writers that take one tensor at a time, so an output never has to fit in memory.

``TorchFileWriter`` produces what ``torch.save`` would (a zip with one record per tensor and
a pickle of the structure, loadable with ``torch.load(weights_only=True)`` and
``mmap=True``). It writes each tensor's record as it arrives and the pickle last.
``SafetensorsWriter`` needs every name, dtype and shape up front for its header, then takes
the tensors in that order. A write that fails for lack of space raises a ``CheckpointError``
naming the file; the partial file is left for its owner (``atomic_path``) to remove.

[Note: a failed zip writer must not finish]
torch's ``PyTorchFileWriter`` finishes its zip (the central directory) in its destructor when
``write_end_of_file`` was not called, and an exception there ends the process
(``std::terminate``): seen with torch 2.9 when a record's write failed on a full disk and the
writer was then dropped, the finishing write failing again. A failed write also leaves the
writer's idea of its position behind the file's, so finishing raises even with space free.
So ``TorchFileWriter`` writes through a sink it can cut off: on a failure, or when it is
dropped unfinished, the sink stops passing writes on and the writer is finished into it,
its exception swallowed; ``write_end_of_file`` marks the writer finished even when it raises.
"""
from __future__ import annotations

import collections
import contextlib
import io
import json
import math
import pickle
import struct
import zlib
from typing import Any, BinaryIO, ContextManager, Dict, List, Optional, Tuple

import torch

from ..._sharding.tensor_tree import map_tensors
from ..._xla.private_api import file_writer, rebuild_tensor, storage_type_names
from .atomic import guarded
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


class _Sink:
    """The file a writer (torch's ``PyTorchFileWriter``, ``SafetensorsWriter``) writes
    through, until it is cut off; see
    [Note: a failed zip writer must not finish]."""

    def __init__(self, path: str) -> None:
        self._file: Optional[BinaryIO] = open(path, "wb")

    def write(self, data: Any) -> int:
        if self._file is not None:
            self._file.write(data)
        return memoryview(data).nbytes

    def write_at(self, offset: int, data: bytes) -> None:
        """Overwrites bytes already written, from ``offset``."""
        if self._file is not None:
            end = self._file.tell()
            self._file.seek(offset)
            self._file.write(data)
            self._file.seek(end)

    def close(self) -> None:
        """Flushes and closes the file (raising, as the flush may, on a full disk)."""
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def cut_off(self) -> None:
        """Drops every later write, and the file's unwritten buffer with it."""
        with contextlib.suppress(OSError):  # the flush fails again on a full disk
            self.close()


class TorchFileWriter:
    def __init__(self, path: str) -> None:
        self._path = path
        self._sink = _Sink(path)
        self._writer = file_writer(self._sink)
        self._count = 0
        self._done = False

    def add(self, tensor: torch.Tensor) -> TensorStub:
        """Writes ``tensor`` now; put the returned stub where the tensor goes in the tree.
        The same stub may appear under several keys (tied weights stay tied on load)."""
        tensor = tensor.detach().contiguous().cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.storage_offset() or tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone()  # a view: the record holds the whole storage, from its start
        key = str(self._count)
        self._count += 1
        with guarded(self._path, self.abort, nbytes):
            self._writer.write_record(f"data/{key}", tensor.untyped_storage(), nbytes)
        return TensorStub(key, tensor.dtype, tuple(tensor.shape))

    def finish(self, tree: Any) -> None:
        """Writes the structure; tensors still in ``tree`` are written first."""
        buffer = io.BytesIO()
        _StubPickler(buffer, protocol=2).dump(map_tensors(self.add, tree))
        data = buffer.getvalue()
        with guarded(self._path, self.abort, len(data)):
            self._writer.write_record("data.pkl", data, len(data))
            self._writer.write_record("byteorder", b"little", len("little"))
            self._writer.write_end_of_file()
            self._done = True  # the zip is complete; only the flush below may still fail
            self._sink.close()

    def abort(self) -> None:
        """Leaves the file unfinished, for its owner to remove; the writer is done with.
        See [Note: a failed zip writer must not finish]."""
        self._sink.cut_off()
        if not self._done:
            self._done = True
            with contextlib.suppress(Exception):
                self._writer.write_end_of_file()

    def __del__(self) -> None:
        if getattr(self, "_sink", None) is not None and getattr(self, "_writer", None) is not None:
            self.abort()


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                       torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


# [Note: checksums in a safetensors header]
# The safetensors format has no checksum, so a byte flipped inside a tensor loaded as it
# was. Our writer lists each tensor's CRC-32 in the header's string metadata, under
# CRC_KEY: eight hex digits per tensor, in the order of the tensors' names (not of their
# data, so a tool that rewrites the same tensors in another layout and keeps the metadata
# keeps a true list). The header comes before the data and its length is fixed by then, so
# it is written with zeros in their place and they are put in once the last tensor is
# written, before the file is published. Readers that do not know the key (safetensors,
# transformers) ignore it; ours check every tensor of a file that has it
# (``SafetensorsFile.verify``), and files written elsewhere load as before, unchecked.
CRC_KEY = "xla_fsdp.crc32"


class SafetensorsWriter:
    def __init__(self, path: str, specs: List[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Dict[str, str]) -> None:
        placeholder = "0" * 8 * len(specs)
        header: Dict[str, Any] = {"__metadata__": dict(metadata, **{CRC_KEY: placeholder})}
        at = 0
        self._order = [(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        for name, dtype, shape in self._order:
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"safetensors cannot hold {name} of dtype {dtype}")
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [at, at + size]}
            at += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        listed = json.dumps({CRC_KEY: placeholder}, separators=(",", ":"))[1:-1].encode()
        self._crc_at = 8 + blob.index(listed) + len(listed) - len(placeholder) - 1
        self._crcs = [0] * len(specs)
        self._slot = {name: i for i, name in enumerate(sorted(name for name, _, _ in specs))}
        self._path = path
        self._size = 8 + len(blob) + at  # the whole file, exactly
        self._sink = _Sink(path)
        with self._guard(8 + len(blob)):
            self._sink.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def _guard(self, writing: Optional[int]) -> ContextManager[None]:
        return guarded(self._path, self._sink.cut_off, writing, self._size)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != expected:
            raise ValueError(f"safetensors writer expected {expected}, got "
                             f"{(name, tensor.dtype, tuple(tensor.shape))}")
        self._next += 1
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._crcs[self._slot[name]] = zlib.crc32(memoryview(data))
        with self._guard(data.nbytes):
            self._sink.write(memoryview(data))

    def finish(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"safetensors writer got {self._next} of {len(self._order)} tensors")
        with self._guard(None):
            # see [Note: checksums in a safetensors header]
            self._sink.write_at(self._crc_at, "".join(f"{c:08x}" for c in self._crcs).encode())
            self._sink.close()
