"""What the units of one model share: which forward pass this is, whether the end of the
backward is already scheduled, and the tensors the backward's barriers order.

The context belongs to the root, the unit no other unit was built around; it is fixed by
the structure of the model when units are built, not by which unit runs first. So a nested
unit used before the root (``inner.no_sync()``, a forward over a submodule only) never
mistakes itself for the root, and any unit can schedule the end of a backward that does not
pass through the root's outputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List

import torch
from torch.autograd import Variable

if TYPE_CHECKING:
    from .unit_state import UnitState


class RootContext:
    def __init__(self, states: List["UnitState"], sync_on_finalization: bool,
                 barrier: bool) -> None:
        self.states = states              # the root's first, then the others in module order
        self.forward_id = 0               # root forwards started; tells passes apart
        self.backward_barrier: List[torch.Tensor] = []
        self._callback_queued = False
        self._sync = sync_on_finalization
        self._barrier = barrier
        self._initialized = False

    @property
    def root(self) -> "UnitState":
        return self.states[0]

    def begin_forward(self, first_time: Callable[[], None]) -> None:
        if not self._initialized:
            first_time()
            self._initialized = True
        self.forward_id += 1

    def end_forward(self, grad_enabled: bool) -> None:
        """After the root's forward: units whose forward did not complete (a grouped unit
        whose member was skipped) finish it, and without grad (eval) every unit frees its
        full parameters, since no backward will."""
        for state in self.states:
            state.end_of_model_forward(grad_enabled)

    def queue_final_callback(self) -> None:
        """Schedules ``finish_backward`` at the end of the current backward, once."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        self._callback_queued = False
        for state in self.states:
            state.finish_backward()
        if self._barrier:
            from .collectives import optimization_barrier
            grads = [g.shard.grad for s in self.states for g in s.params.groups
                     if g.shard.grad is not None]
            optimization_barrier(grads + self.backward_barrier)
        self.backward_barrier.clear()
        if self._sync:
            import torch_xla
            torch_xla.sync()
