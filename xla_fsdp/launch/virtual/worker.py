"""The child process that hosts N virtual XLA:CPU devices, one thread per device.

It runs ``fn(rank, *args)`` on every device thread under the turn ring and sends the
parent one message per event over a pipe:
``("thread", rank, thread id)`` as each rank starts,
``("error", rank, pickled exception or None, formatted traceback)`` as soon as a rank
fails, and ``("results", {rank: pickled value})`` at the end. A rank that calls
``sys.exit(code)`` ends there, as a process of its own would, and its value is a
``RankExit``: ``launch`` returns None for it, or exits with the first non-zero code, as
torch_xla's launcher does.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List


@dataclass(frozen=True)
class RankExit:
    """What a rank that ended with ``sys.exit(code)`` returned."""
    code: Any


# see [Note: collectives in program order on XLA:CPU]
_IN_ORDER = "xla_cpu_enable_concurrency_optimized_scheduler"


def environment(num_devices: int) -> Dict[str, str]:
    """Variables that must be set before the XLA runtime starts in the child."""
    return {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(num_devices),
        # An execution blocks inside a collective until every replica arrives, so the
        # pool that runs executions needs a thread per device and then some.
        "XLA_THREAD_POOL_SIZE": str(max(64, 8 * num_devices)),
        # The asynchronous CPU client starved replicas of threads on small machines.
        "PJRT_CPU_ASYNC_CLIENT": "false",
        "XLA_FLAGS": xla_flags(os.environ.get("XLA_FLAGS", "")),
        _KEPT: os.environ.get(_KEPT) or str(programs_kept(_max_map_count())),
    }


# see [Note: compiled programs within the process's memory maps]
_KEPT = "XLA_COMPILATION_CACHE_SIZE"
# a program's memory maps, measured: 20 to 40 for small graphs on XLA:CPU, about 80 on
# average for the matrix's Rprop steps (at most 47,009 maps held with 511 programs)
MAPS_PER_PROGRAM = 64


def programs_kept(max_map_count: int) -> int:
    """How many compiled programs the device process keeps: at 64 maps a program, half of
    the kernel's limit on its memory maps, which leaves room for larger programs.

    [Note: compiled programs within the process's memory maps]
    XLA:CPU maps each compiled program's machine code into the process in pieces, about
    40 memory maps for a small graph, and unmaps them when torch_xla's compilation cache
    evicts the program. That cache keeps 2,048 programs by default: 80,000 maps or more,
    beyond Linux's default limit of 65,530 per process (``vm.max_map_count``). A launch
    that compiles that many graphs (a matrix of many cells, an optimizer that syncs per
    tensor) then had LLVM fail with "Cannot allocate memory" and the process die of
    SIGSEGV. The device process keeps fewer programs instead: 511 at the default limit,
    more where the limit is higher (the matrix's 35-cell Rprop launch then peaked at 47,009
    maps, 72% of the limit). A launch's steps reuse far fewer programs than that
    (its graphs times its devices), so eviction only drops programs of finished work. A
    user's own ``XLA_COMPILATION_CACHE_SIZE`` wins. On a TPU the program lives on the
    device, not in the host's maps, and torch_xla's launchers keep their default."""
    return max(64, min(2048, max_map_count // 2 // MAPS_PER_PROGRAM))


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def xla_flags(inherited: str) -> str:
    """The parent's XLA flags, and XLA:CPU's list scheduler unless they choose one.

    [Note: collectives in program order on XLA:CPU]
    The virtual devices' collectives meet in XLA:CPU's in-process rendezvous, keyed by the
    collective's kind and its module, not by which of the module's collectives it is: each
    device's collectives must start one at a time and in the same order. XLA:CPU's default
    scheduler for concurrency let a device run two collectives of one scanned step at once
    (the all-gathers and reduce-scatters of its layer loops and those around them): the
    rendezvous then saw three arrivals for two devices, or each device waiting first at a
    different collective, and XLA aborted the process after 10 s. It happened in about one
    launch in four of the matrix's scanned cells on 2 cores, and in every launch with 16
    XLA:CPU threads (``PJRT_NPROC=16``); with the list scheduler, in none of 14. Real
    hardware runs each device's program on its own and keeps its own order, so this exists
    only here."""
    if _IN_ORDER in inherited:
        return inherited
    return " ".join(f for f in (inherited, f"--{_IN_ORDER}=false") if f)


def _dumps_or_none(obj: Any) -> bytes | None:
    try:
        return pickle.dumps(obj)
    except Exception:
        return None


def main(conn, payload: bytes, num_devices: int, stderr_path: str) -> None:
    # XLA's fatal errors go to fd 2; the parent reads this file to explain them.
    log_fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # when XLA aborts the process (a collective not every rank joined), every thread's
    # Python stack goes to the log too; the "thread" messages say which stack is whose
    faulthandler.enable(all_threads=True)
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    try:
        from ...compat.patch import patch_if_requested
        patch_if_requested()  # before fn's module imports torch_xla's FSDP
        from ...checkpoint.manager import preemption
        preemption.watch_for_preemption()  # the ranks' threads cannot; see its Note
        fn, args = pickle.loads(payload)
        results = _run(fn, args, num_devices, send)
        send(("results", results))
    except BaseException as exc:  # a failure of the launcher itself, not of a rank
        send(("error", None, _dumps_or_none(exc), traceback.format_exc()))
    finally:
        conn.close()


def _run(fn, args: tuple, num_devices: int, send) -> Dict[int, bytes]:
    import torch_xla
    import torch_xla.core.xla_model as xm

    from . import process_globals
    from .garbage import CollectorAtMeetings
    from .sync_points import SyncPoints
    from .turn_ring import RankAborted, TurnRing

    devices: List[str] = xm.get_xla_supported_devices()
    if len(devices) != num_devices:
        raise RuntimeError(f"asked for {num_devices} virtual CPU devices, XLA created "
                           f"{len(devices)}; was the runtime started before launch?")
    xm.set_replication(devices[0], devices)
    collector = CollectorAtMeetings()  # see [Note: collection at collective points]
    collector.install()
    ring = TurnRing(num_devices, process_globals.install(), collector.collect_if_due)
    points = SyncPoints(ring, devices)
    points.install()
    results: Dict[int, bytes] = {}

    def run_rank(rank: int) -> None:
        send(("thread", rank, threading.get_ident()))
        torch_xla._XLAC._xla_set_default_device(devices[rank])
        guard = points.bind_rank(rank)
        try:
            ring.enter(rank)
            with guard:
                value = fn(rank, *args)
            results[rank] = pickle.dumps(value)
            ring.finish(rank)
        except RankAborted:
            pass
        except SystemExit as exc:  # the rank ends, as its process would
            results[rank] = pickle.dumps(RankExit(exc.code))
            ring.finish(rank)
        except BaseException as exc:
            send(("error", rank, _dumps_or_none(exc), traceback.format_exc()))
            ring.fail(rank)

    threads = [threading.Thread(target=run_rank, args=(r,), name=f"xla-rank-{r}")
               for r in range(num_devices)]
    for t in threads:
        t.start()
    for t in threads:
        # timed, so that a preemption notice is seen while the ranks run (see [Note: who
        # installs the SIGTERM handler])
        while t.is_alive():
            t.join(timeout=0.1)
    if ring.failed_rank is not None:
        raise RankAborted(f"rank {ring.failed_rank} failed")
    return results
