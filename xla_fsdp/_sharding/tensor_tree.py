"""Walking the nested containers of tensors that modules take and return.

One walk serves both uses, so that what FSDP hooks on a unit's outputs and what it collects
from its inputs are found the same way: tensors inside lists, tuples, sets, dicts and
dict-like outputs (Hugging Face's ``ModelOutput``), named tuples, ``PackedSequence``,
dataclasses, and the attributes of plain objects, one level deep.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Tuple

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
    """``obj`` with its floating-point tensors cast to ``dtype``, finite values saturating
    (see [Note: casting without overflow]). The caller's objects are left as they are: a
    dict-like, dataclass or plain object holding a tensor that changes is copied (a batch
    given to a unit keeps its float32 targets for a loss taken outside)."""
    return _walk(lambda t: _saturating_cast(t, dtype), obj, rebuild=True, copies=True)


def _saturating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Note: casting without overflow]
    A low-precision unit casts its floating inputs to its compute dtype. A finite value
    beyond that dtype's range became an infinity: an additive mask filled with
    ``torch.finfo(torch.float32).min`` (or -1e9 under float16) turned -inf, and a row it
    masks entirely then gave NaN losses and gradients by hand-written attention and a
    uniform row by torch's sdpa, where the unsharded model, adding the float32 mask to its
    scores, computes finite values. Finite values saturate at the dtype's largest; an
    infinity or a NaN stays what it was. Only a cast that narrows the range pays for it."""
    if not torch.is_floating_point(t) or t.dtype == dtype:
        return t
    info = torch.finfo(dtype)
    if torch.finfo(t.dtype).max > info.max:
        t = torch.where(t.isinf(), t, t.clamp(info.min, info.max))
    return t.to(dtype)


def _walk(fn: Visit, obj: Any, rebuild: bool, objects: bool = True,
          copies: bool = False) -> Any:
    """Calls ``fn`` on every tensor in ``obj``; with ``rebuild``, returns ``obj`` with the
    results in place of the tensors. ``objects``: whether to look inside a plain object's
    attributes (not inside an object found that way). ``copies``: a mutable container whose
    contents change is copied, not changed."""
    def walk(value: Any) -> Any:
        return _walk(fn, value, rebuild, copies=copies)

    def updated(changes: Dict[Any, Tuple[Any, Any]], assign: Callable[[Any, Any, Any], Any]
                ) -> Any:
        """``obj`` with ``assign(out, key, new)`` for each key's (old, new) in ``changes``,
        where ``out`` is ``obj``, or with ``copies`` a copy of it if any of them differs
        (``obj`` itself, unchanged, if none does)."""
        if not rebuild:
            return obj
        out = obj
        if copies:
            if not any(_changed(a, b) for a, b in changes.values()):
                return obj
            out = copy.copy(obj)
        for k, (_, new) in changes.items():
            assign(out, k, new)
        return out

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
        # dict-like model outputs: updated in place (with ``copies``, a copy is)
        return updated({k: (v, walk(v)) for k, v in list(obj.items())}, operator.setitem)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: (getattr(obj, f.name), walk(getattr(obj, f.name)))
                   for f in dataclasses.fields(obj) if hasattr(obj, f.name)}
        if rebuild and type(obj).__dataclass_params__.frozen:
            return dataclasses.replace(obj, **{k: v for k, (_, v) in changes.items()
                                               if type(obj).__dataclass_fields__[k].init})
        return updated(changes, setattr)
    if objects and _is_plain_object(obj):
        return updated({k: (getattr(obj, k), _walk(fn, v, rebuild, objects=False, copies=copies))
                        for k, v in list(vars(obj).items())}, setattr)
    return obj


def _changed(old: Any, new: Any) -> bool:
    """Whether a walk's result ``new`` holds another tensor than ``old`` anywhere (a
    container rebuilt around the same tensors has not changed)."""
    if old is new:
        return False
    if isinstance(old, (list, tuple)) and type(old) is type(new) and len(old) == len(new):
        return any(_changed(a, b) for a, b in zip(old, new))
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
        return any(_changed(old[k], new[k]) for k in old)
    return True


def copy_tree(fn: Visit, obj: Any) -> Any:
    """A copy of ``obj`` with every tensor replaced by ``fn(tensor)``, however deep, for a
    checkpoint's tree (``extra`` may hold anything): containers keep their types (a tuple
    stays a tuple, a named tuple, ``OrderedDict`` or ``defaultdict`` its class), dict keys
    are walked too, and a container or object held twice, or holding itself, is copied once.
    Unlike ``map_tensors``, which looks one level into a module's outputs and updates
    dict-like ones in place, nothing of the caller's changes. Types, functions and modules
    are kept as they are."""
    done: dict = {}

    def walk(value: Any) -> Any:
        if id(value) in done:
            return done[id(value)][1]
        if isinstance(value, torch.Tensor):
            out = fn(value)
        elif isinstance(value, tuple):
            items = [walk(v) for v in value]
            out = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        elif isinstance(value, list):
            out = [] if type(value) is list else copy.copy(value)
            done[id(value)] = (value, out)   # before its items: it may hold itself
            out[:] = [walk(v) for v in value]
        elif isinstance(value, (set, frozenset)):
            out = type(value)(walk(v) for v in value)
        elif isinstance(value, dict):
            out = {} if type(value) is dict else copy.copy(value)
            done[id(value)] = (value, out)
            if type(value) is dict:
                out.update((walk(k), walk(v)) for k, v in value.items())
            else:
                for k, v in value.items():
                    out[k] = walk(v)
        elif _is_plain_object(value) or (dataclasses.is_dataclass(value) and
                                         hasattr(value, "__dict__")
                                         and not isinstance(value, type)):
            out = copy.copy(value)
            done[id(value)] = (value, out)
            for k, v in vars(value).items():
                object.__setattr__(out, k, walk(v))
        else:
            out = value
        done[id(value)] = (value, out)  # the value too: its id is not reused meanwhile
        return out
    return walk(obj)


def _is_plain_object(obj: Any) -> bool:
    return (hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module))
            and not callable(obj) and type(obj).__module__ not in ("builtins",))
