"""``unit.module`` as torch_xla presents it.

torch_xla's FSDP puts a flatten wrapper between the unit and the user's module, and its
``unit.module`` returns that wrapper, whose own ``.module`` is the user's module. Code
written against it reads ``unit.module.module`` (Hugging Face Trainer does, to save the
model) and ``unit.module.<attribute of the user's module>``. Our units hold the user's
module directly, so ``unit.module`` is this view of it: attribute access and calls go to
the module, and ``.module`` is the module itself. The view is not part of the unit's module
tree, so it changes no parameter or state dict names.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn


class ModuleView(nn.Module):
    """The user's module one level down (``.module``), everything else forwarded to it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def __getitem__(self, key: Any) -> Any:
        return self.module[key]

    def extra_repr(self) -> str:
        return "view of the wrapped module, as torch_xla's unit.module"
