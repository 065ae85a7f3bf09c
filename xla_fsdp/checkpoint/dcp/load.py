"""``load_dcp``: a DCP checkpoint in the layout of ``dcp.layout`` into a wrapped model (and its
optimizer) at any world size, whoever wrote it: ``save_dcp``, PyTorch FSDP2's
``get_state_dict`` + ``dcp.save``, torchtitan, or a plain single-process ``dcp.save``. Each
rank asks DCP for its own chunks, and reads only the saved chunks that overlap them
(``DcpSource``); what it reads is checked and staged as for every source (``staging``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ..._xla.trace_only import refuse_reads
from ..async_save import wait_for_pending
from ..files import CheckpointError
from ..unit_protocol import ShardedModel, require_root
from .metadata_file import read_metadata_file
from .planners import ChunkLoadPlanner, TensorPieces
from .save import METADATA_FILE, checkpoint_dir_for
from .staging import Source, StagedLoad


def load_dcp(checkpoint_dir: str, model: ShardedModel,
             optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Loads ``checkpoint_dir`` into ``model`` (and ``optimizer``); returns what was saved as
    ``extra`` (None if nothing was). Every rank calls it. Raises ``CheckpointError``, naming
    the key or file at fault, and changes nothing, if the checkpoint does not fit."""
    require_root(model, "load_dcp")
    refuse_reads(checkpoint_dir)
    directory, _ = checkpoint_dir_for(checkpoint_dir, model)
    return load_staged(lambda: DcpSource(directory), model, optimizer, "xla_fsdp.dcp.load")


def load_staged(open_source: Callable[[], Source], model: ShardedModel,
                optimizer: Optional[torch.optim.Optimizer], tag: str,
                with_model: bool = True) -> Any:
    """Stages on every rank, agrees, commits (see [Note: nothing changes unless everything
    was read]); returns the ``extra`` saved, if any."""
    import torch_xla
    from .coordination import agree
    wait_for_pending(model)  # a save of this model in flight is published first
    torch_xla.sync()
    staged, error, source = None, None, None
    try:
        source = open_source()
        staged = StagedLoad(source, model, optimizer, with_model)
    except Exception as exc:  # every rank must reach the agreement below
        error = exc
    finally:
        if source is not None:
            source.close()
    agree(f"{tag}.read", error)
    commit_on_every_rank(tag, staged.where, staged.commit)
    torch_xla.sync()
    return staged.extra


def commit_on_every_rank(tag: str, where: str, commit: Callable[[], Callable[[], None]]
                         ) -> None:
    """Every rank runs ``commit`` (which puts a load in place, undoes itself if it raises, and
    returns its undo) and the ranks agree: when one failed, every rank undoes its commit and
    raises, naming the failing rank and ``where`` (see [Note: nothing changes unless
    everything was read])."""
    from .coordination import agree_or_undo
    error, undo = None, None
    try:
        undo = commit()
    except Exception as exc:  # every rank must reach the agreement
        error = CheckpointError(f"{where}: {type(exc).__name__}: {exc}")
    agree_or_undo(f"{tag}.commit", error, undo)


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
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: data file missing ({METADATA_FILE} refers to it)")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(f"{path}: truncated ({size} bytes, {METADATA_FILE} needs "
                                  f"{end})")
