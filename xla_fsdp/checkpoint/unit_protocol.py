"""What checkpoint code reads of an FSDP model, as typed protocols: this layer sits below the
public class (``XlaFullyShardedDataParallel``, which satisfies both) and never imports it."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

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

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any: ...


def require_root(model: Any, what: str) -> ShardedModel:
    """``model`` if it is an idle root unit; ``what`` (saving, loading) concerns the whole
    model, and a nested unit would cover only part of it."""
    if not isinstance(model, ShardedModel):
        raise TypeError(f"{what} takes the root XlaFullyShardedDataParallel unit, got "
                        f"{type(model).__name__}")
    model.check_root_call(what)
    return model


def sharding_group_index(model: ShardedModel) -> Optional[int]:
    """This rank's sharding group, or None without ``sharding_groups``."""
    import torch_xla.runtime as xr
    sharding = model.options.sharding_groups
    if sharding is None:
        return None
    return next(i for i, g in enumerate(sharding) if xr.global_ordinal() in g)


_FILE_EXTENSIONS = (".pth", ".pt", ".bin", ".safetensors")


def sharding_group_path(path: str, model: ShardedModel, is_prefix: bool = False
                        ) -> Tuple[str, bool]:
    """Where this rank's sharding group keeps a checkpoint named ``path``, and whether the
    groups are independent. Independent ``sharding_groups`` (parts of a model-parallel
    model) each have one of their own (``out/dcp_group-001``, ``out/ck_group-001.pth``, or
    for the ``is_prefix`` of per-rank files ``out/ck_group-001``); replicas
    (``replicate_across_groups``) share the first group's, which it writes."""
    import os
    index = sharding_group_index(model)
    if index is None or model.options.replicate_across_groups:
        return path, False
    stem, ext = os.path.splitext(path)
    if is_prefix or ext not in _FILE_EXTENSIONS:
        stem, ext = path, ""
    return f"{stem}_group-{index:03d}{ext}", True


def writes_sharding_group_copy(model: ShardedModel) -> bool:
    """Whether this rank's sharding group writes its checkpoint: every independent group,
    and the first of replicas (or the only group)."""
    return sharding_group_path("", model)[1] or not sharding_group_index(model)
