"""Redistributes a sharded checkpoint over another number of ranks, one shard group at a time
(the CLI's ``--reshard N``)."""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Dict, List

import torch

from ..files import CheckpointError, TensorRef, TorchFileWriter
from ..metadata import (EXTRA, MODEL, OPTIMIZER, RECORD, SHARD_METADATA, RankRecord,
                        wrapping_fingerprint)
from .optimizer import optimizer_param_keys, redistribute_optimizer_state
from .plan import ShardGroupSpec, ModelPlan, layer_layout, read_shard_group
from .shard_set import ShardSet


def new_shards(per_rank: List[TensorRef], spec: ShardGroupSpec, world_size: int
               ) -> List[torch.Tensor]:
    """The group's shards (or a state tensor sharded like it) for ``world_size`` ranks, from
    its old per-rank ones. A stacked group is resharded one layer at a time into the new
    ranks' rows, so only one layer is ever held besides the new shards."""
    layout = layer_layout(spec, world_size)
    if not spec.stacked:
        content = read_shard_group(per_rank, spec)
        return [layout.shard([content], r) for r in range(world_size)]
    out = [torch.empty((spec.layers,) + tuple(layout.shard_shape), dtype=per_rank[0].dtype)
           for _ in range(world_size)]
    for i in range(spec.layers):
        content = read_shard_group(per_rank, spec, i)
        for r in range(world_size):
            out[r][i] = layout.shard([content], r)
    return out


def redistribute(shards: ShardSet, plan: ModelPlan, world_size: int, paths: List[str],
                 progress: Callable[[int], None]) -> None:
    """Writes ``paths[r]`` for every new rank ``r``; each loads with ``load_sharded`` into the
    same model wrapped at ``world_size`` ranks."""
    record = RankRecord.of(shards.files[0].tree)
    if record is None or not shards.metadata.has_layouts:
        raise CheckpointError(
            f"{shards.files[0].path} was not written by xla_fsdp.checkpoint.save_sharded, so its "
            f"shard layouts are unknown and it cannot be resharded; consolidate it and load the "
            f"result with model.load_full_state_dict() instead")
    head0 = shards.files[0].tree
    writers = [TorchFileWriter(p) for p in paths]
    adds = [w.add for w in writers]
    models: List[Dict[str, Any]] = [{} for _ in paths]
    keys = optimizer_param_keys(shards, plan)[0]
    with_optimizer = keys is not None
    keys = keys or []
    opt_states: List[Dict[int, Any]] = [{} for _ in paths]
    indices: Dict[str, List[int]] = {}  # shard key -> optimizer indices holding state for it
    for index, key in enumerate(keys):
        if index in head0[OPTIMIZER]["state"]:
            indices.setdefault(key, []).append(index)
    for key in plan.buffers:
        tensor = head0[MODEL][key].read()
        for r in range(world_size):
            models[r][key] = adds[r](tensor)
        progress(tensor.numel())
    for spec in plan.shard_groups:
        split = functools.partial(new_shards, spec=spec, world_size=world_size)
        per_rank = [f.tree[MODEL][spec.key] for f in shards.files]
        for r, piece in enumerate(split(per_rank)):
            models[r][spec.key] = adds[r](piece)
        progress(spec.numel)
        for index in indices.get(spec.key, []):
            for r, state in enumerate(redistribute_optimizer_state(shards, spec, index, split,
                                                                   adds)):
                opt_states[r][index] = state
    extra = materialize(head0[EXTRA]) if EXTRA in head0 else None
    for r, writer in enumerate(writers):
        metadata = shards.metadata.for_rank(world_size, r)
        tree = {MODEL: models[r], SHARD_METADATA: metadata,
                RECORD: dataclasses.replace(record, world_size=world_size, rank=r,
                                            fingerprint=wrapping_fingerprint(metadata)).as_dict()}
        if with_optimizer:
            tree[OPTIMIZER] = {"state": opt_states[r],
                               "param_groups": copy.deepcopy(head0[OPTIMIZER]["param_groups"])}
        if EXTRA in head0:
            tree[EXTRA] = extra
        writer.finish(tree)


def materialize(tree: Any) -> Any:
    """``tree`` with every tensor read from its file."""
    if isinstance(tree, TensorRef):
        return tree.read()
    if isinstance(tree, dict):
        return type(tree)((k, materialize(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(materialize(v) for v in tree)
    return tree
