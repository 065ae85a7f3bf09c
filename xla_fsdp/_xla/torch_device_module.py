"""``torch.xla``: the device module that ``torch.utils.checkpoint`` looks up for XLA tensors.

torch 2.9's checkpoint saves and restores the RNG state of the devices its inputs live on
through ``getattr(torch, device_type)``. torch_xla registers no such module, so every
``torch.utils.checkpoint`` call on XLA tensors fails (``module 'torch' has no attribute
'xla'``), and with it Hugging Face's ``gradient_checkpointing_enable()`` and torch's
``checkpoint_wrapper``. This module is that device module: the per-device RNG seed of
torch_xla, read and set around the recomputation, so that dropout draws the same mask twice.
``register()`` installs it; ``_unit.process_effects`` calls that when the first unit is built.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, Optional

import torch

from .private_api import register_device_module

# checkpoint saves device RNG states only when the device module says it is initialized
_initialized = True
_local = threading.local()  # the device selected by device(), per thread


def _name(index: Optional[int]) -> Optional[str]:
    return None if index is None or index < 0 else f"xla:{index}"


def _selected() -> Optional[str]:
    return getattr(_local, "selected", None)


@contextlib.contextmanager
def device(index: Optional[int]) -> Iterator[None]:
    """Makes ``xla:index`` the device that ``get_rng_state``/``set_rng_state`` address."""
    previous = _selected()
    _local.selected = _name(index)
    try:
        yield
    finally:
        _local.selected = previous


def get_rng_state(index: Optional[int] = None) -> int:
    """The RNG seed of ``xla:index``, else of the selected device, else the default one."""
    import torch_xla.core.xla_model as xm
    return xm.get_rng_state(_name(index) or _selected())


def set_rng_state(state: int, index: Optional[int] = None) -> None:
    import torch_xla.core.xla_model as xm
    xm.set_rng_state(int(state), _name(index) or _selected())


def device_count() -> int:
    import torch_xla
    return torch_xla.device_count()


def is_available() -> bool:
    return True


def register() -> None:
    """Installs this module as ``torch.xla`` unless something already did."""
    if not hasattr(torch, "xla"):
        register_device_module("xla", sys.modules[__name__])
