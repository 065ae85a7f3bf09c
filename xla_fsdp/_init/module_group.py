"""Units over several modules that are not one subtree, as in FSDP2's ``fully_shard([a, b])``.

``XlaFullyShardedDataParallel([model.norm, model.head])`` makes one unit of both modules, a
*module group*: one gather for both, when the first of them runs, and one reshard after the
last. The modules stay where they are in the model (the unit hooks their forwards), so
names, ``state_dict`` keys and the consolidated checkpoint are those of the unwrapped model.

A parameter's name depends on where its module sits in the model, which the unit cannot see
when it is built. So such a unit shards nothing at first: it is *detached* until the next
unit built around all of its modules (usually the root) *attaches* it. Attaching registers
the grouping unit as a child of that unit, named ``_fsdp_group_<i>`` (a name
``clean_name`` drops), and shards the modules' parameters under their names relative to that
unit. Until then, units built around some of the modules leave those modules' parameters
alone (``grouping_unit_of``).
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch.nn as nn

from .._sharding.names import GROUP_PREFIX, clean_name
from .._unit.registry import WeakRegistry
from .._xla.private_api import children
from .compiled_module import split_compiled
from .validate import validate_module

_GROUPED: "WeakRegistry[Any]" = WeakRegistry()  # grouped module -> its unit


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


class GroupingUnit(Protocol):
    """What attaching needs of a unit (an ``XlaFullyShardedDataParallel``): of the one built
    around the modules, and of the grouping unit it attaches."""

    @property
    def wrapped_module(self) -> nn.Module: ...

    @property
    def is_attached(self) -> bool: ...

    def attach(self, member_paths: List[str]) -> None: ...

    def add_module(self, name: str, module: nn.Module) -> None: ...


def check_members(members: Sequence[Any]) -> List[nn.Module]:
    members = list(members)
    if not members:
        raise ValueError("FSDP was given an empty list of modules to group")
    for m in members:
        inner, compiled = split_compiled(m)
        if compiled is not None:
            raise ValueError(
                f"FSDP was given a torch.compile'd module ({type(inner).__name__}) to "
                f"group: a group's hooks sit on the modules themselves. Group the modules "
                f"before compiling them, or compile the model around the group: "
                f"torch.compile(FSDP(model)) with FSDP([a, b]) built inside it")
        validate_module(m)
        if m in _GROUPED:
            raise ValueError(f"{type(m).__name__} is already grouped in another FSDP unit")
    if len({id(m) for m in members}) != len(members):
        raise ValueError("FSDP was given the same module twice in one group")
    return members


def mark_grouped(members: Sequence[nn.Module], unit: object) -> None:
    for m in members:
        _GROUPED[m] = unit


def grouping_unit_of(module: nn.Module) -> Optional[GroupingUnit]:
    """The unit that groups ``module`` with others, or None."""
    return _GROUPED.get(module)


def attach_module_groups(unit: GroupingUnit) -> None:
    """Attaches every detached grouping unit whose modules are all inside ``unit``'s wrapped
    module (see the module docstring)."""
    found: Dict[int, Tuple[GroupingUnit, Dict[int, str]]] = {}
    for path, m in unit.wrapped_module.named_modules():
        owner = _GROUPED.get(m)
        if owner is not None and not owner.is_attached:
            found.setdefault(id(owner), (owner, {}))[1][id(m)] = clean_name(path)
    for owner, paths in found.values():
        members = owner.wrapped_module.members
        if any(id(m) not in paths for m in members):
            continue  # an outer unit will see all of them
        member_paths = [paths[id(m)] for m in members]
        check_disjoint(member_paths)
        taken = children(unit)
        index = next(i for i in itertools.count() if f"{GROUP_PREFIX}{i}" not in taken)
        unit.add_module(f"{GROUP_PREFIX}{index}", owner)
        owner.attach(member_paths)


def check_disjoint(paths: List[str]) -> None:
    for a in paths:
        for b in paths:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise ValueError(f"FSDP cannot group '{a or '<the wrapped module>'}' with "
                                 f"'{b}', which is inside it; group disjoint modules")
