"""Modules that present another module's attributes as their own: the one fall-through
(``FallThrough``) and ``unit.module`` as torch_xla presents it (``ModuleView``).

A unit stands where the user's module stood, so code written for the module reads its
attributes off the unit (``model.config``, ``layer.attention_type``). Three modules answer
for another in this way: a unit for its wrapped module, a scanned stack also for its first
layer, and ``unit.module`` for the wrapped module. Each says only where a missing attribute
is looked up next (``_fall_through_to``); ``FallThrough.__getattr__`` is the one lookup.

torch_xla's FSDP puts a flatten wrapper between the unit and the user's module, and its
``unit.module`` returns that wrapper, whose own ``.module`` is the user's module. Code
written against it reads ``unit.module.module`` (Hugging Face Trainer does, to save the
model) and ``unit.module.<attribute of the user's module>``. Our units hold the user's
module directly, so ``unit.module`` is this view of it: attribute access and calls go to
the module, and ``.module`` is the module itself. The view is not part of the unit's module
tree, so it changes no parameter or state dict names.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch.nn as nn


class FallThrough(nn.Module):
    """A module whose missing attributes are looked up on other objects, in order."""

    def _fall_through_to(self) -> Sequence[Any]:
        """Where an attribute this module lacks is looked up next, first to last; the last
        one's ``AttributeError`` is the one raised."""
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        # only reached when ordinary lookup and nn.Module's (parameters, buffers,
        # submodules) both fail
        try:
            return super().__getattr__(name)
        except AttributeError:
            *earlier, last = self._fall_through_to()
            for target in earlier:
                try:
                    return getattr(target, name)
                except AttributeError:
                    pass
            return getattr(last, name)


class ModuleView(FallThrough):
    """The user's module one level down (``.module``), everything else forwarded to it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def _fall_through_to(self) -> Sequence[Any]:
        return (self.module,)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self.module[key]

    def extra_repr(self) -> str:
        return "view of the wrapped module, as torch_xla's unit.module"
