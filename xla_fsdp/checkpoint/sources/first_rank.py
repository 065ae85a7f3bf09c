"""A checkpoint only the first rank can read (pods whose hosts share no filesystem, where only
host 0 has it), sent to the other ranks over the collectives.

[Note: the first rank reads, everyone receives a stream]
The first rank opens the checkpoint and tells the others what it holds (``stored``, over
``xm.rendezvous``); every rank then checks and plans its load from that, as it would from
the files. To read, the ranks agree on the tensors any of them wants and lay them end to
end, in key order, as one byte stream (each tensor starting at a multiple of 8 bytes, so
that no element straddles a bucket). The stream goes out in buckets of at most
``BUCKET_BYTES``, all of one size so that XLA compiles one broadcast. The stream is cut into
buckets as a flat shard group is cut into shards: a ``FlatLayout`` of the tensors' bytes
with a bucket for a rank, whose ``owned`` says which bytes of which tensor a bucket holds.
The first rank reads a bucket's runs from the checkpoint (by runs, as any rank reads its own), every rank gets
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

from ..._sharding.chunks import TensorPieces, run_chunks
from ..._sharding.collectives import broadcast_bytes
from ..._sharding.layout import FlatLayout
from ..coordination import every_rank_agrees, exchange
from ..staging import Source, Stored

BUCKET_BYTES = 16 << 20
_ALIGN = 8


class FirstRankSource:
    """``open_source()`` on global rank 0 (``rank``), the same checkpoint on every rank."""

    def __init__(self, open_source: Callable[[], Source], rank: int, pin_layout: bool,
                 tag: str) -> None:
        self._pin_layout, self._tag = pin_layout, tag
        self._inner: Optional[Source] = None
        described = None
        with every_rank_agrees(f"{tag}.open"):
            if rank == 0:
                self._inner = open_source()
                described = (self._inner.where, self._inner.stored)
        self.where, self.stored = exchange(f"{tag}.describe", described)[0]

    def read(self, tensors: Dict[str, TensorPieces], objects: Dict[str, Any],
             into: Dict[str, Any]) -> None:
        wanted = exchange(f"{self._tag}.want", (sorted(tensors), sorted(objects)))
        object_keys = sorted({k for _, keys in wanted for k in keys})
        if object_keys:
            values: Dict[str, Any] = {}
            with every_rank_agrees(f"{self._tag}.objects.read"):
                if self._inner is not None:
                    self._inner.read({}, {k: None for k in object_keys}, values)
            values = exchange(f"{self._tag}.objects", values)[0]
            into.update((k, values[k]) for k in objects)
        tensor_keys = sorted({k for keys, _ in wanted for k in keys})
        if tensor_keys:
            self._stream(tensor_keys, tensors)

    def _stream(self, keys: List[str], tensors: Dict[str, TensorPieces]) -> None:
        import torch_xla
        layout = _stream_layout(keys, self.stored)
        receiver = _Receiver(keys, tensors, self.stored)
        for n in range(layout.world_size):
            bucket = torch.zeros(layout.shard_shape, dtype=torch.uint8)
            with every_rank_agrees(f"{self._tag}.bucket.{n}"):
                if self._inner is not None:
                    self._fill(keys, layout, n, bucket)
            got = broadcast_bytes(bucket.view(torch.int32).to(torch_xla.device()),
                                  self._pin_layout)
            receiver.take(layout, n, got.cpu().view(torch.uint8))
        receiver.finish()

    def _fill(self, keys: List[str], layout: FlatLayout, n: int, bucket: torch.Tensor) -> None:
        """The first rank: bucket ``n``'s bytes, read by runs."""
        assert self._inner is not None
        for run in layout.owned(n):
            stored = self.stored[keys[run.param]]
            dtype = stored.properties.dtype
            end = min(run.end, math.prod(stored.size) * dtype.itemsize)  # not the alignment
            first, count = run.start // dtype.itemsize, (end - run.start) // dtype.itemsize
            if count <= 0:
                continue
            values = torch.empty(count, dtype=dtype)
            chunks = run_chunks(stored.size, first, first + count)
            self._inner.read({keys[run.param]: TensorPieces(stored.size, dtype, chunks,
                                                             lambda: values)}, {}, {})
            raw = values.view(torch.uint8)
            bucket[run.shard_offset:run.shard_offset + raw.numel()].copy_(raw)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


def _stream_layout(keys: List[str], stored: Dict[str, Stored]) -> FlatLayout:
    """The stream: each tensor's bytes padded to a multiple of ``_ALIGN``, end to end, cut
    into the fewest buckets of at most ``BUCKET_BYTES`` (multiples of ``_ALIGN`` too)."""
    sizes = [-(-math.prod(stored[k].size) * stored[k].properties.dtype.itemsize // _ALIGN)
             * _ALIGN for k in keys]
    buckets = max(1, -(-sum(sizes) // BUCKET_BYTES))
    return FlatLayout(tuple(torch.Size([n]) for n in sizes), buckets, _ALIGN)


class _Receiver:
    """Every rank: copies the runs its pieces want out of each bucket, converted from the
    stored dtype (elements never straddle buckets: see ``_stream_layout``)."""

    def __init__(self, keys: List[str], tensors: Dict[str, TensorPieces],
                 stored: Dict[str, Stored]) -> None:
        # for each tensor of the stream: (first byte, end, dtype, where it goes) of each run
        self._runs: List[List[Tuple[int, int, torch.dtype, torch.Tensor]]] = []
        self._left = 0
        for key in keys:
            pieces, dtype = tensors.get(key), stored[key].properties.dtype
            self._runs.append([])
            if pieces is None:
                continue
            flat, item = pieces.flat(), dtype.itemsize
            for chunk, at in pieces.chunks:
                self._runs[-1].append((chunk.start * item, (chunk.start + chunk.numel) * item,
                                       dtype, flat[at:at + chunk.numel]))
                self._left += chunk.numel * item

    def take(self, layout: FlatLayout, n: int, bucket: torch.Tensor) -> None:
        for run in layout.owned(n):
            for begin, end, dtype, out in self._runs[run.param]:
                lo, hi = max(begin, run.start), min(end, run.end)
                if lo < hi:
                    at = run.shard_offset + lo - run.start
                    values = bucket[at:at + hi - lo].clone().view(dtype)
                    first = (lo - begin) // dtype.itemsize
                    out[first:first + values.numel()].copy_(values)
                    self._left -= hi - lo

    def finish(self) -> None:
        if self._left:
            raise RuntimeError(f"{self._left} bytes wanted were not in the stream")
