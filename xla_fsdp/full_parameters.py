"""Gathering a unit's full parameters (now, or ahead of time for a prefetch) and freeing
them, as a mixin of ``XlaFullyShardedDataParallel``.

A unit's full parameters are in one of three states: freed (placeholders hold a one-element
dummy), issued (the all-gather is in the traced graph, its result kept in ``_gathered``, not
yet behind the barrier that marks where it is used) or installed (placeholders hold slices
of the gathered tensors). A prefetch leaves a unit issued; its own forward or backward then
installs it.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .collectives import optimization_barrier
from .init_sharding import ShardGroup, swap_value
from .safety import shard_generation


class FullParameters:
    @torch.no_grad()
    def _rebuild_full_params(self, deps: List[torch.Tensor], barrier: bool,
                             prefetch: Sequence["FullParameters"] = ()) -> bool:
        """Makes this unit's full parameters current, and issues the all-gathers of the
        ``prefetch`` units now, behind the same barrier, so that the compiler may run them
        during this unit's compute. Returns whether ``deps`` went into a barrier."""
        issue = [u for u in (self, *prefetch) if u._needs_gather()]
        if issue and barrier:
            optimization_barrier([g.shard for u in issue for g in u._groups] + list(deps))
        for unit in issue:
            unit._issue_gather()
        installed = not self.has_full_params
        if installed:
            self._install_gathered(deps if self not in issue else [], barrier)
        return bool(issue) or installed

    def _needs_gather(self) -> bool:
        if self._full_params_stale():
            self._drop_full_params()
        return bool(self._groups) and not self.has_full_params and self._gathered is None

    def _full_params_stale(self) -> bool:
        """Whether the shards changed (an optimizer step, a load) since the full parameters
        this unit holds were gathered, e.g. with ``reshard_after_backward=False``."""
        held = self.has_full_params or self._gathered is not None
        return held and self._gathered_versions != self._shard_versions()

    def _shard_versions(self) -> Tuple[tuple, ...]:
        return tuple(shard_generation(g.shard) for g in self._groups)

    def _issue_gather(self) -> None:
        pieces = [g.layout.pieces(g.shard if g.shard.dtype == self.compute_dtype else
                                  g.shard.to(self.compute_dtype)) for g in self._groups]
        gathered = self._collectives.all_gather([p for ps in pieces for p in ps],
                                                self._options.coalesce_all_gather_ops)
        self._gathered, at = [], 0
        for ps in pieces:
            self._gathered.append(gathered[at:at + len(ps)])
            at += len(ps)
        self._gathered_versions = self._shard_versions()

    def _install_gathered(self, deps: List[torch.Tensor], barrier: bool) -> None:
        gathered, self._gathered = self._gathered, None
        if gathered is not None:
            if barrier:
                optimization_barrier([t for ts in gathered for t in ts] + list(deps))
            for g, full in zip(self._groups, gathered):
                for p, value in zip(g.params, g.layout.unshard_pieces(full)):
                    swap_value(p, value)
                    p._has_full_param = True
        self.has_full_params = True

    @torch.no_grad()
    def _free_full_params(self, groups: Sequence[ShardGroup], deps: List[torch.Tensor],
                          barrier: bool) -> None:
        freed = False
        for g in groups:
            for p in g.params:
                if p._has_full_param:
                    swap_value(p, self._placeholder())
                    p._has_full_param = False
                    freed = True
        if len(groups) == len(self._groups):
            self._gathered = None
        self.has_full_params = any(p._has_full_param for g in self._groups for p in g.params)
        if barrier and (freed or deps):
            optimization_barrier([g.shard for g in groups] + list(deps))

    def _drop_full_params(self) -> None:
        self._free_full_params(self._groups, [], barrier=False)

    def _placeholder(self) -> torch.Tensor:
        if not hasattr(self, "_dummy"):
            self._dummy = torch.zeros(1, dtype=self.compute_dtype, device=self.xla_device)
        return self._dummy
