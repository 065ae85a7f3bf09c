"""Walking nested containers of tensors (module inputs and outputs)."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, List

import torch
from torch.nn.utils.rnn import PackedSequence


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any,
                _objects: bool = True) -> Any:
    """``obj`` with every tensor inside lists, tuples, dicts, dataclasses and the attributes
    of plain objects replaced by ``fn(tensor)``; named tuples, sets and OrderedDicts keep
    their type; dict-like outputs, dataclasses and objects are updated in place (frozen
    dataclasses are copied). A plain object's attributes are searched one level deep."""
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
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj)
                   if hasattr(obj, f.name)}
        if type(obj).__dataclass_params__.frozen:
            return dataclasses.replace(obj, **{k: v for k, v in changes.items()
                                               if type(obj).__dataclass_fields__[k].init})
        for k, v in changes.items():
            setattr(obj, k, v)
        return obj
    if _objects and _is_plain_object(obj):
        for k, v in list(vars(obj).items()):
            setattr(obj, k, map_tensors(fn, v, _objects=False))
        return obj
    return obj


def _is_plain_object(obj: Any) -> bool:
    return (hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module))
            and not callable(obj) and type(obj).__module__ not in ("builtins",))


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
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk(fn, getattr(obj, f.name, None))


def cast_floating(dtype: torch.dtype, obj: Any) -> Any:
    """``obj`` with its floating-point tensors cast to ``dtype``."""
    return map_tensors(
        lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t, obj)
