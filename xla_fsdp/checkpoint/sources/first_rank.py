"""A checkpoint only the first rank can read (pods whose hosts share no filesystem, where only
host 0 has it), sent to the other ranks over the collectives.

[Note: the first rank reads, everyone receives a stream]
The first rank opens the checkpoint and tells the others what it holds (``stored``, over
``xm.rendezvous``); every rank then checks and plans its load from that, as it would from
the files. To read, the ranks agree on the tensors any of them wants and lay them end to
end, in key order, as one byte stream (each tensor starting at a multiple of 8 bytes, so
that no element straddles a bucket). The stream goes out in buckets of at most
``BUCKET_BYTES``, all of one size so that XLA compiles one broadcast: the first rank reads
a bucket's runs from the checkpoint (by runs, as any rank reads its own), every rank gets
it (``collectives.broadcast_bytes``), and each keeps the runs its shards hold. So the first
rank holds one bucket at a time beyond what it loads itself, the others their own runs
and one bucket, and no rank but the first opens a file. Every rank receives every byte,
N times what a scatter of the shards alone would move; in exchange one mechanism serves
every entry (shards of any layout, optimizer state, buffers, step counts) from every
format, and a resume moves the checkpoint once. Objects (param groups, ``extra``) travel
over ``xm.rendezvous``. Before each bucket the ranks agree on whether the first rank read
it, so a failed read raises on every rank, before anything was changed.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..._sharding.chunks import range_chunks
from ..._sharding.collectives import broadcast_bytes
from ..dcp.coordination import agree, exchange
from ..dcp.planners import TensorPieces
from ..dcp.staging import Source, Stored

BUCKET_BYTES = 16 << 20
_ALIGN = 8


class FirstRankSource:
    """``open_source()`` on global rank 0 (``rank``), the same checkpoint on every rank."""

    def __init__(self, open_source: Callable[[], Source], rank: int, pin_layout: bool,
                 tag: str) -> None:
        self._rank, self._pin_layout, self._tag = rank, pin_layout, tag
        self._inner: Optional[Source] = None
        error, described = None, None
        if rank == 0:
            try:
                self._inner = open_source()
                described = (self._inner.where, self._inner.stored)
            except Exception as exc:  # raised on every rank by agree
                error = exc
        agree(f"{tag}.open", error)
        self.where, self.stored = exchange(f"{tag}.describe", described)[0]

    def read(self, tensors: Dict[str, TensorPieces], objects: Dict[str, Any],
             into: Dict[str, Any]) -> None:
        wanted = exchange(f"{self._tag}.want", (sorted(tensors), sorted(objects)))
        object_keys = sorted({k for _, keys in wanted for k in keys})
        if object_keys:
            values, error = None, None
            if self._inner is not None:
                try:
                    values = {}
                    self._inner.read({}, {k: None for k in object_keys}, values)
                except Exception as exc:
                    error = exc
            agree(f"{self._tag}.objects.read", error)
            values = exchange(f"{self._tag}.objects", values)[0]
            into.update((k, values[k]) for k in objects)
        tensor_keys = sorted({k for keys, _ in wanted for k in keys})
        if tensor_keys:
            self._stream(tensor_keys, tensors)

    def _stream(self, keys: List[str], tensors: Dict[str, TensorPieces]) -> None:
        import torch_xla
        layout = _StreamLayout(keys, self.stored)
        size = min(BUCKET_BYTES, layout.total)
        receiver = _Receiver(layout, tensors, self.stored)
        for n, begin in enumerate(range(0, layout.total, size)):
            bucket, error = torch.zeros(size, dtype=torch.uint8), None
            if self._inner is not None:
                try:
                    self._fill(layout, begin, bucket)
                except Exception as exc:
                    error = exc
            agree(f"{self._tag}.bucket.{n}", error)
            got = broadcast_bytes(bucket.view(torch.int32).to(torch_xla.device()),
                                  self._pin_layout)
            received = got.cpu().view(torch.uint8)
            receiver.take(begin, received)
        receiver.finish()

    def _fill(self, layout: "_StreamLayout", begin: int, bucket: torch.Tensor) -> None:
        """The first rank: the stream's bytes from ``begin`` into ``bucket``, read by runs."""
        assert self._inner is not None
        for key, first, count, at in layout.runs(begin, bucket.numel()):
            stored = self.stored[key]
            dtype = stored.properties.dtype
            values = torch.empty(count, dtype=dtype)
            chunks = [(c, c.start - first) for c in range_chunks(stored.size, first, first + count)]
            self._inner.read({key: TensorPieces(stored.size, dtype, chunks, lambda: values)},
                             {}, {})
            raw = values.view(torch.uint8)
            bucket[at:at + raw.numel()].copy_(raw)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


class _StreamLayout:
    """Where each tensor's bytes are in the stream."""

    def __init__(self, keys: List[str], stored: Dict[str, Stored]) -> None:
        self.entries: List[Tuple[str, int, int, int]] = []  # key, offset, item size, numel
        at = 0
        for key in keys:
            meta = stored[key]
            item = meta.properties.dtype.itemsize
            numel = math.prod(meta.size)
            self.entries.append((key, at, item, numel))
            at += -(-numel * item // _ALIGN) * _ALIGN
        self.total = max(at, _ALIGN)

    def runs(self, begin: int, length: int) -> List[Tuple[str, int, int, int]]:
        """(key, first element, count, where in the bucket) of every tensor's elements
        within stream bytes ``[begin, begin + length)``."""
        out = []
        end = begin + length
        for key, offset, item, numel in self.entries:
            lo, hi = max(begin, offset), min(end, offset + numel * item)
            if lo < hi:
                out.append((key, (lo - offset) // item, (hi - lo) // item, lo - begin))
        return out


class _Receiver:
    """Every rank: copies the runs its pieces want out of each bucket, converted from the
    stored dtype (elements never straddle buckets: see ``_StreamLayout``)."""

    def __init__(self, layout: _StreamLayout, tensors: Dict[str, TensorPieces],
                 stored: Dict[str, Stored]) -> None:
        self._runs: List[Tuple[int, int, torch.dtype, torch.Tensor]] = []  # begin, end, ...
        self._left = 0
        for key, offset, item, _ in layout.entries:
            pieces = tensors.get(key)
            if pieces is None:
                continue
            flat, dtype = pieces.flat(), stored[key].properties.dtype
            for chunk, at in pieces.chunks:
                begin = offset + chunk.start * item
                self._runs.append((begin, begin + chunk.numel * item, dtype,
                                   flat[at:at + chunk.numel]))
                self._left += chunk.numel * item

    def take(self, begin: int, bucket: torch.Tensor) -> None:
        end = begin + bucket.numel()
        for run_begin, run_end, dtype, out in self._runs:
            lo, hi = max(begin, run_begin), min(end, run_end)
            if lo < hi:
                item = dtype.itemsize
                values = bucket[lo - begin:hi - begin].clone().view(dtype)
                first = (lo - run_begin) // item
                out[first:first + values.numel()].copy_(values)
                self._left -= hi - lo

    def finish(self) -> None:
        if self._left:
            raise RuntimeError(f"{self._left} bytes wanted were not in the stream")
