"""The consolidated checkpoint as a DCP directory (``--format dcp``), in the layout of
``formats.dcp.layout``: what ``get_state_dict`` + ``dcp.save`` of the unwrapped model and
optimizer would write (or, with ``--dcp_keys torchtitan``, torchtitan's checkpointer), so that
FSDP2 and torchtitan start from it. Every tensor is read when DCP's writer asks for it and
written whole: memory stays near one file's worth (see [Note: DCP's writer keeps a file's
tensors until it closes]). The directory becomes a checkpoint when its ``.metadata`` is
written, last (see [Note: a DCP directory is complete or not a checkpoint])."""
from __future__ import annotations

import functools
from typing import Callable, List

import torch

from ..formats.dcp.layout import KeyScheme, extra_key
from ..formats.dcp.planners import ChunkSavePlanner, OnDemand
from .dcp_files import write_alone
from ..formats.keys import EXTRA
from ..unwrapped_state import Readable, UnwrappedState


def write_dcp(state: UnwrappedState, directory: str, scheme: KeyScheme,
              progress: Callable[[int], None]) -> List[str]:
    """Writes ``state`` (with the optimizer when it has it) as a DCP directory under
    ``scheme``'s keys; returns ``[directory]``."""
    planner = ChunkSavePlanner()

    def read_counted(tensor: Readable) -> torch.Tensor:
        """The progress bar counts the model's elements, each once."""
        value = tensor.read()
        progress(value.numel())
        return value

    # tied: stored under both names, as state_dict has it, its elements counted once
    for name, tensor in state.with_aliases(dict(state.tensors)).items():
        read = functools.partial(read_counted, tensor) if name in state.tensors else tensor.read
        planner.add(scheme.model(name), OnDemand(torch.Size(tensor.shape), tensor.dtype, read))
    named = state.optimizer
    if named is not None:
        # the optimizer state by parameter name, and param groups listing names
        for param_name, name, value in named.in_read_order():  # DCP reads in the order added
            if isinstance(value, Readable):
                value = OnDemand(torch.Size(value.shape), value.dtype, value.read)
            planner.add(scheme.state(param_name, name), value)
        for key, path, value in named.param_group_entries(scheme):
            planner.add((key, path), value)
    if EXTRA in state.extra:
        planner.add(extra_key(), state.extra[EXTRA])
    write_alone(directory, planner)
    return [directory]
