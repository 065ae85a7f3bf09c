"""What the units of one model share: which forward pass this is, whether the end of the
backward is already scheduled, and the tensors the backward's barriers order; an offloaded
model's gradients leave the device when its backward ends (see [Note: the optimizer on
the host]).

The context belongs to the root, the unit no other unit was built around; it is fixed by
the structure of the model when units are built, not by which unit runs first. So a nested
unit used before the root (``inner.no_sync()``, a forward over a submodule only) never
mistakes itself for the root, and any unit can schedule the end of a backward that does not
pass through the root's outputs.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence

import torch
import torch.nn as nn

from .._sharding.collectives import optimization_barrier
from .._xla.private_api import in_backward, queue_backward_callback
from .host_offload import fetch_gradients
from .optimizer_guard import declare_sharded_gradients
from .options import FsdpOptions
from .training_state import TrainingState
from .unit_params import UnitParams


class Participant(Protocol):
    """A unit's state (``UnitState``) as the units of one model see each other through
    their context: this module cannot import that class, which imports it."""

    detached: bool                     # a grouping unit not attached yet
    compile_refusal: Optional[str]     # why the unit cannot run compiled, if it cannot
    members: List[nn.Module]
    training_state: TrainingState

    params: UnitParams

    def end_of_model_forward(self, grad_enabled: bool) -> None: ...

    def traceable(self) -> bool: ...

    def finish_backward(self) -> None: ...

    def abandon_pass(self) -> None: ...


# parameters registered on any module of the process, counted by a hook that
# ``process_effects`` installs: a model's first-forward checks run again after any
_registrations = [0]


def count_parameter_registration(*_args: object) -> None:
    """torch's module-parameter registration hook (returns None: the parameter stays)."""
    _registrations[0] += 1


class RootContext:
    def __init__(self, root: Participant, options: FsdpOptions) -> None:
        self.states: List[Participant] = [root]  # the root's first, then in module order
        self.forward_id = 0               # root forwards started; tells passes apart
        self.backward_barrier: List[torch.Tensor] = []
        self._results: List[torch.Tensor] = []
        self._callback_queued = False
        self._sync = options.sync_on_finalization
        self._barrier = options.optimization_barrier_in_backward
        self._checked_at: Optional[int] = None   # the registration count then
        # while Dynamo traces a forward: whether its units take the traced path (set by the
        # unit's forward, read by the hooks)
        self.tracing = False

    @property
    def root(self) -> Participant:
        return self.states[0]

    def set_participants(self, others: Sequence[Participant]) -> None:
        """The states of every unit below the root, in module order."""
        self.states = [self.root] + [s for s in others if s is not self.root]

    def begin_forward(self, first_time: Callable[[], None], compiled: bool) -> None:
        """A root forward starts (``compiled``: between compiled regions, which a unit that
        cannot run compiled refuses, by name)."""
        for state in self.states if compiled else ():
            if state.compile_refusal:
                raise RuntimeError(state.compile_refusal)
        self.check_first_forward(first_time)
        self.forward_id += 1

    def traced(self) -> bool:
        """Whether the model's units gather and reduce inside a graph Dynamo traces (see
        [Note: collectives traced into the compiled graph]): all of them can, and no eager
        backward is pending."""
        return not self._callback_queued and all(s.traceable() for s in self.states)

    def choose_path(self) -> None:
        """Sets ``tracing`` for the forward Dynamo is tracing now: its units' hooks read it."""
        self.tracing = self.traced()

    def check_first_forward(self, first_time: Callable[[], None]) -> bool:
        """Runs the checks of the model's first forward, and again at the first forward after
        a parameter was registered anywhere (one assigned to a wrapped module after wrapping
        would be neither sharded nor reduced); Dynamo runs it while it traces
        (``assume_constant_result`` in ``unit_hooks``), so the traced graph holds none of it."""
        if self._checked_at != _registrations[0]:
            first_time()
            self._checked_at = _registrations[0]
        return True

    def end_forward(self, grad_enabled: bool, outputs: Sequence[torch.Tensor]) -> None:
        """After the root's forward: units whose forward did not complete (a grouped unit
        whose member was skipped) finish it, and without grad (eval) every unit frees its
        full parameters, since no backward will. The forward's scalar ``outputs`` (the
        loss) are held for the backward's first barrier (see [Note: the loss before the
        backward])."""
        for state in self.states:
            state.end_of_model_forward(grad_enabled)
        self._results = [t for t in outputs if t.dim() == 0] if grad_enabled else []

    # [Note: the loss before the backward]
    # A loss the model computes in its forward (Hugging Face's, from ``labels``) is a
    # reduction over the logits that the backward never reads: the backward starts from the
    # logits' own gradient. libtpu's scheduler is free to compute it at the end of the step,
    # and does, where the logits it reads are a GiB at a 128K vocabulary: they then stay
    # live through the whole backward (the vocabulary-parallel 1B with per-layer
    # checkpointing peaked 1 GiB higher for it). So the first barrier of the backward holds
    # the root's scalar outputs with the incoming gradient: the loss is computed before any
    # backward work. Larger outputs are left alone: a cache the model returns and the user
    # drops would otherwise be kept until the backward.
    def take_results(self) -> List[torch.Tensor]:
        """The root forward's scalar outputs not yet ordered before a backward (once)."""
        results, self._results = self._results, []
        return results

    # [Note: a pass that raised]
    # An exception from user code inside a forward or a backward (a shape error at some
    # step) leaves the units mid-pass: full parameters gathered, gathers in flight, a
    # reduction queue, gradients on placeholders, the end of backward scheduled with a
    # graph task that autograd has dropped. A forward that raised is settled as the
    # exception leaves the root unit's forward. A backward gives no such point, so it is
    # settled at the model's next use: its next root forward, or a call that needs the model
    # idle. Either way every unit then frees its full parameters and drops what the pass left
    # unreduced; gradients already reduced into the shards stay there, as an unsharded
    # model keeps the gradients a failed backward produced. After ``optimizer.zero_grad()``
    # the next step is the one a model that never saw the error would take.
    def settle(self) -> None:
        """Settles a backward that raised (see [Note: a pass that raised])."""
        if self._callback_queued and not in_backward():
            self.abandon_pass()

    def abandon_pass(self) -> None:
        self._callback_queued = False
        self.backward_barrier.clear()
        self._results = []
        for state in self.states:
            state.abandon_pass()

    def queue_final_callback(self) -> None:
        """Schedules ``finish_backward`` at the end of the current backward, once."""
        if not self._callback_queued:
            self._callback_queued = True
            queue_backward_callback(self._finish_backward)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        self._callback_queued = False
        for state in self.states:
            state.finish_backward()
        if self._barrier:
            grads = [g for s in self.states for g in s.params.shard_gradients()]
            optimization_barrier(grads + self.backward_barrier)
        self.backward_barrier.clear()
        self._results = []   # a backward without barriers never took them
        if self._sync:
            import torch_xla
            torch_xla.sync()
        fetch_gradients([(g.shard, g.offload) for s in self.states for g in s.params.shard_groups
                         if g.offload is not None])
        declare_sharded_gradients(self.root.params.device)
        # see [Note: hooks on a shard's gradient]; a vocabulary table is in autograd's graph,
        # which ran its hooks
        for state in self.states:
            for g in state.params.gathered:
                g.run_gradient_hooks()
