"""A preemption notice (SIGTERM) as a process-wide flag that training reads at its step
boundaries, instead of the end of the process.

[Note: who installs the SIGTERM handler]
Python runs signal handlers only in a process's main thread, and only a main thread may
install one. Training functions do not run there: the virtual launcher runs each rank on a
thread of its own, and torch_xla's launcher runs a process's devices on a thread pool. So
the handler is installed by whoever holds a main thread: the launchers, in every process
they start (``xla_fsdp.launch``'s virtual worker, and its child processes on accelerators
as they unpickle the function), ``CheckpointManager`` when it is made on a main thread, or
the user through ``watch_for_preemption()`` before starting training any other way. The
parent of the virtual worker forwards the signal to it.

The handler runs when the main thread next runs Python. Linux hands a process's signal to its
main thread unless that thread already has one pending; then to any other thread, which does
not wake a main thread blocked in an untimed wait. The virtual worker's main thread therefore
waits for the ranks with a timeout (seen once in CI: a run trained to its end and was then
killed by the notice it got at step 8). torch_xla's own launcher waits for its device threads
without one, which a process we do not write cannot change.

The handler only sets a flag while some ``CheckpointManager`` of the process watches for
preemption. Otherwise it does what SIGTERM did before it was installed (by default, end the
process), so a process that uses no manager behaves as if nothing were installed.

The code a preempted process exits with, ``PREEMPTED_EXIT_CODE``, is 143: what a process
killed by SIGTERM reports (128 + 15). A scheduler that restarts preempted work then treats
a clean stop as it treats the preemption itself.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Optional

from ..._xla.private_api import activate_preemption_sync, preemption_sync_point_reached

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM

_lock = threading.Lock()
_watchers = 0
_requested = threading.Event()
_previous: Any = None   # the handler before ours, run when no manager watches
_installed = False
_sync_point_active = False  # torch_xla's preemption sync point, started once per process


def watch_for_preemption() -> bool:
    """Installs the SIGTERM handler (see the Note above) if this is the main thread (once
    per process); returns whether it is installed."""
    global _installed, _previous
    if threading.current_thread() is not threading.main_thread():
        return _installed
    with _lock:
        if not _installed:
            _previous = signal.signal(signal.SIGTERM, _on_sigterm)
            _installed = True
    return True


def _on_sigterm(signum: int, frame: Any) -> None:
    if _watchers > 0:
        _requested.set()
        return
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default: end the process as SIGTERM does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def start_watching() -> None:
    """A manager watches: SIGTERM now sets the flag."""
    global _watchers
    with _lock:
        _watchers += 1


def stop_watching() -> None:
    global _watchers
    with _lock:
        _watchers = max(0, _watchers - 1)


def requested() -> bool:
    """Whether this process received SIGTERM while watched."""
    return _requested.is_set()


def activate_runtime_sync_point() -> Optional[str]:
    """Starts torch_xla's preemption sync point (a TPU runtime's, the one its
    ``CheckpointManager`` uses) once per process; returns None if it is active, else why
    not."""
    global _sync_point_active
    import torch_xla.runtime as xr
    with _lock:
        if _sync_point_active:
            return None
        if xr.device_type() != "TPU":
            return f"the runtime's preemption sync point is a TPU's; this is {xr.device_type()}"
        why = activate_preemption_sync()
        _sync_point_active = why is None
        return why


class Forwarding:
    """While it lasts (made on the main thread), SIGTERM to this process is sent on to
    ``pid`` (the virtual launcher's worker) instead of acting here. ``end(exitcode)`` puts
    the previous handler back; if the signal came and ``pid`` then died of it (nothing there
    watched), this process ends of it too, as it would have without the forwarding."""

    def __init__(self, pid: int) -> None:
        self.received = False
        self._previous: Any = None
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            self._previous = signal.signal(signal.SIGTERM, self._forward)
        self._pid = pid

    def _forward(self, signum: int, frame: Any) -> None:
        self.received = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pid, signal.SIGTERM)

    def end(self, exitcode: Optional[int]) -> None:
        if not self._active:
            return
        self._active = False
        signal.signal(signal.SIGTERM, self._previous)
        if self.received and exitcode == -signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)
