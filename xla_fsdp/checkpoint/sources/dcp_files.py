"""A DCP directory as the loader's source (``staging.Source``): whoever wrote it (``save_dcp``,
PyTorch FSDP2's ``get_state_dict`` + ``dcp.save``, torchtitan, a plain single-process
``dcp.save``), its ``.metadata`` is read admitting only DCP's metadata classes, and each rank
reads, through DCP's own reader, only the saved chunks that overlap the chunks it asks for.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ..._sharding.chunks import TensorPieces
from ..._xla.private_api import dcp_stored_at
from ..formats.dcp.metadata_file import METADATA_FILE, read_metadata_file
from ..formats.dcp.planners import ChunkLoadPlanner
from ..files import CheckpointError


def read_metadata(directory: str) -> Metadata:
    """The ``.metadata`` of the DCP checkpoint ``directory``, read admitting only DCP's
    metadata classes (``metadata_file``), never with DCP's reader's ``pickle.load``."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such directory")
    if not os.path.exists(os.path.join(directory, METADATA_FILE)):
        raise CheckpointError(f"{directory} has no {METADATA_FILE}: it is not a DCP checkpoint, "
                              f"or its save did not complete")
    return read_metadata_file(os.path.join(directory, METADATA_FILE))


class DcpSource:
    """A DCP directory: its ``.metadata`` read by ``read_metadata``, its data through DCP's
    own reader (tensors as ``torch.load(weights_only=True)``, objects by our planner, the
    same way)."""

    def __init__(self, directory: str) -> None:
        self.where = directory
        self.metadata = read_metadata(directory)
        self.stored = self.metadata.state_dict_metadata

    def read(self, tensors: Dict[str, TensorPieces], objects: Dict[str, Any],
             into: Dict[str, Any]) -> None:
        loaded = dict(objects)
        _run(self.where, self.metadata, ChunkLoadPlanner(tensors, loaded))
        into.update((k, loaded[k]) for k in objects)

    def close(self) -> None:
        """DCP's reader opens each file as it reads it."""


def _run(directory: str, metadata: Metadata, planner: ChunkLoadPlanner) -> None:
    """DCP's read protocol for one rank: plan, check the files the plan reads, read."""
    reader = FileSystemReader(directory)
    reader.set_up_storage_reader(metadata, True)
    planner.set_up_planner({}, metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(reader.prepare_global_plan([plan])[0])
    _check_files(directory, metadata, plan.items)
    try:
        reader.read_data(plan, planner).wait()
    except CheckpointError as exc:  # the planner's refusal of an object, naming its file
        raise CheckpointError(f"{directory}/{exc}") from None
    except Exception as exc:
        raise CheckpointError(f"{directory}: reading the data failed ({type(exc).__name__}: "
                              f"{exc}); a data file is corrupted") from None


def _check_files(directory: str, metadata: Metadata, items: List[Any]) -> None:
    """Every data file the reads need exists and is long enough (DCP's own error for a
    missing or truncated file names neither)."""
    needed: Dict[str, int] = {}
    for item in items:
        info = metadata.storage_data.get(item.storage_index)
        if info is None:
            raise CheckpointError(f"{directory}: {METADATA_FILE} lists no data for "
                                  f"{item.storage_index.fqn}")
        name, offset, length = dcp_stored_at(info)
        needed[name] = max(needed.get(name, 0), offset + length)
    for name, end in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: data file missing ({METADATA_FILE} refers to it)")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(f"{path}: truncated ({size} bytes, {METADATA_FILE} needs "
                                  f"{end})")
