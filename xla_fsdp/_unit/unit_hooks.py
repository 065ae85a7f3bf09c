"""The hooks that drive a unit of ``XlaFullyShardedDataParallel``: a ``UnitState`` whose
modules' forward and whose placeholders' gradients are hooked, one object per unit.

A unit's hooks sit on the modules it wraps: on the wrapped module, or on each module of a
module group (``_init.module_group``), the same hooks either way. The state registers them
(``hook_members``, ``watch_gradients``) and is the only code they call.

forward: pre-hook (gather, and issue the prefetched units' gathers; hook the inputs'
gradients) -> the module -> post-hook (free if resharding, once every member ran; hook the
outputs' gradients).
backward: an output's gradient hook gathers again (if freed) -> each parameter's
post-accumulate hook hands its gradient to ``UnitParams.post_backward``, which frees and
queues a complete shard group for reduce-scatter -> the root context's callback finishes
every unit (``UnitParams.finalize_backward``: what is still unreduced, see [Note: parameters
without a gradient]; the queue flushed) and the unit returns to ``IDLE``. A pass that raised
is settled by the root context (see [Note: a pass that raised]).

Every hook on a tensor holds the state weakly: tensors may outlive the model (a placeholder
held by a module the user kept, a graph input torch_xla's compile bridge keeps), and hooks
are invisible to Python's cycle collector.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .._sharding.collectives import optimization_barrier
from .._sharding.tensor_tree import cast_floating, collect_tensors, map_tensors
from .._xla.donation_order import pin_parameter_order
from .._xla.private_api import in_backward, run_at_trace
from . import attention as attention_scope
from .options import FsdpOptions
from .root_context import RootContext
from .shard_group import ShardGroup
from .training_state import TrainingState
from .unit_params import UnitParams
from .unit_state import UnitState, detached_message


class HookedUnitState(UnitState):
    def __init__(self, unit: nn.Module, name: str, members: Sequence[nn.Module],
                 params: UnitParams, options: FsdpOptions, detached: bool,
                 first_forward_check: Callable[["HookedUnitState"], None],
                 compile_refusal: Optional[str] = None) -> None:
        super().__init__(unit, name, members, params, options, detached, compile_refusal)
        self.forward_prefetch: List["HookedUnitState"] = []
        self.backward_prefetch: List["HookedUnitState"] = []
        self._forward_id = -1              # the root forward this unit's members ran in
        self._first_forward_check = first_forward_check  # as a root, before its first forward
        self._members_run: set = set()
        self._leaf_hooks: List[RemovableHandle] = []  # on persistent leaves: removed after backward
        self._warned_hidden = False
        self._check_at_trace = _checks_at_trace(self)

    def hook_members(self, compiled: Sequence[Optional[nn.Module]] = ()) -> None:
        """Hooks each member's forward; a member given with its ``torch.compile`` module is
        hooked on that module, so that its hooks run before its compiled region, not in it
        (see [Note: FSDP's hooks under torch.compile])."""
        disable = functools.partial(torch.compiler.disable, reason=(
            f"FSDP unit around {self.name}: its gathers and reductions run eagerly between "
            f"compiled regions, so torch.compile(fullgraph=True) cannot span the unit. Compile "
            f"the module the unit wraps instead, and wrap the compiled module: "
            f"FSDP(torch.compile(module, fullgraph=True))"))
        self._pre_eager = disable(self.pre_forward)
        self._post_eager = disable(self.post_forward)
        for m, outer in zip(self.members, list(compiled) or [None] * len(self.members)):
            target = m if outer is None else outer
            on_compiled = outer is not None
            target.register_forward_pre_hook(
                functools.partial(self._pre_forward_hook, m, on_compiled), with_kwargs=True,
                prepend=True)
            target.register_forward_hook(
                functools.partial(self._post_forward_hook, m, on_compiled))

    def watch_gradients(self, shard_group: ShardGroup) -> None:
        """Hooks each placeholder's accumulated gradient (once per placeholder)."""
        # a tensor's hooks are invisible to Python's cycle collector: a hook that held this
        # state (or the shard group, which holds the placeholder) would keep the whole
        # model alive after the user dropped it
        state, held = weakref.ref(self), weakref.ref(shard_group)
        for i, r in enumerate(shard_group.records):
            r.hook_gradient(functools.partial(_gradient_arrived, state, held, i))

    def set_prefetch(self, forward: Optional[List["HookedUnitState"]] = None,
                     backward: Optional[List["HookedUnitState"]] = None) -> None:
        if forward is not None:
            self.forward_prefetch = list(forward)
        if backward is not None:
            self.backward_prefetch = list(backward)

    # -- forward ---------------------------------------------------------------------------
    # These two may run in Dynamo, which then reads that it is tracing, and hand over to
    # the eager code at a graph break (see [Note: FSDP's hooks under torch.compile]). On a
    # member's torch.compile module the compiled region comes right after them.
    # When Dynamo traces them and the model allows it, the gathers go into the traced graph
    # instead (see [Note: collectives traced into the compiled graph]). The choice is made
    # once, in the unit's forward (``RootContext.tracing``): read here, the state behind it
    # made the hooks' frames take the units' tensors as inputs, and on the graph-break path
    # the bridge then ran a region on an activation whose buffer it had donated.
    def _traced(self, on_compiled: bool) -> bool:
        """Whether this hook runs in the graph Dynamo traces, gathers included."""
        return torch.compiler.is_compiling() and not on_compiled and self.context.tracing

    def _pre_forward_hook(self, member: nn.Module, on_compiled: bool, _module: nn.Module,
                          args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        if self._traced(on_compiled):
            return self._pre_traced(member, args, kwargs)
        return self._pre_eager(member, args, kwargs,
                               on_compiled or torch.compiler.is_compiling())

    def _post_forward_hook(self, member: nn.Module, on_compiled: bool, _module: nn.Module,
                           _args: tuple, outputs: Any) -> Any:
        if self._traced(on_compiled):
            self.params.take_back()
            attention_scope.leave((id(self), id(member)))
            return outputs
        return self._post_eager(member, outputs)

    def _pre_traced(self, member: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        if self is self.context.root:
            self._check_at_trace()
        args, kwargs = self._enter(member, args, kwargs)
        # the first positional input that carries a gradient is tied to the unit's
        # reductions (see [Note: one unit's reductions before the next unit's backward])
        at = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                   and a.requires_grad and a.is_floating_point()), None)
        x = self.params.lend_full_values(None if at is None else args[at])
        if at is not None:
            args = args[:at] + (x,) + args[at + 1:]
        return args, kwargs

    def _enter(self, member: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        """The member's inputs in the compute dtype, and the attention scope taken (see [Note:
        attention inside a unit keeps no probabilities]; traced by Dynamo too, which guards
        the compiled code on the scope)."""
        if self.options.compute_dtype != torch.float32:
            args, kwargs = cast_floating(self.options.compute_dtype, (args, kwargs))
        attention_scope.enter((id(self), id(member)))
        return args, kwargs

    def pre_forward(self, member: nn.Module, args: tuple, kwargs: dict,
                    compiled: bool) -> Tuple[tuple, dict]:
        recompute = _in_checkpoint_recompute()
        if self.detached:
            raise ValueError(detached_message(self.members))
        context = self.context
        if self is context.root and not recompute:
            context.settle()
            context.begin_forward(self._first_root_forward, compiled)
            pin_parameter_order(self.params.device, context,
                                [t for s in context.states for t in s.params.rewritten_shards()],
                                torch.is_grad_enabled())
        if self._forward_id != context.forward_id or id(member) in self._members_run:
            self._forward_id = context.forward_id  # a new pass (or a unit used on its own)
            self._members_run.clear()
        self._members_run.add(id(member))
        if not recompute:  # a recompute runs inside this unit's backward: keep its state
            self.params.set_immediate(compiled)
            self.sync_trainable()
            self.params.drop_abandoned()
            self.training_state = TrainingState.FORWARD
        args, kwargs = self._enter(member, args, kwargs)
        inputs = collect_tensors((args, kwargs))
        prefetch = [] if recompute else [s.params for s in self.forward_prefetch]
        self.params.unshard(inputs, self.options.optimization_barrier_in_forward, prefetch)
        if self.params.barrier_on_activations(backward=True) and torch.is_grad_enabled():
            for t in inputs:
                if t.requires_grad:
                    self._hook(t, self._input_grad_barrier)
        return args, kwargs

    def post_forward(self, member: nn.Module, outputs: Any) -> Any:
        attention_scope.leave((id(self), id(member)))
        if _in_checkpoint_recompute():
            # the recomputed activations' backward comes next and reads the full
            # parameters; it frees them as any backward does
            return self._hook_outputs(outputs)[0]
        grad = torch.is_grad_enabled()
        last = len(self._members_run) >= len(self.members)
        outputs, hooked = self._hook_outputs(outputs)
        if last and (self.params.reshard_after_forward or not grad):
            if grad and not hooked and any(g.shard.requires_grad for g in self.params.gathered):
                self._keep_for_hidden_outputs()
            else:
                on_outputs = self.params.barrier_on_activations(backward=False)
                self.params.reshard(self.params.gathered,
                                    collect_tensors(outputs) if on_outputs else [],
                                    self.options.optimization_barrier_in_forward)
        if last:
            self.training_state = TrainingState.IDLE
        if self is self.context.root:
            self.context.end_forward(grad, collect_tensors(outputs))
        return outputs

    def _first_root_forward(self) -> None:
        self._first_forward_check(self)
        if self.options.debug_print and self.options.rank == 0:
            count = sum(len(s.params.shard_groups) for s in self.context.states)
            print(f"root FSDP unit got {count} sharded parameters "
                  f"(_debug_msg: {self.options.debug_msg})")

    # -- backward --------------------------------------------------------------------------
    def _hook(self, t: torch.Tensor, fn: Any) -> None:
        # weakly, as the placeholders' hooks: a tensor may outlive the model (torch_xla's
        # torch.compile bridge keeps a compiled graph's example inputs for good)
        handle = t.register_hook(functools.partial(_call_if_alive, weakref.WeakMethod(fn)))
        if t.grad_fn is None:  # a leaf outlives the step: its hook must not pile up
            self._leaf_hooks.append(handle)

    def _hook_outputs(self, outputs: Any) -> Tuple[Any, bool]:
        """``outputs`` with a pre-backward hook on each tensor that requires grad, and
        whether there was one."""
        if not torch.is_grad_enabled():
            return outputs, False
        hooked = []

        def attach(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                self._hook(t, self._pre_backward)
                hooked.append(t)
            return t

        return map_tensors(attach, outputs), bool(hooked)

    def _keep_for_hidden_outputs(self) -> None:
        """No output tensor to hook: if the backward reaches this unit, it comes without the
        hook that would gather the parameters again, so they stay gathered (the per-
        parameter hooks free them after their gradients, the end of backward at the latest)."""
        if not self._warned_hidden:
            self._warned_hidden = True
            warnings.warn(
                f"FSDP unit around {self.name}: its output holds no tensor that requires grad "
                f"where FSDP looks (tensors, lists, tuples, dicts, dataclasses, attributes of "
                f"an object), so its full parameters are kept from forward to backward. "
                f"Return the tensors less deeply nested to let it free them.")

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # a backward records a graph only with create_graph=True
            raise RuntimeError(
                f"FSDP unit around {self.name}: a backward with create_graph=True (a gradient "
                f"penalty, torch.autograd.grad(..., create_graph=True), double backward) is "
                f"not supported: the graph it records reads the unit's full parameters, "
                f"which are freed when the backward ends, so its gradients would be wrong.")
        context = self.context
        context.queue_final_callback()
        # a forward recomputed in this backward (torch's checkpoint inside a unit, which
        # bypasses its hooks) computes attention as the forward did, until finish_backward
        attention_scope.enter(_backward_scope(context))
        barrier = self.params.barrier_on_activations(backward=True)
        if barrier:
            context.backward_barrier.append(grad)
        if self.params.immediate:  # the reductions held so far, before its compiled backward
            for state in context.states:
                state.params.run_reductions()
        if self.params.unshard(list(context.backward_barrier) if barrier else [], barrier,
                               [s.params for s in self.backward_prefetch]):
            context.backward_barrier.clear()
        if self.training_state in (TrainingState.IDLE, TrainingState.FORWARD):
            self.training_state = TrainingState.BACKWARD_PRE
        self.params.reached()
        if barrier:
            # the first also holds the forward's loss (see [Note: the loss before the
            # backward])
            optimization_barrier([grad] + context.take_results())
            grad = grad.view(grad.size())
        return grad

    def _input_grad_barrier(self, grad: torch.Tensor) -> torch.Tensor:
        self.context.backward_barrier.append(grad)
        optimization_barrier([grad])
        return grad.view(grad.size())

    def _post_accumulate(self, shard_group: ShardGroup, index: int) -> None:
        self.context.queue_final_callback()
        record = shard_group.records[index]
        if not record.holds_full:
            raise RuntimeError(
                f"FSDP unit around {self.name}: the gradient of '{record.name}' was computed "
                f"while its full parameters were freed, so it is wrong. The unit's backward "
                f"started without passing through its outputs' gradient hooks: return "
                f"tensors (in lists, tuples, dicts, named tuples or dataclasses) from the "
                f"wrapped module, or set_reshard_after_forward(False) on this unit.")
        with torch.no_grad():
            self.training_state = TrainingState.BACKWARD_POST
            self.params.post_backward(shard_group, index)

    def forward_raised(self) -> None:
        """The unit's forward raised: settles the model's pass, unless it is a recompute
        inside backward (settled with that backward) or a nested unit's forward inside the
        root's (settled as the exception leaves the root's). See [Note: a pass that raised]."""
        attention_scope.abandon()
        root = self.context.root
        if not in_backward() and (self is root
                                  or root.training_state is not TrainingState.FORWARD):
            self.context.abandon_pass()

    # -- the end of a pass ---------------------------------------------------------------------
    def finish_backward(self) -> None:
        self._drop_leaf_hooks()
        super().finish_backward()
        attention_scope.leave(_backward_scope(self.context))

    def abandon_pass(self) -> None:
        self._drop_leaf_hooks()
        super().abandon_pass()
        self._members_run.clear()
        attention_scope.leave(_backward_scope(self.context))

    def _drop_leaf_hooks(self) -> None:
        for handle in self._leaf_hooks:
            handle.remove()
        self._leaf_hooks.clear()


def _checks_at_trace(state: "HookedUnitState") -> Callable[[], bool]:
    """The first forward's checks as a function Dynamo runs while it traces the root's
    forward, leaving nothing of it in the graph (it takes no arguments: Dynamo passes only
    constants to such a function)."""
    held = weakref.ref(state)

    def check() -> bool:
        root = held()
        return root is None or root.context.check_first_forward(root._first_root_forward)
    return run_at_trace(check)


def _call_if_alive(method: "weakref.WeakMethod", grad: torch.Tensor) -> Optional[torch.Tensor]:
    fn = method()
    return None if fn is None else fn(grad)


def _gradient_arrived(state: "weakref.ref[HookedUnitState]",
                      shard_group: "weakref.ref[ShardGroup]", index: int) -> None:
    s, g = state(), shard_group()
    if s is not None and g is not None:
        s._post_accumulate(g, index)


def _backward_scope(context: RootContext) -> Tuple[str, int]:
    """Who holds the attention scope through a backward of ``context``'s model."""
    return ("backward", id(context))


def _in_checkpoint_recompute() -> bool:
    """Whether this forward recomputes activations during backward: activation
    checkpointing around the unit (``torch.utils.checkpoint``, reentrant or not, or
    torch_xla's), which runs the unit's forward again from inside the autograd engine."""
    from torch_xla.utils.checkpoint import chkpt_status
    return bool(chkpt_status.in_chkpt_bwd) or in_backward()
