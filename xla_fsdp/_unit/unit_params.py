"""A unit's parameters: its shard groups, where their full values are, and the reduction of
their gradients.

The full parameters are in one of three states, read from what is held rather than stored
beside it (``UnitParams.state``):

* ``SHARDED``: every placeholder holds an empty dummy (see
  [Note: a freed placeholder is empty]);
* ``GATHERING``: the all-gather is in the traced graph (issued by a prefetch), its result
  held here, not yet behind the barrier that marks where it is used;
* ``UNSHARDED``: placeholders hold slices of the gathered tensors (``ParamRecord.holds_full``).

Gradients of complete shard groups are queued and reduce-scattered in buckets
(``reduce_scatter_bucket_size_mb``) into the shards' ``.grad``, or with offload beside their
device copies (see [Note: the optimizer on the host]); under ``no_sync`` they stay on the
placeholders until the next synchronised backward.

[Note: per-step host cost]
On XLA the host traces every step while the device runs the previous one; once tracing
takes longer, the chips wait, so a wrapper's per-step Python is step time on small and
medium models. The per-step path does per parameter only what puts a node in the graph
(its gather, its install, its reduction), and what depends only on the model's structure
once, while that structure is unchanged:

* layouts cache their derived sizes (``_sharding.layout``);
* a unit's placeholders swap under one version-counter guard (``ParamRecord.install``);
* ``Collectives`` issues pinned gathers through torch_xla's bindings (its
  ``pinned_all_gathers``, from ``_xla.private_api``), not ``xm.all_gather``, which with an
  output buffer compares it with ``None`` twice, each comparison raising and catching a
  TypeError inside torch;
* the optimizer's donors are listed again only when it holds other tensors
  (``_xla.donation_order``);
* on the virtual devices every torch call (a ``.grad`` or ``.requires_grad`` read
  included) also passes the launcher's torch-function mode, so reads that repeat per
  parameter cost more there than on a TPU: the benchmark measures the launcher's tax too.

``python -m scripts.bench.step_phases`` shows a step's host time per phase next to the
unwrapped model's and torch_xla's FSDP's.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from .._sharding.collectives import (Collectives, gather_pieces, optimization_barrier,
                                     padded_gradient, scatter_gradients)
from .._sharding.layout import compute_cached, unshard_all
from .._xla.private_api import in_backward, run_pending, to_cpu
from .options import FsdpOptions
from .param_record import ParamRecord
from .registry import WeakRegistry
from .shard_group import ShardGroup
from .traced_unshard import blocker, full_values
from .vocab_tables import compute_on_shard


class FullParams(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


_BY_SHARD_GROUP: "WeakRegistry[UnitParams]" = WeakRegistry()


def params_of(shard_group: ShardGroup) -> Optional["UnitParams"]:
    """The unit parameters (and reduction) ``shard_group`` belongs to."""
    return _BY_SHARD_GROUP.get(shard_group)


class UnitParams:
    def __init__(self, collectives: Collectives, options: FsdpOptions,
                 device: torch.device) -> None:
        self.shard_groups: List[ShardGroup] = []
        # what the unit gathers and reduces: not the vocabulary tables, whose modules
        # compute on their shards (see [Note: vocabulary-parallel tables])
        self.gathered: List[ShardGroup] = []
        self.collectives = collectives
        self.options = options
        self.device = device
        self._gathered_records: List[ParamRecord] = []
        # the all-gathers' results while a gather is in flight (``FullParams.GATHERING``)
        self._in_flight: Optional[List[torch.Tensor]] = None
        self._gathered_generation: Tuple[tuple, ...] = ()
        self._dummies: Dict[torch.dtype, torch.Tensor] = {}
        self._queue: List[Tuple[ShardGroup, torch.Tensor]] = []
        self._queue_bytes = 0
        # this backward's facts: whether it reached the unit, each shard group's records
        # whose gradient arrived since it was last reduced, and the shard groups reduced
        self._reached = False
        self._arrived: Dict[ShardGroup, Set[int]] = {}
        self._reduced: Set[ShardGroup] = set()
        # the reduction's settings, changed only through the unit's setters
        self._explicit_reshard_after_forward: Optional[bool] = None   # set by the user
        self._at_root = True
        self.reshard_after_forward = options.reshard_after_forward
        self.reshard_after_backward = True
        self.sync_gradients = True                 # False under no_sync
        self.divide = (1.0, 1.0)                   # what gradients are divided by, pre and post
        self.divide_factors = (1.0, 1.0)           # the factors as the user set them
        self._backward_barrier: List[torch.Tensor] = []
        self._replica_groups = options.replica_groups
        self.traced_blocker = blocker(options)  # see [Note: collectives traced into the compiled graph]
        # the last pass ran between compiled regions: its work executes where it is issued
        # (see [Note: FSDP's hooks under torch.compile])
        self.immediate = False

    def rewritten_shards(self) -> List[torch.Tensor]:
        """The shards this unit's barriers pass through, which the step therefore replaces
        whether or not an optimizer holds them (see [Note: shards no optimizer holds are
        donors too] in ``donation_order``): all of them unless both barriers are off."""
        if not (self.options.optimization_barrier_in_forward
                or self.options.optimization_barrier_in_backward):
            return []
        return [g.shard for g in self.shard_groups]

    def add(self, shard_groups: Sequence[ShardGroup]) -> None:
        self.shard_groups.extend(shard_groups)
        for g in shard_groups:
            compute_cached(g.layout)
            _BY_SHARD_GROUP[g] = self
            if g.vocab_table:
                compute_on_shard(g, self.collectives, lambda: self.divide[0] * self.divide[1])
            else:
                self.gathered.append(g)
                self._gathered_records += g.records

    @property
    def state(self) -> FullParams:
        """A gather in flight, else whether any placeholder holds its full value: the records
        are the one account of what is held."""
        if self._in_flight is not None:
            return FullParams.GATHERING
        if any(r.holds_full for r in self._gathered_records):
            return FullParams.UNSHARDED
        return FullParams.SHARDED

    # -- gathering and freeing ---------------------------------------------------------------
    @torch.no_grad()
    def unshard(self, deps: Sequence[torch.Tensor], barrier: bool,
                prefetch: Sequence["UnitParams"] = ()) -> bool:
        """Makes the full parameters current, and issues the all-gathers of the ``prefetch``
        units now, behind the same barrier as ``deps`` (the unit's inputs), so that the
        compiler may run them during this unit's compute. In an ``immediate`` pass the
        inputs and the gather execute now, and nothing is prefetched. Returns whether
        ``deps`` went into a barrier."""
        if self.immediate:
            run_pending(deps)
            deps, prefetch = [], ()
        elif not barrier:
            deps = []
        issue = [u for u in (self, *prefetch) if u._needs_gather()]
        if issue and barrier:
            optimization_barrier([g.local() for u in issue for g in u.gathered] + list(deps))
        for unit in issue:
            unit._issue_gather()
        installing = self._in_flight is not None
        if installing:
            self._install(list(deps) if self not in issue else [], barrier)
        return bool(issue) or installing

    def _needs_gather(self) -> bool:
        # full parameters gathered before the shards changed (an optimizer step, a load),
        # e.g. kept with ``reshard_after_backward=False``, are gathered again
        if self.state is not FullParams.SHARDED \
                and self._gathered_generation != self._generation():
            self.reshard(self.gathered, [], barrier=False)
        return bool(self.gathered) and self.state is FullParams.SHARDED

    def _generation(self) -> Tuple[tuple, ...]:
        return tuple(g.generation() for g in self.gathered)

    def _issue_gather(self) -> None:
        self._in_flight = gather_pieces(
            self.collectives, [(g.layout, g.local(), g.compute_dtype) for g in self.gathered],
            self.options.coalesce_all_gather_ops, chained=in_backward())
        self._gathered_generation = self._generation()

    def _install(self, deps: List[torch.Tensor], barrier: bool) -> None:
        gathered, self._in_flight = self._in_flight, None
        if barrier:
            optimization_barrier(gathered + deps)
        if self.immediate:
            run_pending(gathered)
        ParamRecord.install(self._gathered_records,
                            unshard_all([g.layout for g in self.gathered], gathered))

    @torch.no_grad()
    def reshard(self, shard_groups: Sequence[ShardGroup], deps: Sequence[torch.Tensor],
                barrier: bool, writes_kept: bool = False) -> None:
        """Frees the full parameters of ``shard_groups`` (and a gather issued for them);
        ``writes_kept`` as ``ParamRecord.free``'s."""
        records, dummies = [], []
        for g in shard_groups:
            records += g.records
            dummies += [self._dummy(g.compute_dtype)] * len(g.records)
        freed = ParamRecord.free(records, dummies, writes_kept)
        if len(shard_groups) == len(self.gathered):
            self._in_flight = None
        if barrier and (freed or deps):
            optimization_barrier([g.local() for g in shard_groups] + list(deps))

    @contextlib.contextmanager
    def full_values_written_back(self) -> Iterator[None]:
        """The full parameters in the shards' own dtype (exact, whatever the compute dtype) in
        the placeholders; what is written to them meanwhile, in place or through ``.data``,
        is this rank's slice of the shards after a normal exit, cut on the host: a slice at
        this rank's offset in the device's graph would differ between ranks. Freed either
        way. Vocabulary tables, never gathered for a forward, are gathered here too."""
        shard_groups = self.shard_groups
        gathered = gather_pieces(self.collectives,
                                 [(g.layout, g.on_device(), g.shard.dtype) for g in shard_groups],
                                 self.options.coalesce_all_gather_ops)
        ParamRecord.install([r for g in shard_groups for r in g.records],
                            unshard_all([g.layout for g in shard_groups], gathered))
        try:
            yield
            full = to_cpu([[r.placeholder.detach() for r in g.records] for g in shard_groups])
            with torch.no_grad():
                for g, values in zip(shard_groups, full, strict=True):
                    value = g.layout.shard(values, self.collectives.rank)
                    g.shard.copy_(value.view(g.shard.shape).to(g.shard.device, g.shard.dtype))
                    g.mark_updated()
        finally:
            self.reshard(shard_groups, [], barrier=False, writes_kept=True)

    def drop_prefetch(self) -> None:
        """Forgets a gather issued for a pass that never reached this unit."""
        self._in_flight = None

    def abandon(self) -> None:
        """After a pass that raised: frees the full parameters and drops the gather in flight
        and the reductions not issued yet (see [Note: a pass that raised])."""
        self._queue, self._queue_bytes = [], 0
        self.drop_prefetch()
        self.reshard(self.gathered, [], barrier=False, writes_kept=True)
        for g in self.gathered:
            g.drop_unreduced()
        self._end_backward()

    def _dummy(self, dtype: torch.dtype) -> torch.Tensor:
        # see [Note: a freed placeholder is empty]
        if dtype not in self._dummies:
            self._dummies[dtype] = torch.zeros(0, dtype=dtype, device=self.device)
        return self._dummies[dtype]

    # -- the traced path (see [Note: collectives traced into the compiled graph]) -------------
    def traceable(self) -> bool:
        """Whether this unit's next forward can gather in a traced graph: its options allow
        it, gradients are synchronised, and nothing eager is held (full parameters, a
        ``no_sync`` accumulation)."""
        return (self.traced_blocker is None and self.sync_gradients
                and self.state is FullParams.SHARDED
                and not any(g.accumulation_pending for g in self.gathered))

    def lend_full_values(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """In a traced forward: gathers the full values in the graph and lends them to the
        modules for this forward; returns ``x`` tied to the unit's reductions."""
        x, values = full_values(self.gathered, self.collectives.world_size, self.options,
                                self.divide, not self.reshard_after_forward, x)
        ParamRecord.lend(self._gathered_records, values)
        return x

    def take_back(self) -> None:
        """After a traced forward: the placeholders back where the full values were lent."""
        ParamRecord.take_back(self._gathered_records)

    # -- the unit's reduction settings (its public setters) -------------------------------------
    def set_reshard_after_forward(self, value: Optional[bool] = None,
                                  at_root: Optional[bool] = None) -> None:
        """Decides whether full parameters are freed after forward: as the user set it
        (``value``), else not at the root under ``disable_reshard_on_root`` (its parameters
        are needed first in backward), else as the options say. ``at_root`` when the unit's
        place in the model changes."""
        if value is not None:
            self._explicit_reshard_after_forward = bool(value)
        if at_root is not None:
            self._at_root = at_root
        if self._explicit_reshard_after_forward is not None:
            self.reshard_after_forward = self._explicit_reshard_after_forward
        else:
            self.reshard_after_forward = self.options.reshard_after_forward and not (
                self._at_root and self.options.disable_reshard_on_root)

    def set_reshard_after_backward(self, value: bool) -> None:
        self.reshard_after_backward = value

    def set_sync_gradients(self, value: bool) -> None:
        self.sync_gradients = value

    def set_immediate(self, value: bool) -> None:
        self.immediate = value

    def barrier_on_activations(self, backward: bool) -> bool:
        """Whether this pass ties activations (inputs, outputs, their gradients) into the
        unit's optimization barriers of the forward or the ``backward``: as the options say,
        but never in an ``immediate`` pass, whose activations are a compiled region's, which
        the bridge still holds (see [Note: FSDP's hooks under torch.compile])."""
        option = (self.options.optimization_barrier_in_backward if backward
                  else self.options.optimization_barrier_in_forward)
        return option and not self.immediate

    def set_divide(self, pre: float, post: float, world_size: int) -> None:
        """The gradient divide factors, applied as torch_xla's FSDP applies them: each one
        only when it is above 1, and (1, 1) asks for the mean, taken after the sum."""
        self.divide_factors = (pre, post)
        self.divide = ((1.0, float(world_size)) if (pre, post) == (1.0, 1.0)
                       else (max(pre, 1.0), max(post, 1.0)))

    def join(self, backward_barrier: List[torch.Tensor]) -> None:
        """Orders this unit's reduced gradients in the model's backward barrier."""
        self._backward_barrier = backward_barrier

    def reshard_after_backward_now(self) -> bool:
        # under no_sync, a unit that keeps its parameters between forward and backward keeps
        # them between accumulation steps too (torch_xla's behaviour)
        keep_for_no_sync = not self.sync_gradients and not self.reshard_after_forward
        return self.reshard_after_backward and not keep_for_no_sync

    # -- gradients ----------------------------------------------------------------------------
    def reached(self) -> None:
        """The backward reached this unit (an output's gradient, before any of its own)."""
        self._reached = True

    def post_backward(self, shard_group: ShardGroup, index: int) -> bool:
        """Record ``index`` of ``shard_group`` has its gradient: a shard group whose trainable
        records all have theirs is reduced now (unless missing gradients are zero-filled at
        the end of backward: see [Note: parameters without a gradient]). In an ``immediate``
        pass the reduce-scatters are held until every trainable shard group of the unit is
        reduced, then executed together. Returns whether every one is."""
        self._reached = True
        if not shard_group.shard.requires_grad and shard_group.sentinel is None:
            # frozen between the forward and this backward (and holding no no_sync
            # accumulation): torch gives a leaf that no longer requires grad no gradient,
            # so the optimizer leaves it alone
            shard_group.records[index].placeholder.grad = None
            return False
        arrived = self._arrived.setdefault(shard_group, set())
        arrived.add(index)
        if not arrived.issuperset(shard_group.trainable_records()) \
                or self.options.zero_missing_gradients:
            return False
        self._reduce(shard_group, hold=self.immediate)
        last = all(g in self._reduced for g in self.gathered if g.shard.requires_grad)
        if last and self.immediate:
            self.run_reductions()
        return last

    def _needs_reduction(self, shard_group: ShardGroup, zero_fill: bool) -> bool:
        """At the end of backward: whether a gradient arrived that was not reduced yet, or,
        with ``zero_fill``, whether the shard group was not reduced at all (see [Note:
        parameters without a gradient])."""
        return shard_group.shard.requires_grad and (
            bool(self._arrived.get(shard_group)) or zero_fill and shard_group not in self._reduced)

    def _end_backward(self) -> None:
        self._reached = False
        self._arrived.clear()
        self._reduced.clear()

    @torch.no_grad()
    def finalize_backward(self) -> None:
        """The end of a backward, whether or not it reached this unit."""
        # [Note: parameters without a gradient]
        # A shard group none of whose parameters got a gradient on this rank keeps a None
        # gradient, as unsharded training does when no rank used them (a skipped module: the
        # optimizer then leaves it alone, momentum and weight decay included). When ranks'
        # data skip different modules (data-dependent expert routing), they would then issue
        # different reduce-scatters, which on hardware pair by order (experts of one shape
        # sum each other's gradients, without a word) or hang; with zero_missing_gradients
        # every trainable shard group of a unit that took part is reduced here, at the end of
        # backward and in shard group order (so also in the same order on every rank), zeros
        # standing for what did not arrive. The price is holding the unit's full gradients
        # until the end of backward. A no_sync accumulation a synced backward did not reach
        # (a head used only in earlier micro-batches) is reduced here too, in the same order:
        # unsharded training steps with the gradients accumulated so far.
        zero_fill = self.options.zero_missing_gradients
        for g in self.gathered:
            carried = self.sync_gradients and g.shard.requires_grad and g.accumulating()
            if carried or self._reached and self._needs_reduction(g, zero_fill):
                self._reduce(g, hold=False)
        if self._reached and not self.sync_gradients:
            self._mark_accumulating()
        self._flush(self.options.optimization_barrier_in_backward)
        self._end_backward()
        self.drop_prefetch()  # prefetched for a backward that did not reach the unit
        if self.reshard_after_backward_now():
            self.reshard(self.gathered, [], self.options.optimization_barrier_in_backward)

    def run_reductions(self) -> None:
        """Under torch.compile: issues the reductions held back and executes them now (see
        [Note: FSDP's hooks under torch.compile])."""
        self._flush(barrier=False)
        run_pending(self.shard_gradients())

    def shard_gradients(self) -> List[torch.Tensor]:
        grads = [g.device_gradient() for g in self.gathered]
        return [g for g in grads if g is not None]

    @torch.no_grad()
    def _reduce(self, shard_group: ShardGroup, hold: bool) -> None:
        """The shard group's gradients are complete for this backward (or as complete as
        they will be: a parameter without a gradient contributes zeros, so that every rank
        issues the same collectives whatever its data). Frees the shard group if resharding
        after backward; when gradients are synced queues its reduce-scatter (issued when
        the bucket is full, unless ``hold``: then at the next flush), otherwise leaves the
        full gradients on the placeholders."""
        self._arrived.pop(shard_group, None)
        self._reduced.add(shard_group)
        grads = [r.placeholder.grad for r in shard_group.records]
        if any(g is not None and g.requires_grad for g in grads):
            raise RuntimeError("FSDP does not support gradients that require grad "
                               "(create_graph=True)")
        barrier = self.options.optimization_barrier_in_backward
        reshard = self.reshard_after_backward_now()
        if not self.sync_gradients:
            if reshard:
                self.reshard([shard_group], [g for g in grads if g is not None], barrier)
            return
        shard_group.end_accumulation()  # the reduced gradient adds to the accumulated one
        for r in shard_group.records:
            r.placeholder.grad = None
        flat = padded_gradient(shard_group.layout, grads, shard_group.compute_dtype,
                               self.device, self.options.fp32_reduce_scatter, self.divide)
        self.reshard([shard_group] if reshard else [], [flat], barrier)
        self._queue.append((shard_group, flat))
        self._queue_bytes += flat.numel() * flat.element_size()
        if not hold and \
                self._queue_bytes > self.options.reduce_scatter_bucket_size_mb * 1024 * 1024:
            self._flush(barrier)

    @torch.no_grad()
    def _flush(self, barrier: bool) -> None:
        if not self._queue:
            return
        queue, self._queue, self._queue_bytes = self._queue, [], 0
        inputs = [flat for _, flat in queue]
        if barrier and len(inputs) > 1:  # one input already passed _reduce()'s barrier
            optimization_barrier(inputs)
        outputs = scatter_gradients(self.collectives, self.divide, inputs,
                                    self._replica_groups,
                                    float32=not self.options.offload_optimizer)
        for (shard_group, _), reduced in zip(queue, outputs):
            if barrier:
                optimization_barrier([reduced])
                self._backward_barrier.append(reduced)
            shard_group.add_gradient(reduced)

    # -- abandoned accumulation ----------------------------------------------------------------
    def _mark_accumulating(self) -> None:
        """After a ``no_sync`` backward: marks each shard group whose placeholders hold
        unreduced gradients (see ``ShardGroup.mark_accumulation``)."""
        for g in self.gathered:
            if g.sentinel is None and any(r.placeholder.grad is not None for r in g.records):
                g.mark_accumulation()

    def drop_abandoned(self) -> None:
        """Drops the full gradients of an accumulation whose shard gradient was dropped."""
        for g in self.gathered:
            if g.accumulation_abandoned():
                for r in g.records:
                    r.placeholder.grad = None
                g.end_accumulation()
