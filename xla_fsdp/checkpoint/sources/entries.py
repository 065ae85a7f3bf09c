"""A checkpoint held as named entries, each a tensor (in memory or in a file, read by runs of
elements) or another object, as a ``staging.Source``.

The unwrapped model's state dict and an optimizer state dict, in any of the forms they are
saved in, become entries under the keys of the DCP layout's ``get_state_dict`` scheme
(``model_entries``, ``optimizer_entries``), so that one loader checks and stages all of them.

[Note: a rank reads the runs its shards hold]
A shard holds runs of a parameter's row-major elements (``Layout.owned``), which the loader
asks for as chunks (``live_model.ParamSlot``). A tensor stored contiguously, as a
``.safetensors`` or ``torch.save`` file stores it, gives any run with one read at its
offset; so a rank reads the bytes of its own shards, and of the whole tensors it needs
(buffers, a step count), and nothing else, whatever the world size.
"""
from __future__ import annotations

from typing import (Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple,
                    Union, runtime_checkable)

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   TensorProperties, TensorStorageMetadata)

from ..._sharding.chunks import TensorPieces
from ..formats.dcp.layout import GET_STATE_DICT
from ..staging import Stored
from ..files import CheckpointError, TensorRef
from ..files.reader import materialized
from ..optimizer_state import param_group_settings


@runtime_checkable
class StoredTensor(Protocol):
    """A tensor not in memory, read by runs of its row-major elements: a ``TensorRef`` in
    a file, or a parameter spread over per-rank files (``sources.per_rank_files``)."""
    dtype: torch.dtype

    @property
    def shape(self) -> Sequence[int]: ...

    def read_elements(self, start: int, out: torch.Tensor) -> None:
        """Fills the 1-D contiguous ``out`` (of ``dtype``) with elements ``start, ...``."""


Tensorish = Union[torch.Tensor, StoredTensor]


def is_tensor(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, TensorRef, StoredTensor))


class EntrySource:
    """Entries under DCP-layout keys; ``closers`` run when the loader is done with it."""

    def __init__(self, where: str, tensors: Dict[str, Tensorish], objects: Dict[str, Any],
                 closers: Sequence[Callable[[], None]] = ()) -> None:
        self.where = where
        self._tensors, self._objects, self._closers = tensors, objects, list(closers)
        self.stored: Dict[str, Stored] = {k: BytesStorageMetadata() for k in objects}
        for key, value in tensors.items():
            size = torch.Size(value.shape)
            self.stored[key] = TensorStorageMetadata(
                TensorProperties(dtype=value.dtype), size,
                [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])

    def read(self, tensors: Dict[str, TensorPieces], objects: Dict[str, Any],
             into: Dict[str, Any]) -> None:
        for key, pieces in tensors.items():
            flat = pieces.flat()
            for start, at, count in _runs(pieces):
                _read_run(self._tensors[key], start, flat[at:at + count])
        for key in objects:
            into[key] = materialized(self._objects[key])

    def close(self) -> None:
        for close in self._closers:
            close()


def _runs(pieces: TensorPieces) -> List[Tuple[int, int, int]]:
    """(first element, where it goes, count) of each run of consecutive chunks: the chunks
    of one shard's run of a parameter are consecutive both in the tensor and in the shard."""
    out: List[List[int]] = []
    for chunk, at in pieces.chunks:
        if out and out[-1][0] + out[-1][2] == chunk.start and out[-1][1] + out[-1][2] == at:
            out[-1][2] += chunk.numel
        else:
            out.append([chunk.start, at, chunk.numel])
    return [tuple(r) for r in out]  # type: ignore[misc]


def _read_run(value: Tensorish, start: int, out: torch.Tensor) -> None:
    """Elements ``start, start + 1, ...`` of ``value`` (row-major) into the flat ``out``."""
    if isinstance(value, torch.Tensor):
        out.copy_(value.detach().reshape(-1)[start:start + out.numel()])
    elif value.dtype == out.dtype:
        value.read_elements(start, out)
    else:
        buffer = torch.empty(out.numel(), dtype=value.dtype)
        value.read_elements(start, buffer)
        out.copy_(buffer)


def model_entries(state_dict: Mapping[str, Any]) -> Tuple[Dict[str, Tensorish], Dict[str, Any]]:
    """The unwrapped model's state dict, as (tensors, objects) under the layout's keys."""
    tensors: Dict[str, Tensorish] = {}
    objects: Dict[str, Any] = {}
    for name, value in state_dict.items():
        (tensors if is_tensor(value) else objects)[GET_STATE_DICT.model(name)[0]] = value
    return tensors, objects


def optimizer_entries(state_dict: Mapping[str, Any], where: str,
                      names: Optional[Sequence[str]] = None
                      ) -> Tuple[Dict[str, Tensorish], Dict[str, Any]]:
    """An optimizer state dict over the unwrapped model's parameters, as (tensors, objects)
    under the layout's keys. Its parameters are named by ``names`` (index -> name, as a
    consolidated checkpoint records them in ``optimizer_param_names``), by each param group's
    ``param_names`` (torch records them for an optimizer built over ``named_parameters()``),
    or in the state dict itself (``get_state_dict``'s form: state and ``params`` by name)."""
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
        raise CheckpointError(f"{where}: the optimizer state is not an optimizer state dict "
                              f"(no 'param_groups')")
    name_of: Dict[Any, str] = {}
    tensors: Dict[str, Tensorish] = {}
    objects: Dict[str, Any] = {}
    for j, param_group in enumerate(state_dict["param_groups"]):
        given = param_group.get("param_names")
        for i, p in enumerate(param_group["params"]):
            if isinstance(p, str):
                name_of[p] = p
            elif names is not None:
                name_of[p] = names[p]
            elif given is not None:
                name_of[p] = given[i]
            else:
                raise CheckpointError(
                    f"{where}: the optimizer state numbers its parameters (param group {j}) "
                    f"without naming them; give it as get_state_dict does (state and params "
                    f"by name), or with the names in order (param_names)")
        for key, _, value in GET_STATE_DICT.param_group(
                j, [name_of[p] for p in param_group["params"]],
                param_group_settings(param_group)):
            objects[key] = value
    state = state_dict.get("state", {})
    for p in state:
        if p not in name_of:
            raise CheckpointError(f"{where}: optimizer state for parameter {p!r}, which no "
                                  f"param group holds")
    add_state_entries({name_of[p]: s for p, s in state.items()}, tensors, objects)
    return tensors, objects


def add_state_entries(state: Mapping[str, Mapping[str, Any]], tensors: Dict[str, Tensorish],
                      objects: Dict[str, Any]) -> None:
    """Each parameter's optimizer ``state`` (by parameter name) under its key in the loader's
    layout (``GET_STATE_DICT``): the tensors into ``tensors``, the rest into ``objects``."""
    for param_name, param_state in state.items():
        for name, value in param_state.items():
            key = GET_STATE_DICT.state(param_name, name)[0]
            (tensors if is_tensor(value) else objects)[key] = value
