"""Where each full tensor of the unwrapped model lives inside the per-rank shards, and any
run of its elements read from them.

Each shard group's metadata gives its layout at the checkpoint's world size (``Layout``, the
one the training wrote it by): flat, interleaved, dim-0, or stacked layers of one of them.
Which elements of which parameter each rank's shard holds is that layout's answer
(``Layout.owned``, inverted by ``runs_by_param``), as for a live model's shards; nothing
here computes offsets of its own. A shard group torch_xla wrote (no layout recorded) is
read as a flat group whose shards have the size rank 0's has: torch_xla pads as it pleases,
always at the end, and its flattened groups and dim-0 shards concatenate in rank order as a
flat group does.

``SpreadTensor`` reads any run of a full tensor's elements from the rank files that hold it
and from nothing else; consolidation reads whole tensors through it, and the per-rank
files' source (``sources.per_rank_files``) the runs a loading rank's shards hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..files import CheckpointError, TensorRef
from ..live_model import EXTRA_STATE, is_extra_state_key
from ..formats.per_rank import LAYER_KINDS, ShardEntry
from ..formats.keys import MODEL
from ..._sharding.layout import (Dim0Layout, FlatLayout, InterleavedLayout, Layout, Owned,
                                 StackedLayout, runs_by_param)
from ..._sharding.names import SHARD_PREFIX, clean_name, join_name
from .shard_set import ShardSet


@dataclass(frozen=True)
class ParamSpec:
    name: str                       # in the unwrapped model
    shape: Tuple[int, ...]
    index: int                      # its number in the group's layout (``Layout.shapes``)


@dataclass(frozen=True)
class ShardGroupSpec:
    key: str                        # the shard's key in each rank's model state dict
    params: Tuple[ParamSpec, ...]   # stacked: layer 0's, then layer 1's, ...
    # how one layer (the whole group unless stacked) is laid out: "flat" | "interleaved" |
    # "dim0"; None if the writer did not record it (torch_xla: read as flat)
    kind: Optional[str]
    multiple: int                   # kind None: the elements of rank 0's shard
    world_size: int                 # the checkpoint's
    stacked: bool = False
    layers: int = 1

    @property
    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def layout(self, world_size: int) -> Layout:
        """How the group is sharded at ``world_size``: what ``save_sharded`` of the same model
        at that world size writes (its parameters are numbered as ``params``)."""
        shapes = tuple(torch.Size(p.shape) for p in self.params[:len(self.params) // self.layers])
        if self.kind == "dim0":
            layer: Any = Dim0Layout(shapes[0], world_size)
        elif self.kind == "interleaved":
            layer = InterleavedLayout(shapes, world_size, self.multiple)
        else:
            layer = FlatLayout(shapes, world_size, self.multiple)
        return StackedLayout(layer, self.layers) if self.stacked else layer

    @cached_property
    def saved(self) -> Layout:
        """The layout of the checkpoint's shards."""
        return self.layout(self.world_size)

    @cached_property
    def runs(self) -> List[List[Tuple[int, Owned]]]:
        """Each parameter's (rank, run) in the checkpoint's shards."""
        return runs_by_param(self.saved)


@dataclass
class ModelPlan:
    shard_groups: List[ShardGroupSpec]
    buffers: Dict[str, str]               # state dict key -> unwrapped name
    buffer_dtypes: Dict[str, torch.dtype]  # state dict key -> dtype to restore
    aliases: List[Tuple[str, str]]        # (alias, source) unwrapped names of tied parameters
    param_order: List[str]                # unwrapped names in parameters() order
    # unwrapped names of parameters whose shards no rank file holds (see [Note: shards
    # left out of every rank file])
    left_out: List[str] = field(default_factory=list)

    def spec_of(self) -> Dict[str, ShardGroupSpec]:
        """{shard key: its spec}."""
        return {g.key: g for g in self.shard_groups}


