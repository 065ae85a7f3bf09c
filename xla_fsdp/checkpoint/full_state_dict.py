"""The unwrapped model's ordinary state dict, gathered from the shards, and back."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .gathered_state import gathered_state, read_every_entry
from .live_model import refuse_lost_writes
from .sources.entries import EntrySource, model_entries, optimizer_entries
from .staging import load_staged
from .unit_protocol import ShardedModel


@torch.no_grad()
def full_state_dict(root: ShardedModel, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    """The consolidated save's gathers (``gathered_state``, a run of shard groups at a time)
    read into a dict on the host. Every rank must call it; with ``rank0_only`` only global
    rank 0 keeps the result (the others get ``{}``)."""
    import torch_xla.runtime as xr
    refuse_lost_writes(root)
    state, gathers = gathered_state(root, None, what="full_state_dict")
    keep = not rank0_only or xr.global_ordinal() == 0
    entries = read_every_entry(state, gathers, keep)   # every rank takes part
    return state.with_aliases(entries) if keep else {}


def load_full_state_dict(root: ShardedModel, state_dict: Mapping[str, torch.Tensor],
                         strict: bool = True) -> Tuple[List[str], List[str]]:
    """Loads an ordinary (unwrapped) state dict through the staging loader: each rank keeps
    its shards' runs, and every rank loads or none does. Returns (missing, unexpected) keys;
    with ``strict`` either is a ``CheckpointError`` naming them. A tied parameter loads from
    any one of its names."""
    staged = load_staged(lambda: EntrySource("the state dict", *model_entries(state_dict)),
                         root, None, "xla_fsdp.load_full_state_dict", strict=strict)
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
