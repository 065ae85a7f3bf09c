"""``launch(fn)``: run ``fn(rank, *args)`` once per XLA device and collect the results.

On a TPU or Trainium host this is torch_xla's own multiprocess runner, unchanged. On a
machine without an accelerator it starts one child process hosting ``num_devices``
virtual XLA:CPU devices, one thread each, with what it takes for their collectives to be
exact and to never hang (see ``launch.virtual``). User code is the same in both cases.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import re
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence

from .._xla.hardware import torch_xla_device_type_quietly
from ..checkpoint.manager import preemption
from ..compat.patch import patch_if_requested
from . import process_start
from .virtual import worker

DEFAULT_VIRTUAL_DEVICES = 4
NUM_DEVICES_ENV = "XLA_FSDP_NUM_DEVICES"
_FAILED_GRACE_SECONDS = 20.0
_instead: Optional[Callable[[Callable[..., Any], tuple], Any]] = None


def launch_instead(replacement: Optional[Callable[[Callable[..., Any], tuple], Any]]) -> None:
    """Makes every later ``launch(fn, args, ...)`` in this process return
    ``replacement(fn, args)`` instead of running ``fn`` (None restores launching): how
    ``python -m xla_fsdp.aot`` plans an unchanged script's launch."""
    global _instead
    _instead = replacement