def plan_model(shards: ShardSet) -> ModelPlan:
    """The plan of ``shards``' rank files (opened and checked), by their shard metadata.

    [Note: shards left out of every rank file]
    A caller may save part of each rank's state dict: Lightning Fabric's ``save(...,
    filter=)`` keeps the keys its filter accepts (only the adapters, only the weights), the
    same on every rank, while the shard metadata still describes every shard. A shard no
    rank file holds was left out on purpose: its parameters are left out of the plan and
    named (``ModelPlan.left_out``), and a consolidation warns and writes the others. A shard
    some rank files hold and others do not is a damaged checkpoint: refused, naming a file
    without it; so are files that hold no shard at all, whose keys are not the model's."""
    specs: List[ShardGroupSpec] = []
    left_out: List[str] = []
    metadata, files = shards.metadata, shards.files
    world = metadata.world_size
    trees = [f.tree[MODEL] for f in files]
    model_tree = trees[0]
    _refuse_objects_as_extra_state(model_tree)
    saved_key = saved_keys(model_tree)
    for entry in metadata.entries():
        key = saved_key(entry.key)
        holders = [key in t for t in trees]
        if not all(holders) and any(holders):
            raise CheckpointError(
                f"{files[holders.index(False)].path} holds no shard {key}, which "
                f"{files[holders.index(True)].path} holds: a checkpoint's rank files hold "
                f"the same shards")
        shard = model_tree.get(key)
        if entry.kind == "stacked":
            spec = _stacked_shard_group(entry, key, shard, world)
        else:
            spec = _layer_group(entry, key, shard, world)
        if shard is None:
            left_out += [p.name for p in spec.params]
        else:
            specs.append(spec)
    if left_out and not specs:   # nothing left in: renamed keys, not a filter
        raise CheckpointError(
            f"no shard in the shard metadata is in the model state dict (the first: "
            f"{saved_key(metadata.entries()[0].key)}): its keys are not the wrapped "
            f"model's own (a torch.compile'd model's state dict adds '_orig_mod.'; save "
            f"the FSDP model's state_dict())")
    shard_keys = {g.key for g in specs}
    # a shard under a second key (its unit also kept as an attribute) is not a buffer
    buffers = {k: clean_name(k) for k, v in model_tree.items()
               if k not in shard_keys and isinstance(v, TensorRef)
               and not k.rpartition(".")[2].startswith(SHARD_PREFIX)}
    # ``buffer_info`` names a buffer as the unwrapped model does (``persistent_buffers``),
    # not by its key in the file, which keeps the wrapper's ``_fsdp_wrapped_module.``
    restore = metadata.buffer_dtypes()
    buffer_dtypes = {k: restore[name] for k, name in buffers.items() if name in restore}
    order = metadata.parameter_order() or [p.name for g in specs for p in g.params]
    gone = set(left_out)
    return ModelPlan(specs, buffers, buffer_dtypes,
                     [(a, s) for a, s in metadata.tied_aliases() if s not in gone],
                     [n for n in order if n not in gone], left_out)


def _layer_group(entry: ShardEntry, key: str, shard: Optional[TensorRef], world: int
                 ) -> ShardGroupSpec:
    """The spec of a shard that is not stacked."""
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
        params = _numbered(clean_name(entry.unit_path), *entry.members[:2])
    else:
        params = [ParamSpec(clean_name(join_name(entry.unit_path, entry.orig_name)),
                            entry.orig_size, 0)]
    multiple = entry.multiple if entry.kind or shard is None else max(shard.numel, 1)
    return _checked(ShardGroupSpec(key, tuple(params), entry.kind, multiple, world), shard)


def _refuse_objects_as_extra_state(model_tree: Dict[str, Any]) -> None:
    """A module's extra state that is a tensor is carried as a buffer is, rank 0's; any other
    object would be dropped by every output but per-rank files, so it is refused, naming the
    modules (see [Note: modules' extra state])."""
    holders = [clean_name(k[:-len(EXTRA_STATE)].rstrip(".")) or "the root module"
               for k, v in model_tree.items()
               if is_extra_state_key(k) and not isinstance(v, TensorRef)]
    if holders:
        raise CheckpointError(
            f"{holders[:5]} keep extra state (get_extra_state) that is not a tensor in these "
            f"per-rank files, which a consolidation cannot carry: only load_sharded, at the "
            f"world size and wrapping that saved them, puts it back")


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


def _numbered(prefix: str, names: Sequence[str], shapes: Sequence[Sequence[int]],
             first: int = 0) -> List[ParamSpec]:
    """The parameters ``names`` under ``prefix``, numbered in the layout from ``first``."""
    return [ParamSpec(clean_name(join_name(prefix, n)), tuple(s), first + i)
            for i, (n, s) in enumerate(zip(names, shapes))]


