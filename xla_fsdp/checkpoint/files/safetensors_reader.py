"""Reads ``.safetensors`` files lazily: the header now, each tensor's bytes on demand.

The format is an 8-byte little-endian header length, a JSON header giving every tensor's
dtype, shape and byte range in the data that follows, then the data, each tensor
contiguous and row-major. So any run of a tensor's elements is one ``pread``; a rank that
needs a slice of a tensor reads that slice and nothing else. Tensors are handed out as
``TensorRef`` (``reader``), the file acting as its storage.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Dict, Tuple

from .reader import CheckpointError, PreadFile, TensorRef, contiguous_strides
from .writer import CRC_KEY, SAFETENSORS_DTYPES

_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 << 20


class SafetensorsFile(PreadFile):
    """One ``.safetensors`` file: ``tensors`` by name, ``metadata`` (its ``__metadata__``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such file") from None
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> None:
        """Reads ``tensors``, ``metadata`` and where each tensor's bytes are (``_ranges``)."""
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{self.path}: not a safetensors file, or truncated (header "
                                  f"of {length} bytes in a file of {size})")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except ValueError as exc:
            raise CheckpointError(f"{self.path}: its safetensors header is not JSON ({exc})") \
                from None
        start = 8 + length
        self.metadata: Dict[str, str] = header.pop("__metadata__", None) or {}
        self._ranges: Dict[str, Tuple[int, int]] = {}
        self.tensors: Dict[str, TensorRef] = {}
        for name, entry in header.items():
            dtype = _DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} has dtype "
                                      f"{entry.get('dtype')!r}, which this reader does not know")
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(f"{self.path}: tensor {name!r} has {end - begin} bytes "
                                      f"for shape {list(shape)} of {entry['dtype']}")
            if start + end > size:
                raise CheckpointError(f"{self.path}: truncated ({size} bytes; tensor {name!r} "
                                      f"ends at byte {start + end})")
            self._ranges[name] = (start + begin, end - begin)
            self.tensors[name] = TensorRef(self, name, dtype, 0, shape, contiguous_strides(shape))

    def record_size(self, key: str) -> int:
        return self._ranges[key][1]

    def _data_offset(self, key: str) -> int:
        return self._ranges[key][0]

    def _record_name(self, key: str) -> str:
        return f"tensor {key!r}"

    def verify(self, share: Tuple[int, int] = (0, 1)) -> None:
        """Checks the CRC-32 of every tensor, or with ``share`` (i, n) of every n-th from the
        i-th, when the file lists them (see [Note: checksums in a safetensors header] in
        ``writer``; files written elsewhere have none); raises ``CheckpointError`` naming the
        first bad one."""
        listed = self.metadata.get(CRC_KEY)
        if listed is None:
            return
        order = sorted(self._ranges)
        try:
            crcs = [int(listed[i:i + 8], 16) for i in range(0, len(listed), 8)]
        except (TypeError, ValueError):
            crcs = []
        if len(crcs) != len(order) or len(listed) != 8 * len(order):
            raise CheckpointError(f"{self.path}: its {CRC_KEY} metadata does not list one "
                                  f"CRC-32 for each of its {len(order)} tensors (the header "
                                  f"is corrupted, or a tool changed the tensors and kept the "
                                  f"metadata we wrote)")
        for name, crc in list(zip(order, crcs, strict=True))[share[0]::share[1]]:
            if self.crc32(*self._ranges[name], f"tensor {name!r}") != crc:
                raise CheckpointError(f"{self.path}: tensor {name!r} fails its CRC-32 check "
                                      f"(the file is corrupted, or a tool changed the tensor "
                                      f"and kept the metadata we wrote)")
