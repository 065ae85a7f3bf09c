"""DCP planners over explicit chunks: what a rank writes, and where what it reads goes.

DCP's default planners take a state dict of whole tensors or DTensors. Our shards are
neither: a rank holds runs of each parameter's elements, as one or a few chunks
(``formats.dcp.layout``). These planners take those chunks directly, through DCP's public planner
interface, and leave everything else to DCP: the global metadata (``.metadata``), the file
format, and which saved chunks overlap which requested ones.

[Note: torch.save's reference cycles]
Every ``torch.save`` (DCP's writer makes one per tensor) leaves a reference cycle that holds
the saved tensor's storage until Python's cycle collector runs, and nothing about a tensor's
size makes it run: a save of many large tensors would hold all of them. The save planner
collects the youngest generations each time ``COLLECT_BYTES`` more have been handed to the
writer (a few milliseconds each), so what such cycles hold stays under that.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem,
                                                  SavePlan, SavePlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ...._sharding.chunks import TensorPieces
from ...._xla.private_api import dcp_stored_at
from ...files import CheckpointError
from .layout import Path

COLLECT_BYTES = 64 << 20


@dataclass(frozen=True)
class OnDemand:
    """A whole tensor read only when DCP writes it: DCP's writer takes one tensor at a
    time, so a checkpoint of any size is written holding one tensor."""
    size: torch.Size
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


class ChunkSavePlanner(SavePlanner):
    """Writes ``tensors`` (this rank's chunks), and on the first rank ``wholes`` (whole
    tensors, each read when written) and ``objects`` (anything else, saved as DCP
    saves objects), each key at its nest path (``paths``); given whole, or entry by entry
    (``add``)."""

    def __init__(self, tensors: Optional[Dict[str, TensorPieces]] = None,
                 wholes: Optional[Dict[str, OnDemand]] = None,
                 objects: Optional[Dict[str, Any]] = None,
                 paths: Optional[Dict[str, Path]] = None) -> None:
        self.tensors, self.wholes = tensors or {}, wholes or {}
        self.objects, self.paths = objects or {}, paths or {}
        self.is_coordinator = False
        # each tensor item's reader, each object item's value
        self._by_index: Dict[MetadataIndex, Any] = {}
        self._uncollected = 0

    def add(self, key_path: Tuple[str, Path], value: Any) -> None:
        """``value`` under the key and nest path ``key_path``: a ``TensorPieces`` as this
        rank's chunks, an ``OnDemand`` whole, anything else as an object."""
        key, self.paths[key] = key_path
        if isinstance(value, TensorPieces):
            self.tensors[key] = value
        elif isinstance(value, OnDemand):
            self.wholes[key] = value
        else:
            self.objects[key] = value

    def set_up_planner(self, state_dict: Dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, pieces in self.tensors.items():
            props = TensorProperties(dtype=pieces.dtype)
            for i, (chunk, _) in enumerate(pieces.chunks):
                index = MetadataIndex(key, torch.Size(chunk.offsets))
                self._by_index[index] = functools.partial(pieces.view, i)
                items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=TensorWriteData(
                    ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)),
                    props, pieces.size)))
        if self.is_coordinator:
            for key, whole in self.wholes.items():
                size = torch.Size(whole.size)
                index = MetadataIndex(key, torch.Size([0] * len(size)))
                self._by_index[index] = whole.read
                items.append(WriteItem(index, WriteItemType.TENSOR, tensor_data=TensorWriteData(
                    ChunkStorageMetadata(index.offset, size),
                    TensorProperties(dtype=whole.dtype), size)))
        # the coordinator's objects, and any other rank's own (its extra)
        for key, value in self.objects.items():
            index = MetadataIndex(key)
            self._by_index[index] = value
            items.append(WriteItem(index, WriteItemType.BYTE_IO))
        return SavePlan(items, planner_data=self.paths if self.is_coordinator else
                        {k: self.paths[k] for k in self.objects})

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        paths: Dict[str, Path] = {}
        for plan in all_plans:
            paths.update(plan.planner_data or {})
        return plans, dataclasses.replace(metadata, planner_data=paths)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        value = self._by_index[dataclasses.replace(write_item.index, index=None)]
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer
        value = value()
        self._uncollected += value.numel() * value.element_size()
        if self._uncollected > COLLECT_BYTES:  # see [Note: torch.save's reference cycles]
            gc.collect(1)
            self._uncollected = 0
        return value.detach().contiguous()


class ChunkLoadPlanner(LoadPlanner):
    """Reads the checkpoint's overlap with each chunk of ``tensors`` into its view, and the
    objects named in ``objects`` into that dict."""

    def __init__(self, tensors: Dict[str, TensorPieces], objects: Dict[str, Any]) -> None:
        self.tensors, self.objects = tensors, objects
        self.metadata: Optional[Metadata] = None

    def set_up_planner(self, state_dict: Dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        items: List[ReadItem] = []
        for key, pieces in self.tensors.items():
            wanted = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                      for c, _ in pieces.chunks]
            if wanted:
                items += create_read_items_for_chunk_list(key, stored[key], wanted)
        for key in self.objects:
            index = MetadataIndex(key)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index,
                                  torch.Size([0]), torch.Size([0])))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """An object saved beside the tensors (``extra``, param group settings), read as
        ``torch.load(weights_only=True)`` reads: tensors, plain containers, numbers, strings;
        DCP's own planner would unpickle anything, running what it names."""
        fqn = read_item.dest_index.fqn
        try:
            self.objects[fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            assert self.metadata is not None
            where = dcp_stored_at(self.metadata.storage_data[read_item.storage_index])[0]
            raise CheckpointError(f"{where}: entry {fqn!r} is refused by torch.load("
                                  f"weights_only=True): {_reason(exc)}") from None

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.tensors[read_item.dest_index.fqn].view(read_item.dest_index.index)
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read into the view itself


def _reason(exc: Exception) -> str:
    """The sentence of torch's weights-only refusal that names the global, not its advice."""
    text = str(exc)
    marker = "WeightsUnpickler error: "
    if marker in text:
        return text.split(marker, 1)[1].split(". ", 1)[0]
    return text.splitlines()[0] if text else type(exc).__name__
