"""Reads torch.save checkpoints lazily: the structure now, each tensor's bytes on demand.

``torch.load(mmap=True)`` would also avoid reading everything up front, but every page it
touches stays mapped into the process, so consolidating a checkpoint grows the resident set
to the checkpoint's size. Here tensors are read with ``pread`` into buffers the caller owns,
so memory is what the caller allocates. Every record's CRC-32 (written by ``torch.save``
into the zip) is checked by ``verify()``, and truncation is caught when the zip is opened.
"""
from __future__ import annotations

import collections
import math
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

from ..._xla.private_api import storage_type_names

_CHUNK = 16 * 1024 * 1024
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header, 30 bytes


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, corrupted or inconsistent."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside a checkpoint file, not yet read."""
    file: "CheckpointFile"
    key: str                   # storage record key
    dtype: torch.dtype
    storage_offset: int        # in elements
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_contiguous(self) -> bool:
        expected = contiguous_strides(self.shape)
        return all(s == e for s, e, d in zip(self.stride, expected, self.shape) if d != 1)

    def read_elements(self, start: int, out: torch.Tensor) -> None:
        """Fills the 1-D contiguous ``out`` with elements ``start, start + 1, ...`` of the
        tensor in row-major order."""
        if not self.is_contiguous:
            out.copy_(self.read().reshape(-1)[start:start + out.numel()])
            return
        if start < 0 or start + out.numel() > self.numel:
            raise IndexError(f"{self.file.path}: elements {start}..{start + out.numel()} out of "
                             f"range for a tensor of {self.numel}")
        self.file.pread_into(self.key, (self.storage_offset + start) * out.element_size(),
                             out.view(torch.uint8).numpy())

    def read(self) -> torch.Tensor:
        """The whole tensor, as a new CPU tensor."""
        if self.is_contiguous:
            out = torch.empty(self.shape, dtype=self.dtype)
            if out.numel():
                self.read_elements(0, out.reshape(-1))
            return out
        storage_numel = self.file.record_size(self.key) // self.dtype.itemsize
        storage = torch.empty(storage_numel, dtype=self.dtype)
        self.file.pread_into(self.key, 0, storage.view(torch.uint8).numpy())
        return storage.as_strided(self.shape, self.stride, self.storage_offset).clone()


def pread_fully(fd: int, view: memoryview, at: int, truncated: str) -> None:
    """Fills ``view`` with the file's bytes from offset ``at``, in reads of at most
    ``_CHUNK``; ``CheckpointError(truncated)`` if the file ends first."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + _CHUNK]], at + done)
        if n <= 0:
            raise CheckpointError(truncated)
        done += n


def materialized(value: Any) -> Any:
    """``value`` with every ``TensorRef`` in it read (objects saved next to the tensors)."""
    if isinstance(value, TensorRef):
        return value.read()
    if isinstance(value, dict):
        return {k: materialized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(materialized(v) for v in value)
    return value


def contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``, in elements."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


class PreadFile:
    """A file whose records are byte ranges read by ``pread`` (``_fd``) into buffers the
    caller owns. Subclasses say where a record is (``record_size(key)``,
    ``_data_offset(key)``) and what errors call it (``_record_name(key)``)."""
    path: str
    _fd: int

    def pread_into(self, key: str, byte_offset: int, out: Any) -> None:
        """Reads ``len(out)`` bytes of record ``key`` from ``byte_offset`` into ``out``."""
        view = memoryview(out).cast("B")
        what = self._record_name(key)
        if byte_offset + len(view) > self.record_size(key):
            raise CheckpointError(f"{self.path}: read past the end of {what}")
        pread_fully(self._fd, view, self._data_offset(key) + byte_offset,
                    f"{self.path}: file ends inside {what} (truncated)")

    def crc32(self, at: int, size: int, what: str) -> int:
        """The CRC-32 of the file's ``size`` bytes from offset ``at`` (``what`` they are)."""
        buffer, crc = memoryview(bytearray(min(_CHUNK, size))), 0
        for done in range(0, size, _CHUNK):
            view = buffer[:min(_CHUNK, size - done)]
            pread_fully(self._fd, view, at + done, f"{self.path}: truncated inside {what}")
            crc = zlib.crc32(view, crc)
        return crc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "PreadFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CheckpointFile(PreadFile):
    """One checkpoint file: ``tree`` is its object with every tensor a ``TensorRef``."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._zip = zipfile.ZipFile(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such file") from None
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(
                f"{path}: not a readable torch.save checkpoint ({exc}); the file is truncated, "
                f"corrupted, or was written with the legacy non-zip format") from None
        names = self._zip.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise CheckpointError(f"{path}: no data.pkl record; not a torch.save checkpoint")
        self._prefix = pkl[0][:-len("data.pkl")]
        self._records: Dict[str, zipfile.ZipInfo] = {n[len(self._prefix):]: self._zip.getinfo(n)
                                                     for n in names}
        self._offsets: Dict[str, int] = {}
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.tree = _LazyUnpickler(self, self._zip.read(pkl[0])).load()
        except CheckpointError:
            self.close()
            raise
        except Exception as exc:  # zipfile's, pickle's, or a malformed record's
            self.close()
            raise CheckpointError(f"{path}: data.pkl is corrupted ({type(exc).__name__}: "
                                  f"{exc})") from None

    def close(self) -> None:
        super().close()
        self._zip.close()

    def _info(self, key: str) -> zipfile.ZipInfo:
        info = self._records.get("data/" + key)
        if info is None:
            raise CheckpointError(f"{self.path}: storage record data/{key} is missing")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.path}: storage record data/{key} is compressed")
        return info

    def record_size(self, key: str) -> int:
        return self._info(key).file_size

    def _data_offset(self, key: str) -> int:
        return self._record_offset("data/" + key, self._info(key))

    def _record_offset(self, name: str, info: zipfile.ZipInfo) -> int:
        """Where a record's bytes start: after its local header, name and extra field."""
        if name not in self._offsets:
            header = os.pread(self._fd, _LOCAL_HEADER.size, info.header_offset)
            fields = _LOCAL_HEADER.unpack(header)
            if fields[0] != b"PK\x03\x04":
                raise CheckpointError(f"{self.path}: bad zip header for {name}")
            name_len, extra_len = fields[-2], fields[-1]
            self._offsets[name] = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        return self._offsets[name]

    def _record_name(self, key: str) -> str:
        return f"storage data/{key}"

    def verify(self, share: Tuple[int, int] = (0, 1)) -> None:
        """Checks the CRC-32 of every record, or with ``share`` (i, n) of every n-th from the
        i-th (n readers of one file check each record once); raises ``CheckpointError``
        naming the first bad one."""
        for name, info in list(self._records.items())[share[0]::share[1]]:
            if info.compress_type != zipfile.ZIP_STORED:
                continue  # zipfile checks these when reading; torch.save never compresses
            crc = self.crc32(self._record_offset(name, info), info.file_size, f"record {name}")
            if crc != info.CRC:
                raise CheckpointError(f"{self.path}: record {name} fails its CRC-32 check "
                                      f"(the file is corrupted)")


