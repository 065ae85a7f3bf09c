"""The state of one FSDP unit as its model sees it, one object per unit: its place in the
model (its parent, the root's context), its training state, its settings and its
parameters (``UnitParams``, with the shard groups). What drives a unit is its kind's: a
hooked unit's hooks on its modules and its placeholders' gradients
(``unit_hooks.HookedUnitState``), or a scanned stack's loop (``scan.loop``), which gathers,
computes and reduces inside its own autograd function and so hooks nothing. The root's
context ends every unit's pass through the methods here, whatever drives it.

Units are registered by module in a weak registry, as FSDP2 keeps its states: ``is_unit``
lets code below the public API (auto-wrapping) tell a unit from a module without importing
the public classes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn

from .options import FsdpOptions
from .registry import WeakRegistry
from .root_context import RootContext
from .shard_group import ShardGroup
from .training_state import TrainingState, TrainingStateError
from .unit_params import FullParams, UnitParams

_STATES: "WeakRegistry[UnitState]" = WeakRegistry()  # unit module -> its UnitState


def is_unit(module: nn.Module) -> bool:
    return module in _STATES


def detached_message(members: Sequence[nn.Module]) -> str:
    names = ", ".join(type(m).__name__ for m in members)
    return (f"the FSDP unit grouping ({names}) was never attached: wrap a module that contains "
            f"all of them (usually the whole model) in FSDP after building the group")


class UnitState:
    def __init__(self, unit: nn.Module, name: str, members: Sequence[nn.Module],
                 params: UnitParams, options: FsdpOptions, detached: bool,
                 compile_refusal: Optional[str] = None) -> None:
        self.name = name                   # the wrapped module's class, for messages
        # a hooked unit's members' hooks hold this state, and so, through it, a grouping
        # unit that nothing else holds until the unit built around its modules attaches it
        self.unit = unit
        self.members = list(members)
        self.params = params
        self.options = options
        self.parent: Optional["UnitState"] = None
        self.context = RootContext(self, options)
        self.training_state = TrainingState.IDLE
        self.detached = detached           # a grouping unit no unit was built around yet
        self.compile_refusal = compile_refusal  # why the unit cannot run compiled, if it cannot
        params.join(self.context.backward_barrier)
        params.set_reshard_after_forward(at_root=True)
        _STATES[unit] = self

    def add_shard_groups(self, shard_groups: Sequence[ShardGroup]) -> None:
        self.params.add(shard_groups)
        tables = [g.names[0] for g in shard_groups if g.vocab_table]
        if tables and self.compile_refusal is None:
            self.compile_refusal = (
                f"FSDP unit around {self.name}: the vocab_parallel tables {tables} cannot run "
                f"inside torch.compile (their lookups' collectives are issued eagerly); wrap "
                f"without vocab_parallel to compile")
        for g in shard_groups:
            self.watch_gradients(g)

    def watch_gradients(self, shard_group: ShardGroup) -> None:
        """How this kind of unit learns that ``shard_group``'s gradients arrived, for a new
        shard group or one made trainable again: here it does not need to, since its own
        code hands them over (a scanned stack's loop reduces each layer's)."""

    # The public API's settings (``set_reshard_after_forward``, ``set_divide``,
    # ``set_sync_gradients``, ...) are set on ``params``, which decides with them.
    def mark_attached(self) -> None:
        self.detached = False

    # -- structure -------------------------------------------------------------------------
    @property
    def is_root(self) -> bool:
        return self.parent is None

    def adopt(self, states: Sequence["UnitState"]) -> None:
        """Becomes the parent of the states no unit was built around yet, and gives every
        state below it this root's context. Refuses a state sharded over other ranks than
        this one (see ``refuse_mixed_sharding``)."""
        refuse_mixed_sharding(self, states)
        for s in states:
            if s is not self and s.parent is None:
                s.parent = self
                s.params.set_reshard_after_forward(at_root=False)
        self.context.set_participants([s for s in states if s is not self])
        for s in states:
            s.context = self.context
            s.params.join(self.context.backward_barrier)

    def assert_state(self, states: Sequence[TrainingState]) -> None:
        if TrainingState.IDLE in states:
            self.context.settle()
        if self.training_state not in states:
            raise TrainingStateError(
                f"FSDP unit around {self.name} is in state {self.training_state.name}, "
                f"expected {[s.name for s in states]}. This happens when a nested unit is "
                f"called outside its parent's forward, or when backward runs twice over the "
                f"same forward without retain_graph.")

    def traceable(self) -> bool:
        return not self.detached and self.compile_refusal is None and self.params.traceable()

    def end_of_model_forward(self, grad_enabled: bool) -> None:
        if self.training_state is TrainingState.FORWARD:  # a grouped member never ran
            self.training_state = TrainingState.IDLE
            if self.params.reshard_after_forward:
                self.params.reshard(self.params.gathered, [], barrier=False)
        if not grad_enabled and self.params.state is not FullParams.SHARDED:
            self.params.reshard(self.params.gathered, [], barrier=False)

    def sync_trainable(self) -> None:
        """Agrees ``requires_grad`` between shards and placeholders, whichever of the two
        was changed since wrapping (frozen through ``model.parameters()``, which yields
        shards, or through a module attribute, which is a placeholder)."""
        for g in self.params.shard_groups:
            changed = [r for r in g.records if r.placeholder.requires_grad != r.requires_grad]
            if changed:
                want = changed[0].placeholder.requires_grad
                if any(r.placeholder.requires_grad != want for r in g.records):
                    names = ", ".join(r.name for r in g.records)
                    raise ValueError(
                        f"FSDP unit around {self.name}: parameters {names} are sharded as one "
                        f"tensor (flattened together, or one parameter of every layer of a "
                        f"scanned stack) and must all be trainable or all frozen; set "
                        f"requires_grad on all of them (or wrap without flatten_parameters)")
                g.shard.requires_grad_(want)
            trainable = g.shard.requires_grad
            # unchanged (the common case, every step): two reads, no writes (see [Note:
            # per-step host cost]); the records always agree among themselves
            if changed or g.records[0].requires_grad != trainable:
                for r in g.records:
                    r.agree_requires_grad(trainable, g.accumulating())
                self.watch_gradients(g)

    # -- the end of a pass, for every unit of the model (from the root context) ----------------
    def finish_backward(self) -> None:
        """The end of a backward."""
        self.params.finalize_backward()
        self.training_state = TrainingState.IDLE

    def abandon_pass(self) -> None:
        """Returns to ``IDLE`` after a pass that raised (see [Note: a pass that raised])."""
        self.params.abandon()
        self.training_state = TrainingState.IDLE


def refuse_mixed_sharding(root: UnitState, states: Sequence[UnitState]) -> None:
    """Raises ``ValueError`` if a state below ``root`` has other ``sharding_groups`` or
    ``replicate_across_groups`` than ``root``. What spans the model (``clip_grad_norm_``'s
    norm, loss scaling's inf flags, which ranks write a checkpoint) reduces over the ranks
    its root's options name; a unit sharded otherwise would be counted twice or not at all
    there, silently."""
    def sharding(s: UnitState) -> tuple:
        # the default (None) is one group of every rank, however it is written
        rank_groups = s.options.sharding_groups or [range(s.options.world_size)]
        return tuple(tuple(g) for g in rank_groups), s.options.replicate_across_groups
    for s in states:
        if sharding(s) != sharding(root):
            raise ValueError(
                f"FSDP unit around {root.name} has sharding_groups={root.options.sharding_groups}"
                f", replicate_across_groups={root.options.replicate_across_groups}, but the "
                f"unit around {s.name} inside it has sharding_groups="
                f"{s.options.sharding_groups}, replicate_across_groups="
                f"{s.options.replicate_across_groups}. Every unit of one model must be sharded "
                f"over the same ranks: the gradient norm, loss scaling and checkpoints treat the "
                f"model as one. Give every unit the same two options (auto_wrap_policy does)")
