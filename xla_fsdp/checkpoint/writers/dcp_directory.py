"""The consolidated checkpoint as a DCP directory (``--format dcp``), in the layout of
``dcp_format.layout``: what ``get_state_dict`` + ``dcp.save`` of the unwrapped model and
optimizer would write (or, with ``--dcp_keys torchtitan``, torchtitan's checkpointer), so that
FSDP2 and torchtitan start from it. Every tensor is read when DCP's writer asks for it and
written whole: memory stays near one file's worth (see [Note: DCP's writer keeps a file's
tensors until it closes]). The directory becomes a checkpoint when its ``.metadata`` is
written, last (see [Note: a DCP directory is complete or not a checkpoint])."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from ..dcp_format.layout import KeyScheme, Path, extra_key
from ..dcp_format.planners import ChunkSavePlanner, OnDemand
from .dcp_files import write_alone
from ..per_rank_format import EXTRA
from ..optimizer_state import param_group_settings
from ..unwrapped_state import NamedState, Readable, UnwrappedState


def write_dcp(state: UnwrappedState, directory: str, scheme: KeyScheme,
              progress: Callable[[int], None]) -> List[str]:
    """Writes ``state`` (with the optimizer when it has it) as a DCP directory under
    ``scheme``'s keys; returns ``[directory]``."""
    wholes: Dict[str, OnDemand] = {}
    objects: Dict[str, Any] = {}
    paths: Dict[str, Path] = {}

    def add(key_path: Tuple[str, Path], size: Any, dtype: torch.dtype,
            read: Callable[[], torch.Tensor], counted: bool = False) -> None:
        """``counted``: the progress bar counts the model's elements, each once."""
        key, paths[key] = key_path

        def read_counted() -> torch.Tensor:
            tensor = read()
            progress(tensor.numel())
            return tensor
        wholes[key] = OnDemand(torch.Size(size), dtype, read_counted if counted else read)

    # tied: stored under both names, as state_dict has it, its elements counted once
    for name, tensor in state.with_aliases(dict(state.tensors)).items():
        add(scheme.model(name), tensor.shape, tensor.dtype, tensor.read,
            counted=name in state.tensors)
    if state.optimizer is not None:
        _optimizer(state.optimizer, scheme, add, objects, paths)
    if EXTRA in state.extra:
        key, paths[key] = extra_key()
        objects[key] = state.extra[EXTRA]
    write_alone(directory, ChunkSavePlanner({}, wholes, objects, paths))
    return [directory]


def _optimizer(named: NamedState, scheme: KeyScheme, add: Callable[..., None],
               objects: Dict[str, Any], paths: Dict[str, Path]) -> None:
    """The optimizer state by parameter name, and param groups listing names."""
    for param_name, name, value in named.in_read_order():  # DCP reads in the order added
        key_path = scheme.state(param_name, name)
        if isinstance(value, Readable):
            add(key_path, value.shape, value.dtype, value.read)
        else:
            key, paths[key] = key_path
            objects[key] = value
    for i, (param_group, params) in enumerate(named.param_groups):
        settings = param_group_settings(param_group)
        for key, path, value in scheme.param_group(i, params, settings):
            paths[key], objects[key] = path, value
