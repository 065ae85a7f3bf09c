"""Per-rank checkpoints of an FSDP model: ``save_sharded`` and ``load_sharded``.

Each rank writes ``{prefix}_rank-{rank:08d}-of-{world:08d}.pth`` holding torch_xla's
format, ``{'model', 'shard_metadata', 'optimizer'}``, plus an ``'xla_fsdp'`` record (world
size, rank, a fingerprint of the wrapping, which optimizer index is which shard, and a save
counter that ties the files of one save together) and the caller's ``'extra'``. Every
record carries the CRC-32 ``torch.save`` computes; ``load_sharded`` checks it. A save is
every rank's or none (see the Note below): a crash or a full disk mid-save leaves the
previous files whole, and no file of the failed save on any rank. Once a save is in place,
the files an earlier save at another world size left under the same prefix are removed:
the prefix names this save, and a load at either size would otherwise find both.

With ``sharding_groups`` each group is a model of its own (torch_xla's meaning: a part of a
model-parallel model), numbered by its index in ``sharding_groups``, so each group writes
its own files, ``{prefix}_group-{k:03d}_rank-...``, which consolidate on their own. With
``replicate_across_groups=True`` the groups are replicas and only the first writes,
``{prefix}_rank-...``.

[Note: a save is all ranks' or none]
A checkpoint is the files of every rank. If each rank replaced its file as soon as it had
written it, one rank failing (its disk full) would leave some ranks' new files beside other
ranks' old ones: the previous save no longer loadable, the new one incomplete. So each rank
writes its file under a temporary name beside the final one and flushes it to disk; the
ranks then agree through ``xm.rendezvous`` (no process group is needed, on a TPU pod as on
virtual devices); then either every rank renames its file into place, or, if any rank
failed, every rank removes its temporary file and raises. A rename within a directory
needs no more than a directory entry, not the file's size, so once every file is on disk
putting them in place does not run out of space. Either way the ranks meet once more
before returning, so that when ``save_sharded`` returns or raises on one rank, every
rank's file is in place, or gone.
"""
from __future__ import annotations

import contextlib
import functools
import os
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._sharding.tensor_tree import collect_tensors
from .._xla.trace_only import refuse_reads
from .async_save import copy_of_extra, host_copy, run_save, wait_for_pending
from .per_rank.shard_set import save_identity
from .sources.per_rank_files import open_per_rank_files
from .coordination import agree, agree_or_undo, every_rank_agrees, exchange, naming
from .staging import commit_on_every_rank, load_optimizer_state, load_staged
from .files import CheckpointError, CheckpointFile, StagedFile
from .metadata import (EXTRA, FORMAT_VERSION, MODEL, OPTIMIZER, RANK_FILES, RankRecord,
                       other_world_files, rank_file_tree, sharded_checkpoint_path,
                       wrapping_fingerprint)
from .optimizer_state import holds_settings_of, optimizer_shard_keys
from .unit_protocol import ShardedModel
from .live_model import is_extra_state_key, require_root, sharding_group_path, writes_sharding_group_copy

_SAVE_COUNT: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # per root


def _sharding_group_prefix(prefix: str, model: ShardedModel) -> Optional[str]:
    """Where this rank's sharding group writes, or None for a replica that does not write."""
    if not writes_sharding_group_copy(model):
        return None
    return sharding_group_path(prefix, model, is_prefix=True)[0]


def save_sharded(path_prefix: str, model: ShardedModel,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 extra: Any = None, async_save: bool = False) -> Any:
    """Writes this rank's checkpoint file; returns its path (None on a replica that does not
    write). Every rank must call it: it synchronises the device first, and the save is put
    in place on every rank or on none (a ``CheckpointError`` on every rank, naming the file
    and the space it needed when a disk is full); see [Note: a save is all ranks' or none].

    With ``async_save=True`` it returns a ``PendingSave`` as soon as this rank's state is
    copied to host memory; the file is written on a background thread, and the pending
    save's ``wait()`` (or the model's next save) puts it in place and returns the path; see
    [Note: the three phases of a save]."""
    import torch_xla
    require_root(model, "save_sharded")
    wait_for_pending(model)
    torch_xla.sync()
    metadata = model.get_shard_metadata()
    _SAVE_COUNT[model] = _SAVE_COUNT.get(model, 0) + 1
    path_prefix = _sharding_group_prefix(path_prefix, model)
    job = _RankFileSave(path_prefix, model.rank, model.world_size)
    if path_prefix is not None:
        try:
            job.checkpoint = _checkpoint(model, metadata, optimizer, extra)
        except Exception as exc:  # every rank must reach the agreement in publish
            job.error = exc
    return run_save(model, job, async_save, f"save_sharded {path_prefix}")


