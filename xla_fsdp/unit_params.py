"""A unit's parameters: its shard groups, where their full values are, and the reduction of
their gradients.

The full parameters are in one of three states:

* ``SHARDED``: every placeholder holds a one-element dummy;
* ``GATHERING``: the all-gather is in the traced graph (issued by a prefetch), its result
  held here, not yet behind the barrier that marks where it is used;
* ``UNSHARDED``: the placeholders hold slices of the gathered tensors.

Gradients of complete groups are queued and reduce-scattered into the shards' ``.grad`` in
buckets (``reduce_scatter_bucket_size_mb``); under ``no_sync`` they stay on the placeholders
until the next synchronised backward.
"""
from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .collectives import Collectives, optimization_barrier
from .options import FsdpOptions
from .shard_group import ShardGroup


class FullParams(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class UnitParams:
    def __init__(self, groups: List[ShardGroup], collectives: Collectives,
                 options: FsdpOptions, device: torch.device) -> None:
        self.groups = groups
        self.collectives = collectives
        self.options = options
        self.device = device
        self.state = FullParams.SHARDED
        self._gathered: Optional[List[List[torch.Tensor]]] = None
        self._gathered_generation: Tuple[tuple, ...] = ()
        self._dummies: Dict[torch.dtype, torch.Tensor] = {}
        self._queue: List[Tuple[ShardGroup, torch.Tensor]] = []
        self._queue_bytes = 0

    # -- gathering and freeing ---------------------------------------------------------------
    @torch.no_grad()
    def unshard(self, deps: Sequence[torch.Tensor], barrier: bool,
                prefetch: Sequence["UnitParams"] = ()) -> bool:
        """Makes the full parameters current, and issues the all-gathers of the ``prefetch``
        units now, behind the same barrier, so that the compiler may run them during this
        unit's compute. Returns whether ``deps`` went into a barrier."""
        issue = [u for u in (self, *prefetch) if u._needs_gather()]
        if issue and barrier:
            optimization_barrier([g.shard for u in issue for g in u.groups] + list(deps))
        for unit in issue:
            unit._issue_gather()
        installing = self.state is not FullParams.UNSHARDED
        if installing:
            self._install(list(deps) if self not in issue else [], barrier)
        return bool(issue) or installing

    def _needs_gather(self) -> bool:
        if self.state is not FullParams.SHARDED and self._stale():
            self.reshard(self.groups, [], barrier=False)
        return bool(self.groups) and self.state is FullParams.SHARDED

    def _stale(self) -> bool:
        """Whether the shards changed (an optimizer step, a load) since the full parameters
        held here were gathered, e.g. with ``reshard_after_backward=False``."""
        return self._gathered_generation != self._generation()

    def _generation(self) -> Tuple[tuple, ...]:
        return tuple(g.generation() for g in self.groups)

    def _issue_gather(self) -> None:
        self._gathered = gather_pieces(self.collectives, self.options,
                                       [(g.layout, g.shard, g.compute_dtype) for g in self.groups])
        self._gathered_generation = self._generation()
        self.state = FullParams.GATHERING

    def _install(self, deps: List[torch.Tensor], barrier: bool) -> None:
        gathered, self._gathered = self._gathered, None
        if gathered is not None:
            if barrier:
                optimization_barrier([t for ts in gathered for t in ts] + deps)
            for g, full in zip(self.groups, gathered):
                for record, value in zip(g.records, g.layout.unshard_pieces(full)):
                    record.install(value)
        self.state = FullParams.UNSHARDED

    @torch.no_grad()
    def reshard(self, groups: Sequence[ShardGroup], deps: Sequence[torch.Tensor],
                barrier: bool) -> None:
        """Frees the full parameters of ``groups`` (and a gather issued for them)."""
        freed = False
        for g in groups:
            for record in g.records:
                freed |= record.gathered
                record.free(self._dummy(g.compute_dtype))
        if len(groups) == len(self.groups):
            self._gathered = None
        if self._gathered is None:
            held = any(r.gathered for g in self.groups for r in g.records)
            self.state = FullParams.UNSHARDED if held else FullParams.SHARDED
        if barrier and (freed or deps):
            optimization_barrier([g.shard for g in groups] + list(deps))

    def drop_prefetch(self) -> None:
        """Forgets a gather issued for a pass that never reached this unit."""
        if self.state is FullParams.GATHERING:
            self._gathered = None
            self.state = FullParams.SHARDED

    def _dummy(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._dummies:
            self._dummies[dtype] = torch.zeros(1, dtype=dtype, device=self.device)
        return self._dummies[dtype]

    # -- gradients ----------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, group: ShardGroup, sync: bool, reshard: bool, barrier: bool,
               divide: Tuple[float, float], barrier_out: List[torch.Tensor]) -> None:
        """The group's gradients are complete for this backward (or as complete as they will
        be: a parameter without a gradient contributes zeros, so that every rank issues the
        same collectives whatever its data). Frees the group if ``reshard``; with ``sync``
        queues its reduce-scatter, otherwise leaves the full gradients on the placeholders."""
        group.arrived.clear()
        group.reduced = True
        grads = [r.placeholder.grad for r in group.records]
        if any(g is not None and g.requires_grad for g in grads):
            raise RuntimeError("FSDP does not support gradients that require grad "
                               "(create_graph=True)")
        if not sync:
            if reshard:
                self.reshard([group], [g for g in grads if g is not None], barrier)
            return
        group.sentinel = None  # the accumulation ends here: the reduced gradient adds to it
        for r in group.records:
            r.placeholder.grad = None
        flat = padded_gradient(group.layout, grads, group.compute_dtype, self.device,
                               self.options, divide)
        self.reshard([group] if reshard else [], [flat], barrier)
        self._queue.append((group, flat))
        self._queue_bytes += flat.numel() * flat.element_size()
        if self._queue_bytes > self.options.reduce_scatter_bucket_size_mb * 1024 * 1024:
            self.flush(barrier, divide, barrier_out)

    @torch.no_grad()
    def flush(self, barrier: bool, divide: Tuple[float, float],
              barrier_out: List[torch.Tensor]) -> None:
        if not self._queue:
            return
        queue, self._queue, self._queue_bytes = self._queue, [], 0
        inputs = [flat for _, flat in queue]
        if barrier:
            optimization_barrier(inputs)
        outputs = scatter_gradients(self.collectives, self.options, divide, inputs)
        for (group, _), reduced in zip(queue, outputs):
            if barrier:
                optimization_barrier([reduced])
                barrier_out.append(reduced)
            shard = group.shard
            shard.grad = reduced if shard.grad is None else shard.grad + reduced

    # -- abandoned accumulation ----------------------------------------------------------------
    def mark_accumulating(self) -> None:
        """After a ``no_sync`` backward: leaves on each shard holding unreduced gradients a
        gradient the next reduction adds to, whose disappearance (``zero_grad``) means the
        accumulation was abandoned (see ``drop_abandoned``)."""
        for g in self.groups:
            if g.sentinel is None and any(r.placeholder.grad is not None for r in g.records):
                if g.shard.grad is None:
                    g.shard.grad = torch.zeros_like(g.shard)
                g.sentinel = (g.shard.grad, g.shard.grad._version)

    def drop_abandoned(self) -> None:
        for g in self.groups:
            if g.sentinel is not None and not accumulating(g):
                for r in g.records:
                    r.placeholder.grad = None
                g.sentinel = None


# -- stateless steps, shared with the scanned layers' loop bodies ------------------------------
def gather_pieces(collectives: Collectives, options: FsdpOptions,
                  groups: Sequence[Tuple[Any, torch.Tensor, torch.dtype]]
                  ) -> List[List[torch.Tensor]]:
    """All-gathers (layout, shard, compute dtype) groups, cast to the compute dtype first so
    that low-precision compute moves low-precision bytes; per group, what its layout's
    ``unshard_pieces`` takes."""
    pieces = [layout.pieces(shard if shard.dtype == dtype else shard.to(dtype))
              for layout, shard, dtype in groups]
    gathered = collectives.all_gather([p for ps in pieces for p in ps],
                                      options.coalesce_all_gather_ops)
    out, at = [], 0
    for ps in pieces:
        out.append(gathered[at:at + len(ps)])
        at += len(ps)
    return out


def padded_gradient(layout: Any, grads: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
                    device: Any, options: FsdpOptions, divide: Tuple[float, float]
                    ) -> torch.Tensor:
    """A group's full gradients as the padded tensor its reduce-scatter takes; a parameter
    without a gradient contributes zeros. Low-precision sums are pre-divided for headroom."""
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, shape in zip(grads, layout.shapes)]
    flat = layout.pad(full)
    if options.fp32_reduce_scatter and flat.dtype != torch.float32:
        flat = flat.float()
    pre, _ = divide
    if flat.dtype != torch.float32 and pre != 1:
        flat = flat / pre
    return flat


