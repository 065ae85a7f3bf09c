"""What a module inside a unit lists as its parameters: the placeholders its unit holds.

[Note: a module's parameters inside its unit]
A module inside a unit holds placeholders, not parameters (see ``param_record``), so torch's
``parameters()`` of it lists nothing of its unit. Code that reads a module's own parameters
went wrong: a penalty ``sum(p.pow(2).sum() for p in self.parameters())`` in forward added
nothing, without a word, and ``next(self.parameters()).dtype`` raised StopIteration; between
forwards, an optimizer group built from a submodule's ``parameters()`` (a learning rate of
its own) was empty and trained nothing, and a loop freezing them (Hugging Face's
``freeze_feature_encoder()``) froze nothing. So ``named_parameters`` of a module that holds
a placeholder, or of any module above it, also lists it under its attribute's name, as
PyTorch FSDP2's modules list their parameters: its full value while the unit holds it (the
unit's forward and backward, an ``unshard()``), and between forwards the empty placeholder,
whose ``requires_grad`` the unit agrees with its shard at the next forward and which an
optimizer refuses to step (its values read nothing: see [Note: a freed placeholder is
empty]); so does a scanned layer's trace the values lent to it. A module that lists the
placeholder's shard (a unit, or a module above it) lists the shard only, so what an
optimizer built from the model is never changes, and a listing of the shards stays what
code written for torch_xla's FSDP reads. Under ``torch.compile`` nothing is added (the
listing is torch's, which Dynamo follows), nor in a process without units. FSDP's own walks
over what a module registers use ``registered_parameters``, which lists only that.
"""
from __future__ import annotations

from typing import Iterator, Set, Tuple

import torch
import torch.nn as nn

from .._xla.private_api import children
from .param_record import any_placeholder, is_placeholder, placeholder_attributes
from .shard_group import shard_group_holding, shard_group_of

_TORCH_NAMED_PARAMETERS = nn.Module.named_parameters


def registered_parameters(module: nn.Module, recurse: bool = True,
                          remove_duplicate: bool = True
                          ) -> Iterator[Tuple[str, nn.Parameter]]:
    """torch's ``named_parameters``: what ``module`` registers, never a placeholder."""
    return _TORCH_NAMED_PARAMETERS(module, recurse=recurse, remove_duplicate=remove_duplicate)


def held_values_listed() -> None:
    """Patches ``nn.Module.named_parameters`` (and so ``parameters``) once per process (see
    [Note: a module's parameters inside its unit])."""
    if getattr(nn.Module.named_parameters, "lists_held_values", False):
        return

    def named_parameters(self: nn.Module, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[Tuple[str, torch.Tensor]]:
        # Dynamo traces this (HF's ``self.dtype``): nothing it cannot follow before the
        # check, and a compiled region lends its full values, it never holds them
        # a unit lists its shards and its nested units': every placeholder below stands
        # for one of those (see the Note)
        if torch.compiler.is_compiling() or not any_placeholder() or \
                "_fsdp_wrapped_module" in children(self):
            yield from _TORCH_NAMED_PARAMETERS(self, prefix, recurse, remove_duplicate)
            return
        listed: Set[int] = set()
        for name, p in _TORCH_NAMED_PARAMETERS(self, prefix, recurse, remove_duplicate):
            shard_group = shard_group_of(p)
            if shard_group is not None:
                listed.add(id(shard_group))
            yield name, p
        seen: Set[int] = set()
        modules = (self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
                   if recurse else [(prefix, self)])
        for path, module in modules:
            for attr in placeholder_attributes(module):
                value = module.__dict__.get(attr)
                if not isinstance(value, torch.Tensor) or not is_placeholder(value):
                    continue
                if id(shard_group_holding(value)) in listed or \
                        (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield (f"{path}.{attr}" if path else attr), value

    named_parameters.lists_held_values = True  # type: ignore[attr-defined]
    named_parameters.__doc__ = _TORCH_NAMED_PARAMETERS.__doc__
    nn.Module.named_parameters = named_parameters  # type: ignore[method-assign]
