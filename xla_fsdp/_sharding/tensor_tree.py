"""Walking the nested containers of tensors that modules take and return.

One walk serves both uses, so that what FSDP hooks on a unit's outputs and what it collects
from its inputs are found the same way: tensors inside lists, tuples, sets, dicts and
dict-like outputs (Hugging Face's ``ModelOutput``), named tuples, ``PackedSequence``,
dataclasses, and the attributes of plain objects, one level deep.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, List

import torch
from torch.nn.utils.rnn import PackedSequence

Visit = Callable[[torch.Tensor], torch.Tensor]


def map_tensors(fn: Visit, obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``. Named tuples, sets and
    OrderedDicts keep their type; dict-like outputs, dataclasses and plain objects are updated
    in place (frozen dataclasses are copied)."""
    return _walk(fn, obj, rebuild=True)


def collect_tensors(obj: Any) -> List[torch.Tensor]:
    """Every distinct tensor inside ``obj``, in order of first appearance."""
    found: List[torch.Tensor] = []
    seen = set()

    def visit(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in seen:
            seen.add(id(t))
            found.append(t)
        return t

    _walk(visit, obj, rebuild=False)
    return found


def cast_floating(dtype: torch.dtype, obj: Any) -> Any:
    """``obj`` with its floating-point tensors cast to ``dtype``."""
    return map_tensors(
        lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t, obj)


def _walk(fn: Visit, obj: Any, rebuild: bool, objects: bool = True) -> Any:
    """Calls ``fn`` on every tensor in ``obj``; with ``rebuild``, returns ``obj`` with the
    results in place of the tensors. ``objects``: whether to look inside a plain object's
    attributes (not inside an object found that way)."""
    def walk(value: Any) -> Any:
        return _walk(fn, value, rebuild)

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, PackedSequence):
        data = fn(obj.data)
        return obj._replace(data=data) if rebuild else obj
    if isinstance(obj, OrderedDict) or type(obj) is dict:
        items = [(k, walk(v)) for k, v in obj.items()]
        return type(obj)(items) if rebuild else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        values = [walk(v) for v in obj]
        return type(obj)(*values) if rebuild else obj
    if isinstance(obj, (list, tuple, set, frozenset)):
        values = [walk(v) for v in obj]
        return type(obj)(values) if rebuild else obj
    if hasattr(obj, "keys") and hasattr(obj, "__setitem__") and hasattr(obj, "items"):
        for k, v in list(obj.items()):  # dict-like model outputs: updated in place
            new = walk(v)
            if rebuild:
                obj[k] = new
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                   if hasattr(obj, f.name)}
        if not rebuild:
            return obj
        if type(obj).__dataclass_params__.frozen:
            return dataclasses.replace(obj, **{k: v for k, v in changes.items()
                                               if type(obj).__dataclass_fields__[k].init})
        for k, v in changes.items():
            setattr(obj, k, v)
        return obj
    if objects and _is_plain_object(obj):
        for k, v in list(vars(obj).items()):
            new = _walk(fn, v, rebuild, objects=False)
            if rebuild:
                setattr(obj, k, new)
        return obj
    return obj


def _is_plain_object(obj: Any) -> bool:
    return (hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module))
            and not callable(obj) and type(obj).__module__ not in ("builtins",))
