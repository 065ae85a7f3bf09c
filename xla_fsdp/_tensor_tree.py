"""Walking nested containers of tensors (module inputs and outputs)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, List

import torch
from torch.nn.utils.rnn import PackedSequence


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor inside lists, tuples, dicts and dataclass-free containers
    replaced by ``fn(tensor)``; named tuples, sets and OrderedDicts keep their type."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, PackedSequence):
        return obj._replace(data=fn(obj.data))
    if isinstance(obj, OrderedDict) or type(obj) is dict:
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if hasattr(obj, "keys") and hasattr(obj, "__setitem__") and hasattr(obj, "items"):
        # dict-like model outputs (e.g. Hugging Face ModelOutput) are updated in place
        for k, v in list(obj.items()):
            obj[k] = map_tensors(fn, v)
        return obj
    return obj


def collect_tensors(obj: Any) -> List[torch.Tensor]:
    """Every distinct tensor inside ``obj``, in order of first appearance."""
    found: List[torch.Tensor] = []
    seen = set()

    def visit(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in seen:
            seen.add(id(t))
            found.append(t)
        return t

    _walk(visit, obj)
    return found


def _walk(fn, obj) -> None:
    if isinstance(obj, torch.Tensor):
        fn(obj)
    elif isinstance(obj, PackedSequence):
        fn(obj.data)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _walk(fn, v)
    elif isinstance(obj, dict) or (hasattr(obj, "items") and hasattr(obj, "keys")):
        for v in obj.values():
            _walk(fn, v)


def cast_floating(dtype: torch.dtype, obj: Any) -> Any:
    """``obj`` with its floating-point tensors cast to ``dtype``."""
    return map_tensors(
        lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t, obj)
