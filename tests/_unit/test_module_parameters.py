"""[Note: a module's parameters inside its unit]: what modules inside a unit list, while it
holds its full values and between forwards, and that the listing stays one Dynamo can
trace. No XLA."""
import torch
import torch.nn as nn

from tests.support.fake_collectives import FakeWorld
from xla_fsdp._unit.module_parameters import held_values_listed, registered_parameters
from xla_fsdp._unit.param_record import FreedPlaceholder, ParamRecord
from ..support.checks import every, pairs
from .test_param_record import Tied, full_values, records_of


def test_a_module_lists_the_full_values_its_unit_holds_and_the_placeholders_between():
    held_values_listed()
    world = FakeWorld(Tied(), world_size=1)
    module, records = world.modules[0], records_of(world)

    def placeholders_listed():
        listed = list(module.named_parameters())
        assert [n for n, _ in listed] == ["embed.weight", "layer.weight", "layer.bias"]
        assert every(p is r.placeholder and type(p) is FreedPlaceholder and p.numel() == 0
                     for (_, p), r in pairs(listed, records, what="records"))
    placeholders_listed()
    # a loop freezing them freezes the placeholders, which the unit agrees with its shard
    for p in module.layer.parameters():
        p.requires_grad = False
    assert [r.placeholder.requires_grad for r in records] == [True, False, False]
    module.layer.requires_grad_(True)
    ParamRecord.install(records, full_values(world))
    names = [n for n, _ in module.named_parameters()]
    assert names == ["embed.weight", "layer.weight", "layer.bias"], names   # tied: once
    assert [n for n, _ in module.named_parameters(remove_duplicate=False)] == \
        ["embed.weight", "head.weight", "layer.weight", "layer.bias"]
    assert [n for n, _ in module.layer.named_parameters(prefix="layer")] == \
        ["layer.weight", "layer.bias"]
    assert list(registered_parameters(module)) == []   # FSDP's own walks see none
    ParamRecord.free(records, [torch.zeros(0)] * len(records))
    placeholders_listed()


def test_the_listing_is_traceable():
    held_values_listed()
    layer = nn.Linear(3, 3)
    compiled = torch.compile(lambda x: layer(x.to(next(layer.parameters()).dtype)),
                             fullgraph=True, backend="eager")
    assert compiled(torch.ones(2, 3, dtype=torch.float64)).dtype == torch.float32
