"""The traced process: ``fn(0, *args)`` as rank 0 of a world it stands for alone, with
nothing executed, until its steady training step is known.

[Note: one traced rank stands for the world] A step's graph is the same on every rank:
the launcher checks it on virtual devices (ranks with different graphs are refused before
their collectives would hang), and FSDP's collectives take their sizes from the world
size, not from the devices present. So one process with one device, told the world has N
ranks and it is rank 0, traces the program every rank of an N-chip slice would compile,
with N-way collectives in it. Nothing runs, so the other N - 1 ranks are never needed:
256 chips are planned as cheaply as 4. What this relies on, and what breaks it: code whose
graph depends on the rank (rank 0's program is the one compiled), and code that reads
values to decide what to trace (every value read here is zero, see below).

What the process changes in torch_xla, for its own lifetime only:
* ``torch_xla.sync()`` (the step marker) captures the pending graph and cuts it
  (``step_graphs``); ``xm.wait_device_ops`` and syncs of chosen tensors do nothing;
* a value read on the host (``.item()``, ``print(t)``, ``.cpu()``, torch_xla's own copies
  to the CPU...) is zeros of the tensor's shape: nothing has run, so no value exists;
* ``xm.rendezvous`` returns this rank's payload for every rank, ``xm.mesh_reduce``
  reduces N copies of this rank's value;
* ``torch.save`` refuses: a checkpoint of zeros must not replace a real one;
* the wrapper builds its units with a TPU's defaults (``_xla.hardware``);
* ``xr.use_spmd()`` puts the world back: an SPMD program is one program for every chip,
  traced over the process's CPU devices (one per chip), with no rank to stand in for;
* checkpoints read as absent: a ``CheckpointManager`` finds none to restore, and loading
  one is refused (see ``trace_only.refuse_reads``), so a script that would resume a
  finished run plans its training step, not what it does when there is nothing to train.

[Note: a training step] What a plan is for is the training step, and a script can reach
its sync points without one: resumed at its last step, it only evaluates. The program does
not say whether it holds a backward pass, so the process counts, between syncs, the
backward passes (``torch.autograd.backward`` and ``grad``, which ``Tensor.backward`` calls)
and the optimizer steps (torch's global step hook, which every ``torch.optim.Optimizer``
subclass runs); a program that replaces a parameter's buffer (an update written by hand)
counts as an update too. ``TracedStep.kind`` is read from the steady step's graphs.
"""
from __future__ import annotations

import os
import pickle
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import torch
from torch.overrides import TorchFunctionMode

from ..._xla import trace_only
from ..._xla.hardware import plan_for
from ..._xla.host_reads import reads_host_value
from ..._xla.private_api import pretend_world
from ...launch.runner import launched_here
from ..report import TRAINING
from . import pallas
from .model_flops import ForwardFlops
from .step_graphs import Graph, StepFound, StepGraphs
from .switches import Switches
from .switches import apply as apply_switches


@dataclass
class TracedStep:
    """What the traced process sends back: the steady step's graphs (several when the
    function syncs more than once per step), and how the trace ended."""
    graphs: List[Graph]
    syncs: int
    repeated: bool              # a graph repeated: these are the steady step
    host_reads: int             # values read on the host (each read as zeros)
    returned: bool              # the function returned before a step repeated
    spmd: bool                  # traced in SPMD mode: one program partitioned over the chips
    chips: int = 1              # the world it stood for
    host_state_bytes: int = 0   # what optimizers keep in host memory (offload), this rank
    fsdp_units: int = 0         # xla_fsdp units the function built (switches apply to them)

    @property
    def model_flops(self) -> float:
        """The model's FLOPs per chip and step: three times its forward passes' matmul
        FLOPs (see [Note: model FLOPs and hardware FLOPs]); an SPMD program traces every
        chip's batch at once."""
        forward = sum(g.activity.forward_flops for g in self.graphs)
        return 3 * forward / (self.chips if self.spmd else 1)

    @property
    def kind(self) -> str:
        """``"training"`` (a backward pass and an update), ``"backward only"`` or
        ``"forward only"`` (see [Note: a training step])."""
        backward = sum(g.activity.backward_passes for g in self.graphs)
        updates = sum(g.activity.optimizer_steps + g.parameters_updated for g in self.graphs)
        if backward and updates:
            return TRAINING
        return "backward only" if backward else "forward only"


