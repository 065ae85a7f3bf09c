"""PEFT adapters saved from a model with nested units: what peft reads of the model made to
meet the full state dict it is given.

[Note: peft's names under nested units]
``peft``'s ``get_peft_model_state_dict(model, state_dict)``, which ``PeftModel.save_pretrained``
and Hugging Face Trainer's save go through, picks the adapter's entries out of
``state_dict`` by what it reads of ``model``, and two of those readings differ inside units
from the unwrapped model that the state dict (``full_state_dict``, Trainer's consolidation)
describes:

* Paths. The tuner layers' key prefixes, the biases of ``bias="lora_only"``, the
  ``modules_to_save`` copies and the embedding layers are named by
  ``model.named_modules()``, whose paths hold the wrapper parts ``clean_name`` drops
  (``...layers.0._fsdp_wrapped_module.self_attn.q_proj``). No key matches, and the adapter
  is saved with no tensor and no error. (peft strips one leading ``_fsdp_wrapped_module.``,
  for torch's FSDP around the whole model, never parts in the middle.)
* A module's own ``state_dict()``. ``ModulesToSaveWrapper`` lists the entries of its trained
  copy by the copy's ``state_dict()`` keys; inside a unit a parameter is a placeholder, a
  plain attribute, so those keys are missing and ``modules_to_save`` is saved empty.

We wrap the public function and method these go through rather than the private places
that derive names (four of them, changing between peft versions). ``get_peft_model_state_dict``
gets ``state_dict`` renamed into the model's own module paths (each key's module to the
innermost module with that clean path, so a unit and the module it wraps resolve to the
module; paths through a grouping unit's ``_fsdp_group_<i>`` hold none of the model's
modules and are skipped), peft runs unchanged, and the keys it returns are cleaned back.
When nothing is renamed (a model without units, a state dict already in the model's
names, no state dict) peft runs exactly as before. ``ModulesToSaveWrapper.adapter_state_dict``
also takes every entry the state dict it is given holds under the copy's prefix (the very
keys the copy's ``state_dict()`` lists outside a unit), values always from that state dict.
Loading an adapter into a wrapped model (``load_adapter``) is not covered: load it, like
``get_peft_model``, before wrapping.

Both are installed with the other process-wide effects (``process_effects``), on the first
unit built once peft has been imported. A tree holding peft's layers cannot exist before
peft is imported, so a unit built inside a PEFT model always finds it; importing peft
ourselves would cost every user who has it installed, and device threads racing on
imports would be ours to cause. A future peft without either function gets nothing
installed for it, and ``tests/compat/test_peft.py`` fails.

This module is in ``_unit`` because ``process_effects`` may import ``_unit`` and below only.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch.nn as nn

from .._sharding.names import GROUP_PREFIX, clean_name, join_name
from .param_record import placeholders_in, unit_state_dict

# what is wrapped: (module, class in it or "", attribute)
Target = Tuple[str, str, str]
STATE_DICT_FUNCTION: Target = ("peft.utils.save_and_load", "", "get_peft_model_state_dict")
MODULES_TO_SAVE_METHOD: Target = ("peft.utils.other", "ModulesToSaveWrapper",
                                  "adapter_state_dict")

_lock = threading.Lock()
_wrapped: List[str] = []  # the attributes wrapped, once each


def module_paths(model: nn.Module) -> Dict[str, str]:
    """Each module's clean path -> its path in ``model``, the innermost module's where
    several share a clean path (a unit and the module it wraps)."""
    out: Dict[str, str] = {}
    for path, _ in model.named_modules(remove_duplicate=False):
        if any(part.startswith(GROUP_PREFIX) for part in path.split(".")):
            continue
        clean = clean_name(path)
        if clean not in out or len(path) > len(out[clean]):
            out[clean] = path
    return out


def in_model_names(model: nn.Module,
                   state_dict: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """``state_dict`` with each key's module path as ``model.named_modules()`` has it, or
    None when that renames nothing."""
    paths = module_paths(model)
    out: Dict[str, Any] = {}
    renamed = False
    for key, value in state_dict.items():
        owner, _, leaf = key.rpartition(".")
        path = paths.get(owner)
        if path is not None and path != owner:
            key, renamed = join_name(path, leaf), True
        out[key] = value
    return out if renamed else None


Extractor = Callable[..., Dict[str, Any]]


def _state_dict_function(original: Extractor) -> Extractor:
    @functools.wraps(original)
    def get_peft_model_state_dict(model: nn.Module,
                                  state_dict: Optional[Mapping[str, Any]] = None,
                                  *args: Any, **kwargs: Any) -> Dict[str, Any]:
        if state_dict is None and placeholders_in(model):
            raise ValueError(
                "peft's get_peft_model_state_dict (PeftModel.save_pretrained) was given no "
                "state_dict for a model with FSDP units, so it would read model.state_dict(), "
                "where the adapter's parameters are placeholders, and save an adapter of no "
                "tensors: pass state_dict=full_state_dict(model) (every rank gathers it; rank 0 "
                "gets it), as docs/clients.md shows")
        renamed = None if state_dict is None else in_model_names(model, state_dict)
        if renamed is None:
            return original(model, state_dict, *args, **kwargs)
        result = original(model, renamed, *args, **kwargs)
        return {clean_name(k): v for k, v in result.items()}
    return get_peft_model_state_dict


def _modules_to_save_method(original: Extractor) -> Extractor:
    @functools.wraps(original)
    def adapter_state_dict(self: nn.Module, adapter_name: str, *args: Any,
                           **kwargs: Any) -> Dict[str, Any]:
        # it reads the module's own state dict for the names only, and gets the values from
        # the one given: no dict below a unit escapes (see [Note: state_dict() below a unit])
        with unit_state_dict():
            result = original(self, adapter_name, *args, **kwargs)
        given = args[0] if args else kwargs.get("state_dict")
        if isinstance(given, Mapping):
            prefix = f"modules_to_save.{adapter_name}."
            for key, value in given.items():
                if key.startswith(prefix):
                    result.setdefault(key[len(prefix):], value)
        return result
    return adapter_state_dict


def _dotted(target: Target) -> str:
    return ".".join(p for p in target if p)


def _install_one(target: Target, wrap: Callable[[Extractor], Extractor], rebind: bool) -> None:
    module_name, owner_name, attribute = target
    module = sys.modules.get(module_name)
    owner = getattr(module, owner_name, None) if owner_name else module
    original = getattr(owner, attribute, None) if owner is not None else None
    if not callable(original):
        return  # not imported (yet), or a peft without it
    wrapper = wrap(original)
    setattr(owner, attribute, wrapper)
    if rebind:  # modules that imported the function by name hold it too
        for name, other in list(sys.modules.items()):
            if (name == "peft" or name.startswith("peft.")) and \
                    getattr(other, "__dict__", {}).get(attribute) is original:
                setattr(other, attribute, wrapper)
    _wrapped.append(_dotted(target))


def install() -> None:
    """Wraps what peft has of the two (see [Note: peft's names under nested units]) once
    peft has been imported. Cheap once both are."""
    if len(_wrapped) == 2 or "peft" not in sys.modules:
        return
    with _lock:
        if _dotted(STATE_DICT_FUNCTION) not in _wrapped:
            _install_one(STATE_DICT_FUNCTION, _state_dict_function, rebind=True)
        if _dotted(MODULES_TO_SAVE_METHOD) not in _wrapped:
            _install_one(MODULES_TO_SAVE_METHOD, _modules_to_save_method, rebind=False)