def scatter_gradients(collectives: Collectives, options: FsdpOptions,
                      divide: Tuple[float, float], inputs: List[torch.Tensor]
                      ) -> List[torch.Tensor]:
    """Reduce-scatters ``padded_gradient`` outputs into float32 shard gradients, averaged
    over the ranks (and over the replicas, with ``replicate_across_groups``)."""
    # A float32 sum cannot overflow where the pre-division would matter, so the whole
    # division is the reduce-scatter's scale on the shard: one pass over the full
    # gradients fewer, and the same bits when both factors are powers of two.
    pre, post = divide
    divisor = post * pre if inputs[0].dtype == torch.float32 else post
    replicas = options.replica_groups
    if replicas:  # then averaged over the sharding groups too
        divisor *= len(replicas[0])
    outputs = collectives.reduce_scatter(inputs, scale=1.0 / divisor)
    if replicas:
        outputs = [collectives.all_reduce_sum(t, replicas) for t in outputs]
    return [t if t.dtype == torch.float32 else t.float() for t in outputs]


def accumulating(group: ShardGroup) -> bool:
    """Whether the shard's gradient is still the one a ``no_sync`` backward left."""
    if group.sentinel is None:
        return False
    tensor, version = group.sentinel
    return group.shard.grad is tensor and tensor._version == version
