"""Per-rank files of a live model: ``save_sharded``.

Each rank writes ``{prefix}_rank-{rank:08d}-of-{world:08d}.pth`` holding torch_xla's
format, ``{'model', 'shard_metadata', 'optimizer'}``, plus an ``'xla_fsdp'`` record (world
size, rank, a fingerprint of the wrapping, which optimizer index is which shard, and a save
counter that ties the files of one save together) and the caller's ``'extra'``
(``formats.per_rank``). Every record carries the CRC-32 ``torch.save`` computes. A save is
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

import secrets
import weakref
from typing import Any, Dict, Optional

import torch

from ..._sharding.tensor_tree import collect_tensors
from ..async_save import copy_of_extra, host_copy, run_save, wait_for_pending
from ..coordination import agree, agree_or_undo, every_rank_agrees, exchange, naming
from ..files import StagedFile, remove_if_there
from ..live_model import (extras_of_replicas, require_root, sharding_group_path,
                          writes_sharding_group_copy)
from ..optimizer_state import optimizer_shard_keys, saved_state_dict
from ..formats.per_rank import (FORMAT_VERSION, RankRecord, other_world_files, rank_file_tree,
                               sharded_checkpoint_path, wrapping_fingerprint)
from ..unit_protocol import ShardedModel

# per root: its saves so far, or the count of the save it last loaded (``continue_count``)
_SAVE_COUNT: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def continue_count(model: ShardedModel, save_index: int) -> None:
    """After ``model`` loaded the files of save ``save_index``: its next save is the one
    after it, so that files of one save are never taken for another's."""
    _SAVE_COUNT[model] = save_index


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
    save_id = exchange("xla_fsdp.save_sharded.id", secrets.token_hex(8))[0]  # rank 0's
    # a value one rank cannot copy or pickle fails every rank, before any file is touched
    with every_rank_agrees("xla_fsdp.save_sharded.extra_copy",
                           naming(f"{path_prefix}: the save's extra")):
        copied = copy_of_extra(extra) if extra is not None else None
    replicas = extras_of_replicas(model, copied)
    # None on a replica that does not write
    path_prefix = (sharding_group_path(path_prefix, model, is_prefix=True)[0]
                   if writes_sharding_group_copy(model) else None)
    job = _RankFileSave(path_prefix, model.rank, model.world_size)
    if path_prefix is not None:
        try:
            record = RankRecord(FORMAT_VERSION, model.world_size, model.rank,
                                wrapping_fingerprint(metadata), _SAVE_COUNT[model],
                                optimizer_shard_keys(model, optimizer) if optimizer is not None
                                else None, save_id)
            job.checkpoint = rank_file_tree(
                host_copy(model.state_dict()), metadata, record,
                host_copy(saved_state_dict(optimizer)) if optimizer is not None else None, copied,
                replicas)
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
        # through Python's file, so that a full disk says ENOSPC
        with self.staged.writing() as tmp, open(tmp, "wb") as f:
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
            remove_if_there(*other_world_files(self.prefix, self.world_size))
        return None if staged is None else self.path


def _tensor_bytes(tree: Any) -> int:
    """What the tensors in ``tree`` take in a ``torch.save`` file: each storage once."""
    storages = (tensor.untyped_storage() for tensor in collect_tensors(tree))
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())
