"""Finding a unit's parameters at construction, under every name they have, and grouping
them for sharding (one shard group per parameter, or per flattened set)."""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from .._unit.module_parameters import registered_parameters
from .._unit.param_record import Member, Owner, taken_by
from .._unit.shard_group import shard_group_of
from .._xla.private_api import children
from .module_group import grouping_unit_of


def find_parameters(roots: List[Tuple[str, nn.Module]], unit: object) -> List[Member]:
    """Every parameter below ``roots`` that belongs to ``unit``, once, with every
    (module, attribute) that holds it and every name it has: a module registered under
    several names (one embedding shared by an encoder, a decoder and a head) gives its
    parameters each of those names, as ``state_dict()`` does. Not the parameters inner units
    have sharded, nor those below modules another unit groups (see ``module_group``).
    ``roots`` are (name prefix, module); ``unit`` is compared by identity only."""
    found: Dict[int, Member] = {}   # by id, in the order first found
    for prefix, root in roots:
        for mod_path, m in _module_paths(root, unit):
            mod_path = ".".join(p for p in (prefix, mod_path) if p)
            for attr, p in list(registered_parameters(m, recurse=False, remove_duplicate=False)):
                if shard_group_of(p) is not None:
                    continue
                name = f"{mod_path}.{attr}" if mod_path else attr
                taken = taken_by(p)
                if taken is not None:
                    raise ValueError(
                        f"parameter '{name}' of {type(root).__name__} is shared with {taken}, "
                        f"which sharded it first. Tied parameters must belong to one unit: "
                        f"wrap the modules that share it together (or leave them to the "
                        f"outer unit).")
                if isinstance(p, nn.parameter.UninitializedParameter):
                    raise ValueError(
                        f"parameter '{name}' of {type(m).__name__} is not materialised yet (a "
                        f"lazy module): run one forward of the unwrapped model before "
                        f"wrapping, so that it has a shape to shard")
                if not p.is_floating_point() or p.dtype != torch.float32:
                    raise TypeError(
                        f"parameter '{name}' of {type(m).__name__} has dtype {p.dtype}; FSDP "
                        f"shards float32 parameters only (set compute_dtype for bf16/fp16 "
                        f"compute, and keep integer state in buffers)")
                _, owners, names = found.setdefault(id(p), (p, [], []))
                if not any(o is m and a == attr for o, a in owners):
                    owners.append((m, attr))
                names.append(name)
    return list(found.values())


def _module_paths(root: nn.Module, unit: object) -> Iterator[Tuple[str, nn.Module]]:
    """Every (path, module) below ``root``, a module once per path that reaches it, without
    the subtrees of modules grouped by another unit."""
    stack = [("", root, ())]
    while stack:
        path, m, ancestors = stack.pop()
        if id(m) in ancestors:
            continue  # a module that contains itself
        owner = grouping_unit_of(m)
        if owner is not None and owner is not unit:
            continue
        yield path, m
        inside = ancestors + (id(m),)
        below = [(f"{path}.{n}" if path else n, c, inside) for n, c in children(m).items()]
        stack.extend(reversed(below))


def shard_group_members(found: List[Member], flatten: bool,
                        dtype_of: Callable[[List[Owner]], torch.dtype]) -> List[List[Member]]:
    """The members of each shard group: one per parameter, or (flattened) one per
    (trainable or frozen, compute dtype), trainable first."""
    if not flatten:
        return [[item] for item in found]
    by_key: Dict[Tuple[bool, torch.dtype], List[Member]] = {}
    for item in found:
        by_key.setdefault((not item[0].requires_grad, dtype_of(item[1])), []).append(item)
    return [by_key[k] for k in sorted(by_key, key=lambda k: (k[0], str(k[1])))]
