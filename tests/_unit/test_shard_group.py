"""ShardGroup on its own: construction (``build_shard_group`` through the real member
finding), its generation, and the facts of a ``no_sync`` accumulation. No XLA."""
import pytest
import torch
import torch.nn as nn

from tests.support.fake_collectives import FakeWorld, data_update, tracked_update
from xla_fsdp._sharding.layout import Dim0Layout, FlatLayout, InterleavedLayout
from xla_fsdp._unit.module_parameters import registered_parameters
from xla_fsdp._unit.shard_group import shard_group_of
from ..support.checks import every, nonempty, pairs

LAYOUTS = {"flat": ({}, FlatLayout), "flatten": ({"flatten_parameters": True}, InterleavedLayout),
           "dim0": ({"shard_param_on_dim_0": True}, Dim0Layout)}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def flattened():
    """One shard group of a model's four parameters (flattened), on rank 0 of 2."""
    world = FakeWorld(model(), flatten_parameters=True)
    return world, world.shard_groups[0][0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_build_shard_group_cuts_the_parameters_and_leaves_placeholders(layout):
    options, layout_type = LAYOUTS[layout]
    world = FakeWorld(model(), world_size=2, **options)
    ranks = world.shard_groups
    names = [[n for n, _ in world.reference.named_parameters()]] if layout == "flatten" else \
        [[n] for n, _ in world.reference.named_parameters()]
    assert [g.names for g in ranks[0]] == [g.names for g in ranks[1]] == names
    for index, (g0, g1) in enumerate(pairs(*ranks, what="shard groups")):
        assert isinstance(g0.layout, layout_type)
        # the ranks' shards are the parameters, cut; each shard holds only its own piece
        full = g0.layout.unshard(torch.cat([g0.shard.detach(), g1.shard.detach()]))
        for got, want in pairs(full, world.reference_params(g0)):
            assert torch.equal(got, want.detach())
        assert g0.shard.shape == g0.layout.shard_shape
        assert not torch.equal(g0.shard, g1.shard)
        # torch_xla's attributes on the shard, and the registry
        orig = "flat_param_0" if layout == "flatten" else g0.names[0]
        assert g0.shard._is_sharded and g0.orig_name == g0.shard._orig_name == \
            "_fsdp_wrapped_module." + orig
        size = [g0.layout.numel] if layout == "flatten" else \
            list(world.reference.get_parameter(g0.names[0]).shape)
        assert list(g0.shard._orig_size) == size
        assert "." not in g0.shard_name and g0.shard_name.startswith("_fsdp_shard")
        assert shard_group_of(g0.shard) is g0 and shard_group_of(g1.shard) is g1
        assert g0.updates == 0 and g0.sentinel is None
    for rank, module in enumerate(nonempty(world.modules, "ranks' modules")):
        # no parameter is registered any more: placeholders stand where they were (and
        # are what the module lists: see [Note: a module's parameters inside its unit])
        assert list(registered_parameters(module)) == []
        records = [r for g in ranks[rank] for r in g.records]
        for name, r in pairs([n for ns in names for n in ns], records):
            owner, attr = module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            assert getattr(owner, attr) is r.placeholder and r.owners == [(owner, attr)]
            assert r.placeholder.shape == (0,) and r.placeholder.requires_grad
            assert not r.holds_full


def test_a_frozen_parameter_gives_a_frozen_shard_and_placeholder():
    m = model()
    m[2].bias.requires_grad_(False)
    world = FakeWorld(m)
    *trainable, frozen = world.shard_groups[0]
    assert not frozen.shard.requires_grad and not frozen.records[0].placeholder.requires_grad
    assert every(g.shard.requires_grad and g.records[0].placeholder.requires_grad
                 for g in trainable)


def test_the_accumulation_sentinel_tells_a_kept_gradient_from_a_dropped_one():
    _, g = flattened()
    assert not g.accumulating() and not g.accumulation_abandoned()
    g.mark_accumulation()
    kept = g.shard.grad
    assert torch.equal(kept, torch.zeros_like(g.shard)) and g.sentinel[0] is kept
    assert g.accumulating() and not g.accumulation_abandoned()

    g.shard.grad = None                                  # zero_grad(set_to_none=True)
    assert not g.accumulating() and g.accumulation_abandoned()
    g.end_accumulation()
    assert g.sentinel is None and not g.accumulation_abandoned()

    g.shard.grad = torch.ones_like(g.shard)              # a gradient from a synced step
    g.mark_accumulation()
    assert torch.equal(g.shard.grad, torch.ones_like(g.shard))  # kept, not replaced
    g.shard.grad.zero_()                                 # zero_grad(set_to_none=False)
    assert g.accumulation_abandoned()
    g.end_accumulation()

    g.mark_accumulation()
    g.shard.grad = torch.zeros_like(g.shard)             # another tensor, equal values
    assert g.accumulation_abandoned()


@pytest.mark.parametrize("accumulating", [False, True])
def test_drop_unreduced_keeps_only_a_no_sync_accumulation(accumulating):
    world, g = flattened()
    world.params[0].unshard([], barrier=False)
    for r in g.records:
        r.placeholder.grad = torch.ones_like(r.placeholder)
    if accumulating:
        g.mark_accumulation()
    g.drop_unreduced()
    assert every((r.placeholder.grad is not None) == accumulating for r in g.records)


@pytest.mark.parametrize("update, counted", [(data_update(1.0), True),
                                             (tracked_update(1.0), False)],
                         ids=["counted step", "in-place write"])
def test_the_generation_changes_with_every_update(update, counted):
    world, g = flattened()
    before = g.generation()
    g.shard.grad = torch.ones_like(g.shard)              # a gradient is no update
    assert g.generation() == before
    world.step(update, count=counted)
    assert g.generation() != before and g.updates == int(counted)
