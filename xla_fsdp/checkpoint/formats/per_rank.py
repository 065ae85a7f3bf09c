"""The per-rank checkpoint format: its keys, the shard metadata (made by ``shard_metadata``,
read through ``ShardMetadata``) and our record (``RankRecord``). The savers and the offline
tools build a file's tree from these; none reads the metadata's raw keys but here.

A per-rank file is torch_xla's ``{'model', 'shard_metadata', 'optimizer'}`` plus, when we
wrote it, our record (``RankRecord``, under ``'xla_fsdp'``) and the caller's ``'extra'``.
The shard metadata is torch_xla's ``get_shard_metadata()`` format plus what resharding and
optimizer consolidation need (torch_xla's consolidation ignores the extra keys):

* ``shard_info``: {unit path: {shard name: {"_orig_size", "_orig_name"}}} (torch_xla's);
* ``flatten_info``: {wrapped name of a flat shard: (names, shapes, numels)} (torch_xla's);
* ``interleave_info``: ``flatten_info``'s entries for interleaved groups (every flattened
  group of ours), kept out of ``flatten_info`` because torch_xla's consolidation would
  read them as one flat tensor cut into shards and silently scramble them. It fails on
  the missing entry instead;
* ``layout_info``: {unit path: {shard name: {"kind": "flat" | "interleaved" | "dim0" |
  "stacked", "multiple": m, and for "stacked" "layers" and "layer_kind"}}};
* ``stack_info``: for each group of scanned layers (``StackedLayout``), one layer's
  parameter names (relative to the layer), shapes and sizes; layer ``i``'s are named
  ``<unit path>.<i>.<name>``, and a rank's shard is its layer shards stacked;
* ``buffer_info``: {buffer key: {"_orig_dtype"}} for buffers placed in another dtype;
* ``shared_info``: {unit path: [(alias, source)]} for tied parameters;
* ``param_order``: the unwrapped model's parameter names in ``parameters()`` order;
* ``update_count``: optimizer steps and loads the shards have had, equal on every rank
  at the same point of training, so that consolidation can tell a file left from an
  earlier save from one of the save it is reading;
* ``world_size``, ``rank``.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from ..._sharding.layout import Dim0Layout, InterleavedLayout, Layout, StackedLayout
from ..._sharding.names import join_name
from ..._unit.buffers import original_dtype
from ..live_model import (parameter_order, persistent_buffers, tied_aliases, unit_aliases,
                          units_by_saved_path)
from .keys import EXTRA, MODEL, OPTIMIZER
from ..unit_protocol import ShardedUnit

# the keys of a per-rank file beside MODEL, OPTIMIZER and EXTRA (``keys``)
SHARD_METADATA, RECORD = "shard_metadata", "xla_fsdp"
REPLICA_EXTRAS = "replica_extras"   # {replica group: extra} (see [Note: each replica's extra])
FORMAT_VERSION = 1
LAYER_KINDS = ("flat", "interleaved", "dim0")  # how one layer (or an unstacked group) is cut
MemberTable = Tuple[List[str], List[List[int]], List[int]]  # names, shapes, numels


def sharded_checkpoint_path(prefix: str, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` writes a checkpoint saved under ``prefix``."""
    return f"{prefix}_rank-{rank:08d}-of-{world_size:08d}.pth"


RANK_FILES = "_rank-*-of-*.pth"  # the glob that completes a prefix to every rank's file
RANK_TAIL = re.compile(r"_rank-\d+-of-(\d+)\.pth$")  # the same, ending a name; its world size


def other_world_files(prefix: str, world_size: int) -> List[str]:
    """The per-rank files under ``prefix`` of a world size other than ``world_size``: what
    an earlier save at another size left, which no load may mix with this size's."""
    directory, base = os.path.split(prefix)
    try:
        names = os.listdir(directory or ".")
    except FileNotFoundError:
        return []
    return sorted(os.path.join(directory, n) for n in names
                  if (m := RANK_TAIL.search(n)) and n[:m.start()] == base
                  and int(m.group(1)) != world_size)


