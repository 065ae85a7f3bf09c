"""How a grouping unit's modules are named and kept apart from other units (no XLA)."""
import pytest
import torch.nn as nn

from xla_fsdp.init_sharding import find_parameters
from xla_fsdp.module_group import _check_disjoint
from xla_fsdp.shard_metadata import clean_name


def test_group_path_is_not_part_of_names():
    assert clean_name("_fsdp_wrapped_module._fsdp_group_0") == ""
    assert clean_name("_fsdp_wrapped_module.b1._fsdp_group_12._fsdp_wrapped_module") == "b1"
    assert clean_name("layers.0.norm.weight") == "layers.0.norm.weight"


def test_grouped_modules_are_left_to_their_unit():
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    grouping_unit, other_unit = object(), object()
    object.__setattr__(model[1], "_fsdp_group_unit", grouping_unit)
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
    _check_disjoint(["norm", "head", "layers.0.attn"])
    with pytest.raises(ValueError, match="'layers.0' with 'layers.0.attn'"):
        _check_disjoint(["layers.0", "layers.0.attn"])
    with pytest.raises(ValueError, match="<the wrapped module>"):
        _check_disjoint(["", "head"])
