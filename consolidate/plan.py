"""Where each full tensor of the unwrapped model lives inside the per-rank shards.

Most shard groups (one sharded tensor per rank) are the rank-ordered concatenation of a
padded flat buffer, and their parameters occupy consecutive element ranges from the start
of that buffer. That holds for single parameters, dim-0 shards (whose row blocks
concatenate in row-major order) and torch_xla's flattened groups, so one rule reads such a
parameter: elements ``[offset, offset + numel)`` of the concatenation. Our flattened groups
are interleaved (``InterleavedLayout``): every rank holds a piece of each parameter, at the
same place in every shard, and the pieces concatenate in rank order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from xla_fsdp.files import CheckpointError, TensorRef
from xla_fsdp.shard_layout import InterleavedLayout
from xla_fsdp.shard_metadata import clean_name, join_name


@dataclass(frozen=True)
class ParamSpec:
    name: str                       # in the unwrapped model
    shape: Tuple[int, ...]
    offset: int                     # first element in the group's concatenated shards
    piece: Optional[Tuple[int, int]] = None  # interleaved: (offset, elements) in every shard


@dataclass(frozen=True)
class GroupSpec:
    key: str                        # the shard's key in each rank's model state dict
    params: Tuple[ParamSpec, ...]
    kind: Optional[str]  # "flat" | "interleaved" | "dim0"; None if the writer did not record it
    multiple: int

    @property
    def numel(self) -> int:
        last = self.params[-1]
        return last.offset + math.prod(last.shape)


@dataclass
class ModelPlan:
    groups: List[GroupSpec]
    buffers: Dict[str, str]               # state dict key -> unwrapped name
    buffer_dtypes: Dict[str, torch.dtype]  # state dict key -> dtype to restore
    aliases: List[Tuple[str, str]]        # (alias, source) unwrapped names of tied parameters
    param_order: List[str]                # unwrapped names in parameters() order

    def group_of(self) -> Dict[str, GroupSpec]:
        return {g.key: g for g in self.groups}


def plan_model(metadata: Dict[str, Any], model_tree: Dict[str, Any]) -> ModelPlan:
    groups: List[GroupSpec] = []
    flatten_info = {**metadata.get("flatten_info", {}), **metadata.get("interleave_info", {})}
    layout_info = metadata.get("layout_info", {})
    for path, shards in metadata["shard_info"].items():
        prefix = path + "." if path else ""
        for shard_name, info in shards.items():
            key = prefix + shard_name
            if key not in model_tree:
                raise CheckpointError(f"shard {key} is in the shard metadata but not in the "
                                      f"model state dict")
            wrapped_name = prefix + info["_orig_name"]
            if wrapped_name in flatten_info:
                names, shapes, numels = flatten_info[wrapped_name]
                member_prefix = clean_name(path)
                params, at = [], 0
                for n, s, k in zip(names, shapes, numels):
                    params.append(ParamSpec(clean_name(join_name(member_prefix, n)), tuple(s), at))
                    at += k
            else:
                params = [ParamSpec(clean_name(wrapped_name), tuple(info["_orig_size"]), 0)]
            layout = layout_info.get(path, {}).get(shard_name, {})
            if layout.get("kind") == "interleaved":
                pieces = InterleavedLayout(tuple(torch.Size(p.shape) for p in params),
                                           metadata["world_size"], layout.get("multiple", 1))
                params = [ParamSpec(p.name, p.shape, p.offset, (o, n)) for p, o, n in
                          zip(params, pieces.piece_offsets, pieces.piece_numels)]
            groups.append(GroupSpec(key, tuple(params), layout.get("kind"),
                                    layout.get("multiple", 1)))
    shard_keys = {g.key for g in groups}
    buffer_info = metadata.get("buffer_info", {})
    buffers = {k: clean_name(k) for k, v in model_tree.items()
               if k not in shard_keys and isinstance(v, TensorRef)}
    buffer_dtypes = {k: buffer_info[k]["_orig_dtype"] for k in buffers if k in buffer_info}
    aliases = []
    for path, pairs in metadata.get("shared_info", {}).items():
        prefix = clean_name(path)
        for alias, source in pairs:
            aliases.append((join_name(prefix, alias), join_name(prefix, source)))
    order = metadata.get("param_order") or [p.name for g in groups for p in g.params]
    return ModelPlan(groups, buffers, buffer_dtypes, aliases, list(order))


def read_range(shards: List[TensorRef], start: int, numel: int) -> torch.Tensor:
    """Elements ``[start, start + numel)`` of the rank-ordered concatenation of ``shards``,
    read straight into one new tensor (nothing else of that size is allocated)."""
    per_rank = shards[0].numel
    out = torch.empty(numel, dtype=shards[0].dtype)
    for rank, shard in enumerate(shards):
        if shard.numel != per_rank:
            raise CheckpointError(f"{shard.file.path}: shard {shard.key} has {shard.numel} "
                                  f"elements, rank 0's has {per_rank}")
        lo, hi = max(start, rank * per_rank), min(start + numel, (rank + 1) * per_rank)
        if lo < hi:
            shard.read_elements(lo - rank * per_rank, out[lo - start:hi - start])
    if start + numel > per_rank * len(shards):
        raise CheckpointError(f"shards of {shards[0].key} hold {per_rank * len(shards)} "
                              f"elements, fewer than the {start + numel} the metadata describes")
    return out


def read_param(shards: List[TensorRef], param: ParamSpec) -> torch.Tensor:
    if param.piece is None:
        return read_range(shards, param.offset, math.prod(param.shape)).view(param.shape)
    start, count = param.piece
    out = torch.empty(count * len(shards), dtype=shards[0].dtype)
    for rank, shard in enumerate(shards):
        if shard.numel != shards[0].numel or start + count > shard.numel:
            raise CheckpointError(f"{shard.file.path}: shard {shard.key} has {shard.numel} "
                                  f"elements; the metadata puts {param.name} at "
                                  f"[{start}, {start + count}) of every rank's shard, and rank "
                                  f"0's has {shards[0].numel}")
        shard.read_elements(start, out[rank * count:(rank + 1) * count])
    return out[:math.prod(param.shape)].view(param.shape)


def read_group(shards: List[TensorRef], spec: GroupSpec) -> torch.Tensor:
    """The group's parameters, flattened and concatenated, without padding."""
    if spec.kind != "interleaved":
        return read_range(shards, 0, spec.numel)
    return torch.cat([read_param(shards, p).reshape(-1) for p in spec.params])
