"""``save_dcp``: every rank writes its own chunks of the unwrapped model (and optimizer) as one
DCP checkpoint that PyTorch FSDP2, torchtitan and ``dcp.load`` read as they read their own.

Coordination goes through ``coordination.exchange`` (DCP's own save needs a process group):
the ranks' plans to the first rank, which makes the global plan and the metadata; the
writes; the write results back to it; it writes ``.metadata``.

[Note: a DCP directory is complete or not a checkpoint]
DCP readers start from ``.metadata``, which lists every file and byte range. It is written
last, atomically (temporary file, fsync, rename), after every rank's data files are on disk.
The data files of one save carry a token of their own in their names, so saving over an
existing checkpoint never touches the files its ``.metadata`` refers to: an interrupted save
leaves the previous checkpoint loadable (or, in a new directory, no ``.metadata`` at all).
Once the new ``.metadata`` is in place, files no longer referenced are removed.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata

from ..._unit.buffers import original_dtype
from ..._xla.private_api import to_cpu
from ..files import atomic_path
from ..metadata import persistent_buffers
from ..unit_protocol import ShardedModel, require_root, sharding_group_index
from .coordination import agree, exchange
from .layout import (KeyScheme, ParamSlot, Path, extra_key, key_scheme, param_slots,
                     slots_by_shard)
from .planners import ChunkSavePlanner, TensorPieces

METADATA_FILE = ".metadata"
SUFFIX = ".distcp"


def checkpoint_dir_for(checkpoint_dir: str, model: ShardedModel) -> Tuple[str, bool]:
    """Where this rank's sharding group keeps its checkpoint, and whether it writes there:
    with independent ``sharding_groups`` (parts of a model-parallel model) each group has a
    directory of its own; replicas (``replicate_across_groups``) share the first group's."""
    index = sharding_group_index(model)
    if index is None:
        return checkpoint_dir, True
    if model.options.replicate_across_groups:
        return checkpoint_dir, index == 0
    return f"{checkpoint_dir}_group-{index:03d}", True


@dataclass(frozen=True)
class _FilePrefix:
    """What ``FileSystemWriter.write_data`` names a rank's files after."""
    prefix: str


def save_dcp(checkpoint_dir: str, model: ShardedModel,
             optimizer: Optional[torch.optim.Optimizer] = None, extra: Any = None,
             keys: str = "get_state_dict") -> Optional[str]:
    """Saves ``model`` (and ``optimizer``, and ``extra``) as a DCP checkpoint in
    ``checkpoint_dir``, in the layout of ``dcp.layout`` with the key scheme ``keys``
    (``"get_state_dict"``, what FSDP2's recipe loads, or ``"torchtitan"``). Every rank calls
    it; each writes only its own chunks, never a full parameter it does not hold. Returns
    the directory (None on a replica that does not write)."""
    import torch_xla
    require_root(model, "save_dcp")
    scheme = key_scheme(keys)
    torch_xla.sync()
    directory, writes = checkpoint_dir_for(checkpoint_dir, model)
    sharding_group = sharding_group_index(model)
    rank = model.rank
    planner = _planner(model, optimizer, extra, scheme, first=rank == 0) if writes else None
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True,
                              thread_count=1) if writes else None
    local = None
    if writes:
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        planner.set_up_planner({}, writer.storage_meta(), rank == 0)
        local = writer.prepare_local_plan(planner.create_local_plan())
    plans = exchange("xla_fsdp.dcp.save.plans", (sharding_group, rank, local))
    central = None
    if writes and rank == 0:
        mine = sorted((r, p) for g, r, p in plans if g == sharding_group and p is not None)
        global_plans, metadata = planner.create_global_plan([p for _, p in mine])
        token = secrets.token_hex(4)
        central = ({r: dataclasses.replace(p, storage_data=_FilePrefix(f"__{r}_{token}_"))
                    for (r, _), p in zip(mine, global_plans)}, metadata)
    centrals = exchange("xla_fsdp.dcp.save.central", (sharding_group, central))
    error, results = None, None
    if writes:
        try:
            plan = next(c for g, c in centrals if g == sharding_group and c is not None)[0][rank]
            results = writer.write_data(planner.finish_plan(plan), planner).value()
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
    agree("xla_fsdp.dcp.save.written", error)
    all_results = exchange("xla_fsdp.dcp.save.results", (sharding_group, results))
    if writes and rank == 0:
        try:
            _commit(directory, central[1],
                    [r for g, r in all_results if g == sharding_group and r],
                    writer)
        except Exception as exc:
            error = exc
    agree("xla_fsdp.dcp.save.committed", error)
    return directory if writes else None


