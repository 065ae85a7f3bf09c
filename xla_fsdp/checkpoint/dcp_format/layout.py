"""The DCP layout: the unwrapped model and its optimizer as ``torch.distributed.checkpoint``
stores them, under the keys of one of two schemes, and where each tensor lives in our shards.

The ``get_state_dict`` scheme is what ``dcp.save({"model": M, "optimizer": O, ...})`` writes
for ``M, O = get_state_dict(model, optimizer)`` (PyTorch FSDP2's recipe); the ``torchtitan``
scheme is what torchtitan's checkpointer writes: the model's entries at the top level under
their bare names, the optimizer flattened (``flatten_optimizer_state_dict``), one entry per
parameter and setting. In both, the model appears under every name ``state_dict()`` has (tied
and shared parameters under each), persistent buffers in their original dtype, optimizer
state under the parameter's first name. DCP flattens the nest into dotted keys, each with the
path it came from (``planner_data``, from which ``dcp_to_torch_save`` rebuilds the nest):

=========================  =====================================  ==========================
entry                      ``get_state_dict``                     ``torchtitan``
=========================  =====================================  ==========================
parameter or buffer        ``model.<name>``                       ``<name>``
optimizer state            ``optimizer.state.<name>.<key>``       the same key, path
                                                                  ``("optimizer", "state.<name>.<key>")``
param group setting        ``optimizer.param_groups.<i>.<key>``,  ``optimizer.param_groups.<name>.<key>``
                           ``params`` listing names               for every parameter
what the caller adds       ``extra``                              ``extra``
=========================  =====================================  ==========================

A parameter's tensors (and the optimizer state sharded like it) are written by every rank as
the chunks its shard holds (``Layout.owned`` and ``chunks.run_chunks``); buffers, scalar
optimizer state and every non-tensor value by the first rank only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from ..._sharding.chunks import Chunk, run_chunks
from ..per_rank_format import EXTRA, MODEL, OPTIMIZER
from ..live_model import unwrapped_name
from ..._unit.shard_group import ShardGroup
from ..unit_protocol import ShardedModel

Path = Tuple[object, ...]


def extra_key() -> Tuple[str, Path]:
    return EXTRA, (EXTRA,)


def rank_extra_key(rank: int) -> Tuple[str, Path]:
    """Where one rank's ``extra`` is kept when the ranks saved different ones (see [Note:
    each rank's extra])."""
    key = f"{EXTRA}.rank{rank:05d}"
    return key, (key,)


def rank_extras(keys: Any) -> List[str]:
    return [k for k in keys if k.startswith(EXTRA + ".rank")]


@dataclass(frozen=True)
class KeyScheme:
    """Which keys (and nest paths) the model's and optimizer's entries have."""
    name: str
    bare_model: bool       # model entries at the top level, not under "model"
    flat_optimizer: bool   # optimizer entries one level deep, param groups per parameter

    def model(self, name: str) -> Tuple[str, Path]:
        if self.bare_model:
            return name, (name,)
        return f"{MODEL}.{name}", (MODEL, name)

    def state(self, name: str, key: str) -> Tuple[str, Path]:
        if self.flat_optimizer:
            return f"{OPTIMIZER}.state.{name}.{key}", (OPTIMIZER, f"state.{name}.{key}")
        return f"{OPTIMIZER}.state.{name}.{key}", (OPTIMIZER, "state", name, key)

    def param_group(self, index: int, names: List[str], settings: Dict[str, Any]
                    ) -> List[Tuple[str, Path, Any]]:
        """The entries of one param group: its settings and the names of its parameters."""
        if self.flat_optimizer:
            return [(f"{OPTIMIZER}.param_groups.{n}.{k}", (OPTIMIZER, f"param_groups.{n}.{k}"), v)
                    for n in names for k, v in settings.items()]
        entries = dict(settings, params=names)
        return [(f"{OPTIMIZER}.param_groups.{index}.{k}", (OPTIMIZER, "param_groups", index, k), v)
                for k, v in entries.items()]


GET_STATE_DICT = KeyScheme("get_state_dict", bare_model=False, flat_optimizer=False)
TORCHTITAN = KeyScheme("torchtitan", bare_model=True, flat_optimizer=True)
KEY_SCHEMES = {s.name: s for s in (GET_STATE_DICT, TORCHTITAN)}


def key_scheme(name: str) -> KeyScheme:
    if name not in KEY_SCHEMES:
        raise ValueError(f"unknown DCP key scheme {name!r}; choose from {sorted(KEY_SCHEMES)}")
    return KEY_SCHEMES[name]


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
    for path, unit in root.named_units():
        for g in unit.shard_groups:
            owned = {o.param: o for o in g.layout.owned(unit.rank)}
            for i, (record, shape) in enumerate(zip(g.records, g.layout.shapes)):
                o = owned.get(i)
                pieces = tuple(run_chunks(shape, o.start, o.end, o.shard_offset)) if o else ()
                out.append(ParamSlot(tuple(unwrapped_name(path, n) for n in record.names),
                                     torch.Size(shape), g, pieces))
    return out


def slots_by_shard(slots: List[ParamSlot]) -> Dict[int, List[ParamSlot]]:
    """{id of a shard: the slots of its parameters}, for the optimizer's state."""
    out: Dict[int, List[ParamSlot]] = {}
    for slot in slots:
        out.setdefault(id(slot.shard_group.shard), []).append(slot)
    return out