def _checked(spec: ShardGroupSpec, shard: Optional[TensorRef]) -> ShardGroupSpec:
    """``spec``, once rank 0's shard (if the files hold it) has the shape its layout gives (a
    mismatch would otherwise read the wrong elements without any error)."""
    expected = tuple(spec.saved.shard_shape)
    if spec.kind is not None and shard is not None and tuple(shard.shape) != expected:
        what = f"{spec.layers} {spec.kind} layers" if spec.stacked else spec.kind
        raise CheckpointError(f"{shard.file.path}: {'stacked ' if spec.stacked else ''}shard "
                              f"{spec.key} has shape {list(shard.shape)}; its metadata ({what} "
                              f"at world size {spec.world_size}) says {list(expected)}")
    return spec


def _stacked_shard_group(entry: ShardEntry, key: str, shard: Optional[TensorRef],
                         world: int) -> ShardGroupSpec:
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
        params += _numbered(join_name(prefix, str(i)), names, shapes, i * len(names))
    return _checked(ShardGroupSpec(key, tuple(params), kind, multiple, world, stacked=True,
                                   layers=layers), shard)


class SpreadTensor:
    """A full tensor of the unwrapped model whose elements are spread over every rank's
    shard of its group (``shards``, in rank order): a parameter, or optimizer state
    sharded like it. Read by runs (``read_elements``) or whole (``read``)."""

    def __init__(self, shards: List[TensorRef], spec: ShardGroupSpec, param: ParamSpec) -> None:
        self.shards, self.spec, self.param = shards, spec, param
        self.dtype: torch.dtype = shards[0].dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.param.shape)

    def read_elements(self, start: int, out: torch.Tensor) -> None:
        """Elements ``start, start + 1, ...`` (row-major) into the 1-D contiguous ``out``,
        read from the runs of the rank files that hold them and from nothing else."""
        count, numel = out.numel(), math.prod(self.param.shape)
        if start < 0 or start + count > numel:
            raise IndexError(f"elements [{start}, {start + count}) of {self.param.name}, "
                             f"which has {numel}")
        size = math.prod(self.spec.saved.shard_shape)
        for shard in self.shards:
            if shard.numel != size:
                raise CheckpointError(f"{shard.file.path}: shard {shard.key} has {shard.numel} "
                                      f"elements, where its group's layout has {size}")
        for rank, run in self.spec.runs[self.param.index]:
            lo, hi = max(start, run.start), min(start + count, run.end)
            if lo < hi:
                self.shards[rank].read_elements(run.shard_offset + lo - run.start,
                                                out[lo - start:hi - start])

    def read(self) -> torch.Tensor:
        """The whole tensor, as a new one."""
        out = torch.empty(math.prod(self.param.shape), dtype=self.dtype)
        self.read_elements(0, out)
        return out.view(self.param.shape)


class _Restored:
    """A buffer saved in the dtype it was placed in, read in the dtype the model restores it
    to (``buffer_info``): what a consolidated checkpoint holds."""

    def __init__(self, ref: TensorRef, dtype: torch.dtype) -> None:
        self.ref, self.dtype = ref, dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.ref.shape)

    def read_elements(self, start: int, out: torch.Tensor) -> None:
        saved = torch.empty(out.numel(), dtype=self.ref.dtype)
        self.ref.read_elements(start, saved)
        out.copy_(saved)

    def read(self) -> torch.Tensor:
        return self.ref.read().to(self.dtype)


def unwrapped_tensors(plan: ModelPlan, files: Sequence[Any]) -> Dict[str, Any]:
    """The unwrapped model's state dict as the rank files hold it, aliases aside: each
    parameter, in its order, as a ``SpreadTensor``, then each buffer as rank 0's file holds
    it, read in the dtype the model restores it to. Each is read by runs or whole."""
    by_name = {p.name: (g, p) for g in plan.shard_groups for p in g.params}
    known = set(plan.param_order)
    out: Dict[str, Any] = {}
    for name in plan.param_order + [n for n in by_name if n not in known]:
        spec, param = by_name[name]
        out[name] = SpreadTensor([f.tree[MODEL][spec.key] for f in files], spec, param)
    for key, name in plan.buffers.items():
        ref = files[0].tree[MODEL][key]
        out[name] = _Restored(ref, plan.buffer_dtypes[key]) if key in plan.buffer_dtypes else ref
    return out
