"""What every checkpoint reads of a live wrapped model beyond its units (``unit_protocol``): the
unwrapped model's names (``unwrapped_name``, a unit's path as its shards are saved under,
``units_by_saved_path``), its persistent buffers, modules' extra state and tied aliases, and the
refusals every save of the unwrapped model applies before reading it (writes lost to a freed
placeholder, extra state that is not a tensor), the check that a call is given the root,
where the root's sharding group keeps a checkpoint, and where each parameter lives in this
rank's shards (``param_slots``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from .._sharding.chunks import Chunk, run_chunks
from .._sharding.names import GROUP_PREFIX, WRAPPER_PARTS, clean_name, join_name
from .._unit.param_record import ParamRecord
from .._unit.shard_group import ShardGroup
from .._xla.private_api import is_persistent_buffer
from .coordination import digest, exchange
from .files import CheckpointError
from .unit_protocol import ShardedModel, ShardedUnit


# -- names ------------------------------------------------------------------------------------
# [Note: names are the state dict's]
# Every name we write must be the one ``state_dict()`` uses, whatever sits between the root
# and a unit or inside one. Wrappers change names in two ways: torch's checkpoint wrapper
# drops its ``_checkpoint_wrapped_module`` from state dict keys with a hook, while
# ``torch.compile``'s ``_orig_mod`` and PEFT's ``base_model.model`` stay in them. So a unit's
# path in a per-rank file (the prefix of its shards' keys) is read off the root's
# ``state_dict(keep_vars=True)`` by the shards' identity, not built from module paths, which
# also sees wrappers applied after wrapping (activation checkpointing usually is). Names in
# the unwrapped model are ``unwrapped_name`` of a path and a name inside the unit: the
# wrapper parts ``state_dict()`` drops (ours, torch_xla's, the checkpoint wrapper's) are
# dropped at every depth, the others kept.
def unwrapped_name(path: str, name: str = "") -> str:
    """The unwrapped model's name of ``name`` (relative to the module at ``path``)."""
    return clean_name(join_name(path, name))


def _keys_by_tensor(root: nn.Module) -> Dict[int, List[str]]:
    keys_of: Dict[int, List[str]] = {}
    for k, v in root.state_dict(keep_vars=True).items():
        keys_of.setdefault(id(v), []).append(k)
    return keys_of


def units_by_saved_path(root: nn.Module, units: Iterable[Tuple[str, ShardedUnit]],
                        keys_of: Optional[Dict[int, List[str]]] = None
                        ) -> List[Tuple[str, ShardedUnit]]:
    """``units`` (path, unit) with each path as the prefix of its shards' keys in
    ``root.state_dict()`` (see [Note: names are the state dict's]; ``keys_of``: its keys by
    tensor, if taken already). A unit kept under two paths has its shards in the state dict
    twice: the key under its own path (where ``named_units`` puts it) is the one, else the
    first."""
    keys_of = _keys_by_tensor(root) if keys_of is None else keys_of
    out = []
    for path, unit in units:
        for g in unit.shard_groups:
            keys = keys_of.get(id(g.shard), [])
            key = join_name(path, g.shard_name)
            key = key if key in keys else (keys[0] if keys else "")
            if key == g.shard_name or key.endswith("." + g.shard_name):
                path = key[:-len(g.shard_name)].rstrip(".")
                break
        out.append((path, unit))
    return out


def other_paths(root: nn.Module, units: Iterable[Tuple[str, ShardedUnit]]
                ) -> Dict[int, List[str]]:
    """[Note: a unit under several paths]
    A module registered at several places (``nn.ModuleList([block] * 3)``, ALBERT's shared
    layers) is one unit, at the first of its paths (``named_units``), while the unwrapped
    model's ``state_dict()`` names its parameters under every path, as it names a tied
    parameter under each of its names. So every name a unit's parameters have is its own
    path's and each other path's: the loader accepts them all (``param_slots``), and the
    consolidated outputs and the per-rank files' ``shared_info`` hold them as aliases of the
    first (``unit_aliases``). The other paths are read off ``root.state_dict()``, by where
    the unit's first shard is saved again (see [Note: names are the state dict's]), inside
    the root's wrapped module only: a unit kept as an attribute of the root wrapper (a
    handle set after wrapping) is not in the unwrapped model, nor is a grouping unit, whose
    parameters are named as its members are, wherever a handle on it is kept.

    By id of the unit: its other paths, for the units of ``units`` that have some."""
    keys_of = _keys_by_tensor(root)
    out: Dict[int, List[str]] = {}
    for path, unit in units_by_saved_path(root, units, keys_of):
        if not unit.shard_groups or path.rpartition(".")[2].startswith(GROUP_PREFIX):
            continue
        g = unit.shard_groups[0]
        others = [k[:-len(g.shard_name)].rstrip(".") for k in keys_of.get(id(g.shard), [])
                  if k != join_name(path, g.shard_name) and k.split(".")[0] in WRAPPER_PARTS]
        if others:
            out[id(unit)] = others
    return out


