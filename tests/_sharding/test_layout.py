"""Shard layout arithmetic (no XLA)."""
import pytest
import torch

from xla_fsdp._sharding.layout import (Dim0Layout, FlatLayout, InterleavedLayout, StackedLayout,
                                      unshard_all)
from ..support.checks import every, pairs


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shapes", [[(10,)], [(7, 3), (5,)], [()], [(70, 32), (70,), (1,)]])
def test_flat_layout_round_trip(world, shapes):
    tensors = [torch.randn(s) for s in shapes]
    layout = FlatLayout(tuple(torch.Size(s) for s in shapes), world)
    shards = [layout.shard(tensors, r) for r in range(world)]
    assert every(s.shape == layout.shard_shape for s in shards)
    assert layout.padded_numel - layout.numel < world  # padding only to a multiple of N
    for got, want in pairs(layout.unshard(torch.cat(shards)), tensors):
        assert torch.equal(got, want)
    # the group's content as one flat tensor shards the same way
    content = torch.cat([t.reshape(-1) for t in tensors])
    assert every(torch.equal(layout.shard([content], r), s) for r, s in enumerate(shards))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("multiple", [1, 4])
@pytest.mark.parametrize("shapes", [[(10,)], [(7, 3), (5,)], [()], [(70, 32), (70,), (1,), ()]])
def test_interleaved_layout_round_trip(world, multiple, shapes):
    tensors = [torch.randn(s) for s in shapes]
    layout = InterleavedLayout(tuple(torch.Size(s) for s in shapes), world, multiple)
    shards = [layout.shard(tensors, r) for r in range(world)]
    assert every(s.shape == layout.shard_shape for s in shards)
    # each parameter is padded on its own, only to a multiple of N (times ``multiple``)
    for n, piece in pairs(layout.numels, layout.piece_numels):
        assert piece % multiple == 0 and 0 <= piece * world - n < world * multiple
    # from one all-gather per parameter piece (what training does) ...
    pieces = [torch.cat([layout.pieces(s)[i] for s in shards]) for i in range(len(shapes))]
    for got, want in pairs(layout.unshard_pieces(pieces), tensors):
        assert torch.equal(got, want)
    # ... and from one all-gather of whole shards (full_state_dict)
    for got, want in pairs(layout.unshard(torch.cat(shards)), tensors):
        assert torch.equal(got, want)
    content = torch.cat([t.reshape(-1) for t in tensors])
    assert every(torch.equal(layout.shard([content], r), s) for r, s in enumerate(shards))
    # what a reduce-scatter of ``pad`` leaves rank r is rank r's shard
    rows = layout.pad(tensors).view(world, -1)
    assert every(torch.equal(rows[r], s) for r, s in enumerate(shards))


def test_interleaved_shard_holds_a_piece_of_every_parameter():
    layout = InterleavedLayout((torch.Size([4]), torch.Size([2])), world_size=2)
    a, b = torch.tensor([1., 2, 3, 4]), torch.tensor([5., 6])
    assert layout.shard([a, b], 0).tolist() == [1, 2, 5]
    assert layout.shard([a, b], 1).tolist() == [3, 4, 6]
    assert layout.pad([a, b]).tolist() == [1, 2, 5, 3, 4, 6]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(10, 3), (3, 5, 2), (1,), (), (16,)])
def test_dim0_layout_round_trip(world, shape):
    t = torch.randn(shape)
    layout = Dim0Layout(torch.Size(shape), world)
    shards = [layout.shard([t], r) for r in range(world)]
    assert every(s.shape == layout.shard_shape for s in shards)
    assert layout.shard_shape[1:] == torch.Size(shape[1:])  # never flattened
    assert torch.equal(layout.unshard(torch.cat(shards))[0], t)
    assert every(torch.equal(layout.shard([t.reshape(-1)], r), s) for r, s in enumerate(shards))


def test_padding_is_minimal_and_visible():
    bias = FlatLayout((torch.Size([10]),), world_size=8)
    assert bias.padded_numel == 16  # torch_xla pads this to 1024
    rows = Dim0Layout(torch.Size([10, 4]), world_size=4)
    assert (rows.padded_rows, rows.pad_rows) == (12, 2)


def test_gradient_padding_is_zero():
    layout = FlatLayout((torch.Size([3]), torch.Size([2])), world_size=4)
    flat = layout.pad([torch.ones(3), torch.ones(2)])
    assert flat.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def test_shards_are_copies():
    t = torch.arange(8.)
    for layout in (FlatLayout((torch.Size([8]),), 2), Dim0Layout(torch.Size([8]), 2),
                   InterleavedLayout((torch.Size([8]),), 2)):
        shard = layout.shard([t], 0)
        shard.add_(100)
        assert t[0] == 0


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layer", [
    lambda w: FlatLayout((torch.Size([5, 3]), torch.Size([7])), w),
    lambda w: InterleavedLayout((torch.Size([5, 3]), torch.Size([7])), w, 2),
    lambda w: Dim0Layout(torch.Size([5, 3]), w)])
def test_stacked_layout_is_a_layout_like_the_others(world, layer):
    """pad's blocks are the ranks' shards, and pieces gathered come back as the tensors."""
    layout = StackedLayout(layer(world), 3)
    tensors = [torch.randn(s) for s in layout.shapes]
    shards = [layout.shard(tensors, r) for r in range(world)]
    assert every(s.shape == layout.shard_shape for s in shards)
    blocks = layout.pad(tensors).chunk(world)
    assert len(blocks) == len(shards) == world
    assert every(torch.equal(b.view(layout.shard_shape), s) for b, s in pairs(blocks, shards))
    gathered = [torch.cat([layout.pieces(s)[i] for s in shards])
                for i in range(len(layout.pieces(shards[0])))]
    for got, want in pairs(layout.unshard_pieces(gathered), tensors):
        assert torch.equal(got, want)


@pytest.mark.parametrize("world", [1, 3])
def test_a_units_gathered_pieces_come_back_as_every_layouts_tensors(world):
    """``unshard_all``: the pieces of several layouts, gathered in one list, split back by
    each layout's ``piece_count`` (an interleaved group gives one piece per parameter)."""
    layouts = [InterleavedLayout((torch.Size([7, 3]), torch.Size([5]), torch.Size([])), world),
               Dim0Layout(torch.Size([4, 2]), world), FlatLayout((torch.Size([6]),), world)]
    tensors = [[torch.randn(s) for s in layout.shapes] for layout in layouts]
    gathered = []
    for layout, ts in pairs(layouts, tensors):
        shards = [layout.shard(ts, r) for r in range(world)]
        assert layout.piece_count == len(layout.pieces(shards[0]))
        gathered += [torch.cat([layout.pieces(s)[i] for s in shards])
                     for i in range(layout.piece_count)]
    want = [t for ts in tensors for t in ts]
    got = unshard_all(layouts, gathered)
    assert len(got) == len(want) == 5
    assert every(torch.equal(g, w) for g, w in pairs(got, want))
