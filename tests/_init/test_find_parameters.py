"""Finding a unit's parameters under every name they have (no XLA)."""
import torch.nn as nn

from xla_fsdp._init.find_parameters import find_parameters


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


def test_a_lazy_parameter_is_refused_by_name():
    import pytest
    model = nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"parameter '1.weight' of LazyLinear is not "
                                         r"materialised yet"):
        find_parameters([("", model)], None)
