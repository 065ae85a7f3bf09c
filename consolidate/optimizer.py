"""Optimizer state: from per-rank shards to the unwrapped model's layout, and back.

An optimizer state tensor is sharded exactly like its parameter when it has the shard's
shape (Adam's moments, SGD's momentum); anything else (``step``) is the same on every rank
and is taken from rank 0. The sharded optimizer's parameter indices are resolved through
``optimizer_param_keys``, which ``save_sharded`` records: index ``i`` is the shard whose
model state dict key is ``optimizer_param_keys[i]``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from xla_fsdp.files import CheckpointError, TensorRef

from .plan import GroupSpec, ModelPlan, ParamSpec, read_param
from .shard_set import ShardSet


def why_not_consolidated(shards: ShardSet) -> Optional[str]:
    """None if the optimizer can be consolidated, else the reason."""
    tree = shards.files[0].tree
    if "optimizer" not in tree:
        return "the checkpoint holds no optimizer state"
    if not (tree.get("xla_fsdp") or {}).get("optimizer_param_keys"):
        return (f"{shards.files[0].path} was not written by xla_fsdp.checkpoint.save_sharded, "
                f"so which parameter each optimizer index refers to is unknown")
    return None


def _param_keys(shards: ShardSet) -> List[str]:
    return shards.files[0].tree["xla_fsdp"]["optimizer_param_keys"]


def _is_sharded(value: Any, shard: TensorRef) -> bool:
    return isinstance(value, TensorRef) and len(value.shape) >= 1 and value.shape == shard.shape


def consolidate_optimizer(shards: ShardSet, plan: ModelPlan,
                          add: Callable[[torch.Tensor], Any]) -> Tuple[Dict[str, Any], List[str]]:
    """The optimizer state dict an optimizer over the unwrapped model's parameters would
    have, and its parameter names by index. Tensors go through ``add`` as they are read.

    Within each param group the parameters are in the unwrapped model's order, so build
    the unsharded optimizer's groups in that order."""
    keys = _param_keys(shards)
    groups = plan.group_of()
    rank = {name: i for i, name in enumerate(plan.param_order)}
    opt0 = shards.files[0].tree["optimizer"]
    state: Dict[int, Dict[str, Any]] = {}
    param_groups, names = [], []
    for group in opt0["param_groups"]:
        members: List[Tuple[ParamSpec, GroupSpec, int]] = []
        for index in group["params"]:
            spec = groups.get(keys[index])
            if spec is None:
                raise CheckpointError(f"optimizer index {index} refers to {keys[index]}, which "
                                      f"is not a shard of the model")
            members += [(p, spec, index) for p in spec.params]
        members.sort(key=lambda m: rank.get(m[0].name, len(rank)))
        new_indices = []
        for param, spec, index in members:
            new_indices.append(len(names))
            names.append(param.name)
            old = opt0["state"].get(index)
            if old is not None:
                state[new_indices[-1]] = _full_state(shards, spec, param, index, old, add)
        new_group = dict(group, params=new_indices)
        if "param_names" in group:
            new_group["param_names"] = [names[i] for i in new_indices]
        param_groups.append(new_group)
    return {"state": state, "param_groups": param_groups}, names


def _full_state(shards: ShardSet, spec: GroupSpec, param: ParamSpec, index: int,
                old: Dict[str, Any], add: Callable[[torch.Tensor], Any]) -> Dict[str, Any]:
    shard0 = shards.files[0].tree["model"][spec.key]
    out = {}
    for name, value in old.items():
        if _is_sharded(value, shard0):
            per_rank = [f.tree["optimizer"]["state"][index][name] for f in shards.files]
            out[name] = add(read_param(per_rank, param))
        elif isinstance(value, TensorRef):
            out[name] = add(value.read())
        else:
            out[name] = value
    return out


def reshard_optimizer_state(shards: ShardSet, spec: GroupSpec, index: int,
                            new_shards: Callable[[List[TensorRef]], List[torch.Tensor]],
                            adds: List[Callable[[torch.Tensor], Any]]) -> List[Dict[str, Any]]:
    """Optimizer state of sharded index ``index`` for every new rank. ``new_shards`` turns
    old per-rank shards into new per-rank shards; ``adds[r]`` writes to new rank ``r``."""
    old = shards.files[0].tree["optimizer"]["state"][index]
    shard0 = shards.files[0].tree["model"][spec.key]
    out: List[Dict[str, Any]] = [{} for _ in adds]
    for name, value in old.items():
        if _is_sharded(value, shard0):
            per_rank = [f.tree["optimizer"]["state"][index][name] for f in shards.files]
            for r, piece in enumerate(new_shards(per_rank)):
                out[r][name] = adds[r](piece)
        elif isinstance(value, TensorRef):
            tensor = value.read()
            for r, add in enumerate(adds):
                out[r][name] = add(tensor)
        else:
            for r in range(len(adds)):
                out[r][name] = value
    return out
