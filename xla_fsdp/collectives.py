"""The only place that calls XLA collectives and optimization barriers.

All-gathers are always native all-gathers. For a single tensor with ``pin_layout=True``,
``xm.all_gather`` is built from an all-reduce of a zero-padded buffer: it moves
``world_size`` times the data and bakes the rank into the graph. Given an ``output``
buffer, the same call lowers to a native all-gather with its layout pinned. torch_xla has
no pinned form of the coalesced (list) all-gather, so coalesced gathers are never pinned.
"""
from __future__ import annotations

from typing import AbstractSet, List, Optional, Sequence

import torch


class Collectives:
    """Collectives over one sharding group, as FSDP uses them."""

    def __init__(self, world_size: int, groups: Optional[List[List[int]]],
                 pin_layout: bool, rank: int = 0, dummy: AbstractSet[str] = frozenset()) -> None:
        self.world_size = world_size
        self.groups = groups
        self.pin_layout = pin_layout
        self.rank = rank
        # torch_xla's _debug_dummy_*_op switches: local stand-ins with the collectives'
        # shapes, to measure what a step costs without them. Their results are wrong.
        self.dummy = frozenset(dummy)

    def all_gather(self, shards: Sequence[torch.Tensor], coalesce: bool) -> List[torch.Tensor]:
        """Concatenations along dim 0 of every rank's shard, one per input."""
        import torch_xla.core.xla_model as xm
        if not shards:
            return []
        if "all_gather" in self.dummy:
            return [s.repeat((self.world_size,) + (1,) * (s.dim() - 1)) for s in shards]
        if coalesce and len(shards) > 1 or not self.pin_layout:
            return list(xm.all_gather(list(shards), dim=0, groups=self.groups, pin_layout=False))
        return [xm.all_gather(s, dim=0, groups=self.groups, pin_layout=True,
                              output=s.new_empty((s.shape[0] * self.world_size,) + s.shape[1:]))
                for s in shards]

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], scale: float) -> List[torch.Tensor]:
        """Sum over ranks times ``scale``; this rank keeps its dim-0 block of each input.

        Several inputs go out as one reduce-scatter of a single buffer whose row ``r`` holds
        rank ``r``'s block of every input. torch_xla's coalesced (list) reduce-scatter aborts
        the process with ``pin_layout=True`` (torch_xla 2.9, any world size)."""
        import torch_xla.core.xla_model as xm
        if not tensors:
            return []
        n = self.world_size
        if len(tensors) == 1:
            buffer = tensors[0]
        else:
            buffer = torch.cat([t.reshape(n, -1) for t in tensors], dim=1).reshape(-1)
        if "reduce_scatter" in self.dummy:
            block = buffer.shape[0] // n
            reduced = buffer.narrow(0, self.rank * block, block) * scale
        else:
            reduced = xm.reduce_scatter(xm.REDUCE_SUM, buffer, scale=scale, scatter_dim=0,
                                        shard_count=n, groups=self.groups,
                                        pin_layout=self.pin_layout)
        if len(tensors) == 1:
            return [reduced]
        # Clones, not views: a live view keeps its base alive too, and torch_xla then makes
        # both outputs of the step graph, doubling the gradients' memory.
        sizes = [t.numel() // n for t in tensors]
        return [part.reshape((t.shape[0] // n,) + tuple(t.shape[1:])).clone()
                for part, t in zip(reduced.split(sizes), tensors)]

    def all_reduce_sum(self, tensor: torch.Tensor,
                       groups: Optional[List[List[int]]] = None) -> torch.Tensor:
        import torch_xla.core.xla_model as xm
        if "all_reduce" in self.dummy:
            return tensor.clone()
        return xm.all_reduce(xm.REDUCE_SUM, tensor, groups=groups, pin_layout=self.pin_layout)

    def all_reduce_max(self, tensor: torch.Tensor,
                       groups: Optional[List[List[int]]] = None) -> torch.Tensor:
        import torch_xla.core.xla_model as xm
        if "all_reduce" in self.dummy:
            return tensor.clone()
        return xm.all_reduce(xm.REDUCE_MAX, tensor, groups=groups, pin_layout=self.pin_layout)


def optimization_barrier(tensors: Sequence[torch.Tensor]) -> None:
    """Stops XLA from fusing or reordering work across this point (e.g. merging a unit's
    forward and backward all-gathers, which keeps its full parameters alive in between)."""
    import torch_xla.core.xla_model as xm
    tensors = [t for t in tensors if t is not None]
    if tensors:
        xm.optimization_barrier_(list(tensors))
