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
Once the new ``.metadata`` is in place, files no longer referenced are removed. A save that
fails anywhere (a rank's disk full, ``.metadata`` not written) removes its data files on
every rank: each rank its own after the ranks agree that a write failed, the first rank all
of them when ``.metadata`` could not be put in place.

[Note: a save copies one tensor to the host at a time]
DCP's writer takes a rank's chunks one at a time, in the order of its plan, and asks the
planner for each when it reaches it. The plan lists the chunks of each device tensor (a
shard group's shard, a piece of optimizer state) together, and ``HostCopies`` copies a tensor
to the host when its first chunk is asked for and drops it when another tensor's is. So a
rank's save holds one of its tensors on the host at a time, never all of its state: copying
everything in one transfer, as ``xm.save`` does, doubles for a moment what the rank holds,
on a host that serves several ranks (benchmarks/save_memory.py).

"""
from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ..._sharding.chunks import TensorPieces
from ..._unit.buffers import original_dtype
from ..._xla.private_api import dcp_file_prefix, dcp_plan_prefix, to_cpu
from ..._xla.trace_only import refuse_writes
from ..async_save import copy_of_extra, host_copy, run_save, wait_for_pending
from ..live_model import (ParamSlot, extra_state_tensors, extras_of_replicas, param_slots,
                          parameter_order, persistent_buffers, refuse_lost_writes, require_root,
                          sharding_group_index, sharding_group_path, slots_by_shard,
                          units_by_saved_path, writes_sharding_group_copy)
from ..optimizer_state import (param_group_settings, live_state, refuse_foreign_params,
                               saved_state_dict, walk_state)
from ..unit_protocol import ShardedModel
from ..coordination import agree, agree_or_undo, digest, every_rank_agrees, exchange, naming
from .dcp_files import commit, local_plan, remove_files, write_in_files
from ..formats.dcp.layout import (KeyScheme, Path, extra_key, key_scheme, rank_extra_key,
                                 replica_extra_key)
from ..formats.dcp.planners import ChunkSavePlanner, OnDemand
from ..unwrapped_state import model_order


def save_dcp(checkpoint_dir: str, model: ShardedModel,
             optimizer: Optional[torch.optim.Optimizer] = None, extra: Any = None,
             keys: str = "get_state_dict", async_save: bool = False) -> Any:
    """Saves ``model`` (and ``optimizer``, and ``extra``) as a DCP checkpoint in
    ``checkpoint_dir``, in the layout of ``formats.dcp.layout`` with the key scheme ``keys``
    (``"get_state_dict"``, what FSDP2's recipe loads, or ``"torchtitan"``). Every rank calls
    it; each writes only its own chunks, never a full parameter it does not hold. Returns
    the directory (None on a replica that does not write).

    With ``async_save=True`` every rank's state is copied to host memory at once and a
    ``PendingSave`` is returned; the files are written on a background thread, and the
    pending save's ``wait()`` (or the model's next save) writes ``.metadata`` and returns
    the directory; see [Note: the three phases of a save]."""
    import torch_xla
    require_root(model, "save_dcp")
    refuse_writes(checkpoint_dir)   # before DCP's writer touches a data file
    extra_states = extra_state_tensors(model, "save_dcp")
    refuse_lost_writes(model)
    scheme = key_scheme(keys)
    wait_for_pending(model)
    torch_xla.sync()
    directory = sharding_group_path(checkpoint_dir, model)[0]
    writes = writes_sharding_group_copy(model)
    sharding_group = sharding_group_index(model)
    rank = model.rank
    host = HostCopies(all_at_once=async_save)
    # a value one rank cannot copy or pickle fails every rank, before any file is touched
    with every_rank_agrees("xla_fsdp.dcp.save.extra_copy",
                           naming(f"{checkpoint_dir}: the save's extra")):
        extra = copy_of_extra(extra)
        extra_digest = digest(extra)
    # see [Note: each rank's extra] in staging
    per_rank = len(set(exchange("xla_fsdp.dcp.save.extra", extra_digest))) > 1
    replicas = extras_of_replicas(model, extra)
    planner = (_planner(model, optimizer, extra, extra_states, scheme, host, per_rank, replicas)
               if writes else None)
    writer, local = local_plan(directory, planner, rank) if writes else (None, None)
    plans = exchange("xla_fsdp.dcp.save.plans", (sharding_group, rank, local))
    central = None
    if writes and rank == 0:
        mine = sorted((r, p) for g, r, p in plans if g == sharding_group and p is not None)
        global_plans, metadata = planner.create_global_plan([p for _, p in mine])
        token = secrets.token_hex(4)
        central = ({r: dataclasses.replace(p, storage_data=dcp_file_prefix(f"__{r}_{token}_"))
                    for (r, _), p in zip(mine, global_plans)}, metadata)
    centrals = exchange("xla_fsdp.dcp.save.central", (sharding_group, central))
    host.copy_all()  # last, after the collectives: a rank's copy keeps no other rank waiting
    job = _DcpRankSave(directory, sharding_group, rank, writer, planner, central)
    if writes:
        job.plan = next(c for g, c in centrals if g == sharding_group and c is not None)[0][rank]
    return run_save(model, job, async_save, f"save_dcp {directory}")


class _DcpRankSave:
    """This rank's files of one ``save_dcp`` after the copy and the plans
    (``async_save.SaveJob``)."""

    def __init__(self, directory: str, sharding_group: Optional[int], rank: int,
                 writer: Optional[FileSystemWriter], planner: Optional[ChunkSavePlanner],
                 central: Any) -> None:
        self.directory, self.sharding_group, self.rank = directory, sharding_group, rank
        self.writer, self.planner, self.central = writer, planner, central
        self.plan: Optional[SavePlan] = None   # None on a replica that does not write
        self.results: Optional[List[WriteResult]] = None

    def write(self) -> None:
        if self.plan is not None:
            planner, self.planner = self.planner, None  # the host copies go once written
            self.results = write_in_files(self.writer, planner.finish_plan(self.plan), planner)

    def publish(self, error: Optional[BaseException]) -> Optional[str]:
        self.planner = None
        prefix = None if self.plan is None else dcp_plan_prefix(self.plan)
        directory, ours = self.directory, self.sharding_group
        try:
            agree_or_undo("xla_fsdp.dcp.save.written", error,
                          None if prefix is None else lambda: remove_files(directory, prefix))
            all_results = exchange("xla_fsdp.dcp.save.results", (ours, self.results))
            error = None
            if self.plan is not None and self.rank == 0:
                try:
                    commit(directory, self.central[1],
                           [r for g, r in all_results if g == ours and r], self.writer)
                except Exception as exc:
                    error = exc
            agree("xla_fsdp.dcp.save.committed", error)
        finally:
            error = None  # see [Note: no frame keeps the exception it raises]
        return directory if self.plan is not None else None


class HostCopies:
    """The host copies a save writes from: made one at a time as the writer reaches each
    tensor (see [Note: a save copies one tensor to the host at a time]), or all at once
    (``all_at_once``, for a save written after training has moved on: ``copy_all``)."""

    def __init__(self, all_at_once: bool = False) -> None:
        self._all_at_once = all_at_once
        self._sources: Dict[int, torch.Tensor] = {}   # by id: a source is copied once
        self._copies: Dict[int, torch.Tensor] = {}
        self._held: Optional[Tuple[int, torch.Tensor]] = None

    def add(self, source: torch.Tensor) -> int:
        """A tensor the save will read; returns its key."""
        self._sources[id(source)] = source
        return id(source)

    def copy_all(self) -> None:
        """With ``all_at_once``: copies every source now and lets go of the sources."""
        if self._all_at_once:
            copies = host_copy([s.detach() for s in self._sources.values()])
            self._copies, self._sources = dict(zip(self._sources, copies)), {}

    def whole(self, key: int) -> torch.Tensor:
        if self._all_at_once:
            return self._copies[key]
        if self._held is None or self._held[0] != key:
            self._held = None  # the previous copy goes before the next comes
            self._held = (key, to_cpu(self._sources[key].detach()))
        return self._held[1]


def _planner(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer], extra: Any,
             extra_states: List[Tuple[str, torch.Tensor]], scheme: KeyScheme, host: HostCopies,
             per_rank_extra: bool, replicas: Dict[int, Any]) -> ChunkSavePlanner:
    """This rank's chunks of the model and the optimizer state sharded like it, and (on the
    first rank) the buffers, the modules' ``extra_states``, the replicated optimizer state and
    every other value, read through ``host``; with ``per_rank_extra`` also this rank's
    ``extra``."""
    rank = model.rank
    first = rank == 0
    slots = param_slots(model)
    by_shard = slots_by_shard(slots)
    if optimizer is not None:
        refuse_foreign_params(optimizer, by_shard)
    planner = ChunkSavePlanner()

    def add_pieces(key_path: Tuple[str, Path], slot: ParamSlot, source: torch.Tensor) -> None:
        if slot.shape.numel() == 0:   # no rank holds a chunk of it: the first writes it whole
            if first:
                add_whole(key_path, torch.empty(slot.shape, dtype=source.dtype), source.dtype)
            return
        planner.add(key_path, TensorPieces(slot.shape, source.dtype, list(slot.pieces),
                                           lambda at=host.add(source): host.whole(at).reshape(-1)))

    def add_whole(key_path: Tuple[str, Path], tensor: torch.Tensor, dtype: torch.dtype) -> None:
        planner.add(key_path, OnDemand(tensor.shape, dtype,
                                       lambda at=host.add(tensor): host.whole(at).to(dtype)))

    for slot in slots:
        for name in slot.names:
            add_pieces(scheme.model(name), slot, slot.shard_group.shard)
    if first:
        for name, buf in persistent_buffers(model):
            add_whole(scheme.model(name), buf, original_dtype(buf))
        for name, tensor in extra_states:
            add_whole(scheme.model(name), tensor, tensor.dtype)
    if optimizer is not None:
        # checked on every rank, so that a refusal stops them all before any collective
        param_groups = saved_state_dict(optimizer)["param_groups"]
        params, state = live_state(optimizer)
        for entry in walk_state(state, lambda i: params[i].shape,
                                lambda i: f"DCP save of {by_shard[id(params[i])][0].name}"):
            for slot in by_shard[id(params[entry.index])]:
                key_path = scheme.state(slot.name, entry.name)
                if entry.sharded:
                    add_pieces(key_path, slot, entry.value)
                elif first and torch.is_tensor(entry.value):
                    add_whole(key_path, entry.value, entry.value.dtype)
                elif first:
                    planner.add(key_path, entry.value)
        if first:
            in_order = model_order(
                parameter_order(model, units_by_saved_path(model, list(model.named_units()))))
            # as the per-rank and consolidated saves hold them: optimizer.state_dict()'s
            # groups, a state dict hook's or an override's changes included
            for index, param_group in enumerate(param_groups):
                names = sorted((t.name for i in param_group["params"]
                                for t in by_shard[id(params[i])]), key=in_order)
                settings = param_group_settings(param_group)
                for key, path, value in scheme.param_group(index, names, settings):
                    planner.add((key, path), value)
    if first and extra is not None:
        planner.add(extra_key(), extra)
    if per_rank_extra:
        planner.add(rank_extra_key(rank), extra)
    for replica, replica_extra in replicas.items():   # see [Note: each replica's extra]
        planner.add(replica_extra_key(rank, replica), replica_extra)
    return planner
