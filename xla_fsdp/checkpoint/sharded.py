"""Per-rank checkpoints of an FSDP model: ``save_sharded`` and ``load_sharded``.

Each rank writes ``{prefix}_rank-{rank:08d}-of-{world:08d}.pth`` holding torch_xla's
format, ``{'model', 'shard_metadata', 'optimizer'}``, plus an ``'xla_fsdp'`` record (world
size, rank, a fingerprint of the wrapping, which optimizer index is which shard, and a save
counter that ties the files of one save together) and the caller's ``'extra'``. Every
record carries the CRC-32 ``torch.save`` computes; ``load_sharded`` checks it. A save is
every rank's or none (see the Note below): a crash or a full disk mid-save leaves the
previous files whole, and no file of the failed save on any rank.

With ``sharding_groups`` each group is a model of its own (torch_xla's meaning: a part of a
model-parallel model), numbered by its sharding rank, so each group writes its own files,
``{prefix}_group-{k}_rank-...``, which consolidate on their own. With
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

import glob
import os
import weakref
from typing import Any, Dict, List, Optional

import torch

from .._sharding.tensor_tree import collect_tensors
from .._xla.private_api import to_cpu
from .dcp.coordination import agree, agree_or_undo
from .files import CheckpointError, CheckpointFile, StagedFile
from .metadata import (EXTRA, FORMAT_VERSION, MODEL, OPTIMIZER, RECORD, SHARD_METADATA,
                       RankRecord, sharded_checkpoint_path, wrapping_fingerprint)
from .unit_protocol import ShardedModel, require_root, sharding_group_index

_SAVE_COUNT: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # per root


def _sharding_group_prefix(prefix: str, model: ShardedModel) -> Optional[str]:
    """Where this rank's sharding group writes, or None for a replica that does not write."""
    index = sharding_group_index(model)
    if index is None:
        return prefix
    if model.options.replicate_across_groups:
        return prefix if index == 0 else None
    return f"{prefix}_group-{index:03d}"


def optimizer_shard_keys(model: ShardedModel, optimizer: torch.optim.Optimizer) -> List[str]:
    """The model state dict key of the shard each optimizer index holds, in index order."""
    names = {id(p): n for n, p in model.state_dict(keep_vars=True).items()}  # the files' keys
    keys = []
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            if id(p) not in names:
                raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} "
                                 f"that is not a shard of this model; create the optimizer "
                                 f"from model.parameters() after wrapping")
            keys.append(names[id(p)])
    return keys


def save_sharded(path_prefix: str, model: ShardedModel,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 extra: Any = None) -> Optional[str]:
    """Writes this rank's checkpoint file; returns its path (None on a replica that does not
    write). Every rank must call it: it synchronises the device first, and the save is put
    in place on every rank or on none (a ``CheckpointError`` on every rank, naming the file
    and the space it needed when a disk is full); see [Note: a save is all ranks' or none]."""
    import torch_xla
    require_root(model, "save_sharded")
    torch_xla.sync()
    metadata = model.get_shard_metadata()
    _SAVE_COUNT[model] = _SAVE_COUNT.get(model, 0) + 1
    path_prefix = _sharding_group_prefix(path_prefix, model)
    staged: Optional[StagedFile] = None
    error: Optional[BaseException] = None
    if path_prefix is not None:
        path = sharded_checkpoint_path(path_prefix, model.rank, model.world_size)
        try:
            checkpoint = _checkpoint(model, metadata, optimizer, extra)
            staged = StagedFile(path, needed=_tensor_bytes(checkpoint))
            with staged.writing() as tmp:
                with open(tmp, "wb") as f:  # through Python, so a full disk says ENOSPC
                    torch.save(checkpoint, f)
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
    agree_or_undo("xla_fsdp.save_sharded.written", error,
                  None if staged is None else staged.discard)
    if staged is not None:
        try:
            staged.put_in_place()
        except Exception as exc:
            error = exc
    agree("xla_fsdp.save_sharded.placed", error)  # so no rank returns before all are
    return None if staged is None else path


def _checkpoint(model: ShardedModel, metadata: Dict[str, Any],
                optimizer: Optional[torch.optim.Optimizer], extra: Any) -> Dict[str, Any]:
    record = RankRecord(FORMAT_VERSION, model.world_size, model.rank,
                        wrapping_fingerprint(metadata), _SAVE_COUNT[model],
                        optimizer_shard_keys(model, optimizer) if optimizer is not None
                        else None)
    checkpoint: Dict[str, Any] = {MODEL: to_cpu(model.state_dict()), SHARD_METADATA: metadata,
                                  RECORD: record.as_dict()}
    if optimizer is not None:
        checkpoint[OPTIMIZER] = to_cpu(optimizer.state_dict())
    if extra is not None:
        checkpoint[EXTRA] = extra
    return checkpoint


def _tensor_bytes(tree: Any) -> int:
    """What the tensors in ``tree`` take in a ``torch.save`` file: each storage once."""
    storages = {}
    for tensor in collect_tensors(tree):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def load_sharded(path_prefix: str, model: ShardedModel,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Loads this rank's file into ``model`` (and ``optimizer``); returns the saved ``extra``.

    The file must come from a model wrapped the same way at the same world size; for another
    world size, reshard it first (``consolidate_sharded_ckpts --reshard N``)."""
    import torch_xla
    require_root(model, "load_sharded")
    path_prefix = _sharding_group_prefix(path_prefix, model) or path_prefix
    metadata = model.get_shard_metadata()
    path = sharded_checkpoint_path(path_prefix, model.rank, model.world_size)
    if not os.path.exists(path):
        others = sorted(glob.glob(f"{glob.escape(path_prefix)}_rank-*-of-*.pth"))
        hint = (f"; found {others[0]} and others of another world size: reshard them with "
                f"consolidate_sharded_ckpts --ckpt_prefix {path_prefix} --reshard "
                f"{model.world_size}" if others else "")
        raise CheckpointError(f"{path}: no such checkpoint file{hint}")
    with CheckpointFile(path) as f:
        f.verify()
        ours = RankRecord.of(f.tree)
    if ours is None:
        raise CheckpointError(f"{path} was not written by save_sharded")
    expected = wrapping_fingerprint(metadata)
    if ours.fingerprint != expected:
        raise CheckpointError(
            f"{path} was saved from a model sharded differently (fingerprint {ours.fingerprint}, "
            f"this model's is {expected}): the wrapping, parameter shapes or options such as "
            f"flatten_parameters/shard_param_on_dim_0 differ. Consolidate it with "
            f"consolidate_sharded_ckpts and load the result with model.load_full_state_dict()")
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    model.load_state_dict(checkpoint[MODEL])
    if optimizer is not None:
        if OPTIMIZER not in checkpoint:
            raise CheckpointError(f"{path} holds no optimizer state")
        if ours.optimizer_param_keys != optimizer_shard_keys(model, optimizer):
            raise CheckpointError(f"{path}: the optimizer's parameters are not the ones it was "
                                  f"saved with (or not in the same order)")
        optimizer.load_state_dict(checkpoint[OPTIMIZER])
    _SAVE_COUNT[model] = ours.save_index
    torch_xla.sync()
    return checkpoint.get(EXTRA)
