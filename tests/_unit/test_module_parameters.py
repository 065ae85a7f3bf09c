"""[Note: a module's parameters inside its unit's forward]: what modules inside a unit list
while it holds its full values, and that the listing stays one Dynamo can trace. No XLA."""
import torch
import torch.nn as nn

from tests.support.fake_collectives import FakeWorld
from xla_fsdp._unit.module_parameters import held_values_listed, registered_parameters
from xla_fsdp._unit.param_record import ParamRecord
from .test_param_record import Tied, full_values, records_of


def test_a_module_lists_the_full_values_its_unit_holds():
    held_values_listed()
    world = FakeWorld(Tied(), world_size=1)
    module, records = world.modules[0], records_of(world)
    assert list(module.parameters()) == []
    ParamRecord.install(records, full_values(world))
    names = [n for n, _ in module.named_parameters()]
    assert names == ["embed.weight", "layer.weight", "layer.bias"], names   # tied: once
    assert [n for n, _ in module.named_parameters(remove_duplicate=False)] == \
        ["embed.weight", "head.weight", "layer.weight", "layer.bias"]
    assert [n for n, _ in module.layer.named_parameters(prefix="layer")] == \
        ["layer.weight", "layer.bias"]
    assert list(registered_parameters(module)) == []   # FSDP's own walks see none
    ParamRecord.free(records, [torch.zeros(1)] * len(records))
    assert list(module.parameters()) == []


def test_the_listing_is_traceable():
    held_values_listed()
    layer = nn.Linear(3, 3)
    compiled = torch.compile(lambda x: layer(x.to(next(layer.parameters()).dtype)),
                             fullgraph=True, backend="eager")
    assert compiled(torch.ones(2, 3, dtype=torch.float64)).dtype == torch.float32
