"""``CheckpointManager``: checkpoints every so many steps, written beside training, kept to
the last few, saved once more and stopped cleanly on a preemption, restored at any world
size.

A training loop calls ``maybe_save(step, model, optimizer)`` at every step boundary (every
rank, at the same boundaries), and stops when ``stop_requested`` is true::

    manager = CheckpointManager(directory, every=100, keep_last=3)
    manager.restore(model, optimizer, missing_ok=True)
    start = manager.restored_step or 0
    for step in range(start, steps):
        train_step()
        manager.maybe_save(step + 1, model, optimizer)
        if manager.stop_requested:
            break
    manager.wait()

(or the loop inside ``with CheckpointManager(...) as manager:``, which publishes at its end)

then the process exits with ``PREEMPTED_EXIT_CODE`` if ``stop_requested``.

At a boundary the manager (1) casts its rank's vote (``step_vote``), (2) acts on the vote
cast two boundaries ago: publishes the pending save once every rank has written it (the
save's error, if a rank's write failed, is raised here), and on a preemption saves at this
step, waits for it, and sets ``stop_requested``; (3) saves if ``step`` is a multiple of
``every``. A save is ``save_sharded`` or ``save_dcp`` into the step's directory
(``directory``), asynchronous unless ``async_save=False``; it is marked complete, and older
checkpoints beyond ``keep_last`` removed, only once it is published.

[Note: one run per directory]
A manager saves only into its own run's history: the steps it published, the step it
restored and the steps before that one. A complete checkpoint outside that history is
another run's: at or after the step saved, by a run started without ``restore`` in a used
directory; after the restored step, by a run rolled back (``restore(step=k)``, also by this
manager itself, whose later steps are then abandoned). Saving beside it would leave
``latest()`` at the other run's step, or keep one save of a step and drop the other, so the
save is refused, on every rank, before anything is written; the user removes those steps or
saves elsewhere. Saving a step of its own again, or one before the step it restored (a
history it holds already), writes nothing and returns False. A process that only traces
(``xla_fsdp.aot``) writes nothing either.
"""
from __future__ import annotations

import glob
import os
import time
import warnings
from typing import Any, Optional, Set

import torch

from ..._xla import trace_only
from ..async_save import PendingSave
from ..dcp import load_dcp, save_dcp
from ..coordination import exchange
from ..formats.dcp.metadata_file import METADATA_FILE
from ..files import CheckpointError
from ..formats.per_rank import RANK_FILES
from ..sharded import load_sharded, save_sharded
from ..unit_protocol import ShardedModel
from ..live_model import sharding_group_path
from . import preemption
from .directory import CheckpointDirectory
from .step_vote import StepVote

FORMATS = ("sharded", "dcp")
_AGREE_TRIES, _AGREE_WAIT = 10, 0.5   # restore(): how long ranks' views may differ
SHARDED_PREFIX = "checkpoint"   # the per-rank files: step000100/checkpoint_rank-...pth
GROUPS_DCP = "dcp"   # independent sharding groups' DCP directories: step000100/dcp_group-001


def _dcp_path(step_path: str, model: ShardedModel) -> str:
    """What ``save_dcp`` and ``load_dcp`` are given for a step: the step's directory itself,
    which is then a DCP checkpoint as FSDP2 and torchtitan load it; with independent
    sharding groups a name inside it, which each group's directory extends
    (``live_model.sharding_group_path``), so that every group's files are in the step's
    directory and go with it."""
    return os.path.join(step_path, GROUPS_DCP) if sharding_group_path(step_path, model)[1] \
        else step_path


