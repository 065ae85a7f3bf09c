"""Sharding a unit's parameters at construction: its shard groups, its tied names and the
order of its parameters.

One walk for both kinds of unit. A unit's modules are one layer; a scanned stack's are
``L`` identical layers, and the parameters at the same position in every layer form one
stacked shard group. Either way the first layer decides the groups (one per parameter, or
flattened, see ``find_parameters.shard_group_members``), and each layer contributes its
members at the same positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch

from .._unit.options import FsdpOptions
from .._unit.param_record import Member, Owner
from .._unit.shard_group import ShardGroup, build_shard_group
from .._unit.vocab_tables import table_ids
from .find_parameters import shard_group_members


@dataclass
class ShardedParameters:
    """What sharding a unit's modules produced."""
    shard_groups: List[ShardGroup]
    shared_params: List[Tuple[str, str]]   # (alias, source) names of tied parameters
    param_order: List[str]                 # names in the unwrapped modules' order


def shard_members(layers: List[List[Member]], stacked: bool, options: FsdpOptions,
                  device: torch.device, unit_name: str,
                  dtype_of: Callable[[List[Owner]], torch.dtype]) -> ShardedParameters:
    """Shards the parameters ``find_parameters`` found: ``layers`` is one list of them, or
    with ``stacked`` one per layer of a scanned stack, in the same order in every layer.
    ``dtype_of`` gives the compute dtype of a parameter's owners."""
    position = {id(p): k for k, (p, _, _) in enumerate(layers[0])}
    tables = table_ids(layers[0]) if options.vocab_parallel and not stacked else set()
    ordinary = [m for m in layers[0] if id(m[0]) not in tables]
    grouped = [[m] for m in layers[0] if id(m[0]) in tables] + \
        shard_group_members(ordinary, options.flatten_parameters, dtype_of)
    shard_groups = []
    for index, members in enumerate(grouped):
        table = id(members[0][0]) in tables
        at = [position[id(p)] for p, _, _ in members]
        shard_groups.append(build_shard_group(
            [[layer[k] for k in at] for layer in layers], index, options, stacked=stacked,
            device=device, compute_dtype=dtype_of(members[0][1]), unit_name=unit_name,
            vocab_table=table))
    found = [m for layer in layers for m in layer]
    return ShardedParameters(shard_groups,
                             [(alias, names[0]) for _, _, names in found for alias in names[1:]],
                             [names[0] for _, _, names in found])
