"""Per-rank checkpoints of an FSDP model: ``save_sharded`` and ``load_sharded``.

Each rank writes ``{prefix}_rank-{rank:08d}-of-{world:08d}.pth`` holding torch_xla's
format, ``{'model', 'shard_metadata', 'optimizer'}``, plus an ``'xla_fsdp'`` record (world
size, rank, a fingerprint of the wrapping, which optimizer index is which shard, and a save
counter that ties the files of one save together) and the caller's ``'extra'``. Every
record carries the CRC-32 ``torch.save`` computes; ``load_sharded`` checks it. Writes are
atomic: a crash mid-save leaves the previous file whole.

With ``sharding_groups`` each group is a model of its own (torch_xla's meaning: a part of a
model-parallel model), numbered by its sharding rank, so each group writes its own files,
``{prefix}_group-{k}_rank-...``, which consolidate on their own. With
``replicate_across_groups=True`` the groups are replicas and only the first writes,
``{prefix}_rank-...``.
"""
from __future__ import annotations

import glob
import os
import weakref
from typing import Any, Dict, List, Optional

import torch

from .._xla.private_api import to_cpu
from .files import CheckpointError, CheckpointFile, atomic_path
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


def _optimizer_param_keys(model: ShardedModel, optimizer: torch.optim.Optimizer) -> List[str]:
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
    write). Every rank must call it: it synchronises the device first."""
    import torch_xla
    require_root(model, "save_sharded")
    torch_xla.sync()
    metadata = model.get_shard_metadata()
    _SAVE_COUNT[model] = _SAVE_COUNT.get(model, 0) + 1
    path_prefix = _sharding_group_prefix(path_prefix, model)
    if path_prefix is None:
        return None
    record = RankRecord(FORMAT_VERSION, model.world_size, model.rank,
                        wrapping_fingerprint(metadata), _SAVE_COUNT[model],
                        _optimizer_param_keys(model, optimizer) if optimizer is not None
                        else None)
    checkpoint: Dict[str, Any] = {MODEL: to_cpu(model.state_dict()), SHARD_METADATA: metadata,
                                  RECORD: record.as_dict()}
    if optimizer is not None:
        checkpoint[OPTIMIZER] = to_cpu(optimizer.state_dict())
    if extra is not None:
        checkpoint[EXTRA] = extra
    path = sharded_checkpoint_path(path_prefix, model.rank, model.world_size)
    with atomic_path(path) as tmp:
        torch.save(checkpoint, tmp)
    return path


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
        if ours.optimizer_param_keys != _optimizer_param_keys(model, optimizer):
            raise CheckpointError(f"{path}: the optimizer's parameters are not the ones it was "
                                  f"saved with (or not in the same order)")
        optimizer.load_state_dict(checkpoint[OPTIMIZER])
    _SAVE_COUNT[model] = ours.save_index
    torch_xla.sync()
    return checkpoint.get(EXTRA)
