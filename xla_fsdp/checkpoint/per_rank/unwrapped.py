"""Per-rank files as the consolidated writers read them (``unwrapped_state.UnwrappedState``):
each entry of the unwrapped model, and each optimizer state sharded like it, read from the runs
of the rank files that hold its elements when a writer asks for it."""
from __future__ import annotations

from ..files.reader import materialized
from ..state_keys import EXTRA
from ..unwrapped_state import UnwrappedState
from .optimizer import named_state
from .plan import ModelPlan, unwrapped_tensors
from .shard_set import ShardSet


def unwrapped_state(shards: ShardSet, plan: ModelPlan, with_optimizer: bool) -> UnwrappedState:
    """``shards`` (opened, checked and planned as ``plan``), the optimizer's state with them
    when ``with_optimizer`` (its parameter mapping known: ``optimizer_param_keys``)."""
    head = shards.files[0].tree
    return UnwrappedState(unwrapped_tensors(plan, shards.files), list(plan.aliases),
                          named_state(shards, plan) if with_optimizer else None,
                          {EXTRA: materialized(head[EXTRA])} if EXTRA in head else {})
