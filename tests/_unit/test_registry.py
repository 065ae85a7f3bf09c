"""The weak registries: a value that holds its key does not keep either alive."""
import gc
import weakref

import torch

from xla_fsdp._unit.registry import WeakRegistry


class Owner:
    def __init__(self, key):
        self.key = key


def test_a_value_holding_its_key_dies_with_its_owner():
    registry = WeakRegistry()
    key = torch.zeros(3)
    owner = Owner(key)            # what a unit's state is to its shard, for example
    registry[key] = owner
    assert registry.get(key) is owner and key in registry
    seen = weakref.ref(owner)
    del owner
    gc.collect()
    assert seen() is None and registry.get(key) is None and key not in registry
    gone = weakref.ref(key)
    registry[key] = Owner(key)    # dies at once: the registry does not own values
    del key
    gc.collect()
    assert gone() is None


def test_keys_are_told_apart_by_identity():
    registry = WeakRegistry()
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, different tensors
    kept = Owner(a)
    registry[a] = kept
    assert registry.get(b) is None and registry.get(a) is kept