# A storage type as torch.save names it (``torch.FloatStorage``) -> the dtype of its elements.
_STORAGE_DTYPES = {name: dtype for dtype, name in storage_type_names().items()}
_STORAGE_DTYPES["UntypedStorage"] = torch.uint8


def _rebuild_tensor(storage: Tuple[str, torch.dtype, "CheckpointFile"], storage_offset: int,
                    size: Any, stride: Any, *unused: Any) -> TensorRef:
    key, dtype, file = storage
    return TensorRef(file, key, dtype, int(storage_offset), tuple(size), tuple(stride))


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): lambda data, *unused: data,  # its TensorRef
    ("torch", "Size"): torch.Size,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
}


class _LazyUnpickler(pickle.Unpickler):
    """Rebuilds the checkpoint's object with ``TensorRef``s; like ``weights_only=True``,
    refuses any global outside plain containers, tensors, dtypes and storage types.

    Nothing it hands out is a class pickle's BUILD could change for the whole process (see
    [Note: building only instances]): besides our rebuild functions, the classes are
    ``OrderedDict``, ``torch.Size`` and builtins, which refuse new attributes, and a storage
    type, a Python class of torch's that would take them, comes back as its dtype, since all
    a pickle does with one is name it in a persistent id. So the C unpickler is enough here,
    unlike for DCP's ``.metadata``."""

    def __init__(self, file: CheckpointFile, data: bytes) -> None:
        import io
        super().__init__(io.BytesIO(data))
        self._file = file

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if module == "torch":
            value = vars(torch).get(name)  # not getattr: torch's __getattr__ imports modules
            if isinstance(value, torch.dtype):
                return value
            if name in _STORAGE_DTYPES:
                return _STORAGE_DTYPES[name]
        raise CheckpointError(f"{self._file.path}: holds {module}.{name}, which a "
                              f"weights-only checkpoint may not contain")

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise CheckpointError(f"{self._file.path}: malformed persistent record {pid!r:.80}")
        kind, storage_type, key, _location, _numel = pid
        if isinstance(kind, bytes):
            kind = kind.decode("ascii")
        if kind != "storage" or not isinstance(storage_type, torch.dtype):
            raise CheckpointError(f"{self._file.path}: unknown persistent record {kind!r}")
        return (str(key), storage_type, self._file)