# [Note: at most 127 devices in a process]
# PyTorch's autograd engine keeps one ready queue per device and indexes them with
# c10::DeviceIndex, an 8-bit integer: with 128 XLA devices in a process or more (SPMD
# counts them all even though it shows one), every backward fails an internal assert in
# engine.cpp. A TPU host has 4 or 8 local devices, so only a plan meets it. Replica
# programs (ours, torch_xla's FSDP) trace on the first device alone and need one; an
# SPMD program's mesh spans a device per chip, so SPMD plans stop at the largest slice
# below the limit, and a larger one is refused when the function turns SPMD on.
MAX_DEVICES = 127


def environment(world: int) -> Dict[str, str]:
    """Variables the traced process must be born with: a CPU device per chip while there
    are few enough (see [Note: at most 127 devices in a process]), else one. Only the
    first is used, except by SPMD programs (FSDPv2), whose mesh spans all of them; CPU
    devices that never run anything cost nothing."""
    devices = world if world <= MAX_DEVICES else 1
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), **launched_here(),
            "PJRT_CPU_ASYNC_CLIENT": "false"}


class _ZeroReads(TorchFunctionMode):
    """Host reads of XLA tensors see zeros of the same shape and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_host_value(func, args, kwargs):
            name = getattr(func, "__name__", "")
            if name == "copy_":     # into a CPU tensor: only the source is read
                swapped = args[0].device.type == "cpu" and _is_xla(args[1])
                args = (args[0], _zeros(args[1])) + tuple(args[2:]) if swapped else args
            elif name == "to":      # to the CPU: only the tensor moved is read
                swapped = _is_xla(args[0])
                args = (_zeros(args[0]),) + tuple(args[1:]) if swapped else args
            else:
                swapped = any(_is_xla(a) for a in (*args, *kwargs.values()))
                args, kwargs = tuple(map(_zeros, args)), {k: _zeros(v) for k, v in kwargs.items()}
            self.count += swapped
        return func(*args, **kwargs)


def _is_xla(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.device.type == "xla"


def _zeros(obj: Any) -> Any:
    return torch.zeros(obj.shape, dtype=obj.dtype) if _is_xla(obj) else obj


def _host_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and state ``opt`` keeps on the host (an offloaded
    optimizer's; in a plan they are meta tensors of the host's shapes), each counted once.

    [Note: host state is measured when an optimizer steps] The gradients exist from
    backward until ``zero_grad``, and the optimizer may live only in the function's frame.
    Counted after the trace, the gradients are gone and the optimizer may be too: a search
    of live objects then finds it or not depending on when the garbage collector last ran.
    So it is counted by the step hook that counts optimizer steps, with what the step held."""
    held = [t for param_group in opt.param_groups for p in param_group["params"]
            if p.device.type in ("cpu", "meta")
            for t in (p, p.grad, *opt.state.get(p, {}).values())]
    on_host = {id(t): t for t in held
               if isinstance(t, torch.Tensor) and t.device.type in ("cpu", "meta")}
    return sum(t.numel() * t.element_size() for t in on_host.values())


