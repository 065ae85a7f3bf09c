"""Process-wide state that every rank owns a copy of, switched with the turn.

Code written for one process per device keeps state in module globals and relies on
nobody else touching it. Device threads of one process would share it, so the launcher
gives every rank its own copy of each piece below, as it does for the RNG: the turn ring
restores a rank's copy when the rank takes the turn and captures it when the rank passes
it on.

* ``RngStreams``: torch's CPU generator, ``random``'s and numpy's global generators.
* ``ProfilerStepFlag``: ``torch_xla.debug.profiler``'s step flag, set by ``xp.StepTrace``
  and cleared by ``MpDeviceLoader``, which syncs at its next batch only when the flag is
  not set. Shared, one rank cleared another's flag, the ranks synced a different number
  of times, and XLA aborted in a rendezvous.
* ``DistributedWorld``: ``torch.distributed``'s world (the default process group, every
  process group's name, ranks, backend and store, the counter that names new groups).
  Shared, the second rank's ``dist.init_process_group('xla', init_method='xla://')`` failed
  with "trying to initialize the default process group twice!".

[Note: each rank owns its process globals]
A rank's copy is swapped in for its turn, rather than kept per thread, because not all the
code that runs for a rank runs on its thread: autograd runs an XLA backward on its own
device thread, so hooks (FSDP's, DDP's reducer) that call ``dist.get_rank()`` or a
collective of the default group run there. Only the turn holder runs Python, and the
holder waits in ``backward()`` while that thread runs for it, so swapping with the turn
hands such threads the right copy, where a ``threading.local`` world (as
``torch.testing._internal.distributed.multi_threaded_pg`` installs) would hand them an
empty one. Two pieces of torch.distributed's state cannot be swapped in Python:

* the C++ registry that maps a group's name to the group (functional collectives resolve
  names there; every rank names its default group "0", and a second registration of a
  name is refused). torch's thread isolation mode gives each thread its own registry, and
  maps autograd's threads to the thread that queued the backward, which is exact for the
  same reason;
* the store behind ``xla://`` (torch_xla's ``rendezvous._store``), one per process: on a
  host the processes share one TCPStore server's keys, and here the ranks share one
  in-process ``HashStore``, as torch's multi-threaded tests do. This one needs no port, so
  launches running side by side cannot collide on torch_xla's fixed default port.

Other module globals of torch_xla that threads share are harmless: they are keyed by
device (``xm``'s device contexts, step closures), equal on every rank (the cached world
size), thread-local already, or set and cleared within one backward, which runs within
one turn (``torch_xla.utils.checkpoint.chkpt_status``). Still one per process: the
profiler session (``xp.start_trace``; TSL runs one per process), torch_xla's metrics and
counters (they count every rank's work), settings held in C++ (eager mode, matmul
precision), which one rank sets for all, and draws from the global RNG made by threads a
rank starts (a DataLoader's iterator in ``MpDeviceLoader``'s thread), which advance the
generator of whichever rank holds the turn.
"""
from __future__ import annotations

import random
from typing import Any, Dict, List, Protocol

import torch

try:
    import numpy as _np
except ImportError:  # numpy is optional for the ring itself
    _np = None


class ProcessGlobal(Protocol):
    """A piece of process-wide state of which every rank has its own copy."""

    def fresh(self) -> Any:
        """The state a newly started process has (called once per rank)."""

    def capture(self) -> Any:
        """The state as the process holds it now."""

    def restore(self, state: Any) -> None:
        """Makes ``state`` the process's."""


class RngStreams:
    """torch's CPU generator and the global generators of ``random`` and numpy. Every rank
    starts from the state at launch, as processes started alike would."""

    def __init__(self) -> None:
        self._initial = self.capture()

    def fresh(self) -> tuple:
        return self._initial

    def capture(self) -> tuple:
        return (torch.get_rng_state(), random.getstate(),
                _np.random.get_state() if _np is not None else None)

    def restore(self, state: tuple) -> None:
        torch_state, py_state, np_state = state
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        if np_state is not None:
            _np.random.set_state(np_state)


class ProfilerStepFlag:
    """``torch_xla.debug.profiler``'s module-global "a StepTrace marked this step" flag."""

    def __init__(self) -> None:
        import torch_xla.debug.profiler as xp
        self._xp = xp

    def fresh(self) -> bool:
        return False  # as the module starts

    def capture(self) -> bool:
        return self._xp.get_tracer_marked_step()

    def restore(self, state: bool) -> None:
        self._xp.set_tracer_marked_step(state)


class DistributedWorld:
    """``torch.distributed.distributed_c10d``'s module globals: ``_world`` (the default
    group and the groups' pending coalesced ops) and the maps and counters ``_World``'s
    properties read from the module, looked up at each call."""

    # name -> the value a freshly imported module holds
    _FRESH = {"_pg_map": dict, "_pg_names": dict, "_pg_group_ranks": dict,
              "_pg_backend_config": dict, "_tags_to_pg": dict, "_pg_to_tag": dict,
              "_group_count": lambda: 0, "_backend": lambda: None,
              "_default_pg_init_method": lambda: None}

    def __init__(self) -> None:
        import torch.distributed.distributed_c10d as c10d
        self._c10d = c10d
        missing = [n for n in ("_world", *self._FRESH) if not hasattr(c10d, n)]
        if missing:
            raise RuntimeError(f"torch.distributed has no {', '.join(missing)}: the virtual "
                               f"launcher does not know this torch version's world state")

    def fresh(self) -> Dict[str, Any]:
        state = {name: make() for name, make in self._FRESH.items()}
        state["_world"] = self._c10d._World()
        return state

    def capture(self) -> Dict[str, Any]:
        return {name: getattr(self._c10d, name) for name in ("_world", *self._FRESH)}

    def restore(self, state: Dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self._c10d, name, value)


def install() -> List[ProcessGlobal]:
    """Prepares the virtual-device process (see [Note: each rank owns its process globals])
    and returns what the turn ring swaps per rank. Call before the device threads start."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _set_thread_isolation_mode
    from torch_xla._internal import rendezvous

    _set_thread_isolation_mode(True)
    with rendezvous._store_lock:
        if rendezvous._store is None:
            rendezvous._store = dist.HashStore()
    return [RngStreams(), ProfilerStepFlag(), DistributedWorld()]
