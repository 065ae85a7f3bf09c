"""Saves that run in three phases, so that the slow one can leave the training loop:
``save_sharded`` and ``save_dcp`` build a ``SaveJob``, and ``run_save`` runs it at once or
with its writing on a background thread (``async_save=True``).

[Note: the three phases of a save]
1. *Copy* (on the training thread, every rank): the device is synchronised, and the rank's
   shards, buffers and optimizer state are copied to host memory. The job is built only
   once this is done; nothing it does later reads the device or the model, so training may
   change both.
2. *Write* (on any thread, no collective): the rank's files are written under temporary
   names and flushed to disk. This is the part that takes as long as the disk does.
3. *Publish* (on the training thread, every rank, a collective): the ranks agree whether
   every rank's write succeeded; then either every file is put in place, or every rank
   removes what it wrote and raises: see the Notes on a save being all ranks' or none
   (``writers.per_rank_files``) and on a DCP directory being complete or not a checkpoint
   (``writers.dcp_shards``).

[Note: a write beside training]
The write competes with training for the host's CPUs: pickling, the CRC-32 of every record
and copying into the page cache. On a TPU or Trainium host the step runs on the
accelerator and the host's CPUs are mostly idle, but the input pipeline and the step's
dispatch still run there, and on virtual devices the step itself does. So the writing
thread lowers its own priority (``_yield_the_cpu``): it gets the CPU time training does
not use, and a write that finds none takes longer instead of slowing the steps; the next
save waits for it if it has not finished (see [Note: one save in flight]).

A synchronous save runs the three in a row. An asynchronous one returns a ``PendingSave``
after the copy; its ``wait()`` publishes. Only the write may run beside training: the
collectives of the copy and the publication go through ``xm.rendezvous``, which is
ordered with the training step's own collectives only on the training thread.

[Note: one save in flight]
At most one asynchronous save per model is in flight: a save of a model whose previous save
is still pending first waits for it (and publishes it, or raises its error). So what a
rank holds on the host for saving is at most one copy of its own state (its shards, its
optimizer state, and on the first rank the buffers): the copy is dropped as soon as the
write is done. The host of a TPU VM or a virtual-device process serving several ranks holds
one copy per rank it serves.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import os
import sys
import threading
import weakref
from typing import Any, Optional, Protocol

from .._sharding.tensor_tree import map_tensors
from .._xla.private_api import to_cpu

_PENDING: "weakref.WeakKeyDictionary[Any, PendingSave]" = weakref.WeakKeyDictionary()
_UNPUBLISHED: "weakref.WeakSet[PendingSave]" = weakref.WeakSet()


def host_copy(tree: Any) -> Any:
    """``tree`` with every tensor copied to host memory: XLA tensors in one transfer, and
    host tensors cloned, since their owner may change them in place while the copy is
    written (an optimizer's ``step`` count is a host tensor it increments)."""
    return to_cpu(map_tensors(
        lambda t: t if t.device.type == "xla" else t.detach().clone(), tree))


def copy_of_extra(extra: Any) -> Any:
    """The caller's ``extra`` as it is now, on the host: the caller may change it, or the
    tensors in it, while the file is written."""
    return copy.deepcopy(to_cpu(extra))


class SaveJob(Protocol):
    """One save after its copy phase (see [Note: the three phases of a save])."""

    def write(self) -> None:
        """Writes this rank's files under temporary names; no collective, no device."""

    def publish(self, error: Optional[BaseException]) -> Any:
        """Every rank: agrees on the ranks' write errors (``error`` is this rank's), puts the
        files in place or removes them, and returns what the save function returns."""


class PendingSave:
    """A save whose files are being written on a background thread. ``wait()`` (every rank
    calls it, or the next save of the same model does) publishes it."""

    def __init__(self, owner: Any, job: SaveJob, what: str) -> None:
        self._job: Optional[SaveJob] = job
        self._error: Optional[BaseException] = None
        self._result: Any = None
        self._published = False
        self._owner = weakref.ref(owner)
        self.what = what
        # registered with the first save, not at import (see [Note: a save never waited on]);
        # unregistering first keeps it registered once
        atexit.unregister(_report_unpublished)
        atexit.register(_report_unpublished)
        _UNPUBLISHED.add(self)
        self._thread = threading.Thread(target=self._write, name=f"xla_fsdp save: {what}",
                                        daemon=True)
        self._thread.start()

    def _write(self) -> None:
        _yield_the_cpu()
        try:
            self._job.write()
        except BaseException as exc:  # raised on the training thread, by publish
            self._error = exc

    def written(self) -> bool:
        """Whether this rank's write is over (successfully or not); not a collective."""
        return not self._thread.is_alive()

    def failed(self) -> bool:
        """Whether this rank's write is over and failed; not a collective."""
        return self.written() and self._error is not None

    def wait(self) -> Any:
        """Every rank: waits for this rank's write, then publishes; returns what the
        synchronous save would have (its path or directory). Raises the save's error, on
        every rank if any rank's write failed, and then nothing of it is in place."""
        if self._published:
            return self._result
        self._thread.join()
        job, error = self._job, self._error
        self._job, self._error = None, None  # the host copy goes with the job
        self._published = True
        _UNPUBLISHED.discard(self)
        owner = self._owner()
        if owner is not None and _PENDING.get(owner) is self:
            del _PENDING[owner]
        try:
            self._result = job.publish(error)
        finally:
            error = None  # see [Note: no frame keeps the exception it raises]
        return self._result


# [Note: a save never waited on]
# Publishing is a collective, so it cannot run at interpreter exit: a rank that exits on an
# exception would wait there for peers still in the training step, turning a crash into a
# hang. So a program that ends with a pending save never published gets it reported: the
# write is let finish (its files stay under their temporary names) and stderr says which
# save was lost and what publishes one. ``CheckpointManager.close()`` and the end of its
# ``with`` block publish theirs.
def _report_unpublished() -> None:
    for pending in list(_UNPUBLISHED):
        pending._thread.join(timeout=60)
        print(f"xla_fsdp: the asynchronous save of {pending.what} was never published: "
              f"nothing called its wait() (nor a later save of the same model, which waits "
              f"for it) before the program ended, so it is not a checkpoint; its files were "
              f"left under temporary names. Call wait() on the PendingSave on every rank "
              f"before exiting.", file=sys.stderr, flush=True)


def _yield_the_cpu() -> None:
    """Lowers this thread's scheduling priority as far as it goes (Linux, where a thread's
    niceness is its own): the write then takes the CPU that training leaves, and the
    training step beside it keeps its pace. See [Note: a write beside training]."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def wait_for_pending(owner: Any) -> None:
    """Every rank: publishes ``owner``'s pending save, if it has one (raising its error)."""
    pending = _PENDING.get(owner)
    if pending is not None:
        pending.wait()


def run_save(owner: Any, job: SaveJob, async_save: bool, what: str) -> Any:
    """Runs ``job`` to the end, or starts its write and returns a ``PendingSave``. The
    caller waited for ``owner``'s previous save before copying (``wait_for_pending``)."""
    if not async_save:
        error: Optional[BaseException] = None
        try:
            job.write()
        except Exception as exc:  # every rank must reach the agreement in publish
            error = exc
        try:
            return job.publish(error)
        finally:
            error = None  # see [Note: no frame keeps the exception it raises]
    pending = PendingSave(owner, job, what)
    _PENDING[owner] = pending
    return pending
