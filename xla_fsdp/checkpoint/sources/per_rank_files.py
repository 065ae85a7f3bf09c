"""One checkpoint's per-rank files as the loader's source (``staging.Source``): what
``load_sharded`` reads at another world size or wrapping, and what ``--reshard N`` reads
each new rank's shards from.

The files hold the unwrapped model as a consolidated file would, under the DCP layout's
``get_state_dict`` keys (``sources.entries``): every parameter (tied ones under each of their
names), every persistent buffer in the dtype the model restores it to, the optimizer's state
by parameter name and its param groups listing names, and ``extra``. No full parameter is
ever assembled: each is a ``plan.SpreadTensor``, whose runs of row-major elements are read
from the rank files that hold them, so a rank reads the runs its own new
shards hold and nothing else (see [Note: a rank reads the runs its shards hold]). Optimizer
state sharded like its shard (Adam's moments, SGD's momentum) is spread the same way; a step
count and anything else not sharded is the same on every rank and comes from rank 0.

Each rank that opens the files opens all of them: the ranks of a load at another world size
need a filesystem they all see, as consolidation does.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence, Tuple

from ..formats.dcp.layout import GET_STATE_DICT, rank_extra_key, replica_extra_key
from ..files import CheckpointError
from ..formats.per_rank import REPLICA_EXTRAS
from .entries import EntrySource, add_state_entries, model_entries
from ..per_rank.optimizer import optimizer_param_keys
from ..per_rank.plan import ModelPlan, plan_model
from ..per_rank.unwrapped import unwrapped_state
from ..per_rank.shard_set import ShardSet, find_shard_set
from ..formats.keys import EXTRA


def open_per_rank_files(prefix: str, suffix: str, with_optimizer: bool,
                        share: Tuple[int, int] = (0, 1)) -> Tuple[EntrySource, ShardSet]:
    """The checkpoint whose rank files are ``prefix + suffix`` (a glob) as a source that
    closes them, with the files. ``share`` (i, n): this caller checks the
    CRC-32s of every n-th file from the i-th, so that n loading ranks together read every
    file once. ``CheckpointError`` naming the file at fault when the files do not form one
    complete checkpoint, or, ``with_optimizer``, when its optimizer state cannot be mapped
    to parameter names."""
    try:
        shards = find_shard_set(prefix, suffix, verify=False)
    except CheckpointError as exc:
        if "no files match" not in str(exc):
            raise
        raise CheckpointError(f"{prefix}: no such checkpoint ({exc})") from None
    with contextlib.ExitStack() as to_close:
        to_close.callback(shards.close)
        for f in shards.files[share[0]::share[1]]:
            f.verify()
        try:
            plan = plan_model(shards)
        except CheckpointError as exc:  # the shard metadata, as rank 0's file holds it
            raise CheckpointError(f"{shards.files[0].path}: {exc}") from None
        return shard_set_source(shards, plan, with_optimizer, [to_close.pop_all().close]), shards


def shard_set_source(shards: ShardSet, plan: ModelPlan, with_optimizer: bool,
                     closers: Sequence[Callable[[], None]] = ()) -> EntrySource:
    """``shards`` (opened and checked, planned as ``plan``) as a source; closing it runs
    ``closers``."""
    head = shards.files[0].tree
    if with_optimizer:
        keys, reason = optimizer_param_keys(shards, plan)
        if keys is None:
            raise CheckpointError(f"{shards.pattern}: its optimizer state cannot be read: "
                                  f"{reason}")
    state = unwrapped_state(shards, plan, with_optimizer)
    tensors, objects = model_entries(state.with_aliases(dict(state.tensors)))
    if state.optimizer is not None:
        # the optimizer state by parameter name, and param groups listing names
        for key, _, value in state.optimizer.param_group_entries(GET_STATE_DICT):
            objects[key] = value
        add_state_entries(state.optimizer.state, tensors, objects)
    if EXTRA in head:
        objects[EXTRA] = head[EXTRA]
    for rank, f in enumerate(shards.files):
        # see [Note: each rank's extra]; for the replicas', see [Note: each replica's extra]
        if EXTRA in head and len(shards.files) > 1:
            objects[rank_extra_key(rank)[0]] = f.tree.get(EXTRA)
        for replica, extra in f.tree.get(REPLICA_EXTRAS, {}).items():
            objects[replica_extra_key(rank, replica)[0]] = extra
    return EntrySource(shards.pattern, tensors, objects, closers)