class _RankFileSave:
    """This rank's file of one ``save_sharded`` after the copy (``async_save.SaveJob``)."""

    def __init__(self, prefix: Optional[str], rank: int, world_size: int) -> None:
        self.prefix, self.rank, self.world_size = prefix, rank, world_size
        # None on a replica that does not write
        self.path = None if prefix is None else sharded_checkpoint_path(prefix, rank, world_size)
        self.checkpoint: Optional[Dict[str, Any]] = None   # on the host
        self.error: Optional[BaseException] = None         # from the copy
        self.staged: Optional[StagedFile] = None

    def write(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            try:
                raise error
            finally:
                error = None  # see [Note: no frame keeps the exception it raises]
        if self.path is None:
            return
        checkpoint, self.checkpoint = self.checkpoint, None  # dropped once written
        self.staged = StagedFile(self.path, needed=_tensor_bytes(checkpoint))
        with self.staged.writing() as tmp:
            with open(tmp, "wb") as f:  # through Python, so a full disk says ENOSPC
                torch.save(checkpoint, f)

    def publish(self, error: Optional[BaseException]) -> Optional[str]:
        self.checkpoint = None
        staged = self.staged
        try:
            agree_or_undo("xla_fsdp.save_sharded.written", error,
                          None if staged is None else staged.discard)
            if staged is not None:
                try:
                    staged.put_in_place()
                except Exception as exc:
                    error = exc
            agree("xla_fsdp.save_sharded.placed", error)  # so no rank returns before all are
        finally:
            error = None  # see [Note: no frame keeps the exception it raises]
        if staged is not None and self.rank == 0:
            # the files an earlier save at another world size left under this prefix: the
            # prefix is this save's now, and a load would not know which save it names
            for stale in other_world_files(self.prefix, self.world_size):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
        return None if staged is None else self.path


def _checkpoint(model: ShardedModel, metadata: Dict[str, Any],
                optimizer: Optional[torch.optim.Optimizer], extra: Any) -> Dict[str, Any]:
    record = RankRecord(FORMAT_VERSION, model.world_size, model.rank,
                        wrapping_fingerprint(metadata), _SAVE_COUNT[model],
                        optimizer_shard_keys(model, optimizer) if optimizer is not None
                        else None)
    return rank_file_tree(host_copy(model.state_dict()), metadata, record,
                          host_copy(optimizer.state_dict()) if optimizer is not None else None,
                          copy_of_extra(extra) if extra is not None else None)


def _tensor_bytes(tree: Any) -> int:
    """What the tensors in ``tree`` take in a ``torch.save`` file: each storage once."""
    storages = {}
    for tensor in collect_tensors(tree):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def load_sharded(path_prefix: str, model: ShardedModel,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Loads a checkpoint ``save_sharded`` wrote into ``model`` (and ``optimizer``), at any
    world size and in any wrapping; returns the saved ``extra``. Every rank calls it.

    When every rank finds its own file of this world size, saved from this wrapping and
    this optimizer's shards by the same save (the usual resume), each rank loads that file
    alone. Otherwise (another world size, another wrapping, torch_xla's recipe files) the
    checkpoint is read as the loader reads a consolidated one: every rank opens all of its
    files (so every rank must see them, as on a shared filesystem) and reads only the runs
    its own shards hold (``sources.per_rank_files``); the ranks share the CRC-32
    checks. Everything is checked against the model first, and the model and optimizer
    change only once every rank has read all it needs: a checkpoint that does not fit raises
    ``CheckpointError`` on every rank, naming the file or key at fault, and changes nothing
    (see [Note: nothing changes unless everything was read])."""
    require_root(model, "load_sharded")
    refuse_reads(path_prefix)
    wait_for_pending(model)  # a save of this model in flight is published first
    path_prefix = sharding_group_path(path_prefix, model, is_prefix=True)[0]
    own = _own_file(path_prefix, model, optimizer)
    # one way for every rank (the other is collective), and the own files of one save only:
    # the save counter alone is 1 for the first save of every run
    everyone = exchange("xla_fsdp.load_sharded.own", None if own is None else own[2])
    if None not in everyone and len(set(everyone)) == 1:
        return _load_own_file(own[0], own[1], model, optimizer)
    return _load_through_source(path_prefix, model, optimizer)


def _own_file(prefix: str, model: ShardedModel, optimizer: Optional[torch.optim.Optimizer]
              ) -> Optional[Tuple[str, RankRecord, tuple]]:
    """This rank's file, its record and the save it is of (``save_identity``) if the file is
    this model's own (this world size and rank, this wrapping, this optimizer's shards in
    order, every record's CRC-32 intact); None otherwise, and the source then says what, if
    anything, is wrong."""
    path = sharded_checkpoint_path(prefix, model.rank, model.world_size)
    if not os.path.exists(path) or other_world_files(prefix, model.world_size):
        return None   # the source names what is wrong (another world size's files: a mix)
    try:
        with CheckpointFile(path) as f:
            f.verify()
            ours, identity = RankRecord.of(f.tree), save_identity(f)
            has_optimizer = isinstance(f.tree, dict) and OPTIMIZER in f.tree
            saved_groups = f.tree[OPTIMIZER].get("param_groups", []) if has_optimizer else []
    except CheckpointError:
        return None
    if ours is None or ours.fingerprint != wrapping_fingerprint(model.get_shard_metadata()):
        return None
    # another optimizer class (settings of its own not saved) is refused by the source, and
    # param groups split otherwise are read by the source as at any other world size
    if optimizer is not None and (not has_optimizer or ours.optimizer_param_keys
                                  != optimizer_shard_keys(model, optimizer)
                                  or [len(g.get("params", ())) for g in saved_groups]
                                  != [len(g["params"]) for g in optimizer.param_groups]
                                  or not all(holds_settings_of(optimizer, g)
                                             for g in saved_groups)):
        return None
    return path, ours, identity


def _load_own_file(path: str, ours: RankRecord, model: ShardedModel,
                   optimizer: Optional[torch.optim.Optimizer]) -> Any:
    """Each rank its own file; the ranks agree that every one of them read it and put it in
    place (see [Note: nothing changes unless everything was read])."""
    import torch_xla
    checkpoint: Any = None
    with every_rank_agrees("xla_fsdp.load_sharded.own.read", naming(path)):
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        _refuse_other_tensors(path, model, checkpoint[MODEL])
    commit_on_every_rank(
        "xla_fsdp.load_sharded.own", path,
        None if optimizer is None else functools.partial(load_optimizer_state, optimizer,
                                                         checkpoint[OPTIMIZER]),
        [functools.partial(model.load_state_dict, checkpoint[MODEL])])
    _SAVE_COUNT[model] = ours.save_index
    torch_xla.sync()
    return checkpoint.get(EXTRA)


def _refuse_other_tensors(path: str, model: ShardedModel, saved: Dict[str, Any]) -> None:
    """What ``model.load_state_dict`` would refuse having copied part of it, refused before
    anything changes: keys the model lacks or does not find, shapes other than its own. A
    module's extra state is given to its ``set_extra_state`` as saved, whatever its shape
    (see [Note: modules' extra state])."""
    own = model.state_dict()
    wrong = sorted(set(own) ^ set(saved)) + sorted(
        k for k in set(own) & set(saved)
        if torch.is_tensor(own[k]) and not is_extra_state_key(k)
        and tuple(own[k].shape) != tuple(saved[k].shape))
    if wrong:
        raise CheckpointError(f"{path} does not hold this model's tensors: {wrong[:10]} "
                              f"differ in name or shape")


def _load_through_source(prefix: str, model: ShardedModel,
                         optimizer: Optional[torch.optim.Optimizer]) -> Any:
    records: List[Optional[RankRecord]] = []

    def open_source() -> Any:
        source, shards, _ = open_per_rank_files(prefix, RANK_FILES, optimizer is not None,
                                                share=(model.rank, model.world_size))
        records.append(RankRecord.of(shards.files[0].tree))
        return source
    extra = load_staged(open_source, model, optimizer, "xla_fsdp.load_sharded").extra
    if records and records[0] is not None:
        _SAVE_COUNT[model] = records[0].save_index
    return extra