def _count_activity(graphs: StepGraphs, host_state: Dict[int, int]) -> ForwardFlops:
    """Backward passes, optimizer steps and forward FLOPs are counted into
    ``graphs.activity`` (see [Note: a training step]), and each optimizer's largest host
    state into ``host_state`` (see [Note: host state is measured when an optimizer steps]);
    returns the FLOP counter, a torch-function mode for the traced function to run under."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    forward = ForwardFlops(lambda flops: graphs.activity.count_forward_flops(flops))

    def counted(run: Callable[..., Any]) -> Callable[..., Any]:
        def in_backward(*args: Any, **kwargs: Any) -> Any:
            graphs.activity.count_backward()
            with forward.in_backward():
                return run(*args, **kwargs)
        return in_backward

    def counted_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        graphs.activity.count_optimizer_step()
        host_state[id(opt)] = max(host_state.get(id(opt), 0), _host_bytes(opt))

    torch.autograd.backward = counted(torch.autograd.backward)
    torch.autograd.grad = counted(torch.autograd.grad)
    register_optimizer_step_post_hook(counted_step)
    return forward


def _patch(graphs: StepGraphs, world: int, host_state: Dict[int, int]) -> ForwardFlops:
    import torch_xla
    import torch_xla.core.xla_model as xm

    forward = _count_activity(graphs, host_state)
    pallas.enable(min(world, MAX_DEVICES), forward.add)

    torch_xla._XLAC._xla_step_marker = lambda *a, **k: graphs.sync()
    # FSDP's sync before an optimizer step's host reads cuts the step's program in two
    torch_xla._XLAC._xla_sync_live_tensors = lambda *a, **k: graphs.sync()
    torch_xla._XLAC._xla_get_cpu_tensors = lambda tensors: [_zeros(t) for t in tensors]
    torch_xla._XLAC._xla_sync_multi = lambda *a, **k: None
    torch_xla._XLAC._xla_wait_device_ops = lambda *a, **k: None
    xm.rendezvous = lambda tag, payload=b"", replicas=None: [payload] * world
    xm.mesh_reduce = lambda tag, data, reduce_fn: reduce_fn([data] * world)
    torch.save = lambda obj, f, *args, **kwargs: trace_only.refuse_writes(str(f))
    import torch_xla.runtime as xr
    use_spmd = xr.use_spmd

    def spmd_is_one_process(*args: Any, **kwargs: Any) -> Any:
        if world > MAX_DEVICES:   # see [Note: at most 127 devices in a process]
            raise RuntimeError(
                f"an SPMD step (FSDPv2) cannot be planned for {world} chips here: its mesh "
                f"needs a CPU device per chip, and PyTorch's autograd engine fails with more "
                f"than {MAX_DEVICES} devices in one process. SPMD plans go up to 64 chips; "
                f"replica FSDP (xla_fsdp, torch_xla's FSDP) plans go up to 256.")
        # SPMD traces one program for all devices: no rank to stand in for
        pretend_world(None, None)
        return use_spmd(*args, **kwargs)
    xr.use_spmd = spmd_is_one_process
    return forward


def main(conn, payload: bytes, world: int, max_graphs: int, switches: Switches,
         stderr_path: str) -> None:
    """The child process: reports ``("results", {0: TracedStep})`` or ``("error", 0, ...)``
    as ``launch``'s device process does."""
    log_fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        from ...compat.patch import patch_if_requested
        patch_if_requested()
        fn, args = pickle.loads(payload)
        import torch_xla
        pretend_world(world, 0)
        plan_for("TPU")   # the wrapper's defaults are a TPU's (see hardware.py)
        trace_only.activate()
        graphs = StepGraphs(str(torch_xla.device()), max_graphs)
        host_state: Dict[int, int] = {}   # per optimizer: two optimizers hold both
        forward = _patch(graphs, world, host_state)
        units = apply_switches(switches)
        reads = _ZeroReads()
        returned = False
        try:
            with reads, forward:
                fn(0, *args)
                returned = True
                graphs.sync()   # what it left pending, as the sync it did not make
        except StepFound:
            pass
        steady = graphs.steady
        import torch_xla.runtime as xr
        result = TracedStep(steady if steady is not None else graphs.graphs[-1:],
                            graphs.syncs, steady is not None, reads.count, returned,
                            xr.is_spmd(), world, sum(host_state.values()), units.units)
        conn.send(("results", {0: pickle.dumps(result)}))
    except BaseException as exc:
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = None
        conn.send(("error", 0, blob, traceback.format_exc()))
    finally:
        conn.close()
