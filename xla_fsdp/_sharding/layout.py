"""How a group of parameters is laid out across ranks. Pure tensor arithmetic; no XLA.

Every FSDP unit owns one or more *shard groups*. A group is sharded as one tensor:

* ``FlatLayout``: the group's tensors are flattened, concatenated and zero-padded to
  ``world_size * multiple`` elements, then cut into ``world_size`` equal 1-D shards. With
  ``flatten_parameters=False`` each parameter is a group of one (torch_xla's checkpoints
  also use it for flattened groups).
* ``InterleavedLayout``: ``flatten_parameters=True``, where all trainable parameters of a
  unit form one group (and the frozen ones another). Each parameter is padded and cut into
  ``world_size`` pieces on its own, and a rank's shard is its piece of every parameter,
  concatenated. The optimizer still sees one tensor per group, but every parameter is
  gathered into a buffer of its own, so nothing slices it out of a unit-sized buffer, and
  a backward fusion that reads one bias keeps that bias alive, not the whole unit.
* ``Dim0Layout``: one tensor, padded along dim 0 to a multiple of ``world_size`` and cut
  into row blocks, never flattened (``shard_param_on_dim_0=True``, for compilers such as
  AWS Neuron that mishandle flattened parameters).

* ``StackedLayout``: ``L`` identical layers run as one scan (``ScannedLayers``). Each
  layer is laid out as one of the above would lay it out on its own, and a rank's shard is
  its ``L`` layer shards stacked, ``[L, *layer shard]``: the scan slices one row per step.

Layouts are frozen, and their derived sizes (offsets, padded sizes, shard shapes) are cached
properties: every step reads them for every parameter, and computing them once keeps that
reading off the step's host time.

Only the padding a collective needs is added: a multiple of ``world_size`` elements (or
rows), not of ``128 * world_size`` as torch_xla does.

Every layout is a ``Layout`` (the protocol below), and answers ``owned(rank)``: which
row-major elements of which parameter a rank's shard holds, and where in the shard
(flattened) they sit. It is the one answer to where a parameter's elements live: training
cuts and gathers by the same layouts, checkpoints are written piece by piece from it
(``chunks.run_chunks``), read back at any world size through its inverse (``runs_by_param``),
and the first rank's stream of a checkpoint is cut into buckets by a ``FlatLayout``.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import List, Protocol, Sequence, Tuple, Union

import torch


@dataclass(frozen=True)
class Owned:
    """Elements ``[start, end)`` of parameter ``param`` (row-major; for a stacked layout,
    parameter ``layer * k + j``) are elements ``[shard_offset, shard_offset + end - start)``
    of a rank's shard, flattened."""
    param: int
    start: int
    end: int
    shard_offset: int


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _starts(sizes: Sequence[int]) -> Tuple[int, ...]:
    """Where each of ``sizes`` starts when they are laid end to end."""
    return tuple(itertools.accumulate(sizes, initial=0))[:-1]


@dataclass(frozen=True)
class _Tensors:
    """Several tensors sharded as one group, in units of ``multiple`` elements."""
    shapes: Tuple[torch.Size, ...]
    world_size: int
    multiple: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.multiple < 1:
            raise ValueError(f"world_size and multiple must be >= 1: {self}")

    @cached_property
    def numels(self) -> Tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @cached_property
    def numel(self) -> int:
        return sum(self.numels)


