"""Modules that run in float32 whatever the unit's ``compute_dtype``.

BatchNorm keeps running statistics that are averages over many steps, and normalises with a
variance computed as a difference of two means: in bf16 both lose their meaning (a constant
input gives a negative variance and NaN), and XLA refuses a BatchNorm whose input and
statistics have different precisions. So, as PyTorch FSDP's mixed precision does by default,
a BatchNorm's parameters are gathered in float32, its statistics stay float32, and its input
is cast to float32 and its output back to the compute dtype.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Set

import torch
import torch.nn as nn

from .._sharding.tensor_tree import cast_floating
from .._xla.private_api import is_batch_norm

_HOOKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def float32_modules(modules: Iterable[nn.Module], compute_dtype: torch.dtype) -> Set[int]:
    """Ids of the modules among ``modules`` that compute in float32."""
    if compute_dtype == torch.float32:
        return set()
    return float32_statistics(modules)


def float32_statistics(modules: Iterable[nn.Module]) -> Set[int]:
    """Ids of the modules among ``modules`` whose buffers stay float32 whatever
    ``buffer_dtype`` asks: BatchNorm's statistics, under any compute dtype (a float32
    BatchNorm cannot read bf16 statistics either)."""
    return {id(m) for m in modules if is_batch_norm(m)}


def run_in_float32(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """Casts ``module``'s floating inputs to float32 and its outputs to ``compute_dtype``."""
    if module in _HOOKED:
        return  # an inner unit hooked it already
    _HOOKED.add(module)

    def to_float32(_m: nn.Module, args: Any) -> Any:
        return cast_floating(torch.float32, args)

    def back(_m: nn.Module, _args: Any, output: Any) -> Any:
        return cast_floating(compute_dtype, output)

    module.register_forward_pre_hook(to_float32)
    module.register_forward_hook(back)
