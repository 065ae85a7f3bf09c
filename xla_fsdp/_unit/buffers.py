"""A unit's buffers: moved to its device once, cast only when asked, their original dtype
remembered for checkpoints."""
from __future__ import annotations

from typing import Optional, Set

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from .._xla.trace_only import to_device

_PLACED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # buffer -> its dtype before placing


@torch.no_grad()
def place_buffers(module: nn.Module, dtype: Optional[torch.dtype], device: torch.device,
                  keep: Set[int] = frozenset()) -> None:
    """Moves buffers to ``device``, floating ones cast to ``dtype`` if given (by default
    they keep their dtype: BatchNorm statistics and rotary frequencies stay float32 under
    low-precision compute). Inner units placed theirs first, so each buffer is placed once,
    by its innermost unit. The buffers of modules in ``keep`` (ids) keep their dtype."""
    for m in module.modules():
        for name, buf in list(m.named_buffers(recurse=False, remove_duplicate=False)):
            if buf in _PLACED:
                continue
            cast = (id(m) not in keep and dtype is not None and buf.is_floating_point()
                    and buf.dtype != dtype)
            new = to_device(buf.to(dtype) if cast else buf, device)
            _PLACED[new] = buf.dtype
            setattr(m, name, new)


def original_dtype(buf: torch.Tensor) -> torch.dtype:
    """The dtype a buffer had before its unit placed it."""
    return _PLACED.get(buf, buf.dtype)
