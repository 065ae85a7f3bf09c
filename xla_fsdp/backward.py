"""The backward half of a unit, as a mixin of ``XlaFullyShardedDataParallel``.

A hook on the unit's outputs gathers the full parameters again if they were freed (and
issues the gathers of the units it prefetches); a hook on each parameter's gradient
accumulator counts the gradients of its shard group, and the complete group is freed and
queued for reduce-scatter; the root's final callback flushes the queue, frees what is left
and resets every unit for the next step.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.autograd import Variable

from ._tensor_tree import map_tensors
from .collectives import optimization_barrier
from .init_sharding import ShardGroup
from .training_state import TrainingState


class BackwardHooks:
    def _register_pre_backward_hooks(self, outputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return outputs

        def hook(grad: torch.Tensor) -> torch.Tensor:
            return self._pre_backward(grad)

        def attach(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                t.register_hook(hook)
            return t

        return map_tensors(attach, outputs)

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self._is_root and not getattr(self, "_final_callback_queued", False):
            self._final_callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)
        opts = self._options
        barrier = opts.optimization_barrier_in_backward
        if barrier:
            self._backward_barrier_tensors.append(grad)
        if self._rebuild_full_params(list(self._backward_barrier_tensors) if barrier else [],
                                     barrier, self._backward_prefetch):
            self._backward_barrier_tensors.clear()
        if self.training_state == TrainingState.IDLE:
            self.training_state = TrainingState.BACKWARD_PRE
        self._pre_backward_hook_has_run = True
        if barrier:
            optimization_barrier([grad])
            grad = grad.view(grad.size())
        return grad

    def _input_grad_barrier(self, grad: torch.Tensor) -> torch.Tensor:
        self._backward_barrier_tensors.append(grad)
        optimization_barrier([grad])
        return grad.view(grad.size())

    def _register_post_backward_hooks(self) -> None:
        if not torch.is_grad_enabled():
            return
        for g in self._groups:
            if g.hooks or not g.shard.requires_grad:
                continue
            g.pending_grads = len(g.params)
            for p in g.params:
                # A leaf holds its AccumulateGrad node weakly: unless we keep it, it dies
                # with the expand_as below, forward makes a new one without the hook, and
                # every reduce-scatter waits for the end of backward (holding every full
                # gradient until then).
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                g.hooks.append((accumulator, accumulator.register_hook(
                    functools.partial(self._post_backward, g))))

    @torch.no_grad()
    def _post_backward(self, group: ShardGroup, *unused: Any) -> None:
        self.assert_state([TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST])
        self.training_state = TrainingState.BACKWARD_POST
        group.pending_grads -= 1
        if group.pending_grads == 0:
            self._group_grads_ready(group)

    def _group_grads_ready(self, group: ShardGroup) -> None:
        opts = self._options
        barrier = opts.optimization_barrier_in_backward
        grads = [p.grad for p in group.params]
        if any(g is not None and g.requires_grad for g in grads):
            raise RuntimeError("FSDP does not support gradients that require grad "
                               "(create_graph=True)")
        if not self._require_backward_grad_sync:  # no_sync: keep the full gradients
            if self._reshard_after_backward_now():
                self._free_full_params([group], [g for g in grads if g is not None], barrier)
            return
        if all(g is None for g in grads):
            if self._reshard_after_backward_now():
                self._free_full_params([group], [], barrier)
            return
        full = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, group.params)]
        for p in group.params:
            p.grad = None
        flat = group.layout.pad(full)
        if opts.fp32_reduce_scatter and flat.dtype != torch.float32:
            flat = flat.float()
        if flat.dtype != torch.float32 and self.gradient_predivide_factor != 1:
            flat = flat / self.gradient_predivide_factor
        self._free_full_params([group] if self._reshard_after_backward_now() else [], [flat],
                               barrier)
        self._reduce_queue.append((group, flat))
        self._reduce_queue_bytes += flat.numel() * flat.element_size()
        limit = opts.reduce_scatter_bucket_size_mb * 1024 * 1024
        if self._reduce_queue_bytes > limit:
            self._flush_reductions()

    @torch.no_grad()
    def _flush_reductions(self) -> None:
        if not self._reduce_queue:
            return
        barrier = self._options.optimization_barrier_in_backward
        queue, self._reduce_queue, self._reduce_queue_bytes = self._reduce_queue, [], 0
        inputs = [flat for _, flat in queue]
        if barrier:
            optimization_barrier(inputs)
        # A float32 sum cannot overflow where the pre-division would matter, so the whole
        # division is the reduce-scatter's scale on the shard: one pass over the full
        # gradients fewer, and the same bits when both factors are powers of two.
        divisor = self.gradient_postdivide_factor
        if inputs[0].dtype == torch.float32:
            divisor *= self.gradient_predivide_factor
        outputs = self._collectives.reduce_scatter(inputs, scale=1.0 / divisor)
        for (group, _), reduced in zip(queue, outputs):
            if reduced.dtype != torch.float32:
                reduced = reduced.float()
            if barrier:
                optimization_barrier([reduced])
                self._backward_barrier_tensors.append(reduced)
            shard = group.shard
            shard.grad = reduced if shard.grad is None else shard.grad + reduced

    @torch.no_grad()
    def _finalize_backward(self) -> None:
        barrier = self._options.optimization_barrier_in_backward
        for unit in self.units():
            for g in unit._groups:
                if g.pending_grads and g.shard.requires_grad and unit._pre_backward_hook_has_run:
                    # some parameters of the group took no part in this backward
                    g.pending_grads = 0
                    unit._group_grads_ready(g)
                for _, handle in g.hooks:
                    handle.remove()
                g.hooks.clear()
                g.pending_grads = 0
            unit._flush_reductions()
            unit._gathered = None  # prefetched for a backward that did not reach the unit
            if unit._reshard_after_backward_now():
                unit._free_full_params(unit._groups, [], barrier)
            unit.training_state = TrainingState.IDLE
            unit._pre_backward_hook_has_run = False
        self._final_callback_queued = False
        if barrier:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            optimization_barrier(grads + list(self._backward_barrier_tensors))
        self._backward_barrier_tensors.clear()
        if self._options.sync_on_finalization:
            import torch_xla
            torch_xla.sync()


    def _reshard_after_backward_now(self) -> bool:
        # under no_sync, a unit that keeps its parameters between forward and backward keeps
        # them between accumulation steps too (torch_xla's behaviour)
        keep_for_no_sync = not self._require_backward_grad_sync and not self.reshard_after_forward
        return self.reshard_after_backward and not keep_for_no_sync
