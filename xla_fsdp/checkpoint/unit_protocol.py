"""What checkpoint code reads of an FSDP model, as typed protocols: this layer sits below the
public class (``XlaFullyShardedDataParallel``, which satisfies both) and never imports it."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Protocol, Tuple, runtime_checkable

import torch.nn as nn

from .._sharding.collectives import Collectives
from .._unit.options import FsdpOptions
from .._unit.shard_group import ShardGroup


@runtime_checkable
class ShardedUnit(Protocol):
    """One unit: its own shard groups, not its nested units'."""
    rank: int
    world_size: int
    flatten_parameters: bool

    @property
    def shard_groups(self) -> List[ShardGroup]: ...

    @property
    def shared_params(self) -> List[Tuple[str, str]]: ...

    @property
    def param_order(self) -> List[str]: ...

    @property
    def collectives(self) -> Collectives: ...

    @property
    def options(self) -> FsdpOptions: ...


@runtime_checkable
class ShardedModel(ShardedUnit, Protocol):
    """The root unit, which holds the whole model."""

    def named_units(self) -> Iterator[Tuple[str, ShardedUnit]]: ...

    def check_root_call(self, what: str) -> None: ...

    def get_shard_metadata(self) -> Dict[str, Any]: ...

    @property
    def wrapped_module(self) -> nn.Module: ...

    def named_modules(self, memo: Any = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Module]]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any: ...
