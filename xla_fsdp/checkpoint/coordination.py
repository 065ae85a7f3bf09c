"""What checkpoint code needs from the other ranks (the saves and loads of every format, the
manager, the first rank's stream), without a torch.distributed process group: every rank's
Python object, through ``xm.rendezvous``.

DCP coordinates its ranks through a process group. Under torch_xla there is none by default
(and on virtual devices none can exist), but ``xm.rendezvous`` exchanges bytes between all
replicas on every PJRT device, and the virtual launcher routes it through its ring. Each
call is a collective: every rank calls it, in the same order.

Gathering the shards for a host (``full_state_dict``, ``save_consolidated``) is batched by one
rule, ``runs_by_size``, and each run gathered by ``gathered_on_host``: a small model costs one
sync, and a large one's device holds about ``GATHERED_PER_SYNC_BYTES`` of gathered tensors
beyond training's own.
"""
from __future__ import annotations

import contextlib
import hashlib
import pickle
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

T = TypeVar("T")
GATHERED_PER_SYNC_BYTES = 64 * 2 ** 20


def runs_by_size(items: Iterable[T], nbytes: Callable[[T], int]) -> Iterator[List[T]]:
    """``items`` in order, in runs whose ``nbytes`` add up to at most
    ``GATHERED_PER_SYNC_BYTES`` (a larger item is a run of its own): what one sync gathers."""
    run: List[T] = []
    size, limit = 0, GATHERED_PER_SYNC_BYTES  # read here, so that a test may lower it
    for item in items:
        if run and size + nbytes(item) > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += nbytes(item)
    if run:
        yield run


def gathered_bytes(tensor: torch.Tensor, collectives: Any) -> int:
    """What every rank's ``tensor`` takes once gathered."""
    return tensor.numel() * tensor.element_size() * collectives.world_size


def gathered_on_host(run: Sequence[Tuple[torch.Tensor, Any]], keep: bool) -> List[torch.Tensor]:
    """Every rank's tensor of each (device tensor, its unit's collectives), concatenated in rank
    order, after one sync; on this host with ``keep``, else nothing (a rank that only takes
    part)."""
    import torch_xla
    fulls = [collectives.all_gather([t.detach()], coalesce=False)[0] for t, collectives in run]
    torch_xla.sync()
    return [full.cpu() for full in fulls] if keep else []


def exchange(tag: str, obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order (global ranks)."""
    import torch_xla.core.xla_model as xm
    return [pickle.loads(p) for p in xm.rendezvous(tag, pickle.dumps(obj))]


def digest(obj: Any) -> str:
    """A fingerprint of ``obj`` (host values: its pickle), equal for equal objects."""
    return hashlib.sha256(pickle.dumps(obj)).hexdigest()


# [Note: no frame keeps the exception it raises]
# A rank that failed keeps its exception until every rank has heard of it (``agree``), in a
# local or an argument. Once raised, the exception's traceback holds every frame it passed
# through, and each such frame that still names it in a local closes a reference cycle:
# the frame's model, optimizer and gathered tensors then live until the garbage collector
# runs, on the failing rank alone. A step every rank takes and then agrees on is written
# ``with every_rank_agrees(tag):``, which holds the exception in its own frame and clears
# it; a function that is handed an error to agree on (a save's publish step) or that
# gathers several into one agreement clears its local itself (``finally: error = None``)
# once the error is raised or handed on.


def naming(where: str) -> Callable[[Exception], BaseException]:
    """A ``failure`` for ``every_rank_agrees``: a ``CheckpointError`` as it is, any other
    exception as one naming ``where``, the file or directory at fault."""
    from .files import CheckpointError

    def failure(exc: Exception) -> BaseException:
        if isinstance(exc, CheckpointError):
            return exc
        return CheckpointError(f"{where}: {type(exc).__name__}: {exc}")
    return failure


@contextlib.contextmanager
def every_rank_agrees(tag: str, failure: Callable[[Exception], BaseException] = lambda e: e
                      ) -> Iterator[None]:
    """Runs the body, then agrees with the other ranks (``agree``): when the body raised on
    any rank, every rank raises, this rank's own error (through ``failure``) or one naming
    the first rank that failed. For a step no rank may go on from alone."""
    error: Optional[BaseException] = None
    try:
        yield
    except Exception as exc:  # every rank must reach the agreement
        error = failure(exc)
    try:
        agree(tag, error)
    finally:
        error = None  # see [Note: no frame keeps the exception it raises]


def agree(tag: str, error: Any) -> None:
    """Raises on every rank if any rank had an ``error`` (an exception or None): its own,
    or one naming the first rank that failed, so that no rank goes on alone."""
    from .files import CheckpointError
    errors = exchange(tag, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        try:
            raise error
        finally:
            error = None  # see [Note: no frame keeps the exception it raises]
    rank = next((rank for rank, e in enumerate(errors) if e is not None), None)
    if rank is not None:
        raise CheckpointError(f"rank {rank} failed, so this rank stopped too: {errors[rank]}")


def agree_or_undo(tag: str, error: Any, undo: Optional[Callable[[], None]]) -> None:
    """``agree``; when any rank failed, every rank runs its ``undo`` (removing what it wrote)
    and none raises before all of them have, so that no rank's files outlive the failure
    while another rank has already moved on."""
    try:
        agree(tag, error)
    except BaseException:
        try:
            if undo is not None:
                undo()
        finally:
            exchange(f"{tag}.undone", None)
        raise
    finally:
        error = None  # see [Note: no frame keeps the exception it raises]
