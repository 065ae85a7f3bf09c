"""Modules that present another module's attributes as their own: the one fall-through
(``FallThrough``) and ``unit.module`` as torch_xla presents it (``ModuleView``).

A unit stands where the user's module stood, so code written for the module reads its
attributes off the unit (``model.config``, ``layer.attention_type``). Three modules answer
for another in this way: a unit for its wrapped module, a scanned stack also for its first
layer, and ``unit.module`` for the wrapped module. Each says only where a missing attribute
is looked up next (``_fall_through_to``); ``FallThrough.__getattr__`` is the one lookup.

[Note: a setting written through a unit]
What reads fall through to, writes reach too: ``model.block.scale = 0.5`` on a unit around
``block`` sets the attribute the block's forward reads, as it would unwrapped. Left on the
unit, the write changed nothing its forward computes while reading it back gave the new
value. A write goes to the first place of the fall-through (the wrapped module) when that
place has the attribute and this module does not own it (its own fields, class attributes,
parameters, buffers, submodules; private names always stay here). It starts once the module
is built (``start_writing_through``), since building it sets its own new fields.

torch_xla's FSDP puts a flatten wrapper between the unit and the user's module, and its
``unit.module`` returns that wrapper, whose own ``.module`` is the user's module. Code
written against it reads ``unit.module.module`` (Hugging Face Trainer does, to save the
model) and ``unit.module.<attribute of the user's module>``. Our units hold the user's
module directly, so ``unit.module`` is this view of it: attribute access and calls go to
the module, and ``.module`` is the module itself. The view is not part of the unit's module
tree, so it changes no parameter or state dict names.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence, Tuple

import torch.nn as nn


class FallThrough(nn.Module):
    """A module whose missing attributes are looked up on other objects, in order."""

    def _fall_through_to(self) -> Sequence[Any]:
        """Where an attribute this module lacks is looked up next, first to last; the last
        one's ``AttributeError`` is the one raised."""
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        target = self._written_through(name)
        if target is None:
            super().__setattr__(name, value)
        else:
            setattr(target, name, value)

    def _written_through(self, name: str) -> Any:
        """Where a write of ``name`` goes instead of this module, or None (see [Note: a
        setting written through a unit])."""
        own = self.__dict__
        if not own.get("_written_through_on") or name.startswith("_") or name in own \
                or hasattr(type(self), name) \
                or any(name in own[d] for d in ("_parameters", "_buffers", "_modules")):
            return None
        target = self._fall_through_to()[0]
        return target if hasattr(target, name) else None

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
    """The user's module one level down (``.module``), everything else forwarded to it, but
    its parameters: those are the unit's, every shard it trains (``unit.parameters()``).
    Unwrapped, ``model.module.parameters()`` is every parameter of the model; the wrapped
    module alone holds its nested units' shards but not the unit's own, so an optimizer
    built from it would silently leave those untrained."""

    def __init__(self, module: nn.Module, unit: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.__dict__["_unit"] = unit   # not a submodule: the unit's tree does not hold it
        start_writing_through(self)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        return self._unit.named_parameters(prefix, recurse, remove_duplicate)

    def _fall_through_to(self) -> Sequence[Any]:
        return (self.module,)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self.module[key]

    def extra_repr(self) -> str:
        return "view of the wrapped module, as torch_xla's unit.module"


# What is registered through the view is registered on the module it shows, which the
# unit's forward calls and its state dict holds: left on the view, a hook never ran and a
# buffer was never read nor saved. torch_xla's ``unit.module`` is in the forward's path.
_REGISTERED_ON_THE_MODULE = (
    "register_buffer", "register_parameter", "register_module", "add_module",
    "register_forward_pre_hook", "register_forward_hook", "register_full_backward_pre_hook",
    "register_full_backward_hook", "register_backward_hook", "register_state_dict_pre_hook",
    "register_state_dict_post_hook", "register_load_state_dict_pre_hook",
    "register_load_state_dict_post_hook")


def _on_the_module(name: str) -> Any:
    def registered_on_the_module(self: ModuleView, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, name)(*args, **kwargs)
    registered_on_the_module.__name__ = name
    registered_on_the_module.__doc__ = getattr(nn.Module, name).__doc__
    return registered_on_the_module


for _name in _REGISTERED_ON_THE_MODULE:
    setattr(ModuleView, _name, _on_the_module(_name))


def start_writing_through(module: FallThrough) -> None:
    """``module`` is built: its writes of attributes it does not own fall through from now on
    (see [Note: a setting written through a unit])."""
    module.__dict__["_written_through_on"] = True
