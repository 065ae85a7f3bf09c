"""Names in a wrapped model as the unwrapped model has them (no XLA)."""
from xla_fsdp._sharding.names import clean_name, join_name


def test_wrapper_parts_are_not_part_of_names():
    assert clean_name("_fsdp_wrapped_module._fsdp_group_0") == ""
    assert clean_name("_fsdp_wrapped_module.b1._fsdp_group_12._fsdp_wrapped_module") == "b1"
    assert clean_name("layers.0.norm.weight") == "layers.0.norm.weight"
    assert clean_name("_fsdp_wrapped_module.h.0._checkpoint_wrapped_module._fpw_module.w") == \
        "h.0.w"
    assert join_name("", "w") == "w" and join_name("a.b", "w") == "a.b.w"
