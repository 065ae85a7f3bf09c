"""Units that group modules which are not one subtree, as in FSDP2's ``fully_shard([a, b])``.

``XlaFullyShardedDataParallel([model.norm, model.head])`` makes one unit of both modules: one
gather for both, when the first of them runs, and one reshard after the last. The modules
stay where they are in the model (the unit hooks their forwards), so names, ``state_dict``
keys and the consolidated checkpoint are those of the unwrapped model.

A parameter's name depends on where its module sits in the model, which the unit cannot see
when it is built. So such a unit shards nothing at first: the next unit built around all of
its modules (usually the root) *places* it. Placing registers the grouping unit as a child
of that unit, named ``_fsdp_group_<i>`` (a name ``clean_name`` drops), and shards the
modules' parameters under their names relative to that unit. Until then, units built around
some of the modules leave those modules' parameters alone.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch.nn as nn

from .shard_metadata import GROUP_PREFIX, clean_name


class ModuleGroup(nn.Module):
    """The wrapped module of a grouping unit. It holds the grouped modules without registering
    them, because they are registered where they are in the model."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        object.__setattr__(self, "members", tuple(members))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        names = ", ".join(type(m).__name__ for m in self.members)
        raise RuntimeError(f"an FSDP unit that groups several modules ({names}) is not called "
                           f"itself: call the modules, as the model's forward does")


def check_members(members: Sequence[Any], unit_cls: type) -> List[nn.Module]:
    from .safety import validate_module
    members = list(members)
    if not members:
        raise ValueError("FSDP was given an empty list of modules to group")
    for m in members:
        validate_module(m, unit_cls)
        other = m.__dict__.get("_fsdp_group_unit")
        if other is not None:
            raise ValueError(f"{type(m).__name__} is already grouped in another FSDP unit")
    if len({id(m) for m in members}) != len(members):
        raise ValueError("FSDP was given the same module twice in one group")
    return members


def place_grouping_units(unit: Any) -> None:
    """Places every not-yet-placed grouping unit whose modules are all inside ``unit``'s
    wrapped module (see the module docstring)."""
    found: Dict[int, Tuple[Any, Dict[int, str]]] = {}
    for path, m in unit.wrapped_module.named_modules():
        owner = m.__dict__.get("_fsdp_group_unit")
        if owner is not None and not owner.is_placed:
            found.setdefault(id(owner), (owner, {}))[1][id(m)] = clean_name(path)
    for owner, paths in found.values():
        members = owner.wrapped_module.members
        if any(id(m) not in paths for m in members):
            continue  # an outer unit will see all of them
        member_paths = [paths[id(m)] for m in members]
        _check_disjoint(member_paths)
        index = 0
        while f"{GROUP_PREFIX}{index}" in unit._modules:
            index += 1
        unit.add_module(f"{GROUP_PREFIX}{index}", owner)
        owner.place(member_paths)


def check_all_placed(states: Sequence[Any]) -> None:
    """Raised at the root's first forward: a grouping unit no unit was built around."""
    for state in states:
        if state.unplaced:
            raise ValueError(unplaced_message(state.members))


def unplaced_message(members: Sequence[nn.Module]) -> str:
    names = ", ".join(type(m).__name__ for m in members)
    return (f"the FSDP unit grouping ({names}) was never placed: wrap a module that contains "
            f"all of them (usually the whole model) in FSDP after building the group")


def _check_disjoint(paths: List[str]) -> None:
    for a in paths:
        for b in paths:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise ValueError(f"FSDP cannot group '{a or '<the wrapped module>'}' with "
                                 f"'{b}', which is inside it; group disjoint modules")
