"""Optimizer state: from per-rank shards to the unwrapped model's layout.

State sharded like its shard (``optimizer_state.walk_state``) is spread over the rank files as
the parameter is (``plan.SpreadTensor``); anything else (``step``) is the same on every rank
and is taken from rank 0 (``saved_state``). The sharded optimizer's parameter indices are
resolved by ``optimizer_param_keys``: index ``i`` is the shard whose model state dict key is
``keys[i]``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..files import CheckpointError, TensorRef
from ..formats.per_rank import RankRecord
from ..optimizer_state import walk_state
from ..formats.keys import MODEL, OPTIMIZER
from ..unwrapped_state import Member, NamedState, holding, named_state as name_state
from .plan import ShardGroupSpec, ModelPlan, ParamSpec, SpreadTensor, saved_keys
from .shard_set import ShardSet


def optimizer_param_keys(shards: ShardSet, plan: ModelPlan
                         ) -> Tuple[Optional[List[str]], Optional[str]]:
    """Which shard (model state dict key) each optimizer index holds, or why that is unknown.

    ``save_sharded`` records it. A file written with torch_xla's recipe (``model``,
    ``shard_metadata`` and ``optimizer.state_dict()``) does not, but an optimizer built over
    the wrapped model's ``parameters()`` numbers the shards in the state dict's order: that
    is taken when the optimizer has one param group holding every shard and every state
    tensor has its shard's shape on every rank (or when torch recorded ``param_names``)."""
    tree = shards.files[0].tree
    if OPTIMIZER not in tree:
        return None, "the checkpoint holds no optimizer state"
    record = RankRecord.of(tree)
    if record is not None and record.optimizer_param_keys:
        saved_key = saved_keys(tree[MODEL])
        keys = [saved_key(k) for k in record.optimizer_param_keys]
        left_out = [k for k in keys if k not in tree[MODEL]]
        if left_out:   # see [Note: shards left out of every rank file]
            return None, (f"{shards.files[0].path}: the optimizer holds the state of shard "
                          f"{left_out[0]}, which the rank files do not hold (left out when "
                          f"saving)")
        return keys, None
    param_groups = tree[OPTIMIZER].get("param_groups", [])
    if param_groups and all("param_names" in g for g in param_groups):
        keys = [n for g in param_groups for n in g["param_names"]]
    else:
        keys = [k for k in tree[MODEL] if k in plan.spec_of()]
        if len(param_groups) != 1 or len(param_groups[0]["params"]) != len(keys):
            counts = [len(g["params"]) for g in param_groups]
            return None, (f"{shards.files[0].path} does not record which parameter each "
                          f"optimizer index is, and its optimizer ({len(param_groups)} param "
                          f"group(s) of {counts} parameters) is not one group over the "
                          f"{len(keys)} shards of model.parameters(); save with "
                          f"xla_fsdp.checkpoint.save_sharded to record it")
    return keys, _shape_mismatch(shards, keys)


def _shape_mismatch(shards: ShardSet, keys: List[str]) -> Optional[str]:
    """Why index ``i`` cannot be the shard ``keys[i]`` in some file, by the one rule
    (``walk_state``), or None."""
    for f in shards.files:
        opt, model = f.tree[OPTIMIZER], f.tree[MODEL]
        indices = [i for g in opt["param_groups"] for i in g["params"]]
        lost = [i for i in indices if i >= len(keys) or keys[i] not in model]
        if lost:
            return f"{f.path}: optimizer index {lost[0]} has no shard to belong to"
        state = opt.get("state", {})
        try:   # the walk raises at the first value the rule refuses
            list(walk_state({i: state.get(i, {}) for i in indices},
                            lambda i: model[keys[i]].shape,
                            lambda i: f"{f.path}: optimizer index {i} (shard {keys[i]})"))
        except CheckpointError as exc:
            return (f"the optimizer was not built over model.parameters() in order (the file "
                    f"records no optimizer index's shard), or its state is per shard: {exc}")
    return None


def saved_state(shards: ShardSet, spec: ShardGroupSpec, param: ParamSpec, index: int
                ) -> Dict[str, Any]:
    """``param``'s optimizer state as saved under optimizer index ``index``: state sharded
    like the shard as a ``SpreadTensor`` over every rank's, the rest as rank 0 holds it (a
    ``TensorRef`` for a tensor)."""
    head = shards.files[0].tree
    where = (f"{shards.files[0].path}, optimizer index {index} "
             f"({holding([p.name for p in spec.params])})")
    return {s.name: SpreadTensor(_state_of_every_rank(shards, index, s.name), spec, param)
            if s.sharded else s.value
            for s in walk_state({index: head[OPTIMIZER]["state"].get(index, {})},
                                lambda _: head[MODEL][spec.key].shape, lambda _: where)}


def _state_of_every_rank(shards: ShardSet, index: int, name: str) -> List[TensorRef]:
    out = []
    for f in shards.files:
        value = f.tree[OPTIMIZER].get("state", {}).get(index, {}).get(name)
        if not isinstance(value, TensorRef):
            raise CheckpointError(f"{f.path}: optimizer index {index} has no {name!r} state, "
                                  f"which rank 0's file holds")
        out.append(value)
    return out


def named_state(shards: ShardSet, plan: ModelPlan) -> NamedState:
    """The per-rank files' optimizer state by parameter name (``unwrapped_state.named_state``),
    its tensors sharded like their parameter spread over the rank files, the others rank 0's."""
    keys, reason = optimizer_param_keys(shards, plan)
    if keys is None:
        raise CheckpointError(reason)
    specs = plan.spec_of()
    param_groups = []
    for param_group in shards.files[0].tree[OPTIMIZER]["param_groups"]:
        members: List[Member] = []
        for index in param_group["params"]:
            spec = specs.get(keys[index])
            if spec is None:
                raise CheckpointError(f"optimizer index {index} refers to {keys[index]}, which "
                                      f"is not a shard of the model")
            members += [(p.name, spec.key, index) for p in spec.params]
        param_groups.append((param_group, members))
    saved = shards.files[0].tree[OPTIMIZER]["state"]
    param_of = {p.name: p for spec in plan.shard_groups for p in spec.params}

    def state_of(member: Member) -> Optional[Dict[str, Any]]:
        name, key, index = member
        return saved_state(shards, specs[key], param_of[name], index) if index in saved \
            else None
    return name_state(param_groups, plan.param_order, state_of)
