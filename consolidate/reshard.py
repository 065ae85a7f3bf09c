"""Rewrites a sharded checkpoint for another number of ranks, one shard group at a time."""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, List

import torch

from xla_fsdp.files import CheckpointError, TensorRef, TorchFileWriter
from xla_fsdp.shard_metadata import wrapping_fingerprint

from .optimizer import optimizer_param_keys, reshard_optimizer_state
from .plan import GroupSpec, ModelPlan, layer_layout, read_group
from .shard_set import ShardSet


def new_shards(per_rank: List[TensorRef], spec: GroupSpec, world_size: int
               ) -> List[torch.Tensor]:
    """The group's shards (or a state tensor sharded like it) for ``world_size`` ranks, from
    its old per-rank ones. A stacked group is resharded one layer at a time into the new
    ranks' rows, so only one layer is ever held besides the new shards."""
    layout = layer_layout(spec, world_size)
    if not spec.stacked:
        content = read_group(per_rank, spec)
        return [layout.shard([content], r) for r in range(world_size)]
    out = [torch.empty((spec.layers,) + tuple(layout.shard_shape), dtype=per_rank[0].dtype)
           for _ in range(world_size)]
    for i in range(spec.layers):
        content = read_group(per_rank, spec, i)
        for r in range(world_size):
            out[r][i] = layout.shard([content], r)
    return out


def reshard(shards: ShardSet, plan: ModelPlan, world_size: int, paths: List[str],
            progress: Callable[[int], None]) -> None:
    """Writes ``paths[r]`` for every new rank ``r``; each loads with ``load_sharded`` into the
    same model wrapped at ``world_size`` ranks."""
    if not shards.written_by_xla_fsdp or not shards.metadata.get("layout_info"):
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
        if index in head0["optimizer"]["state"]:
            indices.setdefault(key, []).append(index)
    for key in plan.buffers:
        tensor = head0["model"][key].read()
        for r in range(world_size):
            models[r][key] = adds[r](tensor)
        progress(tensor.numel())
    for spec in plan.groups:
        reshard_group = functools.partial(new_shards, spec=spec, world_size=world_size)
        per_rank = [f.tree["model"][spec.key] for f in shards.files]
        for r, piece in enumerate(reshard_group(per_rank)):
            models[r][spec.key] = adds[r](piece)
        progress(spec.numel)
        for index in indices.get(spec.key, []):
            for r, state in enumerate(reshard_optimizer_state(shards, spec, index, reshard_group,
                                                              adds)):
                opt_states[r][index] = state
    extra = _materialize(head0["extra"]) if "extra" in head0 else None
    for r, writer in enumerate(writers):
        tree = {"model": models[r], "shard_metadata": _metadata_for(shards.metadata, world_size, r)}
        tree["xla_fsdp"] = dict(head0["xla_fsdp"], world_size=world_size, rank=r,
                                fingerprint=wrapping_fingerprint(tree["shard_metadata"]))
        if with_optimizer:
            tree["optimizer"] = {"state": opt_states[r],
                                 "param_groups": copy.deepcopy(head0["optimizer"]["param_groups"])}
        if "extra" in head0:
            tree["extra"] = extra
        writer.finish(tree)


def _metadata_for(metadata: Dict[str, Any], world_size: int, rank: int) -> Dict[str, Any]:
    out = copy.deepcopy(metadata)
    out["world_size"], out["rank"] = world_size, rank
    return out


def _materialize(tree: Any) -> Any:
    if isinstance(tree, TensorRef):
        return tree.read()
    if isinstance(tree, dict):
        return type(tree)((k, _materialize(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_materialize(v) for v in tree)
    return tree