# -- writing ----------------------------------------------------------------------------------
def shard_metadata(root: nn.Module, units: Iterable[Tuple[str, ShardedUnit]], world_size: int,
                   rank: int, sharding_group: Optional[Tuple[int, bool]] = None
                   ) -> Dict[str, Any]:
    """This rank's shard metadata (see the module docstring); ``sharding_group`` is the
    index of this rank's group and whether the groups are replicas, under
    ``sharding_groups`` (see [Note: files of several sharding groups])."""
    units = units_by_saved_path(root, units)
    shard_info, flatten_info, layout_info = {}, {}, {}
    interleave_info, stack_info = {}, {}
    for path, unit in units:
        shard_groups = unit.shard_groups
        shard_info[path] = {
            g.shard_name: {"_orig_size": g.orig_size, "_orig_name": g.orig_name}
            for g in shard_groups}
        layout_info[path] = {g.shard_name: _layout_entry(g.layout) for g in shard_groups}
        for g in shard_groups:
            key = join_name(path, g.orig_name)
            if isinstance(g.layout, StackedLayout):
                layer = g.layout.layer
                names = [n.split(".", 1)[1] for n in g.names[:len(layer.shapes)]]
                stack_info[key] = (names, list(layer.shapes), [math.prod(s) for s in layer.shapes])
            elif unit.flatten_parameters and not isinstance(g.layout, Dim0Layout):
                info = interleave_info if isinstance(g.layout, InterleavedLayout) else flatten_info
                info[key] = (list(g.names), list(g.layout.shapes), list(g.layout.numels))
    shared_info = unit_aliases(root, units)
    buffer_info = {name: {"_orig_dtype": original_dtype(buf)}
                   for name, buf in persistent_buffers(root)
                   if original_dtype(buf) != buf.dtype}
    return {"shard_info": shard_info, "flatten_info": flatten_info,
            "interleave_info": interleave_info, "buffer_info": buffer_info,
            "shared_info": shared_info, "layout_info": layout_info, "stack_info": stack_info,
            "param_order": parameter_order(root, units),
            "update_count": sum(g.updates for _, unit in units for g in unit.shard_groups),
            "world_size": world_size, "rank": rank,
            **({} if sharding_group is None else
               {"sharding_group": sharding_group[0], "replica": sharding_group[1]})}


def _layout_entry(layout: Layout) -> Dict[str, Any]:
    if isinstance(layout, StackedLayout):
        layer = _layout_entry(layout.layer)
        return {"kind": "stacked", "multiple": layer["multiple"], "layers": layout.layers,
                "layer_kind": layer["kind"]}
    if isinstance(layout, Dim0Layout):
        return {"kind": "dim0", "multiple": 1}
    kind = "interleaved" if isinstance(layout, InterleavedLayout) else "flat"
    return {"kind": kind, "multiple": layout.multiple}


def wrapping_fingerprint(metadata: Dict[str, Any]) -> str:
    """Identifies how a model was sharded (names, shapes, layouts, world size), not the
    values nor the rank: files of one checkpoint share it, and a model wrapped the same
    way at the same world size computes the same one."""
    keys = ("shard_info", "flatten_info", "interleave_info", "shared_info", "layout_info",
            "stack_info", "world_size")
    canonical = json.dumps({k: metadata.get(k) for k in keys}, sort_keys=True, default=_jsonable)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    return list(value) if hasattr(value, "__iter__") else str(value)  # torch.Size


@dataclass(frozen=True)
class RankRecord:
    """Our record in a per-rank file: what ties its files together and what torch_xla's
    format leaves out."""
    format: int
    world_size: int
    rank: int
    fingerprint: str                          # wrapping_fingerprint of the shard metadata
    save_index: int                           # the model's saves so far; equal across a save
    optimizer_param_keys: Optional[List[str]]  # model state dict key of each optimizer index
    # drawn by rank 0 for each save, the same in all its files: two runs' saves with the same
    # counters (one resumed from the other and saving to the same prefix) differ here
    save_id: Optional[str] = None

    @staticmethod
    def of(tree: Any) -> Optional["RankRecord"]:
        """The record of a per-rank file's tree, or None for a file we did not write."""
        raw = tree.get(RECORD) if isinstance(tree, dict) else None
        if not raw:
            return None
        return RankRecord(raw.get("format", FORMAT_VERSION), raw["world_size"], raw["rank"],
                          raw["fingerprint"], raw.get("save_index"),
                          raw.get("optimizer_param_keys"), raw.get("save_id"))


