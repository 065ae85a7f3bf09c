"""Where each full tensor of the unwrapped model lives inside the per-rank shards.

Most shard groups (one sharded tensor per rank) are the rank-ordered concatenation of a
padded flat buffer, and their parameters occupy consecutive element ranges from the start
of that buffer. That holds for single parameters, dim-0 shards (whose row blocks
concatenate in row-major order) and torch_xla's flattened groups, so one rule reads such a
parameter: elements ``[offset, offset + numel)`` of the concatenation. Our flattened groups
are interleaved (``InterleavedLayout``): every rank holds a piece of each parameter, at the
same place in every shard, and the pieces concatenate in rank order.

A stacked group (scanned layers) holds L identical layers: every rank's shard is
``[L, *layer shard shape]`` and row ``i`` is that rank's shard of layer ``i``, laid out as
an ordinary flat, interleaved or dim-0 group. The rules above then apply within one row.

``read_elements`` reads any run of a full tensor's elements by these rules, from the rank
files that hold it; consolidation reads whole tensors through it, and the per-rank files'
source (``per_rank_source``) the runs a loading rank's shards hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..files import CheckpointError, TensorRef
from ..metadata import LAYER_KINDS, ShardEntry, ShardMetadata
from ..._sharding.layout import Dim0Layout, FlatLayout, InterleavedLayout, Layout, StackedLayout
from ..._sharding.names import clean_name, join_name


@dataclass(frozen=True)
class ParamSpec:
    name: str                       # in the unwrapped model
    shape: Tuple[int, ...]
    offset: int                     # first element in its layer's concatenated shards
    piece: Optional[Tuple[int, int]] = None  # interleaved: (offset, elements) in every shard
    row: int = 0                    # stacked: its layer, the row of every shard it is in
    rows: int = 1                   # stacked: the layers (rows of every shard)


@dataclass(frozen=True)
class ShardGroupSpec:
    key: str                        # the shard's key in each rank's model state dict
    params: Tuple[ParamSpec, ...]   # stacked: layer 0's, then layer 1's, ...
    # how one layer (the whole group unless stacked) is laid out: "flat" | "interleaved" |
    # "dim0"; None if the writer did not record it
    kind: Optional[str]
    multiple: int
    stacked: bool = False
    layers: int = 1

    @property
    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def layer(self, index: int) -> Tuple[ParamSpec, ...]:
        per_layer = len(self.params) // self.layers
        return self.params[index * per_layer:(index + 1) * per_layer]


@dataclass
class ModelPlan:
    shard_groups: List[ShardGroupSpec]
    buffers: Dict[str, str]               # state dict key -> unwrapped name
    buffer_dtypes: Dict[str, torch.dtype]  # state dict key -> dtype to restore
    aliases: List[Tuple[str, str]]        # (alias, source) unwrapped names of tied parameters
    param_order: List[str]                # unwrapped names in parameters() order

    def spec_of(self) -> Dict[str, ShardGroupSpec]:
        """{shard key: its spec}."""
        return {g.key: g for g in self.shard_groups}


def layer_layout(spec: ShardGroupSpec, world_size: int) -> Layout:
    """How one layer of ``spec`` (all of it unless stacked) is sharded at ``world_size``."""
    shapes = tuple(torch.Size(p.shape) for p in spec.layer(0))
    if spec.kind == "dim0":
        return Dim0Layout(shapes[0], world_size)
    if spec.kind == "interleaved":
        return InterleavedLayout(shapes, world_size, spec.multiple)
    return FlatLayout(shapes, world_size, spec.multiple)


def shard_group_layout(spec: ShardGroupSpec, world_size: int) -> Layout:
    """How the whole of ``spec`` is sharded at ``world_size``: what ``save_sharded`` of the
    same model at that world size writes (its parameters are numbered as ``spec.params``)."""
    layer = layer_layout(spec, world_size)
    return StackedLayout(layer, spec.layers) if spec.stacked else layer


def plan_model(metadata: ShardMetadata, model_tree: Dict[str, Any]) -> ModelPlan:
    specs: List[ShardGroupSpec] = []
    world = metadata.world_size
    saved_key = saved_keys(model_tree)
    for entry in metadata.entries():
        key = saved_key(entry.key)
        if key not in model_tree:
            raise CheckpointError(f"shard {key} is in the shard metadata but not in the "
                                  f"model state dict")
        if entry.kind == "stacked":
            specs.append(_stacked_shard_group(entry, key, model_tree[key], world))
            continue
        # read as flat, an unknown layout would come out silently scrambled
        if entry.kind not in (None,) + LAYER_KINDS:
            raise CheckpointError(
                f"shard {key} has layout kind {entry.kind!r}, which this consolidation does "
                f"not know (it reads {', '.join(LAYER_KINDS)} and stacked); use the "
                f"consolidate_sharded_ckpts of the xla_fsdp version that wrote it")
        if entry.has_stack_entry:
            raise CheckpointError(f"shard {key} has a stack_info entry but layout kind "
                                  f"{entry.kind!r}, not 'stacked': the shard metadata is "
                                  f"inconsistent")
        if entry.members is not None:
            params = _consecutive(clean_name(entry.unit_path), *entry.members)
        else:
            params = [ParamSpec(clean_name(join_name(entry.unit_path, entry.orig_name)),
                                entry.orig_size, 0)]
        if entry.kind == "interleaved":
            params = _with_pieces(params, world, entry.multiple)
        specs.append(ShardGroupSpec(key, tuple(params), entry.kind, entry.multiple))
    shard_keys = {g.key for g in specs}
    buffers = {k: clean_name(k) for k, v in model_tree.items()
               if k not in shard_keys and isinstance(v, TensorRef)}
    restore = metadata.buffer_dtypes()
    buffer_dtypes = {k: restore[k] for k in buffers if k in restore}
    order = metadata.parameter_order() or [p.name for g in specs for p in g.params]
    return ModelPlan(specs, buffers, buffer_dtypes, metadata.tied_aliases(), list(order))


def saved_keys(model_tree: Dict[str, Any]) -> Any:
    """Maps a shard key of the metadata to the model state dict's key for it. Files written
    before the fix (see [Note: names are the state dict's]) named a unit by its module path,
    which keeps wrapper parts (``_checkpoint_wrapped_module``) that the state dict drops:
    such a key is matched to the one state dict key that is the same name without them."""
    by_clean: Dict[str, List[str]] = {}
    for k in model_tree:
        by_clean.setdefault(clean_name(k), []).append(k)

    def resolve(key: str) -> str:
        if key in model_tree:
            return key
        found = by_clean.get(clean_name(key), [])
        return found[0] if len(found) == 1 else key
    return resolve


def _consecutive(prefix: str, names: Sequence[str], shapes: Sequence[Sequence[int]],
                 numels: Sequence[int]) -> List[ParamSpec]:
    params, at = [], 0
    for n, s, k in zip(names, shapes, numels):
        params.append(ParamSpec(clean_name(join_name(prefix, n)), tuple(s), at))
        at += k
    return params


def _with_pieces(params: List[ParamSpec], world: int, multiple: int) -> List[ParamSpec]:
    pieces = InterleavedLayout(tuple(torch.Size(p.shape) for p in params), world, multiple)
    return [ParamSpec(p.name, p.shape, p.offset, (o, n), p.row, p.rows) for p, o, n in
            zip(params, pieces.piece_offsets, pieces.piece_numels)]


def _stacked_shard_group(entry: ShardEntry, key: str, shard: TensorRef, world: int
                         ) -> ShardGroupSpec:
    """The spec of a stacked shard; its metadata is checked against rank 0's shard, since
    a mismatch would otherwise read the wrong rows without any error."""
    layers, kind, multiple = entry.layers, entry.layer_kind, entry.multiple
    if kind not in LAYER_KINDS:
        raise CheckpointError(f"stacked shard {key} has layer kind {kind!r}; this "
                              f"consolidation reads layers of kind {', '.join(LAYER_KINDS)}")
    if entry.stack is None:
        raise CheckpointError(f"stacked shard {key} has no stack_info entry naming its layer's "
                              f"parameters")
    names, shapes, numels = entry.stack
    orig = entry.orig_size
    if (not isinstance(layers, int) or layers < 1 or orig[:1] != (layers,)
            or math.prod(orig[1:]) != sum(numels)
            or (kind == "dim0" and (len(names) != 1 or tuple(shapes[0]) != orig[1:]))):
        raise CheckpointError(
            f"stacked shard {key}: layout {entry.layout_description} does not fit its "
            f"original size {list(orig)} and its layer's parameters {list(names)} of shapes "
            f"{[list(s) for s in shapes]}")
    prefix = clean_name(entry.unit_path)
    params: List[ParamSpec] = []
    for i in range(layers):
        one = [ParamSpec(p.name, p.shape, p.offset, None, i, layers)
               for p in _consecutive(join_name(prefix, str(i)), names, shapes, numels)]
        params += _with_pieces(one, world, multiple) if kind == "interleaved" else one
    spec = ShardGroupSpec(key, tuple(params), kind, multiple, stacked=True, layers=layers)
    expected = (layers,) + tuple(layer_layout(spec, world).shard_shape)
    if tuple(shard.shape) != expected:
        raise CheckpointError(f"{shard.file.path}: stacked shard {key} has shape "
                              f"{list(shard.shape)}; its metadata ({layers} {kind} layers at "
                              f"world size {world}) says {list(expected)}")
    return spec


def _row_numel(shards: List[TensorRef], rows: int) -> int:
    """Elements of one row of every rank's shard (the whole shard unless stacked)."""
    total = shards[0].numel
    for shard in shards:
        if shard.numel != total:
            raise CheckpointError(f"{shard.file.path}: shard {shard.key} has {shard.numel} "
                                  f"elements, rank 0's has {total}")
    return total // rows


def read_elements(shards: List[TensorRef], param: ParamSpec, start: int,
                  out: torch.Tensor) -> None:
    """Elements ``start, start + 1, ...`` of ``param`` (row-major) into the 1-D contiguous
    ``out``, read from the rank files that hold them (``shards``: every rank's shard of
    its group, or an optimizer state tensor sharded like it) and from nothing else: the
    one reading primitive of per-rank files (see the module docstring for where they are)."""
    count, numel = out.numel(), math.prod(param.shape)
    if start < 0 or start + count > numel:
        raise IndexError(f"elements [{start}, {start + count}) of {param.name}, which has "
                         f"{numel}")
    per_rank = _row_numel(shards, param.rows)
    base = param.row * per_rank
    if param.piece is None:
        # element e is element offset + e of the rank-ordered concatenation of the rows
        if param.offset + numel > per_rank * len(shards):
            where = f"row {param.row} of the shards" if param.rows > 1 else "shards"
            raise CheckpointError(f"{where} of {shards[0].key} hold {per_rank * len(shards)} "
                                  f"elements, fewer than the {param.offset + numel} the "
                                  f"metadata describes")
        first, step, at = param.offset + start, per_rank, 0
    else:
        # element e is element e % piece of rank e // piece's piece, at the same place in
        # every rank's row
        at, step = param.piece
        if at + step > per_rank or step * len(shards) < numel:
            where = "every row of shard" if param.rows > 1 else "shard"
            raise CheckpointError(f"{shards[0].file.path}: {where} {shards[0].key} has "
                                  f"{per_rank} elements; the metadata puts {param.name} at "
                                  f"[{at}, {at + step}) of every rank's")
        first = start
    for rank, shard in enumerate(shards):
        lo, hi = max(first, rank * step), min(first + count, (rank + 1) * step)
        if lo < hi:
            shard.read_elements(base + at + lo - rank * step, out[lo - first:hi - first])


def read_param(shards: List[TensorRef], param: ParamSpec) -> torch.Tensor:
    """The whole of ``param``, as a new tensor."""
    out = torch.empty(math.prod(param.shape), dtype=shards[0].dtype)
    read_elements(shards, param, 0, out)
    return out.view(param.shape)
