"""Per-rank files as the consolidated writers read them (``unwrapped_state.UnwrappedState``):
each entry of the unwrapped model, and each optimizer state sharded like it, read from the runs
of the rank files that hold its elements when a writer asks for it."""
from __future__ import annotations

import warnings

from ..files.reader import materialized
from ..formats.per_rank import RECORD, REPLICA_EXTRAS, SHARD_METADATA
from ..formats.keys import EXTRA, MODEL, OPTIMIZER
from ..unwrapped_state import UnwrappedState
from .optimizer import named_state
from .plan import ModelPlan, unwrapped_tensors
from .shard_set import ShardSet

# a per-rank file's entries that a consolidated checkpoint holds, or that say how to read them
_CARRIED = (MODEL, OPTIMIZER, EXTRA, SHARD_METADATA, RECORD, REPLICA_EXTRAS)


def unwrapped_state(shards: ShardSet, plan: ModelPlan, with_optimizer: bool) -> UnwrappedState:
    """``shards`` (opened, checked and planned as ``plan``), the optimizer's state with them
    when ``with_optimizer`` (its parameter mapping known: ``optimizer_param_keys``)."""
    head = shards.files[0].tree
    dropped = sorted(str(k) for k in head if k not in _CARRIED)
    if dropped:
        # the caller's own entries (Lightning Fabric's full save puts its state's other
        # keys here, a step count, a scheduler): said, not lost silently
        warnings.warn(f"{shards.files[0].path} holds {dropped} beside the model, which a "
                      f"consolidated checkpoint does not carry: it keeps 'model', "
                      f"'optimizer' and 'extra' only. Keep such values under 'extra' "
                      f"(save_sharded(..., extra=...)) to have them consolidated")
    if plan.left_out:
        # see [Note: shards left out of every rank file]
        names = plan.left_out
        warnings.warn(f"{shards.files[0].path} and the other rank files hold no shard of "
                      f"{len(names)} parameters ({', '.join(names[:3])}"
                      f"{', ...' if len(names) > 3 else ''}), which the shard metadata lists: "
                      f"they were left out when saving (a filter), and only the others are "
                      f"read")
    return UnwrappedState(unwrapped_tensors(plan, shards.files), list(plan.aliases),
                          named_state(shards, plan) if with_optimizer else None,
                          {EXTRA: materialized(head[EXTRA])} if EXTRA in head else {})
