"""A rank's piece of a parameter as rectangular chunks of the full tensor.

``torch.distributed.checkpoint`` (DCP) stores a tensor as chunks, each a box of the full
tensor given by its offsets and sizes per dimension, and reads any box back from whatever
chunks were written. Our shards hold contiguous runs of a parameter's row-major elements
(``Layout.owned``): a flat or interleaved shard cuts rows anywhere, a dim-0 shard holds
whole rows. A contiguous run of row-major elements is a union of at most ``2 * ndim - 1``
boxes: the rest of a partly covered row (recursively, in the next dimension), whole rows,
and the start of a last partly covered row. Each box is itself a contiguous run, so its
values are a slice of the shard, viewed in the box's shape (``run_chunks``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Chunk:
    offsets: Tuple[int, ...]   # where the box starts, per dimension of the full tensor
    sizes: Tuple[int, ...]     # its extent per dimension
    start: int                 # its first element, in the full tensor's row-major order

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class TensorPieces:
    """A tensor of the checkpoint as one rank holds (saving) or wants (loading) it: chunks,
    each a run of a flat host buffer from where it starts there. The buffer is asked for
    only when DCP reaches a chunk, so a save can copy its sources to the host one at a time
    (``HostCopies`` in ``checkpoint/writers/dcp_shards.py``)."""
    size: torch.Size
    dtype: torch.dtype
    chunks: List[Tuple[Chunk, int]]
    flat: Callable[[], torch.Tensor]

    def view(self, i: int) -> torch.Tensor:
        chunk, at = self.chunks[i]
        return self.flat()[at:at + chunk.numel].view(chunk.sizes)


def range_chunks(shape: Sequence[int], start: int, end: int) -> List[Chunk]:
    """Elements ``[start, end)`` of a tensor of ``shape``, in row-major order, as boxes in
    that order (their runs are consecutive and together exactly the range)."""
    shape = tuple(int(d) for d in shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) == 0:
        return [Chunk((), (), 0)]
    if len(shape) == 1:
        return [Chunk((start,), (end - start,), start)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    out: List[Chunk] = []
    row, col = divmod(start, inner)
    if col:  # the rest of a partly covered row
        stop = min(end, (row + 1) * inner)
        out += [Chunk((row,) + c.offsets, (1,) + c.sizes, row * inner + c.start)
                for c in range_chunks(shape[1:], col, stop - row * inner)]
        row, start = row + 1, stop
        if start == end:
            return out
    last_row, last_col = divmod(end, inner)
    if last_row > row:  # whole rows
        out.append(Chunk((row,) + (0,) * (len(shape) - 1), (last_row - row,) + shape[1:],
                         row * inner))
    if last_col:  # the start of a last partly covered row
        out += [Chunk((last_row,) + c.offsets, (1,) + c.sizes, last_row * inner + c.start)
                for c in range_chunks(shape[1:], 0, last_col)]
    return out


def run_chunks(shape: Sequence[int], start: int, end: int, at: int = 0
               ) -> List[Tuple[Chunk, int]]:
    """Elements ``[start, end)`` of a tensor of ``shape`` held contiguously from ``at`` of a
    flat buffer (a rank's ``Owned`` run in its shard, or a run read alone): each box with
    where it starts in that buffer."""
    return [(c, at + c.start - start) for c in range_chunks(shape, start, end)]
