"""Per-rank checkpoints of an FSDP model: ``save_sharded`` (``writers.per_rank_files``) and
``load_sharded``, which reads back what it wrote, at any world size and in any wrapping.
Every record's CRC-32 is checked on load.
"""
from __future__ import annotations

import functools
import glob
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._xla.trace_only import refuse_reads
from .async_save import wait_for_pending
from .coordination import every_rank_agrees, exchange, naming
from .files import CheckpointError, CheckpointFile
from .live_model import (is_extra_state_key, replica_index, require_root,
                         sharding_group_load_path)
from .optimizer_state import holds_settings_of, optimizer_shard_keys
from .per_rank.shard_set import save_identity
from .formats.per_rank import (RANK_FILES, REPLICA_EXTRAS, SHARD_METADATA, RankRecord,
                              other_world_files, sharded_checkpoint_path, wrapping_fingerprint)
from .sources.per_rank_files import open_per_rank_files
from .staging import commit_on_every_rank, load_optimizer_state, load_staged
from .formats.keys import EXTRA, MODEL, OPTIMIZER
from .unit_protocol import ShardedModel
from .writers.per_rank_files import continue_count, save_sharded


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
    path_prefix = sharding_group_load_path(
        path_prefix, model, lambda p: bool(glob.glob(glob.escape(p) + RANK_FILES)), True)
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
            ours = RankRecord.of(f.tree)
            if ours is None or SHARD_METADATA not in f.tree:
                return None   # not one we wrote: the source says what it is
            identity = save_identity(f)
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
        [] if optimizer is None else [functools.partial(load_optimizer_state, optimizer,
                                                        checkpoint[OPTIMIZER])],
        [functools.partial(model.load_state_dict, checkpoint[MODEL])])
    continue_count(model, ours.save_index)
    torch_xla.sync()
    # see [Note: each replica's extra]
    return checkpoint.get(REPLICA_EXTRAS, {}).get(replica_index(model), checkpoint.get(EXTRA))


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
        source, shards = open_per_rank_files(prefix, RANK_FILES, optimizer is not None,
                                             share=(model.rank, model.world_size))
        records.append(RankRecord.of(shards.files[0].tree))
        return source
    extra = load_staged(open_source, model, optimizer, "xla_fsdp.load_sharded").extra
    if records and records[0] is not None:
        continue_count(model, records[0].save_index)
    return extra


__all__ = ["save_sharded", "load_sharded"]
