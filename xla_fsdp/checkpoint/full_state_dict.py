"""The unwrapped model's ordinary state dict, gathered from the shards, and back."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .._unit.buffers import original_dtype
from .._unit.shard_group import ShardGroup
from .coordination import gathered_bytes, gathered_on_host, runs_by_size
from .staging import load_staged
from .live_model import (extra_state_tensors, persistent_buffers, refuse_lost_writes,
                         tied_aliases, unwrapped_name)
from .sources.entries import EntrySource, model_entries, optimizer_entries
from .unit_protocol import ShardedModel, ShardedUnit


def _parameter_slots(root: ShardedModel) -> Iterator[Tuple[ShardedUnit, ShardGroup, List[str]]]:
    """(unit, shard group, unwrapped names of its parameters) for every shard group."""
    for path, unit in root.named_units():
        for g in unit.shard_groups:
            yield unit, g, [unwrapped_name(path, n) for n in g.names]


@torch.no_grad()
def full_state_dict(root: ShardedModel, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    """Gathers the shard groups a run at a time (``coordination.runs_by_size``) and copies
    them to the CPU. Every rank must call it; with ``rank0_only`` only global rank 0 keeps
    the result (the others get ``{}``)."""
    import torch_xla.runtime as xr
    extra_states = extra_state_tensors(root, "full_state_dict")
    refuse_lost_writes(root)
    keep = not rank0_only or xr.global_ordinal() == 0
    out: Dict[str, torch.Tensor] = {}
    for run in runs_by_size(_parameter_slots(root),
                            lambda slot: gathered_bytes(slot[1].shard, slot[0].collectives)):
        fulls = gathered_on_host([(g.on_device(), unit.collectives) for unit, g, _ in run], keep)
        for (_, g, names), full in zip(run, fulls):
            for name, value in zip(names, g.layout.unshard(full)):
                out[name] = value.clone()
    if keep:
        for alias, source in tied_aliases((path, unit.shared_params)
                                          for path, unit in root.named_units()):
            out[alias] = out[source]
        for name, buf in persistent_buffers(root):
            out[name] = buf.detach().cpu().to(original_dtype(buf))
        out.update(extra_states)
    return out


def load_full_state_dict(root: ShardedModel, state_dict: Mapping[str, torch.Tensor],
                         strict: bool = True) -> Tuple[List[str], List[str]]:
    """Loads an ordinary (unwrapped) state dict through the staging loader: each rank keeps
    its shards' runs, and every rank loads or none does. Returns (missing, unexpected) keys;
    with ``strict`` either is a ``CheckpointError`` naming them. A tied parameter loads from
    any one of its names."""
    where = "the state dict"
    staged = load_staged(lambda: EntrySource(where, *model_entries(state_dict)), root, None,
                         "xla_fsdp.load_full_state_dict", strict=strict)
    return staged.missing, staged.unexpected


def load_full_optim_state_dict(root: ShardedModel, optimizer: torch.optim.Optimizer,
                               optim_state_dict: Mapping[str, Any],
                               param_names: Optional[Sequence[str]] = None) -> None:
    """Loads the state of an optimizer over the unwrapped model into ``optimizer`` (over the
    wrapped ``root``), at any world size: each rank keeps its shards' runs of each state
    tensor. The state names its parameters as ``get_state_dict`` does (state and ``params``
    by name), by torch's ``param_names``, or through ``param_names`` (index -> name), as
    a consolidated checkpoint records it (``optimizer_param_names``). Every rank calls it.
    Raises ``CheckpointError`` naming the parameter or setting at fault (another optimizer
    class, a parameter it does not hold) and changes nothing."""
    where = "the optimizer state dict"

    def source() -> EntrySource:
        return EntrySource(where, *optimizer_entries(optim_state_dict, where, param_names))
    load_staged(source, root, optimizer, "xla_fsdp.load_full_optim_state_dict",
                with_model=False)