def unit_aliases(root: nn.Module, units: List[Tuple[str, ShardedUnit]]
                 ) -> Dict[str, List[Tuple[str, str]]]:
    """{unit path: its (alias, source) pairs, relative to that path} for the ``units`` with
    tied parameters, the pairs of the units kept under several paths under "" by their full
    names (see [Note: a unit under several paths]): what ``tied_aliases`` reads, of a live
    model or as ``shared_info`` holds it."""
    out: Dict[str, List[Tuple[str, str]]] = {
        path: list(unit.shared_params) for path, unit in units if unit.shared_params}
    others = other_paths(root, units)
    elsewhere = [(unwrapped_name(q, n), unwrapped_name(path, r.names[0]))
                 for path, unit in units for q in others.get(id(unit), [])
                 for g in unit.shard_groups for r in g.records for n in r.names]
    if elsewhere:
        out[""] = out.get("", []) + elsewhere
    return out


def shard_keys(root: ShardedModel) -> Dict[int, str]:
    """Each shard's state dict key (by the shard's id), as ``units_by_saved_path`` finds it:
    the names of a model's shards in every checkpoint of ours."""
    return {id(g.shard): join_name(saved, g.shard_name)
            for saved, unit in units_by_saved_path(root, root.named_units())
            for g in unit.shard_groups}


# -- what every save reads, and refuses --------------------------------------------------------
def tied_aliases(shared: Iterable[Tuple[str, Iterable[Tuple[str, str]]]]
                 ) -> List[Tuple[str, str]]:
    """(alias, source) names in the unwrapped model of tied parameters, from each unit's
    path and its (alias, source) pairs: a live model's units or ``shared_info``."""
    return [(unwrapped_name(path, a), unwrapped_name(path, s))
            for path, pairs in shared for a, s in pairs]


def refuse_lost_writes(root: ShardedModel) -> None:
    """Refuses to save shards that lack a write made through a module attribute while its
    unit was sharded (see [Note: writes to a freed placeholder]): ``model.apply(init)``
    after wrapping, then a checkpoint before any forward."""
    for _, unit in root.named_units():
        for g in unit.shard_groups:
            ParamRecord.refuse_lost_writes(g.records)


EXTRA_STATE = "_extra_state"   # torch's state dict key for a module's get_extra_state()


def is_extra_state_key(key: str) -> bool:
    """Whether a state dict ``key`` holds a module's extra state."""
    return key.rsplit(".", 1)[-1] == EXTRA_STATE


