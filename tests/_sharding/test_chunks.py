"""A rank's pieces of each parameter as chunks of the full tensor (no XLA)."""
import itertools
import math

import pytest
import torch

from xla_fsdp._sharding.chunks import range_chunks, run_chunks
from xla_fsdp._sharding.layout import (Dim0Layout, FlatLayout, InterleavedLayout, StackedLayout,
                                      runs_by_param)

from ..support.checks import nonempty, pairs

SHAPES = [(7,), (5, 3), (2, 3, 4), (), (6, 1, 5), (1,), (3, 0)]


# a shape of no elements has no range but the empty one, checked below with the others'
@pytest.mark.parametrize("shape", [shape for shape in SHAPES if math.prod(shape)])
def test_every_range_is_its_boxes_in_order(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).reshape(shape)
    for start, end in nonempty(itertools.combinations(range(numel + 1), 2), "ranges"):
        chunks = range_chunks(shape, start, end)
        assert len(chunks) <= max(1, 2 * len(shape) - 1)
        at = start
        for c in nonempty(chunks, f"boxes of [{start}, {end})"):
            assert c.start == at  # consecutive runs
            box = full[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))]
            assert box.reshape(-1).tolist() == list(range(at, at + c.numel))
            at += c.numel
        assert at == end


@pytest.mark.parametrize("shape", SHAPES)
def test_an_empty_range_is_no_boxes(shape):
    assert range_chunks(shape, 0, 0) == []


def _layouts(world):
    shapes = (torch.Size([5, 3]), torch.Size([7]), torch.Size([]), torch.Size([2, 2, 3]))
    return [FlatLayout(shapes, world), FlatLayout(shapes[:1], world, multiple=4),
            InterleavedLayout(shapes, world), InterleavedLayout(shapes, world, multiple=2),
            Dim0Layout(torch.Size([5, 3]), world), Dim0Layout(torch.Size([]), world),
            StackedLayout(FlatLayout(shapes, world), 3),
            StackedLayout(InterleavedLayout(shapes, world), 2),
            StackedLayout(Dim0Layout(torch.Size([5, 3]), world), 3)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_owned_pieces_as_chunks_rebuild_every_parameter(world):
    for layout in nonempty(_layouts(world), "layouts"):
        tensors = [torch.randn(s) for s in layout.shapes]
        shards = [layout.shard(tensors, r).reshape(-1) for r in range(world)]
        rebuilt = [torch.full(s, float("nan")) for s in layout.shapes]
        covered = [torch.zeros(s, dtype=torch.int) for s in layout.shapes]
        for rank, shard in enumerate(shards):
            for owned in layout.owned(rank):
                shape = layout.shapes[owned.param]
                for c, at in run_chunks(shape, owned.start, owned.end, owned.shard_offset):
                    box = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))
                    rebuilt[owned.param][box] = shard[at:at + c.numel].view(c.sizes)
                    covered[owned.param][box] += 1
        for got, want, count in pairs(rebuilt, tensors, covered):
            assert torch.equal(got, want), layout
            assert bool((count == 1).all()), layout  # each element exactly once


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_runs_by_param_read_every_parameter_back(world):
    """The inverse of ``owned``: each parameter's runs, over all ranks, are its elements."""
    for layout in nonempty(_layouts(world), "layouts"):
        tensors = [torch.randn(s) for s in layout.shapes]
        shards = [layout.shard(tensors, r).reshape(-1) for r in range(world)]
        for want, runs in pairs(tensors, runs_by_param(layout)):
            got = torch.full((want.numel(),), float("nan"))
            assert [r for r, _ in runs] == sorted(r for r, _ in runs)
            for rank, run in runs:
                n = run.end - run.start
                got[run.start:run.end] = shards[rank][run.shard_offset:run.shard_offset + n]
            assert torch.equal(got.view(want.shape), want), layout
