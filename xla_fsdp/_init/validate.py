"""What a module must be to become an FSDP unit, what the constructor's arguments must be
beside it, and what the model must be when its root first runs."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch.nn as nn

from .._sharding.names import clean_name
from .._unit.module_parameters import registered_parameters
from .._unit.shard_group import shard_group_of
from .._unit.unit_state import UnitState, detached_message, is_unit


# a wrapped module -> its unit (held weakly: the unit holds the module)
_UNIT_OF: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def mark_wrapped(module: nn.Module, unit: nn.Module) -> None:
    _UNIT_OF[module] = weakref.ref(unit)


def unit_wrapping(module: nn.Module) -> Optional[nn.Module]:
    """The unit ``module`` is, or the one built around it; None if neither."""
    if is_unit(module):
        return module
    ref = _UNIT_OF.get(module)
    return None if ref is None else ref()


def validate_module(module: Any, needs_forward: bool = True) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
    if is_unit(module):
        inner = type(getattr(module, "wrapped_module", module)).__name__
        raise ValueError(
            f"this module ({type(module).__name__} around {inner}) is already wrapped with "
            f"FSDP; wrap inner modules first, then the outer one, and never the same module "
            f"twice")
    if unit_wrapping(module) is not None:
        # a second unit around it would hold none of the shards the first one took: its
        # clipping and its state dict would leave them out
        raise ValueError(
            f"this {type(module).__name__} is already wrapped: an FSDP unit was built around "
            f"it, and holds its parameters. Use that unit (what FSDP(...) returned) instead "
            f"of wrapping the module again")
    forward = getattr(type(module), "forward", None)
    if needs_forward and (forward is None or forward is nn.Module.forward):
        raise ValueError(
            f"cannot wrap {type(module).__name__}: it has no forward() of its own, so FSDP "
            f"could not gather its parameters before use. Wrap the modules inside it (or the "
            f"module that calls them) instead.")


def validate_group_arguments(auto_wrap_policy: Optional[Callable]) -> None:
    """A list of modules to group (whose members ``module_group.check_members`` checks) is
    wrapped as it is."""
    if auto_wrap_policy is not None:
        raise ValueError("auto_wrap_policy wraps the inside of one module; it cannot be "
                         "combined with a list of modules to group")


def validate_first_forward(root: UnitState) -> None:
    """Before the root's first forward: every grouping unit is attached, and every parameter
    the model registers is a shard. One registered after the units were built (adapters that
    peft's ``get_peft_model`` adds to a wrapped model) would be neither sharded nor reduced,
    each rank training its own copy."""
    for state in root.context.states:
        if state.detached:
            raise ValueError(detached_message(state.members))
    for m in root.members:
        for path, attention in m.named_modules():
            # its forward reads out_proj.weight instead of calling out_proj, so a unit
            # there would hand it an empty placeholder (XLA's shape error, naming nothing)
            if isinstance(attention, nn.MultiheadAttention) and is_unit(attention.out_proj):
                raise ValueError(
                    f"FSDP unit around {root.name}: the nn.MultiheadAttention at "
                    f"'{clean_name(path)}' has its out_proj wrapped in a unit of its own, but "
                    f"it reads out_proj.weight without calling out_proj. Wrap the "
                    f"MultiheadAttention whole (size_based_auto_wrap_policy: keep it in "
                    f"force_leaf_modules)")
    added = sorted({clean_name(n) for m in root.members for n, p in registered_parameters(m)
                    if shard_group_of(p) is None})
    if added:
        shown = ", ".join(added[:4]) + (f" and {len(added) - 4} more" if len(added) > 4
                                         else "")
        raise ValueError(
            f"FSDP unit around {root.name}: parameters were added to the model after it "
            f"was wrapped, so no unit shards them or reduces their gradients: {shown}. "
            f"Add them before wrapping (with peft: call get_peft_model on the unwrapped "
            f"model, then wrap the PeftModel)")
