"""The shard metadata a checkpoint needs, in torch_xla's format, plus what resharding and
optimizer consolidation need (torch_xla's consolidation ignores the extra keys)."""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Dict, Iterable, List, Tuple

import torch.nn as nn

from .init_sharding import original_dtype
from .shard_layout import Dim0Layout, InterleavedLayout, StackedLayout


# ours and torch_xla's; torch_xla's flattener; torch's checkpoint_wrapper
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_fpw_module", "_checkpoint_wrapped_module")
GROUP_PREFIX = "_fsdp_group_"  # where a unit grouping several modules sits (module_group.py)


def clean_name(name: str) -> str:
    """A name (or module path) in the wrapped model as it is in the unwrapped one."""
    return ".".join(p for p in name.split(".")
                    if p and p not in _WRAPPER_PARTS and not p.startswith(GROUP_PREFIX))


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def persistent_buffers(root: nn.Module) -> List[Tuple[str, Any]]:
    """(name in the unwrapped model, buffer) for every buffer ``state_dict()`` holds: the
    persistent ones, under every name a shared module gives them."""
    out = []
    for path, m in root.named_modules(remove_duplicate=False):
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                out.append((clean_name(join_name(path, name)), buf))
    return out


def original_names_and_shards(units: Iterable[Tuple[str, Any]]) -> List[Tuple[str, nn.Parameter]]:
    """(name in the unwrapped model, shard) for every group of every unit.

    A flattened group is named ``<unit path>.flat_param_<i>``."""
    out = []
    for path, unit in units:
        prefix = clean_name(path)
        for g in unit.shard_groups:
            out.append((join_name(prefix, clean_name(g.orig_name)), g.shard))
    return out


def shard_metadata(root: nn.Module, units: Iterable[Tuple[str, Any]]) -> Dict[str, Any]:
    """torch_xla's ``get_shard_metadata`` format, plus:

    * ``shared_info``: {unit path: [(alias, source)]} for tied parameters;
    * ``layout_info``: {unit path: {shard name: {"kind": "flat" | "interleaved" | "dim0",
      "multiple": m}}};
    * ``interleave_info``: ``flatten_info``'s entries for interleaved groups (every flattened
      group of ours), kept out of ``flatten_info`` because torch_xla's consolidation would
      read them as one flat tensor cut into shards and silently scramble them. It fails on
      the missing entry instead.
    * ``stack_info``: for each group of scanned layers (``StackedLayout``), one layer's
      parameter names (relative to the layer), shapes and sizes; layer ``i``'s are named
      ``<unit path>.<i>.<name>``, and a rank's shard is its layer shards stacked;
    * ``param_order``: the unwrapped model's parameter names in ``parameters()`` order;
    * ``update_count``: optimizer steps and loads the shards have had, equal on every rank
      at the same point of training, so that consolidation can tell a file left from an
      earlier save from one of the save it is reading.
    """
    units = list(units)
    shard_info, flatten_info, shared_info, layout_info = {}, {}, {}, {}
    interleave_info, stack_info = {}, {}
    for path, unit in units:
        groups = unit.shard_groups
        shard_info[path] = {
            g.shard_name: {"_orig_size": g.shard._orig_size, "_orig_name": g.orig_name}
            for g in groups}
        layout_info[path] = {g.shard_name: _layout_entry(g.layout) for g in groups}
        for g in groups:
            key = (path + "." if path else "") + g.orig_name
            if isinstance(g.layout, StackedLayout):
                layer = g.layout.layer
                names = [n.split(".", 1)[1] for n in g.names[:len(layer.shapes)]]
                stack_info[key] = (names, list(layer.shapes), [math.prod(s) for s in layer.shapes])
            elif unit.flatten_parameters:
                info = interleave_info if isinstance(g.layout, InterleavedLayout) else flatten_info
                info[key] = (list(g.names), list(g.layout.shapes), list(g.layout.numels))
        if unit.shared_params:
            shared_info[path] = unit.shared_params
    buffer_info = {name: {"_orig_dtype": original_dtype(buf)}
                   for name, buf in persistent_buffers(root)
                   if original_dtype(buf) != buf.dtype}
    return {"shard_info": shard_info, "flatten_info": flatten_info,
            "interleave_info": interleave_info, "buffer_info": buffer_info,
            "shared_info": shared_info, "layout_info": layout_info, "stack_info": stack_info,
            "param_order": _plain_parameter_order(root, units),
            "update_count": sum(g.updates for _, unit in units for g in unit.shard_groups),
            "world_size": root.world_size, "rank": root.rank}


def _layout_entry(layout: Any) -> Dict[str, Any]:
    if isinstance(layout, StackedLayout):
        layer = _layout_entry(layout.layer)
        return {"kind": "stacked", "multiple": layer["multiple"], "layers": layout.layers,
                "layer_kind": layer["kind"]}
    if isinstance(layout, Dim0Layout):
        return {"kind": "dim0", "multiple": 1}
    kind = "interleaved" if isinstance(layout, InterleavedLayout) else "flat"
    return {"kind": kind, "multiple": layout.multiple}


def _plain_parameter_order(root: nn.Module, units: List[Tuple[str, Any]]) -> List[str]:
    """Names in the order ``parameters()`` of the unwrapped model yields them: modules in
    pre-order, each module's own parameters in registration order (as each unit found
    them, before grouping)."""
    module_rank: Dict[str, int] = {}
    for path, _ in root.named_modules():
        module_rank.setdefault(clean_name(path), len(module_rank))
    keyed = []
    for path, unit in units:
        prefix = clean_name(path)
        for position, name in enumerate(unit.param_order):
            full = join_name(prefix, name)
            owner = full.rsplit(".", 1)[0] if "." in full else ""
            keyed.append(((module_rank[owner], position), full))
    return [name for _, name in sorted(keyed)]


def wrapping_fingerprint(metadata: Dict[str, Any]) -> str:
    """Identifies how a model was sharded (names, shapes, layouts, world size), not the
    values nor the rank: files of one checkpoint share it, and a model wrapped the same
    way at the same world size computes the same one."""
    keys = ("shard_info", "flatten_info", "interleave_info", "shared_info", "layout_info",
            "stack_info", "world_size")
    canonical = json.dumps({k: metadata.get(k) for k in keys}, sort_keys=True, default=_jsonable)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return list(value)
    if hasattr(value, "__iter__"):  # torch.Size
        return list(value)
    return str(value)
