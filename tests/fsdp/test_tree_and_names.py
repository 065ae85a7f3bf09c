"""Pure logic, no XLA: parameter names of shared modules, and finding tensors in outputs."""
import dataclasses

import torch
import torch.nn as nn

from xla_fsdp._tensor_tree import collect_tensors, map_tensors
from xla_fsdp.init_sharding import find_parameters


def test_a_module_registered_under_several_names_gives_every_name():
    model = nn.Module()
    model.shared = nn.Embedding(5, 3)
    model.encoder = nn.Module()
    model.encoder.embed = model.shared
    model.head = nn.Linear(3, 5, bias=False)
    model.head.weight = model.shared.weight
    (param, owners, names), = find_parameters([("", model)], None)
    assert names == ["shared.weight", "encoder.embed.weight", "head.weight"]
    # the shared module holds the parameter once, the head once
    assert [(type(m).__name__, attr) for m, attr in owners] == [("Embedding", "weight"),
                                                                ("Linear", "weight")]


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: list


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor


class Carrier:
    def __init__(self, t):
        self.t = t


def test_tensors_in_dataclasses_and_plain_objects_are_found_and_replaced():
    a, b, c, d = (torch.ones(1) * i for i in range(4))
    out = Out(a, [b])
    assert map_tensors(lambda t: t + 10, out) is out and out.logits.item() == 10
    assert out.extra[0].item() == 11
    frozen = map_tensors(lambda t: t + 10, Frozen(c))
    assert isinstance(frozen, Frozen) and frozen.value.item() == 12
    carrier = map_tensors(lambda t: t + 10, Carrier(d))
    assert carrier.t.item() == 13
    assert [t.item() for t in collect_tensors((Out(a, [b]), {"k": c}))] == [0, 1, 2]
