"""Identity-keyed maps from tensors and modules to the objects FSDP keeps about them.

Each map is weak at both ends. A weak-keyed map alone holds its values strongly, and every
value here holds its key (a shard group its shard, a record its placeholder, a unit's state
its modules), so no key would ever die: a dropped model, its shards and its placeholders
would stay alive for the whole process. Here each value is owned by whatever owns it
anyway (a unit owns its state, the state its shard groups, a shard group its records), and
the map only finds it.
"""
from __future__ import annotations

import weakref
from typing import Any, Generic, Optional, TypeVar

from torch.utils.weak import WeakIdKeyDictionary

V = TypeVar("V")


class WeakRegistry(Generic[V]):
    """``key -> value`` by the key's identity, keeping neither alive."""

    def __init__(self) -> None:
        self._refs: "WeakIdKeyDictionary" = WeakIdKeyDictionary()

    def __setitem__(self, key: Any, value: V) -> None:
        self._refs[key] = weakref.ref(value)

    def get(self, key: Any) -> Optional[V]:
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def __contains__(self, key: Any) -> bool:
        return self.get(key) is not None

    def pop(self, key: Any) -> None:
        self._refs.pop(key, None)

    def __len__(self) -> int:
        return len(self._refs)
