"""The DCP layout: the unwrapped model and its optimizer as ``torch.distributed.checkpoint``
stores them, under the keys of one of two schemes. Where each parameter lives in this rank's
shards is the live model's (``live_model.param_slots``).

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

from ..keys import EXTRA, MODEL, OPTIMIZER

Path = Tuple[object, ...]


def extra_key() -> Tuple[str, Path]:
    return EXTRA, (EXTRA,)


def rank_extra_key(rank: int) -> Tuple[str, Path]:
    """Where one rank's ``extra`` is kept when the ranks saved different ones (see [Note:
    each rank's extra])."""
    key = f"{EXTRA}.rank{rank:05d}"
    return key, (key,)


def replica_extra_key(rank: int, replica: int) -> Tuple[str, Path]:
    """Where the ``extra`` of rank ``rank`` of replica group ``replica`` is kept when it
    differs from the first group's (see [Note: each replica's extra])."""
    key = f"{EXTRA}.replica{replica:03d}.rank{rank:05d}"
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
