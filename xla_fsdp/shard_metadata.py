"""The shard metadata a checkpoint needs, in torch_xla's format."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import torch.nn as nn


def clean_name(name: str) -> str:
    """A name in the wrapped model as it is in the unwrapped one."""
    return name.replace("_fsdp_wrapped_module.", "")


def original_names_and_shards(units: Iterable[Tuple[str, Any]]) -> List[Tuple[str, nn.Parameter]]:
    """(name in the unwrapped model, shard) for every group of every unit.

    A flattened group is named ``<unit path>.flat_param_<i>``."""
    out = []
    for path, unit in units:
        prefix = clean_name(path + "." if path else "")
        for g in unit._groups:
            out.append((prefix + clean_name(g.shard._orig_name), g.shard))
    return out


def shard_metadata(root: nn.Module, units: Iterable[Tuple[str, Any]]) -> Dict[str, Any]:
    """torch_xla's ``get_shard_metadata`` format, plus ``shared_info`` for tied parameters
    (torch_xla's consolidation ignores unknown keys)."""
    shard_info, flatten_info, shared_info = {}, {}, {}
    for path, unit in units:
        shard_info[path] = {
            g.shard._name: {"_orig_size": g.shard._orig_size, "_orig_name": g.shard._orig_name}
            for g in unit._groups}
        if unit.flatten_parameters:
            for g in unit._groups:
                key = (path + "." if path else "") + g.shard._orig_name
                flatten_info[key] = (list(g.names), list(g.layout.shapes), list(g.layout.numels))
        if unit._shared_params:
            shared_info[path] = list(unit._shared_params)
    buffer_info = {name: {"_orig_dtype": buf._orig_dtype}
                   for name, buf in root.named_buffers() if hasattr(buf, "_orig_dtype")}
    return {"shard_info": shard_info, "flatten_info": flatten_info,
            "buffer_info": buffer_info, "shared_info": shared_info,
            "world_size": root.world_size, "rank": root.rank}
