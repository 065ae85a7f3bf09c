"""A unit's full parameters as values of a graph that ``torch.compile`` traces, gathered in
the graph (each record then lends its value to its modules for one forward:
``ParamRecord.lend``).

[Note: collectives traced into the compiled graph]
Under ``torch.compile`` a unit's forward hooks are traced by Dynamo like the modules' code.
Each shard group is gathered with ``_xla.traced_collectives.traced_gather``, an all-gather
whose backward reduce-scatters, so the whole model's forward, gathers included, is one
Dynamo graph, and AOTAutograd makes one forward and one backward program of it, with every
reduce-scatter in the backward one. The gathered values are put into the modules'
attributes where the placeholders stand (a plain ``setattr``, which Dynamo replays as a
side effect; the placeholders are back when the forward returns), so the modules' own code
reads them and autograd takes their gradients straight to the shards: no hook runs in the
backward, and ``.grad`` of every shard is set by the backward program itself. The unit's
first input that carries a gradient goes through the same gather, so that its reductions
come before the previous unit's backward (see [Note: one unit's reductions before the next
unit's backward] in ``_xla.traced_collectives``).

What ZeRO-3 needs from the partitioner is that no gathered value is saved for the backward.
Untagged, AOTAutograd saves them (re-gathering costs more than keeping). So the gathers run
under ``torch.utils.checkpoint`` with a policy that makes every op of them
``MUST_RECOMPUTE``: the backward program gathers each unit again, from its shard, which the
backward reads anyway. With ``reshard_after_forward=False`` the policy is ``MUST_SAVE``
instead, the full parameters kept from forward to backward as that setting asks. Where the
gathers and the reduce-scatters run inside each program is left to XLA's scheduler
(prefetch settings order eager work and have nothing to order here).

The path is taken only where a unit's eager semantics can be had in a graph (``blocker``
says what stands in the way otherwise, and the graph-break path runs instead: see [Note:
FSDP's hooks under torch.compile]): functional collectives span every rank, so sharding
groups and hybrid sharding are out; offloaded gradients leave the device from a hook at the
end of backward; ``no_sync`` keeps full gradients on the placeholders, which this path never
fills, and a pending accumulation must be reduced by the eager path that holds it; and the
debugging stand-ins for collectives exist only eagerly.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from .._sharding.layout import unshard_all
from .._xla.traced_collectives import traced_gather
from .options import FsdpOptions
from .shard_group import ShardGroup


def blocker(options: FsdpOptions) -> Optional[str]:
    """What keeps a unit with these options off the traced path, or None."""
    if options.sharding_groups is not None or options.replica_groups is not None:
        return "sharding_groups"
    if options.offload_optimizer:
        return "offload_optimizer"
    if options.dummy_collectives:
        return "the _debug_dummy collectives"
    return None


def full_values(shard_groups: Sequence[ShardGroup], world: int, options: FsdpOptions,
                divide: tuple, keep_for_backward: bool, x: Optional[torch.Tensor]
                ) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
    """Every record's full value, in shard group order, gathered in the traced graph, and
    ``x`` (the unit's input, or None) tied to the unit's reductions (see [Note: collectives
    traced into the compiled graph])."""
    gather = functools.partial(_gather_all, [(g.layout, g.compute_dtype) for g in shard_groups],
                               world, options.fp32_reduce_scatter, divide)
    shards = [g.shard for g in shard_groups]
    if not any(s.requires_grad for s in shards):
        return gather(x, *shards)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    policy = functools.partial(_save_or_recompute, keep_for_backward)
    return checkpoint(gather, x, *shards, use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, policy))


def _gather_all(specs: list, world: int, fp32_reduce: bool, divide: tuple,
                x: Optional[torch.Tensor], *shards: torch.Tensor
                ) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
    pieces = [p for (layout, _), shard in zip(specs, shards) for p in layout.pieces(shard)]
    dtypes = [d for layout, d in specs for _ in range(layout.piece_count)]
    reduce_dtypes = [torch.float32 if fp32_reduce else d for d in dtypes]
    x, gathered = traced_gather(pieces, x, world, dtypes, reduce_dtypes, divide)
    return x, unshard_all([layout for layout, _ in specs], gathered)


def _save_or_recompute(save: bool, _ctx: object, _op: object, *_args: object,
                       **_kwargs: object) -> object:
    """Every op of the gather saved for backward, or (not ``save``) every one recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE
