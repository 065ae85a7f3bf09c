"""Giving modules built on the meta device real values before they are sharded."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch.nn as nn

from .._unit.unit_state import is_unit
from .._xla import trace_only
from .._xla.private_api import children
from .module_group import grouping_unit_of


def materialize_meta(module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]]
                     ) -> None:
    """Gives parameters created on the meta device real storage and values.

    Inner units are already sharded on the device; they are hidden while ``param_init_fn``
    (or the default ``to_empty`` + ``reset_parameters()``) runs, so a function written for
    the whole module cannot move or overwrite their shards. So are modules that a grouping
    unit holds: it initialised them itself. A process that only traces leaves them on the
    meta device: their shards become placeholders (see [Note: tracing without values])."""
    if trace_only.active():
        return
    with _inner_units_hidden(module):
        if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            return
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            module.to_empty(device="cpu", recurse=True)
            for m in module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        still_meta = [n for n, t in list(module.named_parameters()) + list(module.named_buffers())
                      if t.is_meta]
        if still_meta:
            raise ValueError(f"param_init_fn left {still_meta} on the meta device; it must give "
                             f"every parameter and buffer of the module real storage")


@contextlib.contextmanager
def _inner_units_hidden(module: nn.Module) -> Iterator[None]:
    hidden, stack = [], [module]
    while stack:
        m = stack.pop()
        for name, child in children(m).items():
            if is_unit(child) or grouping_unit_of(child) is not None:
                setattr(m, name, nn.Module())
                hidden.append((m, name, child))
            else:
                stack.append(child)
    try:
        yield
    finally:
        for m, name, child in hidden:
            setattr(m, name, child)
