"""What a module must be to become an FSDP unit, and what the constructor's arguments must
be beside it."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.nn as nn

from .._unit.unit_state import is_unit


def validate_module(module: Any, needs_forward: bool = True) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
    if is_unit(module):
        raise ValueError(
            "this module is already wrapped with FSDP; wrap inner modules first, then the "
            "outer one, and never the same module twice")
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
