"""Shard groups: parameters sharded as one tensor, and the per-backward facts about them.

A unit owns one or more groups (one per parameter, or per flattened set). A group knows its
layout, its shard (the ``nn.Parameter`` the optimizer sees), the records of its original
parameters, how often the shard was updated (optimizer steps and loads), and which of its
gradients arrived in the current backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from . import shard_layout
from .param_record import Owner, ParamRecord, mark_taken
from .shard_layout import Dim0Layout, FlatLayout, InterleavedLayout

_SEPARATOR = "_FSDP_SHARD_SEPARATOR_"
_BY_SHARD: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


@dataclass(eq=False)
class ShardGroup:
    layout: shard_layout.Layout
    shard: nn.Parameter
    records: List[ParamRecord]
    shard_name: str                      # where the unit registers the shard
    orig_name: str                       # torch_xla's name for it, relative to the unit
    compute_dtype: torch.dtype           # dtype of the gathered full parameters
    updates: int = 0                     # optimizer steps and loads, equal on every rank
    arrived: Set[int] = field(default_factory=set)   # records whose gradient arrived
    reduced: bool = False                # reduce-scattered in this backward
    # a gradient left by a no_sync backward stands for the full gradients still held by
    # the placeholders; if the optimizer drops it, the accumulation was abandoned
    sentinel: Optional[Tuple[torch.Tensor, int]] = None

    @property
    def names(self) -> List[str]:
        return [r.name for r in self.records]

    @property
    def placeholders(self) -> List[torch.Tensor]:
        return [r.placeholder for r in self.records]

    def generation(self) -> Tuple[int, int]:
        """Changes whenever the shard's values may have: counted updates (torch_xla's
        foreach kernels do not bump version counters) or any other in-place write."""
        return (self.shard._version, self.updates)

    def mark_updated(self) -> None:
        self.updates += 1

    def trainable_records(self) -> List[int]:
        return [i for i, r in enumerate(self.records) if r.placeholder.requires_grad]


def group_of(shard: torch.Tensor) -> Optional[ShardGroup]:
    return _BY_SHARD.get(shard)


def _layout(shapes: Tuple[torch.Size, ...], flatten: bool, dim0: bool, world_size: int,
            multiple: int) -> shard_layout.Layout:
    if flatten:
        return InterleavedLayout(shapes, world_size, multiple)
    if dim0:
        return Dim0Layout(shapes[0], world_size)
    return FlatLayout(shapes, world_size, multiple)


@torch.no_grad()
def build_group(members: List[Tuple[nn.Parameter, List[Owner], List[str]]], index: int, *,
                flatten: bool, dim0: bool, world_size: int, rank: int, multiple: int,
                device: Any, compute_dtype: torch.dtype, unit_name: str) -> ShardGroup:
    """Shards one group and puts placeholders where its parameters were.

    ``members`` are (parameter, every (module, attribute) holding it, every name it has).
    Only the shard is copied to ``device``."""
    params = [p for p, _, _ in members]
    layout = _layout(tuple(p.shape for p in params), flatten, dim0, world_size, multiple)
    first = members[0][2][0]
    orig_name = "_fsdp_wrapped_module." + (f"flat_param_{index}" if flatten else first)
    size = torch.Size([layout.numel]) if flatten else params[0].shape
    return _finish(layout, layout.shard([p.detach() for p in params], rank), size, orig_name,
                   members, device, compute_dtype, unit_name)


@torch.no_grad()
def build_stacked_group(layers: List[List[Tuple[nn.Parameter, List[Owner], List[str]]]],
                        layer_names: List[str], index: int, *, flatten: bool, dim0: bool,
                        world_size: int, rank: int, multiple: int, device: Any,
                        compute_dtype: torch.dtype, unit_name: str) -> ShardGroup:
    """The same group of every layer of a scanned stack, as one ``StackedLayout`` shard.
    ``layers[i]`` are layer ``i``'s members; ``layer_names`` their names within a layer."""
    params = [p for members in layers for p, _, _ in members]
    shapes = tuple(p.shape for p, _, _ in layers[0])
    layout = shard_layout.StackedLayout(
        _layout(shapes, flatten, dim0, world_size, multiple), len(layers))
    orig_name = "_fsdp_wrapped_module." + (f"flat_param_{index}" if flatten else layer_names[0])
    size = torch.Size([len(layers), layout.layer.numel] if flatten
                      else (len(layers),) + tuple(shapes[0]))
    return _finish(layout, layout.shard([p.detach() for p in params], rank), size, orig_name,
                   [m for members in layers for m in members], device, compute_dtype,
                   unit_name)


def _finish(layout: shard_layout.Layout, shard_value: torch.Tensor, orig_size: torch.Size,
            orig_name: str, members: List[Tuple[nn.Parameter, List[Owner], List[str]]],
            device: Any, compute_dtype: torch.dtype, unit_name: str) -> ShardGroup:
    shard = nn.Parameter(shard_value.to(device), requires_grad=members[0][0].requires_grad)
    # the three attributes torch_xla's users and tools read on a shard
    shard._is_sharded = True
    shard._orig_size = orig_size
    shard._orig_name = orig_name
    records = []
    for p, owners, names in members:
        mark_taken(p, names[0])
        full = torch.zeros(1, dtype=compute_dtype, device=device)
        full.requires_grad_(p.requires_grad)
        for m, attr in owners:
            del m._parameters[attr]
            object.__setattr__(m, attr, full)
        records.append(ParamRecord(full, list(names), list(owners), unit_name))
    group = ShardGroup(layout, shard, records,
                       ("_fsdp_shard." + orig_name).replace(".", _SEPARATOR), orig_name,
                       compute_dtype)
    for i, r in enumerate(records):
        r.group, r.index = group, i
    _BY_SHARD[shard] = group
    return group