def extra_state_holders(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(key in the unwrapped model's state dict, module) of every module that keeps extra
    state (see [Note: modules' extra state])."""
    return [(unwrapped_name(path, EXTRA_STATE), m)
            for path, m in root.named_modules(remove_duplicate=False)
            if type(m).get_extra_state is not nn.Module.get_extra_state]


def extra_state_tensors(root: nn.Module, what: str) -> List[Tuple[str, torch.Tensor]]:
    """[Note: modules' extra state] A module may keep state of its own in ``state_dict()``
    beside its parameters and buffers (``get_extra_state``/``set_extra_state``, under
    ``<module>._extra_state``): TransformerEngine keeps its FP8 scaling metadata so, as a
    uint8 tensor. Every checkpoint carries extra state that is a tensor as it carries a
    buffer: every rank holds it whole, the one saved is the first rank's (torch_xla's
    consolidation keeps rank 0's too), and a load gives the stored tensor, in its stored
    shape (a serialized state may change length), to ``set_extra_state`` on every rank, at any
    world size. A load also puts back extra state stored as an object, where a format holds
    one (DCP, ``.pth``, a state dict in memory). The per-rank files keep any extra state, and
    their own-file load puts it back through torch's ``load_state_dict()``. Any other save
    refuses extra state that is not a tensor, naming the modules, rather than drop it: the
    safetensors and Hugging Face formats hold tensors only, and the per-rank files'
    consolidation (``per_rank.plan.plan_model``) can carry no object it cannot check alike on
    every rank. Returns (key, this rank's tensor, on the host) for ``what`` to save."""
    found, refused = [], []
    for key, module in extra_state_holders(root):
        value = module.get_extra_state()
        if torch.is_tensor(value):
            found.append((key, value.detach().to("cpu", copy=True)))
        else:
            refused.append(key[:-len(EXTRA_STATE)].rstrip(".") or
                           f"the root {type(module).__name__}")
    if refused:
        raise CheckpointError(
            f"{what}: {refused[:5]} keep extra state (get_extra_state) that is not a tensor, "
            f"which this checkpoint of the unwrapped model cannot hold "
            f"(see [Note: modules' extra state]); save_sharded keeps it, and load_sharded puts "
            f"it back at the same world size and wrapping")
    return found


def persistent_buffers(root: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """(name in the unwrapped model, buffer) for every buffer ``state_dict()`` holds: the
    persistent ones, under every name a shared module gives them."""
    return [(unwrapped_name(path, name), buf)
            for path, m in root.named_modules(remove_duplicate=False)
            for name, buf in m.named_buffers(recurse=False, remove_duplicate=False)
            if is_persistent_buffer(m, name)]


def original_names_and_shards(units: Iterable[Tuple[str, ShardedUnit]]
                              ) -> List[Tuple[str, nn.Parameter]]:
    """(name in the unwrapped model, shard) for every shard group of every unit.

    A flattened group is named ``<unit path>.flat_param_<i>``."""
    return [(unwrapped_name(path, g.orig_name), g.shard)
            for path, unit in units for g in unit.shard_groups]


# -- the root, and where its sharding group keeps a checkpoint ---------------------------------
def require_root(model: Any, what: str) -> ShardedModel:
    """``model`` if it is an idle root unit; ``what`` (saving, loading) concerns the whole
    model, and a nested unit would cover only part of it."""
    if not isinstance(model, ShardedModel):
        raise TypeError(f"{what} takes the root XlaFullyShardedDataParallel unit, got "
                        f"{type(model).__name__}")
    model.check_root_call(what)
    return model


def sharding_group_index(model: ShardedModel) -> Optional[int]:
    """This rank's sharding group, or None without ``sharding_groups``."""
    import torch_xla.runtime as xr
    sharding = model.options.sharding_groups
    if sharding is None:
        return None
    return next(i for i, g in enumerate(sharding) if xr.global_ordinal() in g)


_FILE_EXTENSIONS = (".pth", ".pt", ".bin", ".safetensors")


def sharding_group_path(path: str, model: ShardedModel, is_prefix: bool = False
                        ) -> Tuple[str, bool]:
    """Where this rank's sharding group keeps a checkpoint named ``path``, and whether the
    groups are independent. Independent ``sharding_groups`` (parts of a model-parallel
    model) each have one of their own (``out/dcp_group-001``, ``out/ck_group-001.pth``, or
    for the ``is_prefix`` of per-rank files ``out/ck_group-001``); replicas
    (``replicate_across_groups``) share the first group's, which it writes."""
    index = sharding_group_index(model)
    if index is None or model.options.replicate_across_groups:
        return path, False
    stem, ext = os.path.splitext(path)
    if is_prefix or ext not in _FILE_EXTENSIONS:
        stem, ext = path, ""
    return f"{stem}_group-{index:03d}{ext}", True


def sharding_group_load_path(path: str, model: ShardedModel, present: Callable[[str], bool],
                             is_prefix: bool = False) -> str:
    """``sharding_group_path`` for a load; refuses, naming both paths, a checkpoint that
    ``present`` finds at ``path`` but not at the group's path: one saved without independent
    groups, loaded into a model with them (otherwise reported as missing at a path the
    user never gave)."""
    grouped, independent = sharding_group_path(path, model, is_prefix)
    if independent and not present(grouped) and present(path):
        raise CheckpointError(
            f"{path} was saved without independent sharding_groups, and this model has them: "
            f"each group loads its own checkpoint ({grouped}). To start the groups' models "
            f"from it, load its full state with load_full_state_dict")
    return grouped


def writes_sharding_group_copy(model: ShardedModel) -> bool:
    """Whether this rank's sharding group writes its checkpoint: every independent group,
    and the first of replicas (or the only group)."""
    return sharding_group_path("", model)[1] or not sharding_group_index(model)


def replica_index(model: ShardedModel) -> int:
    """This rank's replica group under ``replicate_across_groups``; 0 otherwise."""
    index = sharding_group_index(model)
    return index if index is not None and model.options.replicate_across_groups else 0


def extras_of_replicas(model: ShardedModel, extra: Any) -> Dict[int, Any]:
    """[Note: each replica's extra]
    Replicas (``replicate_across_groups``) hold the same shards, so only the first group
    writes; but their ranks see other data, and a training loop's ``extra`` (a data
    position, an RNG state) differs between them. The first group's rank then writes the
    extras of its replicas in the other groups beside its own, by group, when any differs
    from its own, and each replica's rank gets its own back (``replica_extra_key``, and
    the per-rank files' ``REPLICA_EXTRAS``); before, every group got the first group's,
    silently. Every rank calls this with its ``extra`` copied to the host; returns, on a
    rank of the first group, its replicas' extras that differ from its own."""
    if not (model.options.replicate_across_groups and model.options.sharding_groups):
        return {}
    index, rank = replica_index(model), model.rank
    digests = exchange("xla_fsdp.extra.replica_digests", (index, rank, digest(extra)))
    first = {r: d for g, r, d in digests if g == 0}
    if all(d == first[r] for _, r, d in digests):
        return {}
    extras = exchange("xla_fsdp.extra.replicas", (index, rank, extra))
    return {} if index else {g: e for g, r, e in extras if r == rank and g != 0}


def parameter_order(root: nn.Module, units: List[Tuple[str, ShardedUnit]]) -> List[str]:
    """The unwrapped model's parameter names, ``units`` as ``units_by_saved_path`` gives them,
    in the order ``parameters()`` of the unwrapped model yields them: modules in
    pre-order, each module's own parameters in registration order (as each unit found
    them, before grouping)."""
    module_rank: Dict[str, int] = {}
    for path, _ in root.named_modules():
        module_rank.setdefault(unwrapped_name(path), len(module_rank))
    keyed = []
    for path, unit in units:
        for position, name in enumerate(unit.param_order):
            full = unwrapped_name(path, name)
            keyed.append(((module_rank[full.rpartition(".")[0]], position), full))
    return [name for _, name in sorted(keyed)]


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of the unwrapped model, as a rank holds it."""
    names: Tuple[str, ...]        # every name it has; the first is get_state_dict's
    shape: torch.Size
    shard_group: ShardGroup
    pieces: Tuple[Tuple[Chunk, int], ...]  # this rank's chunks, each with where it starts
                                           # in the shard group's shard, flattened

    @property
    def name(self) -> str:
        return self.names[0]


def param_slots(root: ShardedModel) -> List[ParamSlot]:
    """Every parameter of the model, with this rank's chunks of it."""
    out = []
    units = list(root.named_units())
    others = other_paths(root, units)   # see [Note: a unit under several paths]
    for path, unit in units:
        paths = [path] + others.get(id(unit), [])
        for g in unit.shard_groups:
            owned = {o.param: o for o in g.layout.owned(unit.rank)}
            for i, (record, shape) in enumerate(zip(g.records, g.layout.shapes)):
                o = owned.get(i)
                pieces = tuple(run_chunks(shape, o.start, o.end, o.shard_offset)) if o else ()
                names = tuple(unwrapped_name(p, n) for p in paths for n in record.names)
                out.append(ParamSlot(names, torch.Size(shape), g, pieces))
    return out


def slots_by_shard(slots: List[ParamSlot]) -> Dict[int, List[ParamSlot]]:
    """{id of a shard: the slots of its parameters}, for the optimizer's state."""
    out: Dict[int, List[ParamSlot]] = {}
    for slot in slots:
        out.setdefault(id(slot.shard_group.shard), []).append(slot)
    return out
