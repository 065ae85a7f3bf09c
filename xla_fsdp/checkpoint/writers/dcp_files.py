"""How a save's DCP files are written, by the online ``save_dcp`` and the offline writers
alike: named by the save, cut into files of bounded size, and committed by ``.metadata``
(see [Note: a DCP directory is complete or not a checkpoint] in ``writers.dcp_shards``).

[Note: DCP's writer keeps a file's tensors until it closes]
``FileSystemWriter.write_data`` (torch 2.9) keeps every tensor it writes to a file in a dict
(for its safetensors format, whichever format is chosen) until the file is closed. With one
file per rank, as ``single_file_per_rank`` writes, a rank would hold everything it saves
by the end of its save; the offline conversion, the whole checkpoint. ``write_in_files``
therefore calls it once per run of the plan's items worth ``FILE_BYTES`` (or one tensor, if
larger), each a file of its own: what is held at once is one such file's worth.

[Note: naming DCP's files]
A save names each of its files itself, so that a failed save removes exactly its own files
and a committed one keeps exactly those ``.metadata`` lists. DCP's writer has no public way
to be told a name: it reads ``plan.storage_data.prefix``, an instance of a private class of
torch's (``private_api.dcp_file_prefix``), and writes ``{prefix}{n}.distcp``. That is
checked on every write (``_check_names``), so a torch whose writer names its files otherwise
fails the save with the file it wrote, and leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import math
import os
import pickle
import secrets
from typing import Any, Iterable, List, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..._xla.private_api import dcp_file_prefix, dcp_plan_prefix, dcp_stored_at
from ..formats.dcp.metadata_file import METADATA_FILE
from ..formats.dcp.planners import ChunkSavePlanner
from ..files import StagedFile, is_out_of_space, no_space_error, remove_if_there

SUFFIX = ".distcp"
FILE_BYTES = 64 << 20


def local_plan(directory: str, planner: ChunkSavePlanner, rank: int
               ) -> Tuple[FileSystemWriter, SavePlan]:
    """DCP's writer of ``directory`` and ``rank``'s local plan, set up as DCP's save does."""
    # one thread and no copy-ahead: a file's tensors are asked for in the plan's order (with
    # CUDA present, copy-ahead would ask smallest first), which save_consolidated's gathers
    # follow (see [Note: every rank knows the writer's read order])
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True,
                              thread_count=1, per_thread_copy_ahead=0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    planner.set_up_planner({}, writer.storage_meta(), rank == 0)
    return writer, writer.prepare_local_plan(planner.create_local_plan())


def write_in_files(writer: FileSystemWriter, plan: SavePlan, planner: ChunkSavePlanner
                   ) -> List[WriteResult]:
    """Writes a rank's plan as files of about ``FILE_BYTES`` each, or of one tensor when
    that is larger. See [Note: DCP's writer keeps a file's tensors until it closes]."""
    def size(item: WriteItem) -> int:
        if item.tensor_data is None:
            return 0
        chunk = item.tensor_data.chunk.sizes
        return math.prod(chunk) * item.tensor_data.properties.dtype.itemsize

    limit = max([FILE_BYTES] + [size(item) for item in plan.items])
    files: List[List[WriteItem]] = [[]]
    held = 0
    for item in plan.items:
        if files[-1] and held + size(item) > limit:
            files.append([])
            held = 0
        files[-1].append(item)
        held += size(item)
    results: List[WriteResult] = []
    for i, items in enumerate(files):
        prefix = f"{dcp_plan_prefix(plan)}{i}_"
        part = dataclasses.replace(plan, items=items, storage_data=dcp_file_prefix(prefix))
        try:
            written_now = writer.write_data(part, planner).value()
        except Exception as exc:
            directory = os.fspath(writer.path)
            partial = [os.path.join(directory, n) for n in _names(directory, prefix)]
            written = sum(os.path.getsize(p) for p in partial)
            remove_files(directory, prefix)  # first, so that the free space reported is real
            name = (partial[0] if len(partial) == 1
                    else os.path.join(directory, f"{prefix}*{SUFFIX}"))
            if not is_out_of_space(exc):
                raise
            raise no_space_error(name, exc, sum(size(item) for item in items),
                                 written=written) from exc
        _check_names(os.fspath(writer.path), prefix, written_now)
        results += written_now
    return results


def _check_names(directory: str, prefix: str, results: List[WriteResult]) -> None:
    """Raises, having removed them, if DCP's writer named files other than ``prefix``'s
    (see [Note: naming DCP's files])."""
    names = {dcp_stored_at(r.storage_data)[0] for r in results}
    other = sorted(n for n in names if not (n.startswith(prefix) and n.endswith(SUFFIX)))
    if other:
        _remove(directory, names)
        raise RuntimeError(
            f"torch.distributed.checkpoint's FileSystemWriter (torch {torch.__version__}) "
            f"wrote {os.path.join(directory, other[0])}, where xla_fsdp expects "
            f"{prefix}<n>{SUFFIX}: this torch names DCP's files in a way xla_fsdp does not "
            f"know, so it cannot tell its own files from others'. The save was undone; "
            f"xla_fsdp is tested with torch 2.9")


def write_alone(directory: str, planner: ChunkSavePlanner) -> None:
    """DCP's save protocol in one process, which is every rank (the offline conversion)."""
    writer, local = local_plan(directory, planner, 0)
    (plan,), metadata = planner.create_global_plan([local])
    prefix = f"__0_{secrets.token_hex(4)}_"
    plan = dataclasses.replace(plan, storage_data=dcp_file_prefix(prefix))
    try:
        results = write_in_files(writer, planner.finish_plan(plan), planner)
    except BaseException:
        remove_files(directory, prefix)
        raise
    commit(directory, metadata, [results], writer)


def _names(directory: str, prefix: str) -> List[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(prefix))


def _remove(directory: str, names: Iterable[str]) -> None:
    remove_if_there(*(os.path.join(directory, name) for name in names))


def remove_files(directory: str, prefix: str) -> None:
    """Removes the files of a failed save: those whose names start with ``prefix``."""
    _remove(directory, _names(directory, prefix))


def commit(directory: str, metadata: Metadata, results: List[List[Any]],
            writer: FileSystemWriter) -> None:
    """See [Note: a DCP directory is complete or not a checkpoint]."""
    storage = {r.index: r.storage_data for rank_results in results for r in rank_results}
    metadata = dataclasses.replace(metadata, version=CURRENT_DCP_VERSION,
                                   storage_data=storage, storage_meta=writer.storage_meta())
    keep = {dcp_stored_at(info)[0] for info in storage.values()}
    data = pickle.dumps(metadata)
    staged = StagedFile(os.path.join(directory, METADATA_FILE), needed=len(data))
    try:
        with staged.writing() as tmp, open(tmp, "wb") as f:
            f.write(data)
        staged.put_in_place()
    except BaseException:
        if not staged.placed:  # the previous .metadata stands: this save's files go
            _remove(directory, keep)
        raise
    for name in os.listdir(directory):
        if name.endswith(SUFFIX) and name not in keep:
            os.remove(os.path.join(directory, name))
