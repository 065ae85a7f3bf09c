"""What a unit does once, at construction, before sharding (``shard_group.build_group``):
find its parameters under every name they have, place its buffers, and give meta-device
modules real values."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from .param_record import Owner, taken_name

Member = Tuple[nn.Parameter, List[Owner], List[str]]  # parameter, its holders, its names


def find_parameters(roots: List[Tuple[str, nn.Module]], unit: Any) -> List[Member]:
    """Every parameter below ``roots`` that belongs to ``unit``, once, with every
    (module, attribute) that holds it and every name it has: a module registered under
    several names (one embedding shared by an encoder, a decoder and a head) gives its
    parameters each of those names, as ``state_dict()`` does. Not the parameters inner units
    have sharded, nor those below modules another unit groups (see ``module_group``).
    ``roots`` are (name prefix, module)."""
    owners: Dict[int, List[Owner]] = {}
    names: Dict[int, List[str]] = {}
    order: List[nn.Parameter] = []
    for prefix, root in roots:
        for mod_path, m in _module_paths(root, unit):
            mod_path = ".".join(p for p in (prefix, mod_path) if p)
            for attr, p in list(m._parameters.items()):
                if p is None or getattr(p, "_is_sharded", False):
                    continue
                name = f"{mod_path}.{attr}" if mod_path else attr
                taken = taken_name(p)
                if taken is not None:
                    raise ValueError(
                        f"parameter '{name}' is shared with '{taken}', which an inner FSDP "
                        f"unit already sharded. Tied parameters must belong to one unit: "
                        f"wrap the modules that share it together (or leave them to the "
                        f"outer unit).")
                if not p.is_floating_point() or p.dtype != torch.float32:
                    raise TypeError(
                        f"parameter '{name}' of {type(m).__name__} has dtype {p.dtype}; FSDP "
                        f"shards float32 parameters only (set compute_dtype for bf16/fp16 "
                        f"compute, and keep integer state in buffers)")
                if id(p) not in owners:
                    owners[id(p)], names[id(p)] = [], []
                    order.append(p)
                if not any(o is m and a == attr for o, a in owners[id(p)]):
                    owners[id(p)].append((m, attr))
                names[id(p)].append(name)
    return [(p, owners[id(p)], names[id(p)]) for p in order]


def _module_paths(root: nn.Module, unit: Any) -> Iterator[Tuple[str, nn.Module]]:
    """Every (path, module) below ``root``, a module once per path that reaches it, without
    the subtrees of modules grouped by another unit."""
    stack = [("", root, ())]
    while stack:
        path, m, ancestors = stack.pop()
        if id(m) in ancestors:
            continue  # a module that contains itself
        owner = m.__dict__.get("_fsdp_group_unit")
        if owner is not None and owner is not unit:
            continue
        yield path, m
        inside = ancestors + (id(m),)
        children = [(f"{path}.{n}" if path else n, c, inside) for n, c in m._modules.items()
                    if c is not None]
        stack.extend(reversed(children))


def group_parameters(found: List[Member], flatten: bool,
                     dtype_of: Callable[[List[Owner]], torch.dtype]) -> List[List[Member]]:
    """One group per parameter, or (flattened) one per (trainable or frozen, compute dtype),
    trainable first."""
    if not flatten:
        return [[item] for item in found]
    groups: Dict[Tuple[bool, torch.dtype], List[Member]] = {}
    for item in found:
        groups.setdefault((not item[0].requires_grad, dtype_of(item[1])), []).append(item)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], str(k[1])))]


_PLACED_BUFFERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # buffer -> original dtype


@torch.no_grad()
def place_buffers(module: nn.Module, dtype: Optional[torch.dtype], device: Any,
                  keep: Set[int] = frozenset()) -> None:
    """Moves buffers to ``device``, floating ones cast to ``dtype`` if given (by default
    they keep their dtype: BatchNorm statistics and rotary frequencies stay float32 under
    low-precision compute). Inner units placed theirs first, so each buffer is placed once,
    by its innermost unit. The buffers of modules in ``keep`` (ids) keep their dtype."""
    for m in module.modules():
        for name, buf in list(m._buffers.items()):
            if buf is None or buf in _PLACED_BUFFERS:
                continue
            cast = id(m) not in keep and dtype is not None and buf.is_floating_point() and buf.dtype != dtype
            new = (buf.to(dtype) if cast else buf).to(device)
            _PLACED_BUFFERS[new] = buf.dtype
            m._buffers[name] = new


def original_dtype(buf: torch.Tensor) -> torch.dtype:
    """The dtype a buffer had before its unit placed it."""
    return _PLACED_BUFFERS.get(buf, buf.dtype)


def materialize_meta(module: nn.Module, param_init_fn: Optional[Callable],
                     unit_cls: type) -> None:
    """Gives parameters created on the meta device real storage and values.

    Inner units are already sharded on the device; they are hidden while ``param_init_fn``
    (or the default ``to_empty`` + ``reset_parameters()``) runs, so a function written for
    the whole module cannot move or overwrite their shards. So are modules that a grouping
    unit holds: it initialised them itself."""
    with _inner_units_hidden(module, unit_cls):
        if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            return
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            module.to_empty(device="cpu", recurse=True)
            for m in module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        still_meta = [n for n, t in list(module.named_parameters()) + list(module.named_buffers())
                      if t.is_meta]
        if still_meta:
            raise ValueError(f"param_init_fn left {still_meta} on the meta device; it must give "
                             f"every parameter and buffer of the module real storage")


@contextlib.contextmanager
def _inner_units_hidden(module: nn.Module, unit_cls: type) -> Iterator[None]:
    hidden, stack = [], [module]
    while stack:
        m = stack.pop()
        for name, child in list(m._modules.items()):
            if child is None:
                continue
            if isinstance(child, unit_cls) or "_fsdp_group_unit" in child.__dict__:
                m._modules[name] = nn.Module()
                hidden.append((m, name, child))
            else:
                stack.append(child)
    try:
        yield
    finally:
        for m, name, child in hidden:
            m._modules[name] = child