class CheckpointManager:
    """Checkpoints in ``directory``, one directory per step (see [Note: complete means
    marked]); every rank makes one, with the same arguments, at the same point.

    ``every``: ``maybe_save`` saves at steps that are multiples of it (None: only on a
    preemption). ``keep_last``: how many complete checkpoints to keep (None: all).
    ``format``: ``"sharded"`` (per-rank files, ``save_sharded``) or ``"dcp"`` (``save_dcp``,
    what PyTorch FSDP2 and torchtitan load). ``async_save``: write beside training; the
    host then holds one copy of each rank's state until it is written (see [Note: one save
    in flight]). ``on_preemption``: save and stop when the process receives SIGTERM (see
    [Note: who installs the SIGTERM handler]), or at torch_xla's preemption sync point
    where the runtime provides one."""

    def __init__(self, directory: str, every: Optional[int] = None,
                 keep_last: Optional[int] = None, format: str = "sharded",
                 async_save: bool = True, on_preemption: bool = True) -> None:
        for name, value in (("every", every), ("keep_last", keep_last)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"CheckpointManager: {name} must be a positive integer or "
                                 f"None, not {value!r}")
        if format not in FORMATS:
            raise ValueError(f"CheckpointManager: format must be one of {FORMATS}, not "
                             f"{format!r}")
        self.directory = CheckpointDirectory(directory)
        self.every, self.keep_last, self.format = every, keep_last, format
        self.async_save = async_save
        self.stop_requested = False
        self._vote = StepVote()
        self._pending: Optional[PendingSave] = None
        self._pending_step: Optional[int] = None
        self._own: Set[int] = set()   # see [Note: one run per directory]
        self._restored: Optional[int] = None
        # why torch_xla's preemption sync point is not used (None: it is)
        self.sync_point_unavailable: Optional[str] = "on_preemption=False"
        self._closed = False
        self.on_preemption = on_preemption
        if on_preemption:
            preemption.watch_for_preemption()
            preemption.start_watching()
            self.sync_point_unavailable = preemption.activate_runtime_sync_point()
        # a process that only traces (xla_fsdp.aot) leaves the directory alone: what looks
        # left over may be a save of the run it plans, in flight
        if not trace_only.active():
            self.directory.remove_leftovers()
        exchange("xla_fsdp.manager.started", None)  # no rank saves while another cleans

    # -- what is saved -----------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        """The step of the newest complete checkpoint, or None; always None in a process
        that only traces (``xla_fsdp.aot``), to which every checkpoint is absent."""
        return None if trace_only.active() else self.directory.latest()

    def save(self, step: int, model: ShardedModel,
             optimizer: Optional[torch.optim.Optimizer] = None, extra: Any = None) -> bool:
        """Saves now, as ``step`` (every rank); returns whether it wrote. The previous save
        is published first, and its error, if any, raised. A step this manager saved or
        restored is not saved again; one another run saved is refused (see [Note: one run
        per directory])."""
        self._finish_pending()
        if trace_only.active() or (self._restored is not None and step < self._restored) \
                or not self._must_write(step):
            return False
        path = self.directory.prepare(step)
        exchange(f"xla_fsdp.manager.prepare.{step}", None)  # every rank's before any writes
        if self.format == "dcp":
            result = save_dcp(_dcp_path(path, model), model, optimizer, extra,
                              async_save=self.async_save)
        else:
            result = save_sharded(os.path.join(path, SHARDED_PREFIX), model, optimizer, extra,
                                  async_save=self.async_save)
        if isinstance(result, PendingSave):
            self._pending, self._pending_step = result, step
        else:
            self._published(step)
        return True

    def maybe_save(self, step: int, model: ShardedModel,
                   optimizer: Optional[torch.optim.Optimizer] = None,
                   extra: Any = None) -> bool:
        """The step boundary (every rank, at the same boundaries): see the module's
        docstring. Returns whether it wrote a checkpoint; sets ``stop_requested`` when a
        preemption was agreed on (after saving)."""
        pending = self._pending
        written = pending is not None and pending.written()
        counts = [int(self._preempted(step)), int(written and not pending.failed()),
                  int(written and pending.failed()), 1]
        result = self._vote.cast(counts, about=pending)
        if result is not None:
            (notices, ok, failed, ranks), about = result
            if notices > 0:
                return self._save_and_stop(step, model, optimizer, extra)
            if about is not None and about is self._pending and ok + failed == ranks:
                self._finish_pending()
        if self.every is not None and step % self.every == 0:
            return self.save(step, model, optimizer, extra)
        return False

    def wait(self) -> None:
        """Publishes the save in flight, if any (every rank); raises its error."""
        self._finish_pending()
        self._vote.forget()

    def restore(self, model: ShardedModel,
                optimizer: Optional[torch.optim.Optimizer] = None,
                step: Optional[int] = None, missing_ok: bool = False) -> Any:
        """Loads the newest complete checkpoint, or that of ``step``, into ``model`` (and
        ``optimizer``), whatever world size and format wrote it; returns the ``extra``
        saved with it. The run then continues from it: a later save refuses checkpoints
        newer than it (see [Note: one run per directory]). With ``missing_ok``, a directory
        without a checkpoint loads nothing and returns None (``restored_step`` stays None);
        every rank decides alike, so a loop starts with ``restore(..., missing_ok=True)``
        rather than asking each rank's ``latest()``."""
        self.wait()
        if step is None:
            step = self._newest_on_every_rank()
            if step is None and missing_ok:
                return None
        trace_only.refuse_reads(str(self.directory.root))
        if step is None:
            raise CheckpointError(f"{self.directory.root} holds no complete checkpoint")
        if not all(exchange(f"xla_fsdp.manager.restore.{step}",
                              self.directory.is_complete(step))):
            raise CheckpointError(f"{self.directory.path(step)} is not a complete checkpoint "
                                  f"on every rank; complete steps here: "
                                  f"{self.directory.complete_steps()}")
        path = self.directory.path(step)
        dcp = _dcp_path(path, model)
        if os.path.exists(os.path.join(sharding_group_path(dcp, model)[0], METADATA_FILE)):
            extra = load_dcp(dcp, model, optimizer)
        else:
            prefix = os.path.join(path, SHARDED_PREFIX)
            if not glob.glob(glob.escape(prefix) + "*" + RANK_FILES):
                raise CheckpointError(f"{path} is marked complete but holds neither a DCP "
                                      f"checkpoint nor per-rank files")
            extra = load_sharded(prefix, model, optimizer)
        self._own = {s for s in self._own if s < step} | {step}
        self._restored = step
        return extra

    @property
    def restored_step(self) -> Optional[int]:
        """The step ``restore`` last loaded, or None."""
        return self._restored

    def close(self) -> None:
        """Publishes what is in flight and stops watching for preemption."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self.on_preemption:
                preemption.stop_watching()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        """A block that ends normally publishes the save in flight (``close``). One that
        raises only stops watching for preemption: publishing is a collective that the
        peers of a failing rank may never reach (see [Note: a save never waited on])."""
        if exc_type is None:
            self.close()
        elif not self._closed:
            self._closed = True
            if self.on_preemption:
                preemption.stop_watching()

    # -- internals ---------------------------------------------------------------------------
    def _newest_on_every_rank(self) -> Optional[int]:
        """The newest complete step, once every rank sees it (a shared filesystem may show a
        new step to some ranks first), or None if no rank sees any. Ranks that go on seeing
        different steps are refused: restoring an older step would leave the newer one
        outside the run's history, and no later save would be allowed."""
        if trace_only.active():
            return None
        views: list = []
        for attempt in range(_AGREE_TRIES):
            if attempt:
                time.sleep(_AGREE_WAIT)
            views = exchange(f"xla_fsdp.manager.restore.latest.{attempt}",
                             self.directory.complete_steps())
            newest = max((max(v) for v in views if v), default=None)
            if all(newest in v for v in views) or newest is None:
                return newest
        raise CheckpointError(
            f"{self.directory.root}: the ranks see different complete checkpoints after "
            f"{_AGREE_TRIES * _AGREE_WAIT:g} s (by rank: {views}); restore(step=...) one "
            f"every rank sees, or remove the others")

    def _save_and_stop(self, step: int, model: ShardedModel,
                       optimizer: Optional[torch.optim.Optimizer], extra: Any) -> bool:
        """A preemption: this step saved and published, then ``stop_requested``. A save
        still pending that failed is reported as a warning, not raised: the checkpoint of
        this step supersedes it, and raising would stop the loop before it saved."""
        try:
            self._finish_pending()
        except Exception as exc:  # the same on every rank: its publication agreed on it
            warnings.warn(f"CheckpointManager: the save before the preemption failed, so step "
                          f"{step} is saved instead: {exc}")
        written = self.save(step, model, optimizer, extra)
        self._finish_pending()
        self.stop_requested = True
        return written

    def _must_write(self, step: int) -> bool:
        """Whether ``save(step)`` writes: not when the step is its own and complete on every
        rank; refused beside another run's checkpoints (see [Note: one run per directory]).
        Every rank decides on every rank's view, so ranks whose filesystems differ still
        all raise, all skip or all write."""
        own = step in self._own and self.directory.is_complete(step)
        others = [s for s in self.directory.complete_steps() if s not in self._own and (
            s >= step if self._restored is None else s > self._restored)]
        views = exchange(f"xla_fsdp.manager.others.{step}", (own, others))
        others = sorted(set().union(*(seen for _, seen in views)))
        if others:
            history = ("it started without restore()" if self._restored is None
                       else f"it continued from step {self._restored}")
            first = " Restore the latest first," if self._restored is None else ""
            raise CheckpointError(
                f"CheckpointManager: {self.directory.root} holds complete checkpoints at "
                f"steps {others} outside this run's history ({history}); saving step {step} "
                f"beside them would mix two histories, and restore() would load step "
                f"{others[-1]}.{first} Remove those steps (manager.directory.remove(step) "
                f"on every rank), or save to another directory")
        return not all(mine for mine, _ in views)

    def _preempted(self, step: int) -> bool:
        if not self.on_preemption:
            return False
        if preemption.requested():
            return True
        return (self.sync_point_unavailable is None
                and preemption.preemption_sync_point_reached(step))

    def _finish_pending(self) -> None:
        pending, step = self._pending, self._pending_step
        if pending is None:
            return
        self._pending, self._pending_step = None, None
        pending.wait()  # raises the save's error on every rank: nothing is marked
        self._published(step)

    def _published(self, step: int) -> None:
        self.directory.mark_complete(step)
        self._own.add(step)
        if self.keep_last is not None:
            self.directory.keep_last(self.keep_last)