class LaunchError(RuntimeError):
    """A rank raised, or the device process died. ``rank`` is None when no rank is to blame."""

    def __init__(self, message: str, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank


def launch(fn: Callable[..., Any], args: Sequence[Any] = (),
           num_devices: Optional[int] = None) -> Dict[int, Any]:
    """Runs ``fn(rank, *args)`` once per device and returns ``{rank: return value}``.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). With no
    accelerator, ``num_devices`` virtual CPU devices are used: the argument, else the
    ``XLA_FSDP_NUM_DEVICES`` environment variable, else 4. If a rank raises, every other
    rank is released and a LaunchError naming that rank and carrying its traceback is
    raised here, chained to the original exception when it can be pickled.
    """
    if _instead is not None:
        return _instead(fn, tuple(args))
    if accelerator_type() is not None:
        return _launch_on_accelerator(fn, tuple(args), num_devices)
    if num_devices is None:
        num_devices = int(os.environ.get(NUM_DEVICES_ENV, DEFAULT_VIRTUAL_DEVICES))
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    env = dict(worker.environment(num_devices), **launched_here())
    return run_device_process(worker.main, (picklable_call(fn, tuple(args)), num_devices), env)


def accelerator_type() -> Optional[str]:
    """'TPU', 'NEURON', ... when torch_xla would run on an accelerator, else None."""
    device = os.environ.get("PJRT_DEVICE") or torch_xla_device_type_quietly()
    device = (device or "CPU").split("_")[0].upper()
    return None if device == "CPU" else device


def _launch_on_accelerator(fn: Callable[..., Any], args: tuple,
                           num_devices: Optional[int]) -> Dict[int, Any]:
    if num_devices not in (None, 1):
        raise ValueError(
            "on an accelerator every local device is used (as torch_xla's launcher does); "
            "pass num_devices=None, or 1 for a single device, and limit devices with "
            "torch_xla's own environment variables (e.g. TPU_PROCESS_BOUNDS, "
            "NEURON_RT_VISIBLE_CORES)")
    from .._xla.private_api import run_multiprocess, run_single_process  # imports torch
    call = _RankCall(fn, args)
    if num_devices == 1:
        return {0: run_single_process(call)}
    return run_multiprocess(call)


class _RankCall:
    """Picklable ``fn(global ordinal, *args)`` for torch_xla's runner. Unpickled in a child,
    it applies ``patch_torch_xla`` first when the parent had, since unpickling ``fn`` imports
    its module."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (_rebuild_rank_call, (pickle.dumps((self.fn, self.args)),))

    def __call__(self):
        import torch_xla.runtime as xr
        return self.fn(xr.global_ordinal(), *self.args)


def _rebuild_rank_call(payload: bytes) -> "_RankCall":
    patch_if_requested()
    preemption.watch_for_preemption()  # unpickled on the child's main thread
    return _RankCall(*pickle.loads(payload))


_IN_LAUNCH = "XLA_FSDP_IN_LAUNCH"


def launched_here() -> Dict[str, str]:
    """The variable that marks a device process as launched by this one. It names this
    process, because the parent holds it in its own environment while the child starts
    (``environment_for_child``): another thread of the parent that launches meanwhile must
    not mistake itself for a launched process."""
    return {_IN_LAUNCH: str(os.getpid())}


def picklable_call(fn: Callable[..., Any], args: tuple) -> bytes:
    """``(fn, args)`` pickled for a child process; TypeError naming what cannot be."""
    if os.environ.get(_IN_LAUNCH, str(os.getpid())) != str(os.getpid()):
        raise RuntimeError("launch() cannot be called from inside a launched function")
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"launch() needs a picklable fn and args (fn must be defined at module level, "
            f"not a lambda or a nested function): {exc}") from exc


def run_device_process(target: Callable[..., None], target_args: tuple,
                       env: Dict[str, str]) -> Dict[int, Any]:
    """Runs ``target(sender, *target_args, log_path)`` in a child process that starts with
    ``env`` (``process_start``), and returns the ``{rank: value}`` it reports. The child
    reports over ``sender`` as ``worker`` does: ``("thread", rank, thread id)`` as a rank
    starts (to name the stacks of a fatal error's dump), ``("error", rank, pickled exception
    or None, traceback)`` as soon as a rank fails, ``("results", {rank: pickled value})`` at
    the end; it writes its fd 2 to ``log_path``, which is forwarded to our stderr."""
    receiver, sender = multiprocessing.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile("w+b", prefix="xla_fsdp_launch_", suffix=".log",
                                     delete=False) as log:
        log_path = log.name
    process = process_start.start(target, (sender,) + tuple(target_args) + (log_path,), env)
    sender.close()
    tail = _LogTail(log_path)
    # a preemption notice to this process is the devices' (see [Note: who installs the
    # SIGTERM handler])
    forwarding = preemption.Forwarding(process.pid)
    try:
        values = _collect(process, receiver, tail)
        # the child sends its results before its exit handlers run (torch_xla's teardown,
        # the report of a save never published: see [Note: a save never waited on]); they
        # print to the log, which is forwarded until the child ends
        process.join(timeout=_EXIT_SECONDS)
        return values
    finally:
        tail.stop()
        if process.is_alive():
            process.kill()
        process.join()
        os.unlink(log_path)
        forwarding.end(process.exitcode)


# a save's report waits up to 60 s for its write to finish
_EXIT_SECONDS = 120


def _collect(process, receiver, tail) -> Dict[int, Any]:
    first_error = None
    threads: Dict[int, int] = {}  # thread id -> rank
    failed_at = None
    while True:
        if receiver.poll(0.2):
            try:
                message = receiver.recv()
            except EOFError:
                break
            if message[0] == "results":
                return _values_or_exit({rank: pickle.loads(blob)
                                        for rank, blob in sorted(message[1].items())})
            if message[0] == "thread":
                threads[message[2]] = message[1]
            elif first_error is None:
                first_error, failed_at = message, time.monotonic()
        elif not process.is_alive():
            break
        elif failed_at is not None and time.monotonic() - failed_at > _FAILED_GRACE_SECONDS:
            break  # the failure is known; the process is stuck tearing down
    process.join(timeout=5)
    if first_error is not None:
        _raise_rank_error(first_error)
    raise LaunchError(_death_message(process.exitcode, tail.text(), threads))


def _values_or_exit(values: Dict[int, Any]) -> Dict[int, Any]:
    """Each rank's return value; None for a rank that called ``sys.exit(0)``, and
    ``SystemExit`` with the first other code, as torch_xla's launcher exits."""
    for value in values.values():
        if isinstance(value, worker.RankExit) and value.code not in (None, 0):
            raise SystemExit(value.code)
    return {rank: None if isinstance(v, worker.RankExit) else v for rank, v in values.items()}


def _raise_rank_error(message):
    _, rank, exc_blob, formatted = message
    who = "the device process" if rank is None else f"rank {rank}"
    original = None
    if exc_blob is not None:
        with contextlib.suppress(Exception):
            original = pickle.loads(exc_blob)
    raise LaunchError(f"{who} raised:\n{formatted.rstrip()}", rank) from original


def _death_message(exitcode, log_text: str, threads: Dict[int, int]) -> str:
    how = (f"was killed by signal {signal.Signals(-exitcode).name}"
           if exitcode is not None and exitcode < 0 else f"exited with code {exitcode}")
    stacks = _rank_stacks(log_text, threads)
    # the log before the stacks Python's fault handler wrote as the process died
    last = _last_lines(log_text.split(_DUMP_START, 1)[0])
    if "Termination timeout" in log_text and "RendezvousKey" in log_text:
        return (
            f"the device process {how}: XLA gave up on a collective that not every rank "
            f"joined. The ranks ran different graphs, did not reach their collectives "
            f"in the same order, or one ran an op that torch_xla computes on the host "
            f"(a CPU fallback) over a pending collective (see the launcher's limits in "
            f"docs/launcher.md).\n{stacks}"
            f"Last lines of XLA's log:\n{last}")
    return (f"the device process {how} before returning.\n{stacks}"
            f"Last log lines:\n{last}")


_DUMP_START = "Fatal Python error:"


def _rank_stacks(log_text: str, threads: Dict[int, int], frames: int = 6) -> str:
    """Where each rank's thread stood when the process died, innermost frames first
    (Python's own threading frames left out), read from the fault handler's dump of every
    thread; ``threads`` maps thread ids to ranks. Empty when there is no dump."""
    found = {}
    for block in log_text.partition(_DUMP_START)[2].split("\n\n"):
        head = re.match(r"\s*(?:Current thread|Thread) (0x[0-9a-f]+)", block)
        rank = threads.get(int(head.group(1), 16)) if head else None
        if rank is not None:
            found[rank] = [line.strip() for line in block.splitlines()
                           if line.strip().startswith("File ")
                           and "/threading.py" not in line][:frames]
    if not found:
        return ""
    lines = [f"  rank {rank}: " + "\n          ".join(found[rank]) for rank in sorted(found)]
    return "Where each rank stood (innermost frames first):\n" + "\n".join(lines) + "\n"


def _last_lines(text: str, count: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-count:])


class _LogTail:
    """Forwards the child's fd-2 log to our stderr as it grows, and keeps it."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._chunks: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        with open(self._path, "rb") as f:
            while True:
                chunk = f.read()
                if chunk:
                    self._chunks.append(chunk)
                    sys.stderr.write(chunk.decode(errors="replace"))
                    sys.stderr.flush()
                elif self._stop.is_set():
                    return
                else:
                    time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def text(self) -> str:
        time.sleep(0.2)  # let the follower catch up with the last writes
        return b"".join(self._chunks).decode(errors="replace")
