"""How a grouping unit's modules are found, named and kept apart from other units (no XLA)."""
import pytest
import torch.nn as nn

from xla_fsdp._init.find_parameters import find_parameters
from xla_fsdp._init.module_group import check_disjoint, mark_grouped


class _Unit:
    """Stands for a unit: the registry finds it, and holds it weakly."""


def test_grouped_modules_are_left_to_their_unit():
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    grouping_unit, other_unit = _Unit(), _Unit()
    mark_grouped([model[1]], grouping_unit)
    outer = [names[0] for _, _, names in find_parameters([("", model)], other_unit)]
    assert outer == ["0.weight", "0.bias"]
    grouped = [names[0] for _, _, names in find_parameters([("1", model[1])], grouping_unit)]
    assert grouped == ["1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"]


def test_tied_parameter_across_grouped_modules_is_found_once_with_both_owners():
    emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    found = find_parameters([("emb", emb), ("head", head)], None)
    assert len(found) == 1
    assert found[0][2] == ["emb.weight", "head.weight"]
    assert [(m, attr) for m, attr in found[0][1]] == [(emb, "weight"), (head, "weight")]


def test_grouped_modules_must_be_disjoint():
    check_disjoint(["norm", "head", "layers.0.attn"])
    with pytest.raises(ValueError, match="'layers.0' with 'layers.0.attn'"):
        check_disjoint(["layers.0", "layers.0.attn"])
    with pytest.raises(ValueError, match="<the wrapped module>"):
        check_disjoint(["", "head"])
