"""The one DCP layout: ``{"model": M, "optimizer": O, "extra": E}`` as
``torch.distributed.checkpoint`` stores it, and where each of its tensors lives in our shards.

``M`` and ``O`` are what ``torch.distributed.checkpoint.state_dict.get_state_dict(model,
optimizer)`` returns for the unwrapped model: the model under every name ``state_dict()``
has (tied and shared parameters under each of them), persistent buffers in their original
dtype, optimizer state keyed by the parameter's first name, and ``param_groups`` whose
``params`` list names. DCP flattens nested dicts and lists into dotted keys, each with the
path it came from (``planner_data``, which ``dcp_to_torch_save`` uses to rebuild the nest):

* ``model.<name>`` -> ``("model", name)``;
* ``optimizer.state.<name>.<key>`` -> ``("optimizer", "state", name, key)``;
* ``optimizer.param_groups.<i>.<key>`` -> ``("optimizer", "param_groups", i, key)``;
* ``extra`` -> ``("extra",)``: whatever the caller saves besides, one object.

A parameter's tensors (and the optimizer state sharded like it) are written by every rank as
the chunks its shard holds (``Layout.owned`` and ``chunks.range_chunks``); buffers, scalar
optimizer state and every non-tensor value by the first rank only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from ..._sharding.chunks import Chunk, range_chunks
from ..._sharding.names import clean_name, join_name
from ..._unit.shard_group import ShardGroup
from ..unit_protocol import ShardedModel

MODEL, OPTIMIZER, EXTRA = "model", "optimizer", "extra"
Path = Tuple[object, ...]


def model_key(name: str) -> Tuple[str, Path]:
    return f"{MODEL}.{name}", (MODEL, name)


def state_key(name: str, key: str) -> Tuple[str, Path]:
    return f"{OPTIMIZER}.state.{name}.{key}", (OPTIMIZER, "state", name, key)


def param_group_key(index: int, key: str) -> Tuple[str, Path]:
    return f"{OPTIMIZER}.param_groups.{index}.{key}", (OPTIMIZER, "param_groups", index, key)


def extra_key() -> Tuple[str, Path]:
    return EXTRA, (EXTRA,)


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
        prefix = clean_name(path)
        for g in unit.shard_groups:
            owned = {o.param: o for o in g.layout.owned(unit.rank)}
            for i, (record, shape) in enumerate(zip(g.records, g.layout.shapes)):
                pieces: Tuple[Tuple[Chunk, int], ...] = ()
                o = owned.get(i)
                if o is not None:
                    pieces = tuple((c, o.shard_offset + c.start - o.start)
                                   for c in range_chunks(shape, o.start, o.end))
                out.append(ParamSlot(tuple(join_name(prefix, n) for n in record.names),
                                     torch.Size(shape), g, pieces))
    return out


def slots_by_shard(slots: List[ParamSlot]) -> Dict[int, List[ParamSlot]]:
    """{id of a shard: the slots of its parameters}, for the optimizer's state."""
    out: Dict[int, List[ParamSlot]] = {}
    for slot in slots:
        out.setdefault(id(slot.shard_group.shard), []).append(slot)
    return out
