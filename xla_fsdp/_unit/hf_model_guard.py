"""Hugging Face model methods that would read or replace parameters FSDP replaced: refused
with what to do instead.

[Note: save_pretrained inside units]
``PreTrainedModel.save_pretrained`` without ``state_dict`` reads ``self.state_dict()``. On a
model inside FSDP units (``model.module.save_pretrained(...)``, the unwrapped model's own
method) that holds this rank's shards under wrapper names and none of the root unit's:
safetensors refused it ("invalid python storage"), and ``safe_serialization=False`` wrote
a checkpoint that ``from_pretrained`` loaded as a randomly initialised model, with a
warning only. It is refused, pointing to the full state dict. Installed with the other
process-wide effects on the first unit built once transformers has been imported (a model
of its classes cannot exist before), never importing it; Trainer's own saves pass the
consolidated state dict and are unchanged.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

import torch.nn as nn

from .param_record import placeholders_in

_installed = False
_lock = threading.Lock()


def install() -> None:
    """Wraps ``transformers.PreTrainedModel.save_pretrained`` and ``resize_token_embeddings``
    once transformers has been imported (see [Note: save_pretrained inside units])."""
    global _installed
    if _installed or "transformers.modeling_utils" not in sys.modules:
        return
    with _lock:
        if _installed:
            return
        cls = getattr(sys.modules["transformers.modeling_utils"], "PreTrainedModel", None)
        if cls is not None:
            cls.save_pretrained = _guarded(cls.save_pretrained)
            cls.resize_token_embeddings = _refused_inside_units(cls.resize_token_embeddings)
        _installed = True


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("state_dict", args[1] if len(args) > 1 else None)
        if given is None and placeholders_in(self):
            raise ValueError(
                f"{type(self).__name__}.save_pretrained() was given no state_dict, and FSDP "
                f"units stand in this model's parameters: it would save this rank's shards "
                f"under wrapper names and not the root unit's parameters. Pass "
                f"state_dict=model.full_state_dict() (every rank calls it on the root unit; "
                f"rank 0 gets the values) with is_main_process=(rank == 0), or call "
                f"xla_fsdp.checkpoint.save_consolidated(path, model, format='hf')")
        return original(self, save_directory, *args, **kwargs)
    return save_pretrained


def _refused_inside_units(original: Callable[..., Any]) -> Callable[..., Any]:
    """``resize_token_embeddings`` builds new embedding tables from the old ones' values,
    which inside units are placeholders (it failed unpacking the empty one's shape)."""
    @functools.wraps(original)
    def resize_token_embeddings(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if placeholders_in(self):
            raise ValueError(
                f"{type(self).__name__}.resize_token_embeddings() on a model inside FSDP "
                f"units: its embedding tables are shards. Resize the model before wrapping "
                f"it (the optimizer too is built after wrapping)")
        return original(self, *args, **kwargs)
    return resize_token_embeddings
