"""Shard layout arithmetic, without XLA."""
import pytest
import torch

from xla_fsdp.shard_layout import Dim0Layout, FlatLayout


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shapes", [[(10,)], [(7, 3), (5,)], [()], [(70, 32), (70,), (1,)]])
def test_flat_layout_round_trip(world, shapes):
    tensors = [torch.randn(s) for s in shapes]
    layout = FlatLayout(tuple(torch.Size(s) for s in shapes), world)
    shards = [layout.shard(tensors, r) for r in range(world)]
    assert all(s.shape == layout.shard_shape for s in shards)
    assert layout.padded_numel - layout.numel < world  # padding only to a multiple of N
    for got, want in zip(layout.unshard(torch.cat(shards)), tensors):
        assert torch.equal(got, want)
    # the group's content as one flat tensor shards the same way
    content = torch.cat([t.reshape(-1) for t in tensors])
    assert all(torch.equal(layout.shard([content], r), s) for r, s in enumerate(shards))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(10, 3), (3, 5, 2), (1,), (), (16,)])
def test_dim0_layout_round_trip(world, shape):
    t = torch.randn(shape)
    layout = Dim0Layout(torch.Size(shape), world)
    shards = [layout.shard([t], r) for r in range(world)]
    assert all(s.shape == layout.shard_shape for s in shards)
    assert layout.shard_shape[1:] == torch.Size(shape[1:])  # never flattened
    assert torch.equal(layout.unshard(torch.cat(shards))[0], t)
    assert all(torch.equal(layout.shard([t.reshape(-1)], r), s) for r, s in enumerate(shards))


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
    for layout in (FlatLayout((torch.Size([8]),), 2), Dim0Layout(torch.Size([8]), 2)):
        shard = layout.shard([t], 0)
        shard.add_(100)
        assert t[0] == 0
