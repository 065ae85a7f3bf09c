"""shard_members: one walk for a unit's parameters and a scanned stack's, on the CPU."""
import pytest
import torch
import torch.nn as nn

from xla_fsdp._init.find_parameters import find_parameters
from xla_fsdp._init.shard_members import shard_members
from xla_fsdp._sharding.layout import StackedLayout
from ..support.checks import every, pairs
from ..support.fake_collectives import fsdp_options

CPU = torch.device("cpu")


def _layer():
    layer = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 3, bias=False))
    layer[1].extra = layer[0].weight  # a second name for one parameter: an alias
    return layer


@pytest.mark.parametrize("flatten", [False, True])
def test_a_stack_is_sharded_position_by_position_as_one_stacked_group_each(flatten):
    torch.manual_seed(0)
    stacks = [nn.ModuleList([_layer() for _ in range(3)]) for _ in range(2)]
    stacks[1].load_state_dict(stacks[0].state_dict())
    reference = [[p.detach().clone() for p in layer.parameters()] for layer in stacks[0]]
    ranks = []
    for rank, stack in enumerate(stacks):
        found = [find_parameters([(str(i), layer)], None) for i, layer in enumerate(stack)]
        options = fsdp_options(2, rank, flatten_parameters=flatten)
        ranks.append(shard_members(found, True, options, CPU, "ModuleList",
                                   lambda owners: torch.float32))
    sharded = ranks[0]
    assert sharded.param_order == [f"{i}.{n}" for i in range(3)
                                   for n in ("0.weight", "0.bias", "1.weight")]
    assert sharded.shared_params == [(f"{i}.1.extra", f"{i}.0.weight") for i in range(3)]
    assert len(sharded.shard_groups) == (1 if flatten else 3)
    for k, (g0, g1) in enumerate(pairs(ranks[0].shard_groups, ranks[1].shard_groups,
                                       what="shard groups")):
        assert isinstance(g0.layout, StackedLayout) and g0.layout.layers == 3
        # named as one layer's parameter, sized as the stack of them
        name = "flat_param_0" if flatten else ("0.weight", "0.bias", "1.weight")[k]
        assert g0.orig_name == "_fsdp_wrapped_module." + name
        assert g0.shard._orig_size[0] == 3
        full = g0.layout.unshard(torch.cat([g0.shard.detach(), g1.shard.detach()]))
        want = [reference[i][j] for i in range(3)
                for j in (range(3) if flatten else [k])]
        assert len(full) == len(want) and every(torch.equal(a, b) for a, b in pairs(full, want))