def write_alone(directory: str, planner: ChunkSavePlanner) -> None:
    """DCP's save protocol in one process, which is every rank (the offline conversion)."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True,
                              thread_count=1)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    planner.set_up_planner({}, writer.storage_meta(), True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    (plan,), metadata = planner.create_global_plan([local])
    plan = dataclasses.replace(plan, storage_data=_FilePrefix(f"__0_{secrets.token_hex(4)}_"))
    results = writer.write_data(planner.finish_plan(plan), planner).value()
    _commit(directory, metadata, [results], writer)


def _planner(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer], extra: Any,
             scheme: KeyScheme, first: bool) -> ChunkSavePlanner:
    """This rank's chunks of the model and the optimizer state sharded like it, and (on the
    first rank) the buffers, the replicated optimizer state and every other value."""
    slots = param_slots(model)
    by_shard = slots_by_shard(slots)
    sources = [s.shard_group.shard for s in slots]
    state: Dict[int, Dict[str, Any]] = {}
    if optimizer is not None:
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                if id(p) not in by_shard:
                    raise ValueError(f"save_dcp: the optimizer holds a tensor of shape "
                                     f"{tuple(p.shape)} that is not a shard of this model; "
                                     f"create the optimizer from model.parameters() after "
                                     f"wrapping")
                state[id(p)] = dict(optimizer.state.get(p, {}))
                sources += [v for v in state[id(p)].values() if torch.is_tensor(v)]
    unique = list({id(t): t for t in sources}.values())
    cpu = dict(zip(map(id, unique), to_cpu([t.detach() for t in unique])))  # one transfer
    tensors: Dict[str, TensorPieces] = {}
    wholes: Dict[str, torch.Tensor] = {}
    objects: Dict[str, Any] = {}
    paths: Dict[str, Path] = {}

    def add_pieces(key_path: Tuple[str, Path], slot: ParamSlot, source: torch.Tensor) -> None:
        key, paths[key] = key_path
        flat = cpu[id(source)].reshape(-1)
        tensors[key] = TensorPieces(slot.shape, source.dtype,
                                    [(c, flat, at) for c, at in slot.pieces])

    for slot in slots:
        for name in slot.names:
            add_pieces(scheme.model(name), slot, slot.shard_group.shard)
    if first:
        for name, buf in persistent_buffers(model):
            key, paths[key] = scheme.model(name)
            wholes[key] = buf.detach().cpu().to(original_dtype(buf))
    if optimizer is not None:
        order = {n: i for i, n in enumerate(model.get_shard_metadata()["param_order"])}
        for index, param_group in enumerate(optimizer.param_groups):
            names: List[str] = []
            for p in param_group["params"]:
                names += [s.name for s in by_shard[id(p)]]
                for k, v in state[id(p)].items():
                    for slot in by_shard[id(p)]:
                        key, path = scheme.state(slot.name, k)
                        if torch.is_tensor(v) and v.shape == p.shape:
                            add_pieces((key, path), slot, v)
                        elif first:
                            paths[key] = path
                            if torch.is_tensor(v):
                                wholes[key] = cpu[id(v)]
                            else:
                                objects[key] = v
            if first:
                settings = {k: v for k, v in param_group.items()
                            if k not in ("params", "param_names")}
                names.sort(key=lambda n: order.get(n, len(order)))
                for key, path, value in scheme.param_group(index, names, settings):
                    paths[key], objects[key] = path, value
    if first and extra is not None:
        key, paths[key] = extra_key()
        objects[key] = extra
    return ChunkSavePlanner(tensors, wholes, objects, paths)


def _commit(directory: str, metadata: Metadata, results: List[List[Any]],
            writer: FileSystemWriter) -> None:
    """See [Note: a DCP directory is complete or not a checkpoint]."""
    storage = {r.index: r.storage_data for rank_results in results for r in rank_results}
    metadata = dataclasses.replace(metadata, version=CURRENT_DCP_VERSION,
                                   storage_data=storage, storage_meta=writer.storage_meta())
    with atomic_path(os.path.join(directory, METADATA_FILE)) as tmp:
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
    keep = {info.relative_path for info in storage.values()}
    for name in os.listdir(directory):
        if name.endswith(SUFFIX) and name not in keep:
            os.remove(os.path.join(directory, name))