def rank_file_tree(model: Dict[str, Any], metadata: Dict[str, Any], record: RankRecord,
                   optimizer: Optional[Dict[str, Any]] = None, extra: Any = None,
                   replica_extras: Optional[Dict[int, Any]] = None) -> Dict[str, Any]:
    """A per-rank file's tree: torch_xla's keys and our record, and the optimizer's state
    dict, ``extra`` and the replicas' own extras when there are any."""
    optional = {OPTIMIZER: optimizer, EXTRA: extra, REPLICA_EXTRAS: replica_extras or None}
    return {MODEL: model, SHARD_METADATA: metadata, RECORD: asdict(record),
            **{k: v for k, v in optional.items() if v is not None}}


# -- reading ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardEntry:
    """One shard group as the shard metadata describes it."""
    unit_path: str                   # the unit's path in the wrapped model, "" for the root
    shard_name: str                  # where the unit registers the shard
    orig_name: str                   # torch_xla's name for the shard, relative to the unit
    orig_size: Tuple[int, ...]
    kind: Optional[str]              # LAYER_KINDS, "stacked", or None if not recorded
    multiple: int
    layers: Any                      # stacked: the number of layers, as recorded
    layer_kind: Optional[str]        # stacked: how each layer is cut
    members: Optional[MemberTable]   # flattened: its parameters, relative to the unit
    stack: Optional[MemberTable]     # stacked: one layer's parameters, relative to a layer
    has_stack_entry: bool            # a stack_info entry exists, whatever the kind says

    @property
    def key(self) -> str:
        """The shard's key in the rank's model state dict."""
        return join_name(self.unit_path, self.shard_name)

    @property
    def layout_description(self) -> Dict[str, Any]:
        return {"kind": self.kind, "multiple": self.multiple, "layers": self.layers,
                "layer_kind": self.layer_kind}


class ShardMetadata:
    """A rank's shard metadata, read: every consumer of the format goes through this."""

    def __init__(self, raw: Dict[str, Any]) -> None:
        self.raw = raw

    # read when asked, not at construction: ``consolidate_state_dicts`` takes metadata
    # without a rank (it stamps each file's own)
    @property
    def world_size(self) -> int:
        return self.raw["world_size"]

    @property
    def rank(self) -> int:
        return self.raw["rank"]

    @property
    def update_count(self) -> Optional[int]:
        return self.raw.get("update_count")

    @property
    def has_layouts(self) -> bool:
        """Whether the writer recorded how each shard is laid out (xla_fsdp did)."""
        return bool(self.raw.get("layout_info"))

    @property
    def sharding_group(self) -> Optional[Tuple[int, bool]]:
        """The writer's sharding group and whether groups are replicas; None if unknown."""
        if "sharding_group" not in self.raw:
            return None
        return self.raw["sharding_group"], bool(self.raw["replica"])

    def entries(self) -> List[ShardEntry]:
        raw = self.raw
        flat = {**raw.get("flatten_info", {}), **raw.get("interleave_info", {})}
        stacks = raw.get("stack_info") or {}
        layouts = raw.get("layout_info", {})
        out = []
        for path, shards in raw["shard_info"].items():
            for shard_name, info in shards.items():
                wrapped = join_name(path, info["_orig_name"])
                layout = layouts.get(path, {}).get(shard_name, {})
                out.append(ShardEntry(
                    path, shard_name, info["_orig_name"], tuple(info["_orig_size"]),
                    layout.get("kind"), layout.get("multiple", 1), layout.get("layers"),
                    layout.get("layer_kind"), flat.get(wrapped), stacks.get(wrapped),
                    wrapped in stacks))
        return out

    def buffer_dtypes(self) -> Dict[str, torch.dtype]:
        """{buffer key: the dtype to restore}, for buffers placed in another dtype."""
        return {k: v["_orig_dtype"] for k, v in self.raw.get("buffer_info", {}).items()}

    def tied_aliases(self) -> List[Tuple[str, str]]:
        return tied_aliases(self.raw.get("shared_info", {}).items())

    def parameter_order(self) -> Optional[List[str]]:
        return self.raw.get("param_order") or None

    def fingerprint(self) -> str:
        return wrapping_fingerprint(self.raw)

    def for_rank(self, world_size: int, rank: int) -> Dict[str, Any]:
        """The same metadata as another rank of another world size writes it."""
        out = copy.deepcopy(self.raw)
        out["world_size"], out["rank"] = world_size, rank
        out.pop("sharding_group", None)   # the new files are one group's
        out.pop("replica", None)
        return out
