"""Host reads in an optimizer step over FSDP shards find the step's gradients computed:
forward and backward run once a step, not once per read.

[Note: a host read runs the graph behind it again]
For a read of a tensor's value on the host (``.item()``, ``bool(t)``, a comparison with a
float), torch_xla runs the pending graph of that tensor alone; every other live tensor keeps
its pending graph, and the step's sync runs it again. A read of a value computed from a
gradient, or from a shard (the backward's barriers rewrite the shards), therefore runs that
part of forward and backward once more per read. Optimizers and loss scaling read so:
- torch's Adafactor reads the norm of each parameter and of each update: on a model of 12
  parameters, 24 programs a step besides the step's own, each a forward and a backward up
  to the tensor it reads (Hugging Face's Adafactor reads each parameter's RMS: 12);
- ``GradScaler.step`` reads the inf flags, computed from every gradient, before it steps:
  forward and backward run twice a step;
- optimizers that adapt their step size from sums over the gradients read those sums.
So before the first such read in the step of an optimizer over FSDP shards on an XLA device,
every live tensor of the device is computed once (``_xla.private_api.run_live_graphs``: what
``torch_xla.sync()`` runs, without ending the step, so the random seed is not advanced and
no step closure runs early). Forward and backward run once, each read then runs a small
program over computed values, and the step's own sync runs the update as a program of its
own (whose buffers need numbering for donation: see [Note: an update that runs as a program
of its own] in ``_xla.donation_order``). GradScaler reads its flags before its optimizer's
step: the sync comes just before that read (``private_api.before_grad_scaler_reads``). The
sync is dispatched, not waited for: the reads wait.

Which steps read is learnt at each optimizer's first step (its first that returns), under a
torch-function mode that syncs at the first read (``_xla.host_reads.runs_graph``) of a
value whose pending graph holds a collective: the backward's gathers and reductions. Reads
of anything else (an optimizer's own scalar state, as torch's ASGD reads it; a value one
rank alone logs) run only what they read, and teach nothing, so every rank learns alike
from what every rank computes. Later steps of an optimizer that read sync in its step's
pre-hook, with no mode: a mode would run Python for every operation of every step. An
optimizer that reads only from its second step on is not caught, and one that read only at
its first step is synced needlessly (one program more). A step called inside the watched
one (a subclass's ``super().step()``, a wrapper's inner optimizer: torch runs the hooks for
each) is part of it. A watched step that raised stops watching at its next read outside it,
and is ended at the next step on its thread, its optimizer watched again. A step given a
closure (LBFGS) runs its forward and backward inside the step, after the pre-hook: its sync
gains nothing there and costs one program.

The first step's checks (``optimizer_guard.check_step``) read the pending gradients before
the sync (before GradScaler's read they run there, and again in the step), so it hides
nothing from their audit. Reads outside the step (a loss or a norm read between backward and
the step) are the user's: they run what they read again, as they do without FSDP.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from .._sharding.tensor_tree import collect_tensors
from .._xla.donation_order import pin_update_order
from .._xla.host_reads import has_pending_collective, runs_graph
from .._xla.private_api import innermost_function_mode, run_live_graphs
from .optimizer_guard import check_step
from .shard_group import shard_groups_of

_reading: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # its step reads
_watched: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # first step seen
_local = threading.local()   # the mode watching this thread's step, while it steps


class _SyncAtFirstRead(TorchFunctionMode):
    """Syncs the device once, before the first read of a value whose pending graph holds a
    collective, in the step run by frame ``caller`` (torch's step wrapper, which runs the
    hooks). The frame is held, not its id: a later step's wrapper can reuse a finished
    frame's id."""

    def __init__(self, optimizer: torch.optim.Optimizer, caller: Any,
                 device: torch.device) -> None:
        super().__init__()
        self.optimizer = weakref.ref(optimizer)
        self.caller = caller
        self.device = device
        self.read = False
        self.watching = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self.watching and runs_graph(func, args, kwargs):
            if not _on_stack(self.caller):   # the step raised: what runs now is not it
                self.watching = False
            elif has_pending_collective(collect_tensors((args, kwargs))):
                self.read, self.watching = True, False
                run_live_graphs(self.device)
        return func(*args, **kwargs)


def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook, after ``check_step``."""
    if torch.compiler.is_compiling():
        return
    watch = getattr(_local, "mode", None)
    if watch is not None:
        if _on_stack(watch.caller):   # a step called inside the watched one (a subclass's
            return                    # ``super().step()``, a wrapper's inner optimizer)
        _end_watch()   # left by a step that raised: its optimizer is watched again
        if watch.optimizer() is not None:
            _watched.discard(watch.optimizer())
    if optimizer in _reading:
        device = _device(optimizer)
        if device is not None:   # its shards all left the device since it learnt
            run_live_graphs(device)
            pin_update_order(optimizer, device, reads=True)
    elif optimizer not in _watched:
        # its first step: later steps of an optimizer without XLA shards look at nothing
        # more, see [Note: per-step host cost] in ``unit_params``
        _watched.add(optimizer)
        device = _device(optimizer)
        if device is not None:
            _local.mode = _SyncAtFirstRead(optimizer, sys._getframe(1), device)
            _local.mode.__enter__()


def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step post-hook: learns whether the step it watched read."""
    if torch.compiler.is_compiling():
        return
    watch = getattr(_local, "mode", None)
    if watch is not None and watch.caller is sys._getframe(1):
        _end_watch()
        if watch.read:
            _reading.add(optimizer)


def before_scaler_reads(optimizer: torch.optim.Optimizer) -> None:
    """Before ``GradScaler.step`` reads ``optimizer``'s inf flags: the step's checks first,
    while the gradients are still a pending graph (after any clipping between ``unscale_``
    and ``step``), then the sync, then the update's numbering for donation unless the
    optimizer reads too: its pre-hook then syncs and numbers it (see [Note: an update that
    runs as a program of its own] in ``_xla.donation_order``)."""
    device = None if torch.compiler.is_compiling() else _device(optimizer)
    if device is not None:
        check_step(optimizer, (), {})
        run_live_graphs(device)
        if optimizer not in _reading:   # else its step's pre-hook syncs and pins again
            pin_update_order(optimizer, device, reads=False)


def _end_watch() -> None:
    mode, _local.mode = _local.mode, None
    mode.watching = False
    if innermost_function_mode() is mode:
        mode.__exit__(None, None, None)
    # else a mode entered after ours is still on: ours stays below it, passing calls on


def _on_stack(caller: Any) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame is caller:
            return True
        frame = frame.f_back
    return False


def _device(optimizer: torch.optim.Optimizer) -> Optional[torch.device]:
    """The XLA device of the FSDP shards ``optimizer`` steps, or None."""
    return next((g.shard.device for g in shard_groups_of(optimizer)
                 if g.shard.device.type == "xla"), None)
