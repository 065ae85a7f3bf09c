"""What a unit does once, at construction: find its parameters, shard them, and leave
full-parameter placeholders in their modules. Also: buffer casting, meta-device init."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from . import shard_layout
from .shard_layout import Dim0Layout, FlatLayout, InterleavedLayout

_SEPARATOR = "_FSDP_SHARD_SEPARATOR_"
Owner = Tuple[nn.Module, str, str]  # (module, attribute, name relative to the wrapped module)


@dataclass
class ShardGroup:
    """Parameters sharded as one tensor: their full placeholders and this rank's shard."""
    layout: shard_layout.Layout
    shard: nn.Parameter
    params: List[torch.Tensor]            # full-parameter placeholders
    names: List[str]                      # names relative to the wrapped module
    pending_grads: int = 0                # grads still to arrive in this backward
    hooks: List[Any] = field(default_factory=list)  # (AccumulateGrad node, its hook handle)


def find_parameters(roots: List[Tuple[str, nn.Module]], unit: Any
                    ) -> List[Tuple[nn.Parameter, List[Owner]]]:
    """Every parameter below ``roots`` that belongs to ``unit``, once, with every place that
    holds it: not the parameters inner units have sharded, nor those below modules that
    another unit groups (see ``module_group``). ``roots`` are (name prefix, module)."""
    owners: Dict[int, List[Owner]] = {}
    order: List[nn.Parameter] = []
    for prefix, root in roots:
        for mod_path, m in _modules_of(root, unit):
            mod_path = ".".join(p for p in (prefix, mod_path) if p)
            for attr, p in list(m._parameters.items()):
                if p is None or getattr(p, "_is_sharded", False):
                    continue
                name = f"{mod_path}.{attr}" if mod_path else attr
                if hasattr(p, "_fsdp_owner_name"):
                    raise ValueError(
                        f"parameter '{name}' is shared with '{p._fsdp_owner_name}', which an "
                        f"inner FSDP unit already sharded. Tied parameters must belong to one "
                        f"unit: wrap the modules that share it together (or leave them to the "
                        f"outer unit).")
                if not p.is_floating_point() or p.dtype != torch.float32:
                    raise TypeError(
                        f"parameter '{name}' of {type(m).__name__} has dtype {p.dtype}; FSDP "
                        f"shards float32 parameters only (set compute_dtype for bf16/fp16 "
                        f"compute, and keep integer state in buffers)")
                if id(p) not in owners:
                    owners[id(p)] = []
                    order.append(p)
                owners[id(p)].append((m, attr, name))
    return [(p, owners[id(p)]) for p in order]


def _modules_of(root: nn.Module, unit: Any) -> Iterator[Tuple[str, nn.Module]]:
    """``root.named_modules()`` without the subtrees of modules grouped by another unit."""
    stack = [("", root)]
    seen = set()
    while stack:
        path, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        owner = m.__dict__.get("_fsdp_group_unit")
        if owner is not None and owner is not unit:
            continue
        yield path, m
        children = [(f"{path}.{n}" if path else n, c) for n, c in m._modules.items()
                    if c is not None]
        stack.extend(reversed(children))


def group_parameters(found: List[Tuple[nn.Parameter, List[Owner]]], flatten: bool
                     ) -> List[List[Tuple[nn.Parameter, List[Owner]]]]:
    """One group per parameter, or (flattened) one for the trainable and one for the frozen."""
    if not flatten:
        return [[item] for item in found]
    trainable = [item for item in found if item[0].requires_grad]
    frozen = [item for item in found if not item[0].requires_grad]
    return [g for g in (trainable, frozen) if g]


@torch.no_grad()
def shard_group(members: List[Tuple[nn.Parameter, List[Owner]]], index: int, *, flatten: bool,
                dim0: bool, world_size: int, rank: int, multiple: int, device: Any,
                compute_dtype: torch.dtype) -> Tuple[ShardGroup, List[Tuple[str, str]]]:
    """Shards one group and puts placeholders where its parameters were.

    Returns the group (its shard not yet registered anywhere) and the (alias, source) names
    of tied parameters. Only the shard is copied to ``device``."""
    params = [p for p, _ in members]
    shapes = tuple(p.shape for p in params)
    if flatten:
        layout = InterleavedLayout(shapes, world_size, multiple)
    elif dim0:
        layout = Dim0Layout(shapes[0], world_size)
    else:
        layout = FlatLayout(shapes, world_size, multiple)
    names = [owners[0][2] for _, owners in members]
    orig_name = "_fsdp_wrapped_module." + (f"flat_param_{index}" if flatten else names[0])
    shard = nn.Parameter(layout.shard([p.detach() for p in params], rank).to(device),
                         requires_grad=params[0].requires_grad)
    shard._is_sharded = True
    shard._orig_size = torch.Size([layout.numel]) if flatten else params[0].shape
    shard._orig_name = orig_name
    shard._name = ("_fsdp_shard." + orig_name).replace(".", _SEPARATOR)
    placeholders, shared = [], []
    for p, owners in members:
        source = owners[0][2]
        p._fsdp_owner_name = source  # marks the original as taken
        full = torch.zeros(1, dtype=compute_dtype, device=device)
        full.requires_grad_(p.requires_grad)
        full._fsdp_owner_name = source
        full._has_full_param = False
        for m, attr, alias in owners:
            del m._parameters[attr]
            object.__setattr__(m, attr, full)
            if alias != source:
                shared.append((alias, source))
        placeholders.append(full)
    return ShardGroup(layout, shard, placeholders, names), shared


@torch.no_grad()
def cast_buffers(module: nn.Module, dtype: torch.dtype, device: Any) -> None:
    """Moves buffers to ``device``, floating ones in ``dtype``; inner units did theirs first
    and marked them, so each buffer is cast once, by its innermost unit."""
    for m in module.modules():
        for name, buf in list(m._buffers.items()):
            if buf is None or getattr(buf, "_fsdp_cast", False):
                continue
            new = buf.to(dtype) if buf.is_floating_point() and buf.dtype != dtype else buf
            new = new.to(device)
            if new.dtype != buf.dtype:
                new._orig_dtype = buf.dtype
            new._fsdp_cast = True
            m._buffers[name] = new


def swap_value(p: torch.Tensor, value: torch.Tensor) -> None:
    """Points the placeholder leaf ``p`` at ``value``, keeping its autograd identity.

    Not ``torch_xla._XLAC._replace_xla_tensor`` (torch_xla's choice): it updates the shape
    but leaves ``numel()`` at the old value. torch_xla's placeholders keep the original
    parameter's numel, so the stale value happens to match whenever the parameter is
    gathered. Ours start as one element (nothing full-size ever reaches the device), and
    ops that check numel, such as BatchNorm's weight, would see 1."""
    with torch.autograd._unsafe_preserve_version_counter(p):
        p.data = value


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