class _WholeShard:
    """A layout whose shard is all-gathered whole: one piece."""

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """[start, end) of ``rank``'s shard along dim 0 of the padded group (``pad``)."""
        size = self.shard_shape[0]
        return rank * size, (rank + 1) * size

    piece_count = 1

    def pieces(self, shard: torch.Tensor) -> List[torch.Tensor]:
        return [shard]

    def unshard_pieces(self, gathered: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return self.unshard(gathered[0])


def unshard_all(layouts: Sequence["Layout"], gathered: Sequence[torch.Tensor]
                ) -> List[torch.Tensor]:
    """Every layout's full tensors, in order, from the all-gathers of all their ``pieces``
    in order: the one way a unit's gathered shards become its parameters' full values,
    eagerly and in a traced graph."""
    out: List[torch.Tensor] = []
    at = 0
    for layout in layouts:
        out += layout.unshard_pieces(gathered[at:at + layout.piece_count])
        at += layout.piece_count
    return out


def compute_cached(layout: "Layout") -> None:
    """Computes every cached size of ``layout`` now. ``cached_property`` takes a lock the
    first time, which code that Dynamo traces cannot (see [Note: collectives traced into the
    compiled graph] in ``_unit.traced_unshard``)."""
    for klass in type(layout).__mro__:
        for name, attr in vars(klass).items():
            if isinstance(attr, cached_property):
                getattr(layout, name)


@dataclass(frozen=True)
class FlatLayout(_Tensors, _WholeShard):
    """Elements per shard are a multiple of ``multiple``."""

    @cached_property
    def padded_numel(self) -> int:
        return _ceil_to(max(self.numel, 1), self.world_size * self.multiple)

    @cached_property
    def shard_shape(self) -> torch.Size:
        return torch.Size([self.padded_numel // self.world_size])

    @cached_property
    def offsets(self) -> Tuple[int, ...]:
        return _starts(self.numels)

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 \
            else tensors[0].reshape(-1)

    def pad(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The group as one padded 1-D tensor (what reduce-scatter consumes)."""
        flat = self._flat(tensors)
        extra = self.padded_numel - self.numel
        if extra:
            flat = torch.cat([flat, flat.new_zeros(extra)])
        return flat

    def shard(self, tensors: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """``rank``'s shard, a new tensor. ``tensors`` may also be the group's whole content
        as one tensor of ``numel`` elements. Only the shard is allocated, never the padded
        group."""
        return _slice_padded(self._flat(tensors), *self.shard_range(rank))

    def unshard(self, gathered: torch.Tensor) -> List[torch.Tensor]:
        """Views of the full tensors inside an all-gathered padded flat tensor."""
        if len(self.shapes) == 1 and self.padded_numel == self.numel:
            return [gathered.view(self.shapes[0])]  # no slice: one op fewer a parameter
        return [gathered[o:o + n].view(s)
                for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def owned(self, rank: int) -> List[Owned]:
        first, stop = self.shard_range(rank)
        out = []
        for i, (at, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(at, first), min(at + n, stop)
            if lo < hi:
                out.append(Owned(i, lo - at, hi - at, lo - first))
        return out


@dataclass(frozen=True)
class InterleavedLayout(_Tensors):
    """Elements of each parameter per shard are a multiple of ``multiple``."""

    @cached_property
    def piece_numels(self) -> Tuple[int, ...]:
        """Elements of each parameter in every rank's shard."""
        return tuple(_ceil_to(max(n, 1), self.world_size * self.multiple) // self.world_size
                     for n in self.numels)

    @cached_property
    def piece_offsets(self) -> Tuple[int, ...]:
        return _starts(self.piece_numels)

    @cached_property
    def padded_numel(self) -> int:
        return sum(self.piece_numels) * self.world_size

    @cached_property
    def shard_shape(self) -> torch.Size:
        return torch.Size([sum(self.piece_numels)])

    def _padded(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if len(tensors) == 1 and len(self.shapes) > 1:  # the group's content as one tensor
            tensors = tensors[0].reshape(-1).split(self.numels)
        out = []
        for t, piece in zip(tensors, self.piece_numels):
            flat = t.reshape(-1)
            extra = piece * self.world_size - flat.numel()
            out.append(torch.cat([flat, flat.new_zeros(extra)]) if extra else flat)
        return out

    def pad(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The group as one 1-D tensor whose ``world_size`` equal blocks are the ranks'
        shards, so that a reduce-scatter leaves each rank its own."""
        padded = self._padded(tensors)
        return torch.cat([p.view(self.world_size, -1) for p in padded], dim=1).reshape(-1)

    def shard(self, tensors: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """``rank``'s shard, a new tensor. ``tensors`` may also be the group's whole content
        as one tensor of ``numel`` elements."""
        return torch.cat([p[rank * n:(rank + 1) * n]
                          for p, n in zip(self._padded(tensors), self.piece_numels)])

    @property
    def piece_count(self) -> int:
        return len(self.shapes)

    def pieces(self, shard: torch.Tensor) -> List[torch.Tensor]:
        """What to all-gather: this rank's piece of each parameter."""
        return [shard[o:o + n] for o, n in zip(self.piece_offsets, self.piece_numels)]

    def unshard_pieces(self, gathered: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The full tensors, from the all-gathers of ``pieces``."""
        return [g[:n].view(s) for g, n, s in zip(gathered, self.numels, self.shapes)]

    def unshard(self, gathered: torch.Tensor) -> List[torch.Tensor]:
        """The full tensors, from an all-gather of whole shards (a copy of each)."""
        rows = gathered.view(self.world_size, -1)
        return [rows[:, o:o + p].reshape(-1)[:n].view(s) for o, p, n, s in
                zip(self.piece_offsets, self.piece_numels, self.numels, self.shapes)]

    def owned(self, rank: int) -> List[Owned]:
        out = []
        for i, (n, piece, at) in enumerate(zip(self.numels, self.piece_numels,
                                               self.piece_offsets)):
            lo, hi = rank * piece, min((rank + 1) * piece, n)
            if lo < hi:
                out.append(Owned(i, lo, hi, at))
        return out


@dataclass(frozen=True)
class Dim0Layout(_WholeShard):
    shape: torch.Size
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1: {self}")

    @cached_property
    def shapes(self) -> Tuple[torch.Size, ...]:
        return (self.shape,)

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) else 1  # a 0-dim tensor is one row

    @cached_property
    def padded_rows(self) -> int:
        return _ceil_to(self.rows, self.world_size)

    @cached_property
    def pad_rows(self) -> int:
        return self.padded_rows - self.rows

    @cached_property
    def shard_shape(self) -> torch.Size:
        tail = tuple(self.shape[1:]) if len(self.shape) else ()
        return torch.Size((self.padded_rows // self.world_size,) + tail)

    def _rows(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        (t,) = tensors
        return t.reshape(self.rows, *self.shape[1:]) if len(self.shape) else t.reshape(1)

    def pad(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        t = self._rows(tensors)
        if self.pad_rows:
            t = torch.cat([t, t.new_zeros((self.pad_rows,) + tuple(t.shape[1:]))])
        return t

    def shard(self, tensors: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """``rank``'s block of rows, a new tensor (``tensors`` is the one tensor, in any
        shape with ``numel`` elements)."""
        return _slice_padded(self._rows(tensors), *self.shard_range(rank))

    def unshard(self, gathered: torch.Tensor) -> List[torch.Tensor]:
        return [gathered[:self.rows].view(self.shape)]

    def owned(self, rank: int) -> List[Owned]:
        first, stop = self.shard_range(rank)
        stop = min(stop, self.rows)
        if first >= stop:
            return []
        inner = self.numel // self.rows
        return [Owned(0, first * inner, stop * inner, 0)] if inner else []


@dataclass(frozen=True)
class StackedLayout(_WholeShard):
    """``layers`` copies of ``layer``; tensors are listed layer by layer."""
    layer: Union[FlatLayout, InterleavedLayout, Dim0Layout]
    layers: int

    @cached_property
    def world_size(self) -> int:
        return self.layer.world_size

    @cached_property
    def shapes(self) -> Tuple[torch.Size, ...]:
        return tuple(self.layer.shapes) * self.layers

    @cached_property
    def numel(self) -> int:
        return self.layer.numel * self.layers

    @cached_property
    def shard_shape(self) -> torch.Size:
        return torch.Size((self.layers,) + tuple(self.layer.shard_shape))

    def _per_layer(self, tensors: Sequence[torch.Tensor]) -> List[Sequence[torch.Tensor]]:
        k = len(self.layer.shapes)
        if len(tensors) != k * self.layers:
            raise ValueError(f"expected {k * self.layers} tensors ({self.layers} layers of "
                             f"{k}), got {len(tensors)}")
        return [tensors[i * k:(i + 1) * k] for i in range(self.layers)]

    def shard(self, tensors: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        return torch.stack([self.layer.shard(ts, rank) for ts in self._per_layer(tensors)])

    def pad(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[N * L, *layer shard]``, rank-major: its ``world_size`` equal blocks along dim 0
        are the ranks' shards (what ``unshard`` reads back)."""
        tail = tuple(self.layer.shard_shape)
        layers = [self.layer.pad(ts).reshape((self.world_size,) + tail)
                  for ts in self._per_layer(tensors)]
        return torch.stack(layers, dim=1).reshape((self.world_size * self.layers,) + tail)

    def unshard(self, gathered: torch.Tensor) -> List[torch.Tensor]:
        """The full tensors, from an all-gather along dim 0 of every rank's ``[L, ...]``
        shard (rank-major: ``[N * L, ...]``)."""
        n, tail = self.world_size, tuple(self.layer.shard_shape)
        by_rank = gathered.view((n, self.layers) + tail)
        out: List[torch.Tensor] = []
        for i in range(self.layers):
            out += self.layer.unshard(by_rank[:, i].reshape((n * tail[0],) + tail[1:]))
        return out

    def owned(self, rank: int) -> List[Owned]:
        k, row = len(self.layer.shapes), math.prod(self.layer.shard_shape)
        return [Owned(i * k + o.param, o.start, o.end, i * row + o.shard_offset)
                for i in range(self.layers) for o in self.layer.owned(rank)]


class Layout(Protocol):
    """What every layout answers (the four above satisfy it): the group's tensors, how a
    rank's shard is cut from them and how they come back from gathered shards, and which
    elements each rank holds."""

    @property
    def world_size(self) -> int: ...

    @property
    def shapes(self) -> Tuple[torch.Size, ...]: ...

    @property
    def numel(self) -> int: ...

    @property
    def shard_shape(self) -> torch.Size: ...

    def shard(self, tensors: Sequence[torch.Tensor], rank: int) -> torch.Tensor: ...

    def pad(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The group as one tensor whose ``world_size`` equal blocks along dim 0 are the
        ranks' shards (what reduce-scatter consumes)."""

    @property
    def piece_count(self) -> int:
        """How many tensors ``pieces`` cuts a shard into."""

    def pieces(self, shard: torch.Tensor) -> List[torch.Tensor]:
        """What to all-gather of a rank's shard."""

    def unshard_pieces(self, gathered: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The full tensors, from the all-gathers of ``pieces``."""

    def unshard(self, gathered: torch.Tensor) -> List[torch.Tensor]:
        """The full tensors, from an all-gather of whole shards."""

    def owned(self, rank: int) -> List[Owned]:
        """``rank``'s runs of each parameter's elements, in shard order."""


def runs_by_param(layout: Layout) -> List[List[Tuple[int, Owned]]]:
    """``owned`` inverted: for each parameter, every (rank, run) holding its elements, in
    rank order; together the runs are its elements, each once. Reading a parameter back
    from all ranks' shards (at any world size) reads these runs and nothing else."""
    out: List[List[Tuple[int, Owned]]] = [[] for _ in layout.shapes]
    for rank in range(layout.world_size):
        for run in layout.owned(rank):
            out[run.param].append((rank, run))
    return out


def _slice_padded(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """A copy of ``t[start:end]`` (along dim 0), zero-filled where it runs past the end."""
    piece = t[start:end]
    missing = (end - start) - piece.shape[0]
    if missing:
        return torch.cat([piece, piece.new_zeros((missing,) + tuple(t.shape[1:]))])
    return piece.clone()
